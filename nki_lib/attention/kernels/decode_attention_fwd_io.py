"""Decode-attention kernel: the loads and stores shared by its paths (q^T, sinks, the V cleaning,
the out rows) and a stream's runtime registers.

Algorithm: q of ``rn`` rows loads with up to ``Q_LOAD_ROWS`` consecutive rows per partition (one
DMA, few long descriptors), is transposed by one PE transpose per row of a partition and put back
in row order by its PSUM -> SBUF copy; V rows of keys outside ``[first, L_b)`` are zeroed by one
predicated copy (0 * NaN would poison P @ V); a stream's four chunk-range bounds load into
registers (derived on chip, ``decode_attention_fwd_meta``). No loops beyond the per-row transposes of q.

Shapes: q (B, Hq, Sq, D) read as (B*Hq*Sq, D) rows; q^T chunks (dc, rn); sink_rows (Hkv, R)
float32 -> (rn, 1); K/V chunks (128, M*D), or (128, M, D) views of token-major rows (``slot_cols``);
key slots (128, M) float32; key windows (128, 2) float32 ``[first, L_b)`` relative to the chunk; out
rows (rn, D). Dimension legend as in ``decode_attention_fwd``.

Limits: q rows of at most ``Q_LOAD_ROW_BYTES`` per partition row of the load; those of
``decode_attention_fwd`` otherwise.
"""

from __future__ import annotations

from nki_lib._nki import nisa, nl
from nki_lib.sizes import spans

__all__ = ["slot_cols", "slot_dim", "StreamSetup", "load_q_t", "load_sink", "store_out", "stream_setup",
           "unit_table_width", "zero_invisible_rows", "clean_edge_rows", "DMA_ENGINE_PARTITIONS", "RANGE_BOUNDS", "BOUND_COLUMNS", "DIRECT_PIECE_SLOTS", "Q_LOAD_ROW_BYTES", "OUT_STORE_LAG",
           "CHUNK_BUFFER_BUDGET", "CHUNK_BUFFER_BYTES"]

RANGE_BOUNDS = 4                  # bounds per split: start, lo, hi, stop (3 ranges) ...
BOUND_COLUMNS = (0, 2, 3, 1)      # ... stored start | stop | lo | hi (the split edges land as one pair)
DIRECT_PIECE_SLOTS = 32           # contiguous interior chunks load K and V in pieces of 32 slots (8 KiB
                                  # rows at D=128 bf16, >= 2 KiB per descriptor; 600 ns hwdge issue
                                  # each): the first scores and P @ V start while the rest lands
Q_LOAD_ROWS = 8                   # q loads with up to 8 consecutive rows per partition (8 PE transposes)
Q_LOAD_ROW_BYTES = 4096           # ... and at most 4 KiB per partition row (long enough to move at DMA
                                  # bandwidth at every documented per-descriptor floor)
OUT_STORE_LAG = 2                 # units whose out stores wait behind later units' loads (the DMA
                                  # engines serve in program order: an early store would hold them)
DMA_ENGINE_PARTITIONS = 8         # a DMA engine serves 8 partitions of a tile (Neuron DMA overview): a
                                  # DMA of at most 8 partitions is one engine's, row after row
CHUNK_BUFFER_BYTES = 32768        # per partition for one K or V chunk buffer: each gather descriptor moves
                                  # one partition's row, and GpSimd pays ~50 ns per descriptor (cost model
                                  # §7.3), so 32 KiB rows keep descriptor generation below the DMA time
CHUNK_BUFFER_BUDGET = 128 * 1024  # SBUF bytes per partition for K/V chunk buffers (divided by the
                                  # number of row tiles, whose working sets grow); streams (one per
                                  # (b, hk, split)) rotate over the pairs that fit, so consecutive
                                  # streams load and compute concurrently



def _q_rows_per_partition(rn, d, itemsize):
    """Rows of q per SBUF partition of its load: the largest power of two dividing ``rn``, at most
    ``Q_LOAD_ROWS`` and ``Q_LOAD_ROW_BYTES`` per partition row (each partition row of a DMA pays the
    per-descriptor floor: few long rows instead of ``rn`` short ones)."""
    k = 1
    while rn % (2 * k) == 0 and 2 * k <= Q_LOAD_ROWS and 2 * k * d * itemsize <= Q_LOAD_ROW_BYTES:
        k *= 2
    return k


def load_q_t(q, row0, rn, d_spans, dtype, copies=1):
    """q^T chunks (dc, rn) of rows ``row0 .. row0 + rn`` of the flattened (B*Hq*Sq, D) queries:
    one DMA of k consecutive rows per partition (rn/k partitions), k PE transposes (row p*k + j of
    block j lands in column j*rn/k + p) and one copy that puts the columns back in row order.
    ``copies`` > 1 (one chunk, D <= 64): (copies*D, rn), copy i on partitions i*D .. (i+1)*D (each
    transpose reads its block ``copies`` times through a stride-0 view), for K^T slots folded onto
    those partitions (``decode_attention_fwd.k_t_fold``)."""
    d = q.shape[3]
    k = _q_rows_per_partition(rn, d, q.itemsize)
    parts = rn // k
    q_sb = nl.ndarray((parts, k * d), dtype=dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=q_sb, src=q.ap([[k * d, parts], [1, k * d]], offset=row0 * d))
    q_t = []
    for d0, dn in d_spans:
        q_t_psum = nl.ndarray((copies * dn, rn), dtype=dtype, buffer=nl.psum)
        for j in range(k):
            block = q_sb[:, j * d + d0:j * d + d0 + dn]
            if copies > 1:
                block = block.expand_dim(1).broadcast(1, copies)
            nisa.nc_transpose(dst=q_t_psum[:, j * parts:(j + 1) * parts], data=block)
        q_t_sb = nl.ndarray((copies * dn, rn), dtype=dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=q_t_sb.reshape((copies * dn, parts, k)),
                         src=q_t_psum.reshape((copies * dn, k, parts)).permute((0, 2, 1)))
        q_t.append(q_t_sb)
    return q_t


def load_sink(sink_rows, hk, r0, rn, sq=1):
    """Sink logits (rn, 1) of rows r0 .. r0 + rn (r = g*Sq + t) of kv head ``hk``. ``sink_rows`` holds
    one logit per row (Hkv, R), or per query head (Hkv, G) when the rows fit one tile (Sq = 1
    included): then one DMA of the (1, G) row (one descriptor, not G at the per-descriptor floor)
    and a PE transpose of its view broadcast over the Sq tokens (fp32 transposes are bit-exact),
    copied to SBUF on ScalarE."""
    sink_sb = nl.ndarray((rn, 1), dtype=nl.float32, buffer=nl.sbuf)
    heads = sink_rows.shape[1]
    if heads * sq != rn:
        nisa.dma_copy(dst=sink_sb, src=sink_rows.ap([[1, rn], [1, 1]], offset=hk * heads + r0))
        return sink_sb
    row_sb = nl.ndarray((1, heads), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=row_sb, src=sink_rows.ap([[heads, 1], [1, heads]], offset=hk * heads))
    sink_psum = nl.ndarray((rn, 1), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_transpose(dst=sink_psum, data=row_sb.expand_dim(2).broadcast(2, sq))
    nisa.tensor_copy(dst=sink_sb, src=sink_psum, engine=nisa.engine.scalar)
    return sink_sb


def store_out(out, out_sb, row0):
    """Out rows (rn, D) -> rows row0 .. row0 + rn of the flattened (B*Hq*Sq, D) output. A tile of at
    most ``DMA_ENGINE_PARTITIONS`` rows would be one DMA engine's work, its rows served one after
    another; it leaves as two DMAs of half the rows (two engines, the same descriptors)."""
    rn, d = out_sb.shape
    pieces = spans(rn, (rn + 1) // 2) if 1 < rn <= DMA_ENGINE_PARTITIONS else [(0, rn)]
    for r0, n in pieces:
        nisa.dma_copy(dst=out.ap([[d, n], [1, d]], offset=(row0 + r0) * d), src=out_sb[r0:r0 + n])


def slot_dim(chunk, m):
    """D of a K or V chunk of ``m`` key slots: a (128, M*D) tile or a (128, M, D) view."""
    return chunk.shape[2] if len(chunk.shape) == 3 else chunk.shape[1] // m


def slot_cols(chunk, d, c, n=1, d0=0, dn=None):
    """Columns ``d0 .. d0 + dn`` (default: all ``d``) of key slots ``c .. c + n`` of a K or V chunk:
    of a (128, M*D) tile (slot c at columns c*D ..) a (128, n*dn) view (n > 1 only with whole
    slots), of a (128, M, D) view (any slot stride: a token-major pool's rows hold [token][kv head]
    [D], ``decode_attention_fwd_gathers``) a (128, dn) or (128, n, D) view."""
    dn = d - d0 if dn is None else dn
    if len(chunk.shape) == 3:
        return chunk[:, c, d0:d0 + dn] if n == 1 else chunk[:, c:c + n, d0:d0 + dn]
    return chunk[:, c * d + d0:c * d + d0 + dn] if n == 1 else chunk[:, c * d:(c + n) * d]


def zero_invisible_rows(v_chunk, key_slots, window_sb):
    """V rows of keys outside [first, L) (relative to the chunk) -> 0: their probabilities are 0,
    but 0 * NaN (garbage past L_b, or stale rows of skipped units) would poison P @ V."""
    pmax, m = key_slots.shape
    outside = nl.ndarray((pmax, m), dtype=nl.uint8, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=outside, data=key_slots, op0=nl.greater_equal, operand0=window_sb[:, 1:2])
    nisa.scalar_tensor_tensor(dst=outside, data=key_slots, op0=nl.less, operand0=window_sb[:, 0:1],
                              op1=nl.maximum, operand1=outside)
    words = _word_view(v_chunk, m)
    d = slot_dim(words, m)
    nisa.tensor_copy_predicated(dst=words, src=0.0, predicate=outside.expand_dim(2).broadcast(2, d))


def _word_view(v_chunk, m):
    """A 16-bit V chunk with an even D reinterpreted as 32-bit words (``NkiTensor.view``): a word holds
    two elements of one key's row, so zeroing it zeroes both (+0.0), and the predicated copy -- one
    element a cycle whatever the dtype (docs/cost-model.md, VectorE generic ops) -- runs over half as
    many elements. Any other chunk as it is."""
    if v_chunk.itemsize != 2 or slot_dim(v_chunk, m) % 2:
        return v_chunk
    return v_chunk.view(nl.float32)


def clean_edge_rows(v_chunk, key_slots, setup):
    """When the only chunk is an edge chunk (a device loop of 0 or 1 trips over each of ``setup``'s
    edge ranges [start, lo) and [hi, stop)), its V rows outside [first, L_b) zeroed."""
    for start, stop, step in setup.edges:
        for _ in nl.dynamic_range(start, stop, step):
            zero_invisible_rows(v_chunk, key_slots, setup.window)


def unit_table_width(m, unit_keys):
    """Unit columns per chunk of 128*M keys."""
    return m * nl.tile_size.pmax // unit_keys


class StreamSetup(nl.NKIObject):
    """Runtime metadata of one (b, hk, split) stream."""
    regs: object       # 4 registers: unit columns start, lo, hi, stop of the edge, interior, edge ranges
    window: object     # (128, 2) float32 [first, L_b) relative to the current chunk, every partition
    key_regs: object   # single-chunk path: registers of first and L_b (from ``window``), or None
    edges: object      # static: (start, stop, step) of the device loop over each edge range (0 or 1 trips
                       # on the single-chunk path: the chunk needs its V rows outside [first, L_b) zeroed)


def stream_setup(meta, ws, static=False, width=1):
    """Registers of the split's chunk ranges (split ``ws`` of the flattened (b, s)) and a copy of
    its key window (moved chunk by chunk; ``static``: the single-chunk path, whose window never
    moves, takes a view of the batch's, and ``edges`` its edge ranges, ``width`` unit columns a
    chunk). Without split bounds (``meta.bounds`` None: one chunk, first = 0, the kernel read the
    lengths) the only edge range is [L_b, C) in keys: one register, a loop of one trip iff L_b < C."""
    if meta.bounds is None:
        reg = nisa.register_alloc()
        nisa.register_load(reg, meta.lengths[0:1, ws:ws + 1])
        return StreamSetup(regs=[reg], window=meta.window[:, 2 * ws:2 * ws + 2], key_regs=None,
                           edges=[(reg, meta.chunk_keys, meta.chunk_keys)])
    n_bounds = RANGE_BOUNDS
    regs = []
    for i in BOUND_COLUMNS:                 # registers in key order: start, lo, hi, stop
        reg = nisa.register_alloc()
        nisa.register_load(reg, meta.bounds[0:1, ws * n_bounds + i:ws * n_bounds + i + 1])
        regs.append(reg)
    if static:
        return StreamSetup(regs=regs, window=meta.window[:, 2 * ws:2 * ws + 2], key_regs=None,
                           edges=[(regs[r], regs[r + 1], width) for r in range(0, n_bounds - 1, 2)])
    window_sb = nl.ndarray((nl.tile_size.pmax, 2), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=window_sb, src=meta.window[:, 2 * ws:2 * ws + 2])
    return StreamSetup(regs=regs, window=window_sb, key_regs=None, edges=None)
