"""Decode-attention NKI kernel: a few new tokens per sequence over a contiguous or paged KV cache.

Algorithm (flash-decoding, keys on partitions). For every (sequence b, kv head hk) the
``R = G * Sq`` query rows of the GQA group (all query heads of hk and all new tokens, row
``r = g * Sq + t``) share every K/V byte read; the *keys* sit on the 128 partitions and the rows on
the free axis (scores are S^T), so VectorE/ScalarE use all lanes even when R is 8. The sequence's
needed key range ``[first, L_b)`` (``first = max(0, L_b - Sq - window_left)``, 0 without a window)
is cut into ``S`` contiguous splits; each split
streams its chunks of ``C = 128 * M`` keys through a *device loop* (``nl.dynamic_range``) whose
bounds are runtime registers loaded from ``split_bounds``, keeping the online-softmax state
(negated running max ``neg_m``, sum ``l``, unnormalised output ``acc``; fp32 SBUF)::

    s     = scale * q @ k^T          (softcap: softcap * tanh(s / softcap)); keys outside [lo, hi]
                                     of the row -> MASK_FILL (range_select, which also gives rowmax)
    m_new = max(m, rowmax(s));  alpha = exp(m - m_new);  p = exp(s - m_new)
    l     = alpha * l + rowsum(p);   acc = alpha * acc + p @ v

The splits are merged exactly through their maxima and sums, together with the sink (a virtual key
with logit ``sinks[h]`` and no value)::

    M = max(m_1..m_S, sink);  w_s = exp(m_s - M);  L = sum_s w_s l_s + exp(sink - M)
    out = (sum_s w_s acc_s) / L;  lse = M + log(L)

Every row sees at least its own position, so ``L >= 1`` (decode has no empty rows); an empty split
keeps ``m = STAT_INIT`` and gets weight exactly 0. A row whose max is +inf (an inf score) has NaN
``p`` and ``L``; its lse is set to +inf, the logsumexp (``tiles.inf_max_rows``).

One chunk (``u`` keys per gathered unit, ``M`` keys per partition)::

    unit ids (C/u, 1) int32   <- DMA of unit_table[b, col : col + C/u]      (col = loop register)
    K, V chunk (128, M*D)     <- indirect DMAs (vector_offset = unit ids, oob_mode.skip), K one per
                                 softmax step, V whole: unit i lands on keys [i*u, (i+1)*u), key k
                                 on partition k // M, slot k % M: one contiguous run per partition
    per softmax step of n slots (``chunk_plan``: n*rn <= 4096 fp32, n <= 128):
      K^T (dc, 128*nk) PSUM   <- nk TensorE transposes of slots c (keys {p*M + c}) per K^T block
                                 (one PSUM bank), evicted by VectorE, issued 3 blocks ahead (across
                                 the units of a wave)
      S^T[:, :, c] (128, rn)  =  sum over head-dim chunks of matmul(K^T slot c (dc, 128), q^T (dc, rn))
                                 into a score block (one PSUM bank), evicted by ScalarE with the
                                 scale (and tanh for softcap) into S^T (128, rn, n) (rows outermost)
      mask + partial max      :  one range_select per row r over its n slots: slot c of partition p
                                 is key p*M + c, visible iff lo_r - p*M <= c <= hi_r - p*M
      row max                 :  partial max (128, rn) -> PE transpose -> VectorE max -> (rn, 1);
                                 -m_new broadcast to (128, rn) by a PE transpose of a stride-0 view
      P^T (128, rn, n)        =  exp(S^T + (-m_r)): one ScalarE exp per row (per-partition bias)
      [O | rowsum] (rn, D+1)  += matmul(P^T slot c (128, rn), V slot c (128, D)) when that costs
                                 TensorE no more than the transposed form (``pv_direct``), else
                                 O^T (dc, rn) += matmul(V slot c (128, dc), P^T slot c) evicted and
                                 PE-transposed back; row sums += matmul(P^T slot c, ones (128, 1));
                                 acc | l updated in one instruction; issued after the next step's scores

Each split visits three chunk ranges in key order (``split_bounds`` (B, S, 4)): edge chunks,
interior chunks (every key inside ``[first, L_b)``), edge chunks. For a contiguous cache an
interior chunk is one contiguous HBM run per kv head and loads with hardware-DGE DMAs
(``.ap(scalar_offset=col)``, ``DIRECT_PIECE_SLOTS`` slots each, no GpSimd descriptor generation);
everything else gathers.

Only needed units are read: the launcher replaces the ids of units that hold no key of
``[first, L_b)`` by an out-of-range sentinel and the indirect DMA skips them (their SBUF rows keep
stale or never-written data, which the mask and the V cleaning remove). The device loops visit only
the chunks of ``[first, L_b)``, so traffic and work follow ``L_b``, not the capacity. Row bounds
(128, rn, 2): ``(lo_r - p*M, hi_r - p*M)`` relative to the chunk start, moved by ``-C`` per chunk.

Loop structure (program order is what the in-order engines and DMA queues see, so every load
is issued before the stores and setup of later units that would otherwise hold them)::

    split bounds (1, B*S*4), key windows (128, B*S*2): one DMA each for the whole batch
    for unit (b, hk) (static):
      prepare the next unit:                     q^T (one DMA of up to 8 rows per partition and
                                                 PE transposes, for the units whose
                                                 rows fit 128 partitions), sinks (once per kv head),
                                                 per split: state, row bounds (from its key window,
                                                 on chip), 4 registers <- split bounds
      for split s (static):
        for range in (edge, interior, edge):
          for col in dynamic_range(lo, hi, C/u):     load (edge: + zero V rows outside
                                                     [first, L_b)), one chunk (above), every row tile
      merge splits + sink -> out (rn, D), -M and L into column k of the batch's lse tiles
      store the out rows of the unit OUT_STORE_LAG units back
    store the remaining out rows; lse = M + log(L) for all units at once (one ACT table switch),
    transposed to (units, rn) and stored by one DMA per row tile

Single-chunk path (one split, a capacity of one chunk of at most ``SINGLE_CHUNK_KEYS`` keys, and
for a contiguous cache exactly one chunk): every unit's only chunk is chunk 0, so its loads and
compute are static code (contiguous: precomputed-descriptor DMAs per group of
``LOAD_GROUP_PARTITIONS`` partitions, each inside device loops of 0 or 1 trips that skip a group
holding no key of [first, L_b); paged: the gathers as above); the V cleaning of an edge chunk runs
in device loops of 0 or 1 trips too. Per group of units (as many as there are buffer pairs): K of
every unit, then V of every unit, then their compute in waves of up to ``LOCKSTEP_CHAINS`` chains,
the instructions of the units' softmax, P @ V and merge chains interleaved phase by phase
(``lockstep``), so the in-order engines pay each hop's latency once per wave, not once per unit.

When a single-chunk unit has one softmax step, its sink is folded into that step (-m = min(-rowmax,
-sink): the sink is a 129th column of the transposed per-partition maxima, and exp(sink - m) is
taken beside the exps), so its merge is L = l + exp(sink - m), out = acc / L: no exp after the
softmax, and the log table for the lse loads behind P @ V and the merges.

Packed single-chunk path (contiguous caches whose chunk rows M*D are short, LNC1; ``_pack_size``):
U consecutive units (2 or 4, U*M*R <= MIN_II_ELEMS) share one chunk -- unit u on partitions
[u*128/U, (u+1)*128/U), U*M slots each, so K and V of the pack are one contiguous run per
partition (U-fold longer DMA rows, U-fold fewer descriptors) -- and one score tile of U*R rows:
the scores, the grouped mask (bounds shifted to each unit's columns, so a partition only sees its
own unit's rows), the row max and the exp run once per pack; P @ V runs per unit, contracting over
its own partitions (a PE row tile), into its own state, and each unit merges as in the
single-chunk path. The pack loads its whole capacity (one chunk per unit; each unit's V rows
outside [first, L_b) are zeroed in device loops over its edge ranges).

K/V chunk buffers: pairs rotate over the (b, hk, split) streams (as many pairs as fit
``CHUNK_BUFFER_BUDGET``), so one stream's gathers overlap another stream's compute.

LNC2 (``kernel[2]``): when B*Hkv is even the (b, hk) units alternate between the cores; otherwise
(S is then even) core p runs splits p, p+2, ... of every unit, the cores swap their packed split
states with ``sendrecv`` and both merge; core p stores the row tiles t with t % 2 == p.

Shapes (HBM): q (B, Hq, Sq, D); k_units/v_units (N_units, row_stride) -- the cache viewed as rows
of gatherable units (paged: one block of all kv heads per row, head hk at ``hk * head_offset``;
contiguous: ``u`` keys of one head per row, ``seq_units`` rows per sequence); unit_table (B, n_cols)
int32 unit ids of kv head 0;
split_bounds (B, S, 4) int32: start <= lo <= hi <= stop in unit columns, the ranges [start, lo),
[lo, hi), [hi, stop); key_window (B, S, 2) float32 [first, L_b) relative to the split's first key
(row r's visible keys: ``[max(pos_r - window_left, first), pos_r]``, ``pos_r = L_b - Sq + t_r``);
sink_rows (Hkv, R) float32 or None; ``window_left`` (static int, -1 unbounded).
Outputs: out (B, Hq, Sq, D) in q's dtype, lse (B, Hq, Sq) float32.
Dimension legend: B batch, Hq/Hkv heads, G = Hq/Hkv, Sq new tokens, D head dim, R = G*Sq rows,
rn rows of a row tile (<= 128), dc head-dim chunk (<= 128), M keys per partition of a chunk,
C = 128*M keys per chunk (M <= 128), n slots of a softmax step, nk slots of a K^T block (one PSUM
bank), u keys per unit, S splits.

Garbage is harmless: K rows of keys outside ``[first, L_b)`` only produce masked scores (masking
is a select), and edge chunks zero the V rows of such keys (``key_window``), so NaN/inf in unused
slots, in stale rows of skipped units or outside the window never reach P @ V (0 * NaN).

Limits: bf16/fp16/fp32 (P in the input dtype for P @ V); D <= 256; R any (row tiles of 128);
positions < 2**24 (float32 bounds); unit size u a power of two with C/u <= 128.
"""

from __future__ import annotations

from nki_lib._nki import nisa, nki, nl
from nki_lib.attention.kernels.decode_attention_fwd_steps import (
    MIN_II_ELEMS,
    KtPipeline,
    LseTile,
    lockstep,
    lockstep_batched,
    merge_phases,
    pv_direct,
    step_probs_phases,
    step_pv_phases,
    step_scores,
    store_lse,
)
from nki_lib.attention.kernels.tiles import MAX_INDEX, STAT_INIT
from nki_lib.sizes import spans

__all__ = ["decode_attention_fwd_kernel", "block_slots", "chunk_plan", "single_chunk_path"]

INTERIOR_RANGE = 1                # split_bounds ranges: edge, interior, edge
RANGE_BOUNDS = 4                  # split_bounds per split: start, lo, hi, stop (3 ranges)
STEP_SCORE_ELEMS = 4096           # fp32 scores per partition of one softmax step (16 KiB of SBUF)
STEP_SLOTS = 64                   # slots per softmax step: >= 64 keeps the per-row range_select at
                                  # one element per cycle; a chunk has >= 2 steps to pipeline
DIRECT_PIECE_SLOTS = 32           # contiguous interior chunks load K and V in pieces of 32 slots (8 KiB
                                  # rows at D=128 bf16, >= 2 KiB per descriptor; 600 ns hwdge issue
                                  # each): the first scores and P @ V start while the rest lands
Q_LOAD_ROWS = 8                   # q loads with up to 8 consecutive rows per partition (8 PE transposes)
Q_LOAD_ROW_BYTES = 4096           # ... and at most 4 KiB per partition row (long enough to move at DMA
                                  # bandwidth at every documented per-descriptor floor)
OUT_STORE_LAG = 2                 # units whose out stores wait behind later units' loads (the DMA
                                  # engines serve in program order: an early store would hold them)
SINGLE_CHUNK_KEYS = 8192          # capacities up to this (one chunk, one split) load their chunk
                                  # statically, so the units' compute pipelines in program order
LOCKSTEP_CHAINS = 4               # softmax / P @ V chains (row tile x head-dim chunk) interleaved in lockstep:
                                  # each holds ~3 PSUM banks while in flight, 8 banks in all
KT_ACT_EVERY = 4                  # single-chunk path: every 4th K^T eviction on ScalarE
LOAD_GROUP_PARTITIONS = 16        # single-chunk contiguous loads skip groups of this many partitions
                                  # that hold no key of [first, L_b) (2 DMA engines each: 16 groups in flight)
PACK_MAX = 4                      # units per packed chunk: unit u's P @ V contracts over its 128/U
                                  # partitions, a row tile of the PE array (32 at least, docs/nki-semantics.md §8.8)
CHUNK_BUFFER_BUDGET = 128 * 1024  # SBUF bytes per partition for K/V chunk buffers (divided by the
                                  # number of row tiles, whose working sets grow); streams (one per
                                  # (b, hk, split)) rotate over the pairs that fit, so consecutive
                                  # streams load and compute concurrently


def block_slots(itemsize: int = 4) -> int:
    """Key slots per K^T block: 128 keys per slot, one PSUM bank of ``itemsize``-byte K^T columns."""
    return nl.tile_size.psum_bank_fmax_bytes // (itemsize * nl.tile_size.pmax)


def _floor_pow2(x):
    return 1 << (max(1, int(x)).bit_length() - 1)


def chunk_plan(m, rows_max, rows_total, itemsize):
    """(step slots, score-block slots, K^T-block slots) for a chunk of M slots, row tiles of at
    most ``rows_max`` rows (``rows_total`` rows in all) and K/V of ``itemsize`` bytes; all powers of
    two dividing M. A score block's fp32 S^T (128, n*rn) fills at most one PSUM bank, so does a K^T
    block; a softmax step covers at most ``STEP_SLOTS`` slots and ``STEP_SCORE_ELEMS`` fp32 scores
    per partition over all row tiles (their scores are live together)."""
    blk = min(m, max(1, _floor_pow2(nl.tile_size.psum_bank_fmax // rows_max)))
    kt = min(blk, block_slots(itemsize))
    step = max(blk, min(m, STEP_SLOTS, _floor_pow2(STEP_SCORE_ELEMS // rows_total)))
    return step, blk, kt


class _SplitState(nl.NKIObject):
    """Online-softmax state of one split over one row tile (fp32 SBUF). ``packed`` (rn, D + 2)
    holds acc | l | neg_m, so one ``sendrecv`` moves a split's state to the other core (LNC2) and
    one instruction updates acc | l from the P @ V result [O | rowsum] (rn, D + 1)."""
    packed: object   # (rn, D + 2)
    acc_l: object    # (rn, D + 1) acc | l                      = packed[:, :D + 1]
    acc: object      # (rn, D) unnormalised output            = packed[:, :D]
    l: object        # (rn, 1) running sum                    = packed[:, D]  # noqa: E741
    neg_m: object    # (rn, 1) negated running max            = packed[:, D + 1]
    bounds: object   # (128, rn, 2) per partition p and row r: (lo_r - p*M, hi_r - p*M), lo/hi
                     # relative to the chunk start: the visible slots of partition p
    group_sq: object  # Sq when the tile holds every row of its unit (rows r = g*Sq + t with equal t
                      # share their bounds: short-row steps mask a whole t at once), else None
    g_bounds: object  # short-row steps of a whole unit: (128, Sq, 2) per position t the bounds of its
                      # G rows in the grouped score layout, (lo_t * G, (hi_t + 1) * G); else None
    pack: int         # units whose rows share the tile (packed single-chunk path: unit u's keys on
                      # partitions [u*128/U, (u+1)*128/U), its rows u*R .. (u+1)*R); 1 otherwise
    units: object     # packed: per unit its own state (R rows on partitions 0 .. R: P @ V, merge), else None
    folded: bool      # single-chunk path, one softmax step: the sink is folded into that step (its -m
                      # includes -sink, ``sink_term`` = exp(sink - m)), so the merge needs no exp
    sink: object      # folded: the sink logits (rn, 1) of the rows, or None (no sinks)
    neg_sink: object  # folded: -sink (rn, 1), or None
    sink_term: object  # folded with sinks: exp(sink - m) (rn, 1), written by the step


def _state_views(packed, bounds=None, group_sq=None, g_bounds=None, pack=1, units=None, sinks=(None, None),
                 folded=False):
    d = packed.shape[1] - 2
    sink, neg_sink = sinks
    sink_term = nl.ndarray((packed.shape[0], 1), dtype=nl.float32, buffer=nl.sbuf) if sink is not None else None
    return _SplitState(packed=packed, acc_l=packed[:, 0:d + 1], acc=packed[:, 0:d], l=packed[:, d:d + 1],
                       neg_m=packed[:, d + 1:d + 2], bounds=bounds, group_sq=group_sq, g_bounds=g_bounds,
                       pack=pack, units=units, folded=folded, sink=sink, neg_sink=neg_sink,
                       sink_term=sink_term)


def _q_rows_per_partition(rn, d, itemsize):
    """Rows of q per SBUF partition of its load: the largest power of two dividing ``rn``, at most
    ``Q_LOAD_ROWS`` and ``Q_LOAD_ROW_BYTES`` per partition row (each partition row of a DMA pays the
    per-descriptor floor: few long rows instead of ``rn`` short ones)."""
    k = 1
    while rn % (2 * k) == 0 and 2 * k <= Q_LOAD_ROWS and 2 * k * d * itemsize <= Q_LOAD_ROW_BYTES:
        k *= 2
    return k


def _load_q_t(q, row0, rn, d_spans, dtype):
    """q^T chunks (dc, rn) of rows ``row0 .. row0 + rn`` of the flattened (B*Hq*Sq, D) queries:
    one DMA of k consecutive rows per partition (rn/k partitions), k PE transposes (row p*k + j of
    block j lands in column j*rn/k + p) and one copy that puts the columns back in row order."""
    d = q.shape[3]
    k = _q_rows_per_partition(rn, d, q.itemsize)
    parts = rn // k
    q_sb = nl.ndarray((parts, k * d), dtype=dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=q_sb, src=q.ap([[k * d, parts], [1, k * d]], offset=row0 * d))
    q_t = []
    for d0, dn in d_spans:
        q_t_psum = nl.ndarray((dn, rn), dtype=dtype, buffer=nl.psum)
        for j in range(k):
            nisa.nc_transpose(dst=q_t_psum[:, j * parts:(j + 1) * parts], data=q_sb[:, j * d + d0:j * d + d0 + dn])
        q_t_sb = nl.ndarray((dn, rn), dtype=dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=q_t_sb.reshape((dn, parts, k)), src=q_t_psum.reshape((dn, k, parts)).permute((0, 2, 1)))
        q_t.append(q_t_sb)
    return q_t


class _BatchMeta(nl.NKIObject):
    """Runtime metadata of every (b, split), each loaded by one DMA at the kernel start."""
    bounds: object     # (1, B*S*4) int32: per (b, s) the unit columns start | lo | hi | stop of its
                       # three chunk ranges (edge [start, lo), interior [lo, hi), edge [hi, stop))
    window: object     # (128, B*S*2) float32: per (b, s) [first, L_b) relative to the split's first key
    window_pm: object  # (128, B*S*2) float32: ``window`` - p*M on partition p
    row_pos: object    # (128, R) float32: t_r - Sq for row r = g*Sq + t_r (its position minus L_b)
    reach: float       # keys a row sees before its own position: window_left, or MAX_INDEX unbounded
    sq: int            # new tokens per sequence


def _load_meta(split_bounds, key_window, rows, sq, part_keys, window_left):
    """The batch's split bounds (one partition) and key windows (every partition), one DMA each,
    and the rows' positions relative to L_b (an iota)."""
    pmax = nl.tile_size.pmax
    n_bounds = split_bounds.shape[0] * split_bounds.shape[1] * split_bounds.shape[2]
    bounds_sb = nl.ndarray((1, n_bounds), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=bounds_sb, src=split_bounds.ap([[n_bounds, 1], [1, n_bounds]]))
    n_window = key_window.shape[0] * key_window.shape[1] * key_window.shape[2]
    window_sb = nl.ndarray((pmax, n_window), dtype=nl.float32, buffer=nl.sbuf)
    if n_window <= pmax:            # one column, broadcast to the partitions by a PE transpose (exact):
        window_col = nl.ndarray((n_window, 1), dtype=nl.float32, buffer=nl.sbuf)   # 1 DMA engine, not 16
        nisa.dma_copy(dst=window_col, src=key_window.ap([[1, n_window], [1, 1]]))
        window_psum = nl.ndarray((pmax, n_window), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_transpose(dst=window_psum, data=window_col.broadcast(1, pmax))
        nisa.tensor_copy(dst=window_sb, src=window_psum)
    else:
        nisa.dma_copy(dst=window_sb, src=key_window.ap([[0, pmax], [1, n_window]]))
    window_pm = nl.ndarray((pmax, n_window), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=window_pm, data=window_sb, op0=nl.subtract, operand0=part_keys)
    row_pos = nl.ndarray((pmax, rows // sq, sq), dtype=nl.float32, buffer=nl.sbuf)
    nisa.iota(dst=row_pos, pattern=[[0, rows // sq], [1, sq]], offset=-sq)
    reach = float(window_left) if window_left >= 0 else float(MAX_INDEX)
    return _BatchMeta(bounds=bounds_sb, window=window_sb, window_pm=window_pm,
                      row_pos=row_pos.reshape((pmax, rows)), reach=reach, sq=sq)


def _init_state(meta, ws, r0, rn, d, step_slots, fresh=False, engine=None, fold=None):
    """Fresh state of rows r0 .. r0 + rn of the split whose key window is column pair ``ws`` of
    ``meta.window``; its row bounds on every partition p, relative to the split's first key and
    shifted by -p*M, come from that window (no HBM read): row r sits at ``L_b - Sq + t_r``, so
    ``hi = L_rel - Sq + t_r - p*M`` and ``lo = max(hi - window_left, first_rel - p*M)``
    (``first`` already folds in the window and cache_start). Steps of ``step_slots`` < MIN_II_ELEMS
    slots over a whole unit mask by position: their grouped bounds are computed here, once.
    ``fresh``: the first step overwrites acc, l and -m without reading them (single-chunk path), so
    they are not initialised. ``engine``: of the bound arithmetic (SBUF only; GpSimd where it idles).
    ``fold``: (sink, -sink) (rn, 1) each, or (None, None), when the sink folds into the state's only step."""
    pmax = nl.tile_size.pmax
    engine = engine or nisa.engine.vector
    whole = r0 == 0 and rn == meta.row_pos.shape[1]
    grouped = whole and step_slots < MIN_II_ELEMS
    state = _state_views(nl.ndarray((rn, d + 2), dtype=nl.float32, buffer=nl.sbuf),
                         nl.ndarray((pmax, rn, 2), dtype=nl.float32, buffer=nl.sbuf), meta.sq if whole else None,
                         nl.ndarray((pmax, meta.sq, 2), dtype=nl.float32, buffer=nl.sbuf) if grouped else None,
                         sinks=fold or (None, None), folded=fold is not None)
    if not fresh:
        nisa.memset(dst=state.packed, value=0.0)
        nisa.memset(dst=state.neg_m, value=-STAT_INIT)
    c = 2 * ws
    nisa.tensor_scalar(dst=state.bounds[:, :, 1], data=meta.row_pos[:, r0:r0 + rn], op0=nl.add,
                       operand0=meta.window_pm[:, c + 1:c + 2], engine=engine)
    nisa.tensor_scalar(dst=state.bounds[:, :, 0], data=state.bounds[:, :, 1], op0=nl.add,
                       operand0=-meta.reach, op1=nl.maximum, operand1=meta.window_pm[:, c:c + 1], engine=engine)
    if grouped:
        group = rn // meta.sq
        nisa.tensor_scalar(dst=state.g_bounds[:, :, 0], data=state.bounds[:, 0:meta.sq, 0], op0=nl.multiply,
                           operand0=float(group), engine=engine)
        nisa.tensor_scalar(dst=state.g_bounds[:, :, 1], data=state.bounds[:, 0:meta.sq, 1], op0=nl.add,
                           operand0=1.0, op1=nl.multiply, operand1=float(group), engine=engine)
    return state


def _gather_chunk(cache_units, idx_sb, head_offset, unit_keys, chunk_sb, slots=None):
    """One indirect DMA: units ``idx_sb`` of the cache (this kv head) -> chunk_sb (128, M*D), or
    only the slots ``(c0, n)`` of every partition -> chunk_sb[:, c0*D : (c0+n)*D] (each unit covers
    u/M whole partitions; M <= u)."""
    n_units = idx_sb.shape[0]
    row_stride = cache_units.shape[1]
    m = unit_keys * n_units // nl.tile_size.pmax
    d = chunk_sb.shape[1] // m
    c0, n = slots or (0, m)
    src = cache_units.ap([[row_stride, n_units], [m * d, unit_keys // m], [1, n * d]], offset=head_offset + c0 * d,
                         vector_offset=idx_sb, indirect_dim=0)
    nisa.dma_copy(dst=chunk_sb[:, c0 * d:(c0 + n) * d], src=src, oob_mode=nisa.oob_mode.skip,
                  dge_mode=nisa.dge_mode.swdge)



class _StreamSetup(nl.NKIObject):
    """Runtime metadata of one (b, hk, split) stream."""
    regs: object       # 4 registers: unit columns start, lo, hi, stop of the edge, interior, edge ranges
    window: object     # (128, 2) float32 [first, L_b) relative to the current chunk, every partition
    key_regs: object   # single-chunk path: registers of first and L_b (from ``window``), or None


def _stream_setup(meta, ws, static=False):
    """Registers of the split's chunk ranges (split ``ws`` of the flattened (b, s)) and a copy of
    its key window (moved chunk by chunk; ``static``: the single-chunk path, whose window never
    moves, takes a view of the batch's)."""
    n_bounds = RANGE_BOUNDS
    regs = []
    for i in range(n_bounds):
        reg = nisa.register_alloc()
        nisa.register_load(reg, meta.bounds[0:1, ws * n_bounds + i:ws * n_bounds + i + 1])
        regs.append(reg)
    if static:
        return _StreamSetup(regs=regs, window=meta.window[:, 2 * ws:2 * ws + 2], key_regs=None)
    window_sb = nl.ndarray((nl.tile_size.pmax, 2), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=window_sb, src=meta.window[:, 2 * ws:2 * ws + 2])
    return _StreamSetup(regs=regs, window=window_sb, key_regs=None)


def _stream(split_states, setup, q_t, k_units, v_units, unit_table, key_slots,
            b, head_offset, seq_offset, unit_keys, chunk_pair, plan, ones_col, d_spans, scale, softcap, dtype):
    """One (b, hk, split) stream: three device loops over the split's chunks, in key order --
    edge chunks (gathered; V rows of keys outside [first, L_b) zeroed, so garbage or stale
    NaN/inf there cannot reach P @ V), interior chunks (one hardware-DGE DMA per K/V for a
    contiguous cache, ``seq_offset`` is None for paged caches, else gathered), edge chunks."""
    pmax = nl.tile_size.pmax
    m = key_slots.shape[1]
    d = split_states[0].acc.shape[1]
    units_per_chunk = m * pmax // unit_keys
    k_chunk, v_chunk = chunk_pair
    regs, window_sb = setup.regs, setup.window
    steps = spans(m, plan[0])       # gathered K per softmax step: the first step's scores start early
    n_cols = unit_table.shape[1]
    for r in range(len(regs) - 1):
        interior = r == INTERIOR_RANGE
        direct = interior and seq_offset is not None
        for col in nl.dynamic_range(regs[r], regs[r + 1], units_per_chunk):
            if direct:                                  # K, then V, in pieces
                pieces = spans(m, DIRECT_PIECE_SLOTS)
                for cache, buf in ((k_units, k_chunk), (v_units, v_chunk)):
                    for c0, n in pieces:
                        src = cache.ap([[m * d, pmax], [1, n * d]], offset=seq_offset + head_offset + c0 * d,
                                       scalar_offset=col, indirect_dim=0)
                        nisa.dma_copy(dst=buf[:, c0 * d:(c0 + n) * d], src=src, dge_mode=nisa.dge_mode.hwdge)
            else:
                idx_sb = nl.ndarray((units_per_chunk, 1), dtype=nl.int32, buffer=nl.sbuf)
                nisa.dma_copy(dst=idx_sb, src=unit_table.ap([[1, units_per_chunk], [1, 1]],
                                                            offset=b * n_cols, scalar_offset=col,
                                                            indirect_dim=1))
                for step in steps:
                    _gather_chunk(k_units, idx_sb, head_offset, unit_keys, k_chunk, step)
                _gather_chunk(v_units, idx_sb, head_offset, unit_keys, v_chunk)
                if not interior:
                    _zero_invisible_rows(v_chunk, key_slots, window_sb)
            _chunk(split_states, q_t, k_chunk, v_chunk, plan, d_spans, m, ones_col, k_units.dtype, scale,
                   softcap, dtype)
            nisa.tensor_scalar(dst=window_sb, data=window_sb, op0=nl.add, operand0=-float(m * pmax))


def _load_needed_groups(cache_units, chunk_sb, base, m, key_regs):
    """A contiguous chunk (keys p*M + c on partition p) by groups of ``LOAD_GROUP_PARTITIONS``
    partitions, each with precomputed descriptors inside two device loops of 0 or 1 trips (static
    start or stop, a key-window register on the other side, a step of one chunk): a group loads
    only if it holds a key of [first, L_b), so traffic follows L_b; in ``DIRECT_PIECE_SLOTS``
    pieces, so the first scores start while the rest lands."""
    pmax = nl.tile_size.pmax
    first_reg, end_reg = key_regs
    chunk_keys = m * pmax
    d = chunk_sb.shape[1] // m
    for p0, pn in spans(pmax, LOAD_GROUP_PARTITIONS):
        for _ in nl.dynamic_range(p0 * m, end_reg, chunk_keys):               # L_b > the group's first key
            for _ in nl.dynamic_range(first_reg, (p0 + pn) * m, chunk_keys):  # first < its end
                for c0, n in spans(m, DIRECT_PIECE_SLOTS):
                    nisa.dma_copy(dst=chunk_sb[p0:p0 + pn, c0 * d:(c0 + n) * d],
                                  src=cache_units.ap([[m * d, pn], [1, n * d]], offset=base + (p0 * m + c0) * d))


def _key_registers(setup):
    """Registers of [first, L_b) (the split's key window, relative to its first key), loaded once."""
    if setup.key_regs is None:
        setup.key_regs = []
        for i in range(2):
            reg = nisa.register_alloc()
            nisa.register_load(reg, setup.window[0:1, i:i + 1])
            setup.key_regs.append(reg)
    return setup.key_regs


def _single_chunk_k(cache, unit, seq_offset, k_chunk, setup):
    """K of the only chunk of a unit whose capacity fits one chunk (static, no device loop):
    contiguous -> the whole capacity in ``DIRECT_PIECE_SLOTS`` pieces (precomputed descriptors; keys
    past L_b only give masked scores); paged -> the unit ids of its columns, then one gather per
    softmax step (unneeded units skipped). Returns the unit ids (paged) for the V gather."""
    k_units, _, unit_table, key_slots, unit_keys, head_offset, plan = cache
    m = key_slots.shape[1]
    b, hk = unit
    if seq_offset is not None:
        _load_needed_groups(k_units, k_chunk, seq_offset + hk * head_offset, m, _key_registers(setup))
        return None
    units_per_chunk = unit_table.shape[1]
    idx_sb = nl.ndarray((units_per_chunk, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=idx_sb, src=unit_table.ap([[1, units_per_chunk], [1, 1]], offset=b * units_per_chunk))
    for step in spans(m, plan[0]):
        _gather_chunk(k_units, idx_sb, hk * head_offset, unit_keys, k_chunk, step)
    return idx_sb


def _single_chunk_v(cache, unit, seq_offset, v_chunk, idx_sb, setup):
    """V of the only chunk (as ``_single_chunk_k``), then, when it is an edge chunk (a device loop of
    0 or 1 trips over each edge range), its V rows outside [first, L_b) zeroed."""
    _, v_units, _, key_slots, unit_keys, head_offset, _ = cache
    m = key_slots.shape[1]
    b, hk = unit
    if seq_offset is not None:
        _load_needed_groups(v_units, v_chunk, seq_offset + hk * head_offset, m, _key_registers(setup))
    else:
        _gather_chunk(v_units, idx_sb, hk * head_offset, unit_keys, v_chunk)
    regs = setup.regs
    for r in range(0, len(regs) - 1, 2):                # the edge ranges [start, lo) and [hi, stop)
        for _ in nl.dynamic_range(regs[r], regs[r + 1], _unit_table_width(m, unit_keys)):
            _zero_invisible_rows(v_chunk, key_slots, setup.window)


def _unit_table_width(m, unit_keys):
    """Unit columns per chunk of 128*M keys."""
    return m * nl.tile_size.pmax // unit_keys


def _zero_invisible_rows(v_chunk, key_slots, window_sb):
    """V rows of keys outside [first, L) (relative to the chunk) -> 0: their probabilities are 0,
    but 0 * NaN (garbage past L_b, or stale rows of skipped units) would poison P @ V."""
    pmax, m = key_slots.shape
    outside = nl.ndarray((pmax, m), dtype=nl.uint8, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=outside, data=key_slots, op0=nl.greater_equal, operand0=window_sb[:, 1:2])
    nisa.scalar_tensor_tensor(dst=outside, data=key_slots, op0=nl.less, operand0=window_sb[:, 0:1],
                              op1=nl.maximum, operand1=outside)
    d = v_chunk.shape[1] // m
    nisa.tensor_copy_predicated(dst=v_chunk, src=0.0, predicate=outside.expand_dim(2).broadcast(2, d))


class _EvictionRota:
    """Engines of consecutive K^T evictions across the units of a wave: every ``KT_ACT_EVERY``-th on
    ScalarE (otherwise idle between exps), the rest on VectorE (the busiest engine at short rows)."""

    def __init__(self):
        self.count = 0

    def next(self):
        self.count += 1
        return nisa.engine.scalar if self.count % KT_ACT_EVERY == 0 else nisa.engine.vector


def _chunk(split_states, q_t, k_chunk, v_chunk, plan, d_spans, m, ones_col, kv_dtype, scale, softcap, dtype):
    """Scores, mask, softmax and P @ V of one loaded chunk for every row tile (``_chunks`` with one
    job); then the row bounds move to the next chunk (-128*M keys)."""
    _chunks([(split_states, q_t, k_chunk, v_chunk)], plan, d_spans, m, ones_col, kv_dtype, scale, softcap, dtype)
    chunk_keys = m * nl.tile_size.pmax
    for st in split_states:
        nisa.tensor_scalar(dst=st.bounds, data=st.bounds, op0=nl.add, operand0=-float(chunk_keys))
        if st.g_bounds is not None:
            group = st.acc.shape[0] // st.group_sq
            nisa.tensor_scalar(dst=st.g_bounds, data=st.g_bounds, op0=nl.add, operand0=-float(chunk_keys * group))


def _chunks(jobs, plan, d_spans, m, ones_col, kv_dtype, scale, softcap, dtype, fresh=False):
    """Scores, mask, softmax and P @ V of loaded chunks -- ``jobs`` of (states per row tile, q^T,
    K chunk, V chunk), one softmax step (``plan[0]`` slots) at a time, software-pipelined over the
    steps of all jobs in order: the scores of item i+1 are issued before the softmax of item i, and
    the P @ V of item i after the softmax of item i+1 (TensorE transposes and multiplies while
    VectorE/ScalarE run the mask, max and exp chain of the item before). Several jobs (units of the
    single-chunk path) so overlap their chains in program order. ``fresh``: the jobs' states are
    newly initialised, so their first step needs no running max and no rescaling.

    A step's -m_prev is the state's own (first step of a job) or the previous wave's item of the
    same job (its state update is still deferred)."""
    pmax = nl.tile_size.pmax
    width = max(1, LOCKSTEP_CHAINS // (len(jobs[0][0]) * len(d_spans)))   # jobs per wave: PSUM bounds it
    rota = _EvictionRota() if len(jobs) > 1 else None
    waves = [[(job, step) for job in jobs[j0:j0 + width]] for j0 in range(0, len(jobs), width)
             for step in spans(m, plan[0])]   # step-major within each wave of jobs

    def scores(wave):
        """S^T of every item of a wave, their K^T blocks pipelined across the items."""
        kt = KtPipeline()
        for (_, _, k_chunk, _), step in wave:
            kt.add(k_chunk, step, plan, d_spans, m, kv_dtype, rota)
        out = []
        for (split_states, q_t, _, _), step in wave:
            n = step[1]
            s_sb = [nl.ndarray((pmax, st.group_sq, st.pack, n, st.acc.shape[0] // (st.group_sq * st.pack)),
                               dtype=nl.float32, buffer=nl.sbuf) if st.group_sq and n < MIN_II_ELEMS else
                    nl.ndarray((pmax, st.acc.shape[0], n), dtype=nl.float32, buffer=nl.sbuf) for st in split_states]
            fused = softcap == 0 and MIN_II_ELEMS <= n <= plan[1]   # one score block, per-row exps
            src = step_scores(s_sb, q_t, step, plan, kt, scale, softcap, fused)
            out.append((s_sb, (src if fused else s_sb), (scale if fused else 1.0)))
        return out

    pending = None                  # (wave, per item: P^T and -m_new per row tile) awaiting P @ V
    s_next = scores(waves[0])
    for w, wave in enumerate(waves):
        s_cur = s_next
        if w + 1 < len(waves):
            s_next = scores(waves[w + 1])
        phases = []
        for i, (job, step) in enumerate(wave):
            s_sb, s_src, score_scale = s_cur[i]
            chained = pending is not None and pending[0][i][0] is job
            phases += [step_probs_phases(st, s_sb[t], step[0], pending[1][i][t][1] if chained else st.neg_m,
                                          dtype, s_src[t], score_scale, fresh and step[0] == 0)
                       for t, st in enumerate(job[0])]
        flat = lockstep_batched(phases, max(1, LOCKSTEP_CHAINS // len(d_spans)))
        probs, k = [], 0
        for (split_states, _, _, _), _ in wave:
            probs.append(flat[k:k + len(split_states)])
            k += len(split_states)
        if pending is not None:
            _flush_pv(pending, ones_col, d_spans, fresh)
        pending = (wave, probs)
    _flush_pv(pending, ones_col, d_spans, fresh)


def _flush_pv(pending, ones_col, d_spans, fresh):
    """P @ V and the state updates of one wave, in lockstep over its items and row tiles (a packed
    tile: over its units, each contracting over its own partitions into its own state)."""
    wave, probs = pending
    phases = []
    for ((split_states, _, _, v_chunk), step), item_probs in zip(wave, probs):
        first = fresh and step[0] == 0
        for st, (p_t, neg_m_new) in zip(split_states, item_probs):
            if st.pack == 1:
                phases.append(step_pv_phases(st, p_t, neg_m_new, v_chunk, step[0], ones_col, d_spans,
                                             pv_direct(*st.acc.shape), first))
                continue
            rows, part = st.units[0].acc.shape[0], nl.tile_size.pmax // st.pack
            phases += [step_pv_phases(ust, p_t[:, u * rows:(u + 1) * rows, :], neg_m_new[u], v_chunk, step[0],
                                      ones_col, d_spans, pv_direct(*ust.acc.shape), first, (u * part, part))
                       for u, ust in enumerate(st.units)]
    lockstep_batched(phases, max(1, LOCKSTEP_CHAINS // len(d_spans)))


def _exchange(states, pid, first_pipe):
    """LNC2 split sharding: swap the packed split states with the other core (same count on both).
    Every exchange gets its own ``pipe_id`` (``first_pipe`` onwards)."""
    received = []
    for i, split_states in enumerate(states):
        peer = []
        for t, st in enumerate(split_states):
            buf = nl.ndarray(st.packed.shape, dtype=nl.float32, buffer=nl.sbuf)
            nisa.sendrecv(src=st.packed, dst=buf, send_to_rank=1 - pid, recv_from_rank=1 - pid,
                          pipe_id=first_pipe + i * len(split_states) + t)
            peer.append(_state_views(buf))
        received.append(peer)
    return received


class _UnitWork(nl.NKIObject):
    """What the streams of one (b, hk) unit need, prepared one unit ahead of them."""
    q_t: object       # per row tile: q^T chunks (dc, rn)
    states: object    # per split of this core: per row tile a _SplitState
    setups: object    # per split of this core: its _StreamSetup


def _load_sink(sink_rows, hk, r0, rn):
    """Sink logits (rn, 1) of rows r0 .. r0 + rn of kv head ``hk``."""
    sink_sb = nl.ndarray((rn, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=sink_sb, src=sink_rows.ap([[1, rn], [1, 1]], offset=hk * sink_rows.shape[1] + r0))
    return sink_sb


def _store_out(out, out_sb, row0):
    rn, d = out_sb.shape
    nisa.dma_copy(dst=out.ap([[d, rn], [1, d]], offset=row0 * d), src=out_sb)


def single_chunk_path(n_split, n_units, n_prog, capacity, chunk_keys, head_keys):
    """Whether the kernel takes the single-chunk path: one split, whole units per core, a capacity
    of at most one chunk of at most ``SINGLE_CHUNK_KEYS`` keys, and for a contiguous cache
    (``head_keys``: keys per kv head, None for paged) at least one whole chunk per head. On that
    path a contiguous cache is loaded directly: the unit table is never read (the launcher then
    builds none)."""
    whole = head_keys is None or head_keys >= chunk_keys
    return (n_split == 1 and n_units % n_prog == 0 and capacity <= chunk_keys
            and chunk_keys <= SINGLE_CHUNK_KEYS and whole)


def _pack_size(n_units, rows, m, d, itemsize, lnc):
    """Units per packed chunk (single-chunk path, contiguous cache; 1: no packing). A unit's chunk
    rows are M*D elements per partition; below ``Q_LOAD_ROW_BYTES`` each pays the per-descriptor
    floor more than its bytes, so U consecutive units share one chunk of 128 partitions (unit u on
    partitions [u*128/U, (u+1)*128/U), U*M slots each: one contiguous HBM run per partition) and
    one row tile of U*R rows. A packed step computes every unit's scores on every partition (U x
    the elements, (U-1)/U of them masked), so it pays only while they still fit one instruction's
    minimum cost, U*M*R <= MIN_II_ELEMS: VectorE's work per step stays at its per-instruction
    floor while its instructions and hops, the DMA descriptors and the merges drop U-fold. U: a
    power of two dividing the units, U*R <= 128, rows of at most ``Q_LOAD_ROW_BYTES``, short-row
    softmax steps (U*M < MIN_II_ELEMS slots), at most ``PACK_MAX``; LNC1 only."""
    pack = 1
    while (lnc == 1 and 2 * pack <= PACK_MAX and n_units % (2 * pack) == 0 and 2 * pack * rows <= nl.tile_size.pmax
           and pack * m * d * itemsize < Q_LOAD_ROW_BYTES and 2 * pack * m < MIN_II_ELEMS
           and 2 * pack * m * rows <= MIN_II_ELEMS):
        pack *= 2
    return pack


def _packed_state(meta, unit_ws, pack_keys, rows, d, slots, engine):
    """The state of a packed chunk: the scores' tile of U*R rows (rows u*R .. (u+1)*R of unit u,
    window column pair ``unit_ws[u]``), one state per unit (``units``) and the grouped bounds on
    unit u's partitions ps (``slots`` = U*M per partition): slot c of
    partition p holds key (p - u*P)*U*M + c of unit u (P = 128/U), so relative to p*U*M its window
    moves by +u*cap; the grouped index of unit u's columns starts at u*n*G (one step of n = U*M
    slots). Per unit, on ``engine`` (SBUF only): the shifted window (also the V cleaning's), hi, lo,
    both clamped to the partition's slots and shifted to the unit's columns; then one multiply by G
    for all. ``pack_keys`` (128, 1): p*U*M."""
    pmax = nl.tile_size.pmax
    pack, sq = len(unit_ws), meta.sq
    part = pmax // pack
    cap = part * slots
    group = rows // sq
    units = [_state_views(nl.ndarray((rows, d + 2), dtype=nl.float32, buffer=nl.sbuf)) for _ in range(pack)]
    state = _state_views(nl.ndarray((pack * rows, d + 2), dtype=nl.float32, buffer=nl.sbuf),   # shapes only
                         nl.ndarray((pmax, sq, 2), dtype=nl.float32, buffer=nl.sbuf), sq,
                         nl.ndarray((pmax, sq, 2), dtype=nl.float32, buffer=nl.sbuf), pack, units)
    window_pm = nl.ndarray((pmax, 2), dtype=nl.float32, buffer=nl.sbuf)   # [first, L_b) - p*U*M + u*cap
    for u, ws in enumerate(unit_ws):
        ps = slice(u * part, (u + 1) * part)
        nisa.tensor_scalar(dst=window_pm[ps], data=meta.window[ps, 2 * ws:2 * ws + 2], op0=nl.subtract,
                           operand0=pack_keys[ps], op1=nl.add, operand1=float(u * cap), engine=engine)
        hi, lo = state.bounds[ps, :, 1], state.bounds[ps, :, 0]
        nisa.tensor_scalar(dst=hi, data=meta.row_pos[ps, 0:sq], op0=nl.add, operand0=window_pm[ps, 1:2],
                           engine=engine)
        nisa.tensor_scalar(dst=lo, data=hi, op0=nl.add, operand0=-meta.reach, op1=nl.maximum,
                           operand1=window_pm[ps, 0:1], engine=engine)
        # clamped to the partition's slots (else a range would reach a neighbour unit's columns), then
        # shifted to unit u's columns: [lo + u*n, hi + 1 + u*n) in slots
        nisa.tensor_scalar(dst=hi, data=hi, op0=nl.minimum, operand0=float(slots - 1), op1=nl.add,
                           operand1=float(u * slots + 1), engine=engine)
        nisa.tensor_scalar(dst=lo, data=lo, op0=nl.maximum, operand0=0.0, op1=nl.add, operand1=float(u * slots),
                           engine=engine)
    nisa.tensor_scalar(dst=state.g_bounds, data=state.bounds, op0=nl.multiply, operand0=float(group), engine=engine)
    return state, window_pm


def _load_packed_chunk(cache_units, chunk_sb, base, slots):
    """A packed chunk: one contiguous HBM run of ``slots`` keys per partition, ``DIRECT_PIECE_SLOTS``
    at a time (precomputed descriptors; keys past each unit's L_b give masked scores, their V rows
    are zeroed)."""
    d = chunk_sb.shape[1] // slots
    for c0, n in spans(slots, DIRECT_PIECE_SLOTS):
        nisa.dma_copy(dst=chunk_sb[:, c0 * d:(c0 + n) * d],
                      src=cache_units.ap([[slots * d, nl.tile_size.pmax], [1, n * d]], offset=base + c0 * d))


def _packed_path(q, k_units, v_units, sink_rows, out, lse, meta, pack, cfg):
    """The single-chunk path with ``pack`` consecutive units per chunk (``_pack_size``): per group of
    packs (as many as buffer pairs fit): q^T and states of each pack, K of every pack, V of every
    pack (each unit's V rows outside its [first, L_b) zeroed in device loops of 0 or 1 trips over
    its edge ranges), the packs' compute in waves (``_chunks``: scores, mask and exp per pack, P @ V
    per unit over its own partitions), one merge per unit."""
    n_kv_heads, m, unit_keys, d_spans, ones_col, scale, softcap = cfg
    pmax = nl.tile_size.pmax
    _, _, _, d = q.shape
    dtype = q.dtype
    rows = meta.row_pos.shape[1]
    prow, slots = pack * rows, pack * m
    n_units = q.shape[0] * n_kv_heads
    unit_stride = m * pmax * d                      # a unit's capacity is one chunk: units back to back
    part = pmax // pack
    plan = chunk_plan(slots, prow, prow, k_units.itemsize)
    pack_keys = nl.ndarray((pmax, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.iota(dst=pack_keys, pattern=[[0, 1]], offset=0, channel_multiplier=slots)
    slot_index = nl.ndarray((pmax, slots), dtype=nl.float32, buffer=nl.sbuf)   # [p, c] = c
    nisa.iota(dst=slot_index, pattern=[[1, slots]], offset=0, channel_multiplier=0)
    pair_bytes = slots * d * (k_units.itemsize + v_units.itemsize)
    n_pairs = max(1, min(n_units // pack, CHUNK_BUFFER_BUDGET // pair_bytes))
    bufs = [(nl.ndarray((pmax, slots * d), dtype=k_units.dtype, buffer=nl.sbuf),
             nl.ndarray((pmax, slots * d), dtype=v_units.dtype, buffer=nl.sbuf)) for _ in range(n_pairs)]
    tile = LseTile(neg_big=nl.ndarray((rows, n_units), dtype=nl.float32, buffer=nl.sbuf),
                   total=nl.ndarray((rows, n_units), dtype=nl.float32, buffer=nl.sbuf), r0=0, first=0, stride=1)
    sinks = {}
    width = _unit_table_width(m, unit_keys)
    pending_out = []
    for g0 in range(0, n_units // pack, n_pairs):
        group = list(range(g0, min(n_units // pack, g0 + n_pairs)))
        works = []
        for k in group:
            ws = [(k * pack + u) // n_kv_heads for u in range(pack)]
            state, window_pm = _packed_state(meta, ws, pack_keys, rows, d, slots, nisa.engine.gpsimd)
            works.append((_load_q_t(q, k * prow, prow, d_spans, dtype), state, window_pm,
                          [_stream_setup(meta, w, static=True).regs for w in ws]))
            for u in range(pack):
                hk = (k * pack + u) % n_kv_heads
                if sink_rows is not None and hk not in sinks:
                    sinks[hk] = _load_sink(sink_rows, hk, 0, rows)
        for i, k in enumerate(group):
            _load_packed_chunk(k_units, bufs[i][0], k * pack * unit_stride, slots)
        for i, k in enumerate(group):
            v_chunk = bufs[i][1]
            _load_packed_chunk(v_units, v_chunk, k * pack * unit_stride, slots)
            window_pm, regs = works[i][2], works[i][3]
            for u in range(pack):
                ps = slice(u * part, (u + 1) * part)
                for r in range(0, RANGE_BOUNDS - 1, 2):     # the unit's edge ranges
                    for _ in nl.dynamic_range(regs[u][r], regs[u][r + 1], width):
                        _zero_invisible_rows(v_chunk[ps], slot_index[ps], window_pm[ps])
        _chunks([([work[1]], [work[0]]) + bufs[i] for i, work in enumerate(works)], plan, d_spans, slots,
                ones_col, k_units.dtype, scale, softcap, dtype, fresh=True)
        merges, rows0 = [], []
        for k, work in zip(group, works):
            for u, ust in enumerate(work[1].units):
                unit = k * pack + u
                merges.append(merge_phases([ust], sinks.get(unit % n_kv_heads), tile.neg_big[:, unit:unit + 1],
                                           tile.total[:, unit:unit + 1], dtype))
                rows0.append(unit * rows)
        pending_out.extend(zip(lockstep(merges), rows0))
        while len(pending_out) > OUT_STORE_LAG:         # stores trail the loads they would block
            _store_out(out, *pending_out.pop(0))
    warm = nl.ndarray((pmax, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=warm, op=nl.log, data=ones_col)   # the log table loads behind the last merges
    for out_sb, row0 in pending_out:
        _store_out(out, out_sb, row0)
    store_lse(tile, lse, rows)


@nki.jit
def decode_attention_fwd_kernel(q, k_units, v_units, unit_table, split_bounds, key_window, sink_rows,
                  n_kv_heads, head_offset, seq_units, unit_keys, keys_per_partition, scale, softcap, window_left):
    """Decode attention; see the module docstring for shapes and the algorithm."""
    pmax = nl.tile_size.pmax
    batch, n_q_heads, sq, d = q.shape
    group = n_q_heads // n_kv_heads
    rows = group * sq
    n_split = split_bounds.shape[1]
    m = keys_per_partition
    dtype = q.dtype
    row_spans = spans(rows, pmax)
    d_spans = spans(d, pmax)
    plan = chunk_plan(m, row_spans[0][1], rows, k_units.itemsize)
    out = nl.ndarray((batch, n_q_heads, sq, d), dtype=dtype, buffer=nl.shared_hbm)
    lse = nl.ndarray((batch, n_q_heads, sq), dtype=nl.float32, buffer=nl.shared_hbm)

    key_slots = nl.ndarray((pmax, m), dtype=nl.float32, buffer=nl.sbuf)   # [p, c] = key p*M + c
    nisa.iota(dst=key_slots, pattern=[[1, m]], offset=0, channel_multiplier=m)
    ones_col = nl.ndarray((pmax, 1), dtype=dtype, buffer=nl.sbuf)         # row sums of P by matmul
    nisa.memset(dst=ones_col, value=1.0)
    warm = nl.ndarray((pmax, 1), dtype=nl.float32, buffer=nl.sbuf)   # the exp table loads while ScalarE
    nisa.activation(dst=warm, op=nl.exp, data=ones_col)             # idles, not in the first softmax
    meta = _load_meta(split_bounds, key_window, rows, sq, key_slots[:, 0:1], window_left)
    pair_bytes = m * d * (k_units.itemsize + v_units.itemsize)
    budget = CHUNK_BUFFER_BUDGET // len(row_spans)   # each row tile's scores and P^T need room too
    n_pairs = max(1, min(batch * n_kv_heads * n_split, budget // pair_bytes))
    chunk_bufs = []   # K/V buffer pairs, never cleared: rows a gather skips only hold keys that every row
                      # masks by selection, and edge chunks zero those V rows (0 * NaN)
    for _ in range(n_pairs):
        pair = (nl.ndarray((pmax, m * d), dtype=k_units.dtype, buffer=nl.sbuf),
                nl.ndarray((pmax, m * d), dtype=v_units.dtype, buffer=nl.sbuf))
        chunk_bufs.append(pair)

    n_prog = nl.num_programs(0)
    pid = nl.program_id(0)
    units = tuple((b, hk) for b in range(batch) for hk in range(n_kv_heads))
    shard_units = len(units) % n_prog == 0          # LNC2: whole (b, hk) units per core ...
    mine = [u for u in range(len(units)) if not shard_units or u % n_prog == pid]
    my_splits = range(n_split) if shard_units else range(pid, n_split, n_prog)  # ... or splits
    my_tiles = [t for t in range(len(row_spans)) if shard_units or t % n_prog == pid]
    lse_tiles = {t: LseTile(neg_big=nl.ndarray((row_spans[t][1], len(mine)), dtype=nl.float32, buffer=nl.sbuf),
                             total=nl.ndarray((row_spans[t][1], len(mine)), dtype=nl.float32, buffer=nl.sbuf),
                             r0=row_spans[t][0], first=mine[0], stride=n_prog if shard_units else 1)
                 for t in my_tiles}
    q_groups = {}                                   # one q load for the units whose rows fit 128 partitions
    sinks = {}                                      # sink logits per (kv head, row tile)
    neg_sinks = {}                                  # single-chunk path, one step: their negation
    units_per_q = pmax // rows if len(row_spans) == 1 else 1

    def unit_q_t(u):
        if units_per_q == 1:
            return [_load_q_t(q, u * rows + r0, rn, d_spans, dtype) for r0, rn in row_spans]
        g = u // units_per_q
        if g not in q_groups:
            n = min(units_per_q, len(units) - g * units_per_q)
            q_groups[g] = _load_q_t(q, g * units_per_q * rows, n * rows, d_spans, dtype)
        j = (u % units_per_q) * rows
        return [[q_t[:, j:j + rows] for q_t in q_groups[g]]]

    def prepare(u):
        b, hk = units[u]
        if sink_rows is not None:
            for t in my_tiles:
                if (hk, t) not in sinks:
                    sinks[(hk, t)] = _load_sink(sink_rows, hk, *row_spans[t])
        engine = nisa.engine.gpsimd if single and seq_units is not None else None   # no swdge gathers
        fold = single and plan[0] == m              # one softmax step: the sink folds into it
        if fold and sink_rows is not None:
            for t in my_tiles:
                if (hk, t) not in neg_sinks:
                    neg_sinks[(hk, t)] = nl.ndarray((row_spans[t][1], 1), dtype=nl.float32, buffer=nl.sbuf)
                    nisa.tensor_scalar(dst=neg_sinks[(hk, t)], data=sinks[(hk, t)], op0=nl.multiply, operand0=-1.0,
                                       engine=nisa.engine.gpsimd)
        return _UnitWork(q_t=unit_q_t(u),
                         states=[[_init_state(meta, b * n_split + s, r0, rn, d, plan[0], single, engine,
                                              (sinks.get((hk, t)), neg_sinks.get((hk, t))) if fold else None)
                                  for t, (r0, rn) in enumerate(row_spans)] for s in my_splits],
                         setups=[_stream_setup(meta, b * n_split + s, single) for s in my_splits])

    pending_out = []                                # (out rows, first row) awaiting their store

    def finish(done):
        """Merge the split states of units ``done`` ((k, u, states): column k of the lse tiles), their
        chains in lockstep; their out stores trail the loads."""
        merges, rows0 = [], []
        for k, u, states in done:
            if not shard_units:
                states = states + _exchange(states, pid, first_pipe=u * n_split * len(row_spans))
            for t in my_tiles:
                tile = lse_tiles[t]
                merges.append(merge_phases([st[t] for st in states], sinks.get((units[u][1], t)),
                                            tile.neg_big[:, k:k + 1], tile.total[:, k:k + 1], dtype))
                rows0.append(u * rows + tile.r0)
        pending_out.extend(zip(lockstep(merges), rows0))
        while len(pending_out) > OUT_STORE_LAG * len(my_tiles):   # stores trail the loads they would block
            _store_out(out, *pending_out.pop(0))

    def seq_offset(b):
        return None if seq_units is None else b * seq_units * k_units.shape[1]

    single = single_chunk_path(n_split, len(units), n_prog, unit_table.shape[1] * unit_keys, m * pmax,
                               None if seq_units is None else head_offset // d)
    pack = (_pack_size(len(units), rows, m, d, k_units.itemsize, n_prog)
            if single and seq_units is not None and len(row_spans) == 1 and head_offset == m * pmax * d else 1)
    if pack > 1:                                    # several units per static chunk
        _packed_path(q, k_units, v_units, sink_rows, out, lse, meta, pack,
                     (n_kv_heads, m, unit_keys, d_spans, ones_col, scale, softcap))
        return out, lse
    if single:                                      # static chunk per unit, pipelined across units
        for g0 in range(0, len(mine), n_pairs):
            group = list(enumerate(mine))[g0:g0 + n_pairs]
            works = [prepare(u) for _, u in group]
            cache = (k_units, v_units, unit_table, key_slots, unit_keys, head_offset, plan)
            idx = [_single_chunk_k(cache, units[u], seq_offset(units[u][0]), chunk_bufs[i][0], work.setups[0])
                   for i, ((_, u), work) in enumerate(zip(group, works))]
            for i, ((_, u), work) in enumerate(zip(group, works)):
                _single_chunk_v(cache, units[u], seq_offset(units[u][0]), chunk_bufs[i][1], idx[i], work.setups[0])
            _chunks([(work.states[0], work.q_t) + chunk_bufs[i] for i, work in enumerate(works)], plan, d_spans, m,
                    ones_col, k_units.dtype, scale, softcap, dtype, fresh=True)
            if plan[0] == m and g0 + n_pairs >= len(mine):   # folded merges need no exp: the log table
                nisa.activation(dst=warm, op=nl.log, data=ones_col)   # loads behind P @ V and the merges
                warm = None
            finish([(k, u, work.states) for (k, u), work in zip(group, works)])
    else:
        stream = 0                                  # this core's streams rotate over the buffer pairs
        work_next = prepare(mine[0])
        for k, u in enumerate(mine):
            b, hk = units[u]
            work = work_next
            if k + 1 < len(mine):                   # the next unit's setup ahead of this unit's loads
                work_next = prepare(mine[k + 1])
            for split_states, setup in zip(work.states, work.setups):
                _stream(split_states, setup, work.q_t, k_units, v_units, unit_table, key_slots, b,
                        hk * head_offset, seq_offset(b), unit_keys, chunk_bufs[stream % n_pairs], plan,
                        ones_col, d_spans, scale, softcap, dtype)
                stream += 1
            finish([(k, u, work.states)])
    if warm is not None:
        nisa.activation(dst=warm, op=nl.log, data=ones_col)   # the log table loads behind the last merge's
    for out_sb, row0 in pending_out:                         # exps, while VectorE finishes L and out
        _store_out(out, out_sb, row0)
    for t in my_tiles:
        store_lse(lse_tiles[t], lse, rows)
    return out, lse
