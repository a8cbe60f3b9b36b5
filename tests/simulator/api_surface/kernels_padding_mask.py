"""Key-padding mask for a batch of variable-length sequences (written for this project).

``key_padding_mask(lengths, n_cols, heads, queries, active_queries, key_major)`` returns
``mask (n, P, C, B, H, Q)`` fp32 where, for program i, partition p and column c, the key position
is k = i * P * C + (c * P + p if key_major else p * C + c), and
mask[i, p, c, b, h, q] = 1.0 if k < lengths[0, b] and q < active_queries else 0.0.
Dimension legend: n programs (LNC), P = pmax partitions, C = ``n_cols`` key columns per partition,
B batch, H = ``heads``, Q = ``queries`` query slots.

Algorithm (per program): the (1, B) lengths are DMA'd to every partition with a stride-0
partition pattern on the HBM side; ``iota`` (pattern + ``channel_multiplier``) writes the key
position of every (p, c); one ``tensor_scalar(op0=nl.less)`` per batch entry compares against
that entry's length, selected from the lengths tile with an ``.ap()`` (P, 1) column view, and
writes a (P, C) plane of a (P, C, B) tile. A 5-D (P, C, B, H, Q) tile is cleared with ``memset``
and the comparison is replicated over H and the active query slots by one Scalar-engine
``tensor_copy`` whose source ``.ap()`` has stride-0 dims. Limits: P * C * n < 2**24, B * H * Q *
C * 4 bytes per partition fit SBUF.
"""

import nki
import nki.isa as nisa
import nki.language as nl


def _key_positions(n_cols, base, key_major):
    pmax = nl.tile_size.pmax
    key_sb = nl.ndarray((pmax, n_cols), dtype=nl.float32, buffer=nl.sbuf)
    if key_major:
        nisa.iota(dst=key_sb, pattern=[[pmax, n_cols]], offset=base, channel_multiplier=1)
    else:
        nisa.iota(dst=key_sb, pattern=[[1, n_cols]], offset=base, channel_multiplier=n_cols)
    return key_sb


@nki.jit
def key_padding_mask(lengths, n_cols, heads, queries, active_queries, key_major):
    batch = lengths.shape[1]
    pmax = nl.tile_size.pmax
    n_prog = nl.num_programs(axes=0)
    pid = nl.program_id(axis=0)
    mask = nl.ndarray((n_prog, pmax, n_cols, batch, heads, queries), dtype=nl.float32, buffer=nl.shared_hbm)

    lengths_sb = nl.ndarray((pmax, batch), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=lengths_sb, src=lengths.ap([[0, pmax], [1, batch]], offset=0))
    key_sb = _key_positions(n_cols, pid * pmax * n_cols, key_major)

    keep_sb = nl.ndarray((pmax, n_cols, batch), dtype=nl.float32, buffer=nl.sbuf)
    for b in range(batch):
        length_col = lengths_sb.ap([[batch, pmax], [1, 1]], offset=b)
        nisa.tensor_scalar(dst=keep_sb[:, :, b], data=key_sb, op0=nl.less, operand0=length_col)

    mask_sb = nl.ndarray((pmax, n_cols, batch, heads, queries), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=mask_sb, value=0.0)
    replicated = keep_sb.ap([[n_cols * batch, pmax], [batch, n_cols], [1, batch], [0, heads], [0, active_queries]])
    nisa.tensor_copy(dst=mask_sb[:, :, :, :, 0:active_queries], src=replicated, engine=nisa.scalar_engine)
    nisa.dma_copy(dst=mask[pid], src=mask_sb)
    return mask
