"""On-chip steps shared by the expert-MLP forward and backward kernels.

Block flags and registers (which expert a block belongs to, whether it holds live slots), the
slot-id loads, row gathers / scatters / transposes between HBM and SBUF, expert weight loads
(row tiles, and transposed column spans of at most ``WEIGHT_SPAN`` columns through TensorE), the
activation table, and the top-k reduction of a token's expert outputs. Shapes: T tokens, H hidden,
I intermediate, S slots (``block`` per block), k top-k; tiles are ``nl.tile_size.pmax`` rows.
Limits: as the kernels that call them (``moe_experts_fwd.py``, ``moe_experts_bwd.py``).
"""

from __future__ import annotations

from nki_lib._nki import nisa, nl
from nki_lib.sizes import FP32_BYTES, spans

# Columns of one weight-row DMA before the on-chip transposes: runs of 2048 bf16 = 4 KiB clear the
# cost model's 105 ns DMA chunk floor at ~23 GB/s per DMA engine (>= ~2.4 KiB), while the staging
# tile stays small whatever H or I is.
WEIGHT_SPAN = 2048

# SBUF bytes per partition of one step's fp32 parts in the final k-sum (reduce_assignments): 16 KiB
# makes the parts DMA's contiguous runs 8 KiB at k = 2 (2 KiB at k = 8), far past the chunk floor,
# while two generations stay a small share of the tail's SBUF.
REDUCE_PARTS_BYTES = 16 * 1024

# Engines that evict the weight transposes from PSUM, in turn (GpSimd cannot read PSUM).
EVICTION_ENGINES = (nisa.engine.vector, nisa.engine.scalar)


def mlp_dims(w_down, in_out=False):
    """(H, I) from W_down: (E, H, I) out_in, (E, I, H) in_out."""
    return (w_down.shape[2], w_down.shape[1]) if in_out else (w_down.shape[1], w_down.shape[2])


def act_fn(activation):
    """The ScalarE function of the gate activation (exact PyTorch definitions)."""
    return {"silu": nl.silu, "gelu": nl.gelu, "gelu_tanh": nl.gelu_apprx_tanh}[activation]


def load_all_ids(slot_ids, n_blocks, block, live=False, partial=False, dtype=nl.int32):
    """(P, ST, NB) int32 tile: [p, st, b] = slot_ids[b * B + st * 128 + p] (token or assignment ids,
    -1 = padding), loaded once per kernel: one contiguous DMA per 128 blocks (blocks on
    partitions), then TensorE transposes put the slots on partitions (``dtype``: of slot_ids and
    the tile, e.g. fp32 per-slot routing weights; the transposes are bit-exact). With ``live``, also the
    (P, NBT, ST) int32 live flags: [p, bt, st] = 1 when slot tile st of block bt * 128 + p holds an
    id >= 0 (a max over the tile's ids per partition, then a compare, on VectorE); with
    ``partial`` (and ``live``), also the same-shaped flags = 1 when the tile holds an id -1 (a min
    and a compare): (ids, live, partial)."""
    pmax = nl.tile_size.pmax
    st_tiles = spans(block, pmax)
    b_tiles = spans(n_blocks, pmax)
    ids_sb = nl.ndarray((pmax, len(st_tiles), n_blocks), dtype=dtype, buffer=nl.sbuf)
    live_sb = nl.ndarray((pmax, len(b_tiles), len(st_tiles)), dtype=nl.int32, buffer=nl.sbuf) if live else None
    partial_sb = nl.ndarray((pmax, len(b_tiles), len(st_tiles)), dtype=nl.int32, buffer=nl.sbuf) if partial else None
    for bt, (b0, nb) in enumerate(b_tiles):
        rows_sb = nl.ndarray((nb, block), dtype=dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=rows_sb, src=slot_ids[b0 * block:(b0 + nb) * block])
        for st, (s0, ps) in enumerate(st_tiles):
            tr_psum = nl.ndarray((ps, nb), dtype=dtype, buffer=nl.psum)
            nisa.nc_transpose(dst=tr_psum, data=rows_sb[:, s0:s0 + ps])
            nisa.tensor_copy(dst=ids_sb[:ps, st, b0:b0 + nb], src=tr_psum)
            if live:
                nisa.tensor_reduce(dst=live_sb[:nb, bt, st:st + 1], op=nl.maximum, data=rows_sb[:, s0:s0 + ps],
                                   axis=1)
            if partial:
                nisa.tensor_reduce(dst=partial_sb[:nb, bt, st:st + 1], op=nl.minimum, data=rows_sb[:, s0:s0 + ps],
                                   axis=1)
        if live:
            nisa.tensor_scalar(dst=live_sb[:nb, bt, :], data=live_sb[:nb, bt, :], op0=nl.greater_equal, operand0=0)
        if partial:
            nisa.tensor_scalar(dst=partial_sb[:nb, bt, :], data=partial_sb[:nb, bt, :], op0=nl.less, operand0=0)
    if partial:
        return ids_sb, live_sb, partial_sb
    return (ids_sb, live_sb) if live else ids_sb


def gather_rows_into(rows_sb, src, ids_sb, fill_reg=None):
    """rows_sb (ps, C) = src[ids] (src (R, C) in HBM); rows with id -1 stay zero. ``fill_reg``: a
    0/1 register, 1 when the tile holds an id -1 (the zero fill runs only then), or None (always)."""
    ps, cols = rows_sb.shape
    for _ in (range(1) if fill_reg is None else nl.dynamic_range(0, fill_reg)):
        nisa.memset(dst=rows_sb, value=0.0, engine=nisa.engine.gpsimd)   # GpSimd issues the gather next
    nisa.dma_copy(dst=rows_sb,
                  src=src.ap([[cols, ps], [1, cols]], offset=0, vector_offset=ids_sb, indirect_dim=0),
                  oob_mode=nisa.oob_mode.skip, dge_mode=nisa.dge_mode.swdge)


def scatter_rows(dst, ids_sb, rows_sb, col0):
    """dst[ids, col0 : col0 + n] = rows (dst (R, C) in HBM); rows with id -1 are not written."""
    ps, n = rows_sb.shape
    cols = dst.shape[1]
    nisa.dma_copy(dst=dst.ap([[cols, ps], [1, n]], offset=col0, vector_offset=ids_sb, indirect_dim=0),
                  src=rows_sb, oob_mode=nisa.oob_mode.skip, dge_mode=nisa.dge_mode.swdge)


def interleaved_blocks(tiles, interleave):
    """``tiles`` (spans of at most 128 rows or columns) in blocks (first tile, tiles m, first row):
    ``interleave`` consecutive full tiles make one block whose rows are interleaved (tile t0 + r of
    the block holds, on partition p, row r0 + m p + r: m consecutive rows per partition, one
    contiguous run of m rows for a DMA); the others, and the rest, one tile each (natural)."""
    pmax, blocks, t = nl.tile_size.pmax, [], 0
    while t < len(tiles):
        block = tiles[t:t + interleave]
        m = interleave if len(block) == interleave and all(n == pmax for _, n in block) else 1
        blocks.append((t, m, tiles[t][0]))
        t += m
    return blocks


def tile_columns(tiles, interleave):
    """Per tile of ``tiles``, in the order of :func:`interleaved_blocks`, (first column, step):
    tile t0 + r of a block of m tiles holds columns c0 + r, c0 + r + m, ... (its transposes read
    them with that step)."""
    return [(c0 + r, m) for _, m, c0 in interleaved_blocks(tiles, interleave) for r in range(m)]


def transpose_rows(dst_t, rows_sb, col0, interleave=1):
    """rows (ps, C) -> dst_t[:, c_tile, col0 : col0 + ps] (C on partitions, tiled by 128); with
    ``interleave`` > 1 the column tiles in the order of :func:`interleaved_blocks` (tile t0 + r
    of a block holds column c0 + m p + r on partition p: a strided read of m elements' step)."""
    ps, cols = rows_sb.shape
    tiles = spans(cols, nl.tile_size.pmax)
    for ct, ((c0, step), (_, cs)) in enumerate(zip(tile_columns(tiles, interleave), tiles)):
        tr_psum = nl.ndarray((cs, ps), dtype=rows_sb.dtype, buffer=nl.psum)
        nisa.nc_transpose(dst=tr_psum, data=rows_sb[:, c0:c0 + step * (cs - 1) + 1:step])
        nisa.tensor_copy(dst=dst_t[:cs, ct, col0:col0 + ps], src=tr_psum)


def block_flags(block_expert):
    """(expert ids, valid flags): two (1, NB) int32 SBUF tiles, valid = (expert >= 0)."""
    n_blocks = block_expert.shape[0]
    expert_sb = nl.ndarray((1, n_blocks), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=expert_sb, src=block_expert)
    valid_sb = nl.ndarray((1, n_blocks), dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=valid_sb, data=expert_sb, op0=nl.greater_equal, operand0=0)
    return expert_sb, valid_sb


def block_registers(expert_sb, valid_sb, b):
    """Registers (expert id, trip count 0/1) of block b."""
    expert_reg = nisa.register_alloc()
    nisa.register_load(expert_reg, expert_sb[0:1, b:b + 1])
    trips_reg = nisa.register_alloc()
    nisa.register_load(trips_reg, valid_sb[0:1, b:b + 1])
    return expert_reg, trips_reg


def load_expert_cols(w, expert_reg, row_tiles, col0, ncols, w_sb=None, interleave=1):
    """(P, RT, ncols) tile of w[e, rows, col0 : col0 + ncols] (w (E, R, C) in HBM, natural layout),
    into ``w_sb`` when given (allocated by the caller, e.g. outside a guard). ``interleave`` > 1:
    the row tiles in the order of :func:`interleaved_blocks`, one DMA per block (with all C
    columns, a contiguous run of m rows per partition instead of one)."""
    cols = w.shape[2]
    if w_sb is None:
        w_sb = nl.ndarray((nl.tile_size.pmax, len(row_tiles), ncols), dtype=w.dtype, buffer=nl.sbuf)
    for rt, m, r0 in interleaved_blocks(row_tiles, interleave):
        rs = row_tiles[rt][1]
        nisa.dma_copy(dst=w_sb[:rs, rt:rt + m, :],
                      src=w.ap([[m * cols, rs], [cols, m], [1, ncols]], offset=r0 * cols + col0,
                               scalar_offset=expert_reg, indirect_dim=0))
    return w_sb


def weight_spans(col_tiles):
    """``col_tiles`` in consecutive groups covering at most WEIGHT_SPAN columns each."""
    per_span = max(1, WEIGHT_SPAN // nl.tile_size.pmax)
    return [col_tiles[i:i + per_span] for i in range(0, len(col_tiles), per_span)]


def load_expert_t(w, expert_reg, col_tiles, row0, nrows, interleave=1, w_t=None):
    """(P, CT, nrows) tile of w[e, row0 : row0 + nrows, cols]^T: the contraction dim (w's
    contiguous last dim, tiled by 128 as ``col_tiles``) on partitions. w (E, R, C) natural layout.
    ``interleave``: the column tiles in the order of :func:`tile_columns` (the in_out layout's
    order of H, so that both layouts sum the same products in the same order). Into ``w_t`` when
    given (allocated by the caller, e.g. outside a guard, or a view of a larger tile).

    Per 128 rows and column span: one DMA with long contiguous runs, then TensorE transposes
    (bit-exact transpose mode) of its 128 x 128 blocks, several blocks per PSUM bank and one
    eviction per bank, alternating between VectorE and ScalarE (a bit-exact copy on either)."""
    pmax = nl.tile_size.pmax
    per_bank = nl.tile_size.psum_fmax // pmax            # transposed blocks per PSUM bank (fp32 bound)
    cols = w.shape[2]
    if w_t is None:
        w_t = nl.ndarray((pmax, len(col_tiles), nrows), dtype=w.dtype, buffer=nl.sbuf)
    columns = dict(zip(col_tiles, tile_columns(col_tiles, interleave)))
    evictions = 0
    for r0, rs in spans(nrows, pmax):
        ct0 = 0
        for span in weight_spans(col_tiles):
            c_start = span[0][0]
            c_span = span[-1][0] + span[-1][1] - c_start
            nat_sb = nl.ndarray((rs, c_span), dtype=w.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=nat_sb, src=w.ap([[cols, rs], [1, c_span]], offset=(row0 + r0) * cols + c_start,
                                               scalar_offset=expert_reg, indirect_dim=0))
            full = [t for t in span if t[1] == pmax]    # only the last tile may be partial
            groups = [(g0, full[g0:g0 + per_bank]) for g0 in range(0, len(full), per_bank)]
            if len(full) < len(span):
                groups.append((len(full), span[len(full):]))
            for g0, group in groups:
                cs = group[0][1]
                tr_psum = nl.ndarray((cs, len(group), rs), dtype=w.dtype, buffer=nl.psum)
                for gi, tile in enumerate(group):
                    c0, step = columns[tile]
                    nisa.nc_transpose(dst=tr_psum[:, gi, :], data=nat_sb[:, c0 - c_start:c0 - c_start + step * (cs - 1) + 1:step])
                nisa.tensor_copy(dst=w_t[:cs, ct0 + g0:ct0 + g0 + len(group), r0:r0 + rs], src=tr_psum,
                                 engine=EVICTION_ENGINES[evictions % len(EVICTION_ENGINES)])
                evictions += 1
            ct0 += len(span)
    return w_t


def reduce_chunk(hidden, top_k):
    """H columns per step of :func:`reduce_assignments`: the k fp32 parts of a step fill at most
    REDUCE_PARTS_BYTES per partition (at least gemm_moving_fmax columns, at most H)."""
    return min(hidden, max(nl.tile_size.gemm_moving_fmax, REDUCE_PARTS_BYTES // (FP32_BYTES * top_k)))


def _reduce_load(src_slots, topk_w, top_k, step):
    """(routing weights (tp, k) or None, fp32 parts (tp, k, hn)) of one step (t0, tp, h0, hn) of
    :func:`reduce_assignments`; the weights are loaded with a token tile's first step."""
    t0, tp, h0, hn = step
    hidden = src_slots.shape[1]
    w_sb = None
    if topk_w is not None and h0 == 0:
        w_sb = nl.ndarray((tp, top_k), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=w_sb, src=topk_w.ap([[top_k, tp], [1, top_k]], offset=t0 * top_k))
    parts_sb = nl.ndarray((tp, top_k, hn), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=parts_sb, src=src_slots.ap([[top_k * hidden, tp], [hidden, top_k], [1, hn]],
                                                 offset=t0 * top_k * hidden + h0))
    return w_sb, parts_sb


def _weighted_sum(out_view, acc_sb, parts_sb, w_sb, top_k):
    """out_view = sum_j w[:, j] * parts[:, j, :] (fp32, j ascending; w = 1 when w_sb is None)."""
    acc_sb = out_view if top_k == 1 else acc_sb
    if w_sb is None:
        nisa.tensor_copy(dst=acc_sb, src=parts_sb[:, 0, :])
    else:
        nisa.tensor_scalar(dst=acc_sb, data=parts_sb[:, 0, :], op0=nl.multiply, operand0=w_sb[:, 0:1])
    for j in range(1, top_k):
        step_sb = out_view if j == top_k - 1 else acc_sb
        if w_sb is None:
            nisa.tensor_tensor(dst=step_sb, data1=acc_sb, data2=parts_sb[:, j, :], op=nl.add)
        else:
            nisa.scalar_tensor_tensor(dst=step_sb, data=parts_sb[:, j, :], op0=nl.multiply,
                                      operand0=w_sb[:, j:j + 1], op1=nl.add, operand1=acc_sb)


def reduce_assignments(src_slots, dst, top_k, topk_w=None, share=(0, 1)):
    """dst[t] = sum_j w[t, j] * src_slots[t * k + j] (fp32, j ascending; w = 1 when topk_w is
    None, else topk_w (N, 1) fp32, read in token order: no gather), cast to dst's dtype.

    ``share`` = (program, programs): this program writes every programs-th 128-token tile from
    its program-th (LNC2: the two cores take alternate tiles). Steps of (token tile, H chunk of
    :func:`reduce_chunk` columns) are software-pipelined: the next step's parts are loaded before
    this step's sum (DMAs start in program order); a token tile's rows are stored once, whole."""
    t_len, hidden = dst.shape
    program, programs = share
    chunk = reduce_chunk(hidden, top_k)
    steps = [(t0, tp, h0, hn) for t0, tp in spans(t_len, nl.tile_size.pmax)[program::programs]
             for h0, hn in spans(hidden, chunk)]
    pending = _reduce_load(src_slots, topk_w, top_k, steps[0]) if steps else None
    w_sb = out_sb = None
    for n, (t0, tp, h0, hn) in enumerate(steps):
        step_w, parts_sb = pending
        pending = _reduce_load(src_slots, topk_w, top_k, steps[n + 1]) if n + 1 < len(steps) else None
        if h0 == 0:
            w_sb, out_sb = step_w, nl.ndarray((tp, hidden), dtype=dst.dtype, buffer=nl.sbuf)
        acc_sb = nl.ndarray((tp, hn), dtype=nl.float32, buffer=nl.sbuf)
        _weighted_sum(out_sb[:, h0:h0 + hn], acc_sb, parts_sb, w_sb, top_k)
        if h0 + hn == hidden:
            nisa.dma_copy(dst=dst[t0:t0 + tp, :], src=out_sb)
