"""Decode-attention kernel, column-tiled packs: token-major rows, and P @ V, merge and out rows per pack.

Algorithm. A column-tiled pack (``decode_attention_fwd_packed.column_pack_size``: U units share a
chunk, unit u's keys and scores on partitions [u*P, (u+1)*P), P = 128/U) keeps each unit's R = G*Sq
rows in *token-major* order, column r' = t*G + g for query head g and new token t (its q^T columns,
sinks, statistics and lse columns), so that, after P @ V, O^T (D, R) is Sq column blocks of G rows:
each block PE-transposed back gives the G rows of one token, and the pack's out tile
(U*G, Sq*D) holds on partition u*G + g the Sq consecutive out rows (g*Sq + t) of head g -- one
DMA row of Sq*D elements per (unit, head) instead of one per row (the out rows of a pack are one
contiguous HBM range). The sink folds into each unit's max (-m = min(-rowmax, -sink), a column of
the transposed per-partition maxima), so the merge is L = l + exp(sink - m), out = O / L::

    q^T (D, n*R)      <- one DMA of a*Sq rows per partition (a heads x Sq tokens, at most 4 KiB),
                         a*Sq PE transposes, one copy into (unit, t, g) column order
    per pack (after the softmax of ``run_chunks``):
      O^T_u (D, R)    += matmul(V slot c (P, D), P^T slot c (P, R)) over unit u's partitions (row tile)
      l_u (R, 1)      += matmul(P^T slot c, ones (P, 1))
      L (R, U)        =  l + exp(sink - m)      (the lse's L; -m is its -M)
      1/L broadcast   -> (D, U*R) by PE transposes of stride-0 views, copied to SBUF (ScalarE)
      out^T (D, Sq, U, G) = O^T * (1/L) in the output dtype (one VectorE pass, O^T read from PSUM)
      out (U*G, Sq*D) <- Sq PE transposes of the (D, U*G) blocks of one token, copied to SBUF

Shapes: q (B, Hq, Sq, D) read as (B*Hq*Sq, D) rows; q^T (D, n*R); sinks (Hkv, G) float32 in HBM,
(R, 1) token-major on chip;
per pack one PSUM tile (128, 2*U*R + U) fp32 = [O^T of each unit | 1/L broadcast | row sums];
out tile (U*G, Sq*D). Dimension legend as in ``decode_attention_fwd`` and
``decode_attention_fwd_packed`` (U units per pack, P = 128/U partitions per unit).

Limits: those of the column-tiled packs (D <= 128, 2-byte K/V, U*R <= 128); U*G <= 128.
"""

from __future__ import annotations

from nki_lib._nki import nisa, nl
from nki_lib.attention.kernels.decode_attention_fwd_io import Q_LOAD_ROW_BYTES

__all__ = ["column_pv_merge_phases", "load_q_t_token_major", "load_sink_token_major", "q_load_units",
           "store_out_pack"]

Q_TOKEN_MAJOR_ROWS = 16           # q rows per partition of the token-major load (a*Sq: that many PE transposes)


def _heads_per_partition(group, sq, d, itemsize):
    """a: query heads whose Sq rows share one partition row of the q load (a power of two dividing G,
    a*Sq rows of at most ``Q_LOAD_ROW_BYTES`` and at most ``Q_TOKEN_MAJOR_ROWS`` rows)."""
    a = 1
    while (group % (2 * a) == 0 and 2 * a * sq <= Q_TOKEN_MAJOR_ROWS
           and 2 * a * sq * d * itemsize <= Q_LOAD_ROW_BYTES):
        a *= 2
    return a


def q_load_units(n_units, pack, group, sq, d, itemsize):
    """Units per token-major q load: a multiple of ``pack`` whose n*G/a partitions fit 128 and whose
    q^T (D, n*R) fits one PSUM bank (each PE transpose writes inside one bank)."""
    a = _heads_per_partition(group, sq, d, itemsize)
    fit = min(nl.tile_size.pmax * a // group, nl.tile_size.psum_bank_fmax_bytes // (group * sq * itemsize))
    return min(n_units, max(pack, fit // pack * pack))


def load_q_t_token_major(q, unit0, n, rows, sq, dtype):
    """q^T (D, n*R) of units unit0 .. unit0 + n, column u*R + t*G + g = row g*Sq + t of unit u: one
    DMA of a*Sq consecutive rows (a heads, every token) per partition, a*Sq PE transposes (row
    p*a*Sq + j lands in column j*parts + p) and one copy that reorders the columns to (u, t, g)."""
    d = q.shape[3]
    group = rows // sq
    a = _heads_per_partition(group, sq, d, q.itemsize)
    k = a * sq
    parts = n * rows // k
    q_sb = nl.ndarray((parts, k * d), dtype=dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=q_sb, src=q.ap([[k * d, parts], [1, k * d]], offset=unit0 * rows * d))
    q_t_psum = nl.ndarray((d, n * rows), dtype=dtype, buffer=nl.psum)
    for j in range(k):
        nisa.nc_transpose(dst=q_t_psum[:, j * parts:(j + 1) * parts], data=q_sb[:, j * d:(j + 1) * d])
    q_t_sb = nl.ndarray((d, n * rows), dtype=dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=q_t_sb.reshape((d, n, sq, group // a, a)),
                     src=q_t_psum.reshape((d, a, sq, n, group // a)).permute((0, 3, 2, 4, 1)))
    return q_t_sb


def load_sink_token_major(sink_rows, hk, sq):
    """Sink logits (R, 1) of kv head ``hk`` in token-major order (row r' = t*G + g holds head g's
    sink) from the per-head sinks (Hkv, G): one DMA of the (1, G) row (one descriptor) and a PE
    transpose of its view broadcast over the Sq tokens, t outermost (fp32 transposes are
    bit-exact), copied to SBUF on ScalarE."""
    group = sink_rows.shape[1]
    rows = group * sq
    row_sb = nl.ndarray((1, group), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=row_sb, src=sink_rows.ap([[group, 1], [1, group]], offset=hk * group))
    sink_psum = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_transpose(dst=sink_psum, data=row_sb.expand_dim(1).broadcast(1, sq))
    sink_sb = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=sink_sb, src=sink_psum, engine=nisa.engine.scalar)
    return sink_sb


def column_pv_merge_phases(state, p_t, neg_m_units, v_chunk, ones_col, c0, sinks, lse_cols, dtype, engine):
    """P @ V of every unit of a column-tiled pack (P^T (128, R, n) token-major, unit u's keys on its
    P partitions: a row tile each, so no unit's zero probabilities meet another unit's V), the merge
    with the folded sinks (``sinks``: per unit (R, 1) or None) and the pack's out tile (U*G, Sq*D)
    in ``dtype``, set as ``state.out_tile``. ``lse_cols``: the (R, U) views of the lse tiles' -M
    and L columns of the pack's units; ``engine``: of the out tile's PSUM -> SBUF copy."""
    pmax = nl.tile_size.pmax
    pack, rows, n = state.pack, p_t.shape[1], p_t.shape[2]
    part = pmax // pack
    d = state.units[0].acc.shape[1]
    sq = state.group_sq
    group = rows // sq
    ur = pack * rows
    acc = nl.ndarray((pmax, 2 * ur + pack), dtype=nl.float32, buffer=nl.psum)   # O^T | 1/L bcast | l
    for j in range(n):
        c = c0 + j
        for u in range(pack):
            ps = slice(u * part, (u + 1) * part)
            tiling = dict(tile_position=(u * part, 0), tile_size=(part, pmax))
            nisa.nc_matmul(dst=acc[0:d, u * rows:(u + 1) * rows], stationary=v_chunk[ps, c * d:(c + 1) * d],
                           moving=p_t[ps, :, j], accumulate=(j > 0), **tiling)
            nisa.nc_matmul(dst=acc[0:rows, 2 * ur + u:2 * ur + u + 1], stationary=p_t[ps, :, j],
                           moving=ones_col[ps], accumulate=(j > 0), **tiling)
    sink_term = None
    if sinks is not None:
        sink_term = nl.ndarray((rows, pack), dtype=nl.float32, buffer=nl.sbuf)
        for u in range(pack):
            nisa.activation(dst=sink_term[:, u:u + 1], op=nl.exp, data=sinks[u], bias=neg_m_units[:, u:u + 1])
    yield
    neg_big, total = lse_cols
    nisa.tensor_copy(dst=neg_big, src=neg_m_units, engine=nisa.engine.gpsimd)
    if sink_term is not None:
        nisa.tensor_tensor(dst=total, data1=acc[0:rows, 2 * ur:2 * ur + pack], data2=sink_term, op=nl.add)
    else:
        nisa.tensor_copy(dst=total, src=acc[0:rows, 2 * ur:2 * ur + pack])
    yield
    inv_total = nl.ndarray((rows, pack), dtype=nl.float32, buffer=nl.sbuf)
    nisa.reciprocal(dst=inv_total, data=total)
    yield
    for u in range(pack):
        nisa.nc_transpose(dst=acc[0:d, ur + u * rows:ur + (u + 1) * rows], data=inv_total[:, u:u + 1].broadcast(1, d))
    yield
    inv_cols = nl.ndarray((d, ur), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=inv_cols, src=acc[0:d, ur:2 * ur], engine=nisa.engine.scalar)
    yield
    out_t = nl.ndarray((d, sq, pack, group), dtype=dtype, buffer=nl.sbuf)      # out^T, (t, u, g) columns
    nisa.tensor_tensor(dst=out_t.permute((0, 2, 1, 3)), data1=acc[0:d, 0:ur].reshape((d, pack, sq, group)),
                       data2=inv_cols.reshape((d, pack, sq, group)), op=nl.multiply)
    yield
    out_psum = nl.ndarray((pack * group, sq * d), dtype=dtype, buffer=nl.psum)
    for t in range(sq):
        nisa.nc_transpose(dst=out_psum[:, t * d:(t + 1) * d], data=out_t[:, t])
    yield
    out_sb = nl.ndarray((pack * group, sq * d), dtype=dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=out_sb, src=out_psum, engine=engine)
    state.out_tile = out_sb


def store_out_pack(out, out_sb, row0):
    """A pack's out tile (U*G, Sq*D) -> rows row0 .. row0 + U*R of the flattened (B*Hq*Sq, D) output:
    partition u*G + g holds the Sq consecutive rows of head g of unit u, so one DMA of U*G rows."""
    parts, width = out_sb.shape
    nisa.dma_copy(dst=out.ap([[width, parts], [1, width]], offset=row0 * out.shape[3]), src=out_sb)
