"""Decode-attention NKI kernel: a few new tokens per sequence over a contiguous or paged KV cache.

Algorithm (flash-decoding, keys on partitions). For every (sequence b, kv head hk) the
``R = G * Sq`` query rows of the GQA group (all query heads of hk and all new tokens, row
``r = g * Sq + t``) share every K/V byte read; the *keys* sit on the 128 partitions and the rows on
the free axis (scores are S^T), so VectorE/ScalarE use all lanes even when R is 8. The sequence's
needed key range ``[first, L_b)`` (``first = max(0, L_b - Sq - window_left)``, 0 without a window)
is cut into ``S`` contiguous splits; each split
streams its chunks of ``C = 128 * M`` keys through a *device loop* (``nl.dynamic_range``) whose
bounds are runtime registers of split bounds the kernel derives from ``cache_seqlens`` on chip
(``decode_attention_fwd_meta``: no host tables), keeping the online-softmax state
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

    unit ids (C/u, 1) int32   <- paged: DMA of block_table[b, col : col + C/u] (col = loop register);
                                 contiguous: b * seq_units + key0 / u + i from the chunk's key window;
                                 an edge chunk's units without a key of [first, L_b) -> sentinel
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

Each split visits three chunk ranges in key order (its 4 derived bounds): edge chunks,
interior chunks (every key inside ``[first, L_b)``), edge chunks. For a contiguous cache an
interior chunk is one contiguous HBM run per kv head and loads with hardware-DGE DMAs
(``.ap(scalar_offset=col)``, ``DIRECT_PIECE_SLOTS`` slots each, no GpSimd descriptor generation);
everything else gathers. At D <= 64 with 2-byte K and a head capacity that is a whole number of
K^T spans (``every_k_by_transpose``, ``stream_k_by_transpose``; D = 32 or 64 and M a multiple of
f = 128/D, ``k_t_fold``), K of every chunk loads as K^T (128, 128/16, M/f, 16) instead, by
hardware-DGE ``dma_transpose``s at the chunk's runtime offset of (16, groups, M/f, 128) sources
(f consecutive slots of a partition per 128-element row, the documented hwdge form: 16 rows, last
dim a multiple of 128), one per span of ``_k_t_groups`` partitions (``_stream_k_t``); K^T slot c sits
on partitions (c % f)*D .. and its score matmuls run on that PE row tile against a q^T held in f
copies (``load_q_t(copies=f)``): an interior chunk all spans, an edge
chunk only the spans holding a key of [first, L_b) (0-or-1-trip device loops on registers of its
key window clamped to the chunk); no PE transposes or K^T evictions (V as before).

Only needed units are read: the kernel replaces the ids of units that hold no key of
``[first, L_b)`` by an out-of-range sentinel (the cache's row count; two compares and a predicated
copy per edge chunk, ``skip_unneeded_units``) and the indirect DMA skips them (their SBUF rows keep
stale or never-written data, which the mask and the V cleaning remove). The device loops visit only
the chunks of ``[first, L_b)``, so traffic and work follow ``L_b``, not the capacity. Row bounds
(128, rn, 2): ``(lo_r - p*M, hi_r - p*M)`` relative to the chunk start, moved by ``-C`` per chunk.

Loop structure (program order is what the in-order engines and DMA queues see, so every load
is issued before the stores and setup of later units that would otherwise hold them)::

    metadata of the whole batch from one DMA of L (and one of cache_start): split bounds (1, B*S*4)
    int32 and key windows (128, B*S*2) by small VectorE/GpSimd ops on one row and one ones-matmul
    broadcast to the partitions (``decode_attention_fwd_meta``); single-chunk paged: the block ids
    of every sequence loaded and skipped right after the broadcast, ahead of the split bounds
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

Multi-chunk streams of several kv heads (``_stream_heads``, ``stream_head_groups``; one core): a
paged pool runs the loop above per group of consecutive kv heads of a sequence instead of per unit;
the group's units are prepared together (the next group's one group ahead) and each split is one
stream of all of them: per chunk one DMA of the unit ids (interior chunks: one DMA per trip of
``IDS_AHEAD`` chunks, or of one chunk per buffer pair when a stream holds ``TRIP_PAIRS``, alternating
them; a token-major two-pair trip's ids are read during the trip before), gathers that move several
heads at once,
then the heads' chunks as the jobs of one ``run_chunks`` (chains in lockstep, K^T evictions shared by
VectorE and ScalarE; an edge chunk's V cleaning issued per wave right before its first P @ V). A
token-major pool (``token_major``: block rows of [token][kv head][D], vLLM's and Hugging Face's
layout): all Hkv heads, one gather of K per softmax step and one of V (partition j of a block holds
its keys j*M .. j*M + M - 1, one contiguous run of M*Hkv*D, so M is chosen by the launcher to fit
that run in a chunk buffer), each head's chunk its (128, M, D) view. A head-major pool with one
block per partition (M = block size): a block's heads are one run of its row, so each gather moves
as many heads as fit a chunk buffer, one descriptor per partition (4 at gpt-oss-120b's D = 64 and
blocks of 64: a quarter of the GpSimd descriptor work of per-head streams), K of every head before
V, so that the first heads' scores start while the later heads land; as many heads per stream as
fit one buffer pair (the gathers of a stream's next chunk then wait only for their own heads'
compute). At D <= 64 the multi-chunk paths make K^T of 128/D slots per PE transpose
(``decode_attention_fwd_pairs``), as the single-chunk path does.

Single-chunk path (one split, a capacity of one chunk of at most ``SINGLE_CHUNK_KEYS`` keys; a
contiguous cache below the chunk fills its first ``chunk_partitions`` partitions, the last one
partly when M does not divide the capacity, ``partition_rows``): every unit's only chunk is chunk
0, so its loads and compute are static code (contiguous: precomputed-descriptor DMAs per group of
``LOAD_GROUP_PARTITIONS`` partitions, each inside device loops of 0 or 1 trips that skip a group
holding no key of [first, L_b); paged: the gathers as above, except that with one block per
partition (M = block size, ``shared_gathers``) the units' K (and V) chunks are consecutive
(128, M*D) views of one tile and each gather carries a run of consecutive kv heads of one sequence
(``head_runs``: a block's heads are one contiguous run of its row, so a partition is still one
descriptor, and the GpSimd descriptor generation falls by the heads per gather), K per wave of
``run_chunks``; when K and V of all units do not fit the budget but K alone does (``overlay``),
every unit's V lands over its own K, each wave's V gathers issued right before its P @ V
(``run_chunks`` ``before_pv``) in the parts of ``v_gather_parts``; at D <= 64 dividing 128, one PE
transpose makes K^T of 128/D consecutive slots at once (slot i on partitions i*D ..) and each slot's
score matmul is a row tile over its own D partitions with q^T replicated there
(``decode_attention_fwd_pairs``)); the V cleaning of an edge chunk runs
in device loops of 0 or 1 trips too. A token-major pool (``token_major``: block rows of [token][kv
head][D], vLLM's and Hugging Face's layout) is read in place on that path only: one gather per
sequence's run of kv heads moves K (then V) of all its heads, a whole block row per partition,
and each unit's chunk is its (128, M, D) view of the run's [token][run head][D] rows (slot stride
run x D, ``slot_cols``); a run that is not all of a sequence's heads (a group that splits them)
reads M pieces per partition (multi-chunk token-major streams: after the loop structure). Per group of units (as many as there are buffer pairs): K of
every unit, then V of every unit, then their compute in waves of up to ``LOCKSTEP_CHAINS`` chains,
the instructions of the units' softmax, P @ V and merge chains interleaved phase by phase
(``lockstep``), so the in-order engines pay each hop's latency once per wave, not once per unit --
except that in a group a later group follows (one wave of one step), each unit's P @ V and merge
are issued unit after unit (``run_chunks`` ``tails``): its merge then ends as its own chunk's
compute does, ahead of the traffic behind the group (docs/perf-log.md §18.10). The last unit of the core's last group, whose K lands last, takes its K as K^T by one
``dma_transpose`` of the whole chunk when the cache is contiguous, K 2-byte, D <= 128 and the chunk
has at most ``K_T_DMA_MAX_SLOTS`` keys per partition (``k_by_transpose``): its scores then start
when its K lands, without the PE transposes and K^T evictions that otherwise gate its wave's
softmax (that one unit reads its whole chunk, whatever L_b). At D <= 64 (``every_k_by_transpose``)
every unit takes its K that way, by one ``dma_transpose`` per group of partitions holding a key of
[first, L_b) (K^T (D, 128/pg, M, pg); a slot's PE transposes would cost TensorE as much as its score
and P @ V matmuls together, and TensorE, not HBM, would bind); groups of units are of equal size.

When a single-chunk unit has one softmax step, its sink is folded into that step (-m = min(-rowmax,
-sink): the sink is a 129th column of the transposed per-partition maxima, and exp(sink - m) is
taken beside the exps), so its merge is L = l + exp(sink - m), out = acc / L: no exp after the
softmax, and the log table for the lse loads behind P @ V and the merges.

Packed single-chunk path (contiguous caches whose chunk rows M*D are short, LNC1; ``pack_size``):
U consecutive units share one chunk and one score tile; where that tile would be too large (2-byte
K/V, D <= 128; ``column_pack_size``), they share the chunk only, K^T comes by ``dma_transpose`` and
each unit's scores are column-tiled matmuls onto its own partitions, its rows token-major so that a
pack's out rows leave as one tile of Sq rows per partition; see ``decode_attention_fwd_packed`` and
``decode_attention_fwd_columns``.

K/V chunk buffers: pairs rotate over the (b, hk, split) streams (as many pairs as fit
``CHUNK_BUFFER_BUDGET``; a K^T buffer counts 128 keys per slot, 128/f on the multi-chunk path),
so one stream's gathers overlap another stream's compute.

LNC2 (``kernel[2]``): when B*Hkv is even the (b, hk) units alternate between the cores; otherwise
(S is then even) core p runs splits p, p+2, ... of every unit, the cores swap their packed split
states with ``sendrecv`` and both merge; core p stores the row tiles t with t % 2 == p.

Shapes (HBM): q (B, Hq, Sq, D); k_units/v_units (N_units, row_stride) -- the cache viewed as rows
of gatherable units (paged: one block of all kv heads per row, head hk at ``hk * head_offset``;
contiguous: ``u`` keys of one head per row, ``seq_units`` rows per sequence); block_table (B, n_cols)
int32 block ids (paged; n_cols a whole number of chunks of C/u columns) or None;
cache_seqlens (B,) int32 L_b; cache_start (B,) int32 or None; static ``n_split`` S and ``n_cols``
(unit columns per sequence, whole chunks). On chip (``decode_attention_fwd_meta``): per (b, s) the
bounds start <= lo <= hi <= stop in unit columns, the ranges [start, lo), [lo, hi), [hi, stop),
and the key window [first, L_b) relative to the split's first key
(row r's visible keys: ``[max(pos_r - window_left, first), pos_r]``, ``pos_r = L_b - Sq + t_r``);
sink_rows float32 or None: (Hkv, G) per query head when R <= 128 (broadcast over the tokens on
chip), else (Hkv, R) per row; ``window_left`` (static int, -1 unbounded). On the
single-chunk path of a contiguous cache with first = 0 (``reads_lengths``) no bounds are derived:
the windows are [0, L_b) and the only edge range is [L_b, C) (one register per unit).
Outputs: out (B, Hq, Sq, D) in q's dtype, lse (B, Hq, Sq) float32.
Dimension legend: B batch, Hq/Hkv heads, G = Hq/Hkv, Sq new tokens, D head dim, R = G*Sq rows,
rn rows of a row tile (<= 128), dc head-dim chunk (<= 128), M keys per partition of a chunk,
C = 128*M keys per chunk (M <= 128), n slots of a softmax step, nk slots of a K^T block (one PSUM
bank), u keys per unit, S splits.

Garbage is harmless: K rows of keys outside ``[first, L_b)`` only produce masked scores (masking
is a select), and edge chunks zero the V rows of such keys (the key window), so NaN/inf in unused
slots, in stale rows of skipped units or outside the window never reach P @ V (0 * NaN).

Limits: bf16/fp16/fp32 (P in the input dtype for P @ V); D <= 256; R any (row tiles of 128);
positions and cache unit ids < 2**24 (float32 bounds and metadata arithmetic); unit size u a
power of two with C/u <= 128.
"""

from __future__ import annotations

from nki_lib._nki import nisa, nki, nl
from nki_lib.attention.kernels.decode_attention_fwd_chunks import chunk_plan, run_chunks, state_views, wave_jobs
from nki_lib.attention.kernels.decode_attention_fwd_gathers import (
    gather_chunk,
    gather_chunk_token_major,
    gather_heads,
    gather_runs_token_major,
    load_unit_ids,
    shared_gathers,
    unit_views,
    v_gather_parts,
)
from nki_lib.attention.kernels.decode_attention_fwd_io import (
    CHUNK_BUFFER_BUDGET,
    CHUNK_BUFFER_BYTES,
    DIRECT_PIECE_SLOTS,
    OUT_STORE_LAG,
    clean_edge_rows,
    load_q_t,
    load_sink,
    store_out,
    stream_setup,
    unit_table_width,
    zero_invisible_rows,
)
from nki_lib.attention.kernels.decode_attention_fwd_meta import contiguous_unit_ids, load_meta, skip_unneeded_units
from nki_lib.attention.kernels.decode_attention_fwd_packed import column_pack_size, pack_size, packed_path
from nki_lib.attention.kernels.decode_attention_fwd_pairs import slots_per_transpose
from nki_lib.attention.kernels.decode_attention_fwd_steps import (
    MIN_II_ELEMS,
    LseTile,
    lockstep,
    merge_phases,
    store_lse,
)
from nki_lib.attention.kernels.tiles import STAT_INIT
from nki_lib.sizes import ceil_div, spans

__all__ = ["decode_attention_fwd_kernel", "k_by_transpose", "reads_lengths", "single_chunk_path"]

INTERIOR_RANGE = 1                # a split's chunk ranges: edge, interior, edge
TRIP_PAIRS = 2                    # K/V buffer pairs a head stream alternates over a trip's chunks, when the
                                  # budget holds that many per stream (docs/perf-log.md §34.3)
IDS_AHEAD = 4                     # interior chunks per device-loop trip of a one-pair head stream: their
                                  # ids in one DMA, ahead of the earlier chunks' gathers (docs/perf-log.md §34.2)
SINGLE_CHUNK_KEYS = 8192          # capacities up to this (one chunk, one split) load their chunk
                                  # statically, so the units' compute pipelines in program order
LOAD_GROUP_PARTITIONS = 16        # single-chunk contiguous loads skip groups of this many partitions
                                  # that hold no key of [first, L_b) (2 DMA engines each: 16 groups in flight)
K_T_DMA_MAX_SLOTS = 16            # single-chunk path: the last unit's K by dma_transpose up to this many keys
                                  # per partition (measured, B=4 Hq=8 D=128: M = 16 -1.3 us in order,
                                  # M = 32 +0.3, M = 64 +1.1: the V left after its K hides the hops)
K_T_ROW_BYTES = 4096              # K^T by dma_transpose in partition groups whose K^T rows (M x group keys)
                                  # are at least 4 KiB: a DMA chunk that long runs at full rate even at the
                                  # highest documented chunk floor (docs/cost-model.md §2.6)
K_T_DGE_ROWS = 16                 # multi-chunk path: K^T by hardware-DGE dma_transposes (runtime chunk
                                  # offsets), whose sources take exactly 16 rows (partitions of a group) and
                                  # a last dim a multiple of 128 (docs/nki-semantics.md §8.10)
K_T_FOLD_MIN_D = 32               # multi-chunk K^T: f = 128/D slots folded per source row need a PE row
                                  # tile of D rows (32 or 64; nki.isa.nc_matmul "Tiling mode", NC-v3+)


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
    state = state_views(nl.ndarray((rn, d + 2), dtype=nl.float32, buffer=nl.sbuf),
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


def _stream(split_states, setup, q_t, k_units, v_units, table, key_slots,
            b, head_offset, seq_offset, unit_keys, chunk_pair, plan, ones_col, d_spans, scale, softcap, dtype, pack=1):
    """One (b, hk, split) stream: three device loops over the split's chunks, in key order --
    edge chunks (gathered; V rows of keys outside [first, L_b) zeroed, so garbage or stale
    NaN/inf there cannot reach P @ V), interior chunks (one hardware-DGE DMA per K/V for a
    contiguous cache, ``seq_offset`` is None for paged caches, else gathered), edge chunks. A 4-d
    ``k_chunk`` is a K^T buffer: K then loads by ``_stream_k_t`` (all spans of an interior chunk, the
    needed spans of an edge chunk) instead of DMAs or gathers of K."""
    pmax = nl.tile_size.pmax
    m = key_slots.shape[1]
    d = split_states[0].acc.shape[1]
    units_per_chunk = m * pmax // unit_keys
    k_chunk, v_chunk = chunk_pair
    regs, window_sb = setup.regs, setup.window
    steps = spans(m, plan[0])       # gathered K per softmax step: the first step's scores start early
    block_table, meta, seq_units = table
    k_t = len(k_chunk.shape) == 4   # K^T by dma_transpose (a contiguous 2-byte cache, D <= 64)
    if k_t:                         # an edge chunk's [first, L_b), clamped to the chunk [0, C]: registers
        edge_regs = [nisa.register_alloc() for _ in range(2)]   # of 0-or-1-trip group loops
        edge_window = nl.ndarray((1, 2), dtype=nl.float32, buffer=nl.sbuf)
    for r in range(len(regs) - 1):
        interior = r == INTERIOR_RANGE
        direct = interior and seq_offset is not None
        for col in nl.dynamic_range(regs[r], regs[r + 1], units_per_chunk):
            if direct:                                  # K, then V, in pieces
                pieces = spans(m, DIRECT_PIECE_SLOTS)
                if k_t:
                    _stream_k_t(k_units, k_chunk, seq_offset + head_offset, col, d)
                for cache, buf in ((v_units, v_chunk),) if k_t else ((k_units, k_chunk), (v_units, v_chunk)):
                    for c0, n in pieces:
                        src = cache.ap([[m * d, pmax], [1, n * d]], offset=seq_offset + head_offset + c0 * d,
                                       scalar_offset=col, indirect_dim=0)
                        nisa.dma_copy(dst=buf[:, c0 * d:(c0 + n) * d], src=src, dge_mode=nisa.dge_mode.hwdge)
            else:
                if block_table is None:                 # contiguous edge chunk: ids from its key window
                    idx_sb = contiguous_unit_ids(meta, window_sb, b, seq_units, unit_keys, units_per_chunk)
                else:
                    idx_sb = _paged_unit_ids(block_table, b, col, units_per_chunk)
                if not interior:                        # units holding no key of [first, L_b) skipped
                    skip_unneeded_units(idx_sb, meta.unit_keys, window_sb, k_units.shape[0])
                if k_t:                                 # edge K^T: the partition groups holding a needed key
                    nisa.tensor_scalar(dst=edge_window, data=window_sb[0:1, 0:2], op0=nl.maximum, operand0=0.0,
                                       op1=nl.minimum, operand1=float(m * pmax), engine=nisa.engine.gpsimd)
                    for i, reg in enumerate(edge_regs):
                        nisa.register_load(reg, edge_window[0:1, i:i + 1])
                    _stream_k_t(k_units, k_chunk, seq_offset + head_offset, col, d, edge_regs)
                else:
                    for step in steps:
                        gather_chunk(k_units, idx_sb, head_offset, unit_keys, k_chunk, step)
                gather_chunk(v_units, idx_sb, head_offset, unit_keys, v_chunk)
                if not interior:
                    zero_invisible_rows(v_chunk, key_slots, window_sb)
            _chunk(split_states, q_t, k_chunk, v_chunk, plan, d_spans, m, ones_col, k_units.dtype, scale,
                   softcap, dtype, pack)
            nisa.tensor_scalar(dst=window_sb, data=window_sb, op0=nl.add, operand0=-float(m * pmax))


def _paged_unit_ids(block_table, b, col, n, chunks=1, idx_sb=None, cols_ahead=0, ahead_of_use=False):
    """Unit ids (n, chunks) int32 of ``chunks`` consecutive chunks of sequence ``b``: columns
    ``col + cols_ahead .. + chunks*n`` (``col`` a loop register) of its block-table row, one DMA (into
    ``idx_sb`` when given). One chunk: partition p holds column p. Several (a trip of interior
    chunks): partition p holds ``chunks`` consecutive columns, one per chunk, so each partition reads
    one run of ``4 * chunks`` bytes (a chunk per column would be one 4-byte run per element: 3.4 us
    of DMA for (128, 4) against 0.8); chunk j then holds units ``p*chunks + j``, which an interior
    chunk may (no key of it is masked: the softmax does not depend on the keys' order, and K and V
    take the same ids). ``ahead_of_use``: a read of the next trip's ids, which after a stream's last
    trip may run past the table's end; that read is then skipped (``oob_mode.skip``,
    docs/nki-semantics.md §14.7), the ids it would have fetched never used."""
    if idx_sb is None:
        idx_sb = nl.ndarray((n, chunks), dtype=nl.int32, buffer=nl.sbuf)
    src = block_table.ap([[chunks, n], [1, chunks]], offset=b * block_table.shape[1] + cols_ahead,
                         scalar_offset=col, indirect_dim=1)
    oob = nisa.oob_mode.skip if ahead_of_use else nisa.oob_mode.error
    nisa.dma_copy(dst=idx_sb, src=src, oob_mode=oob)
    return idx_sb


def _trip_ids(ids_next):
    """This trip's ids, copied (GpSimd) out of the prefetch tile so the next trip's ids DMA may land there."""
    ids_sb = nl.ndarray(ids_next.shape, dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=ids_sb, src=ids_next, engine=nisa.engine.gpsimd)
    return ids_sb


def _interior_trips(chunk, block_table, b, lo, hi, units_per_chunk, ahead, n_pairs, prefetch):
    """The interior chunks of [lo, hi) as a device loop of whole trips of ``ahead`` chunks (returns
    where the trips end): a trip's ids in one DMA ahead of its gathers. ``prefetch``: the next trip's
    ids DMA issued right after this trip's first chunk, so a trip's first gathers never wait on its
    ids DMA (docs/perf-log.md §36.1)."""
    step = ahead * units_per_chunk
    end = _whole_trips_end(lo, hi, step)
    if prefetch:
        ids_next = _paged_unit_ids(block_table, b, lo, units_per_chunk, ahead, ahead_of_use=True)
    for col in nl.dynamic_range(lo, end, step):
        if prefetch:
            ids_sb = _trip_ids(ids_next)
        else:
            ids_sb = _paged_unit_ids(block_table, b, col, units_per_chunk, ahead)
        for j in range(ahead):
            chunk(ids_sb[:, j:j + 1], True, j % n_pairs)
            if prefetch and j == 0:
                _paged_unit_ids(block_table, b, col, units_per_chunk, ahead, ids_next, step, True)
    return end


def stream_pairs(chunk_bufs, stream, per_stream):
    """The ``per_stream`` K/V buffer pairs of head stream ``stream`` (the streams rotate over ``chunk_bufs``)."""
    first = stream * per_stream % len(chunk_bufs)
    return chunk_bufs[first:first + per_stream]


def _whole_trips_end(lo, hi, step):
    """A register of lo + step * floor((hi - lo) / step) (``lo``, ``hi`` registers, ``step`` a power of
    two): where a device loop from ``lo`` by ``step`` makes only whole trips before ``hi``."""
    vals = nl.ndarray((1, 2), dtype=nl.int32, buffer=nl.sbuf)
    nisa.register_store(vals[0:1, 0:1], lo)
    nisa.register_store(vals[0:1, 1:2], hi)
    end = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    shift = step.bit_length() - 1
    nisa.tensor_tensor(dst=end, data1=vals[0:1, 1:2], data2=vals[0:1, 0:1], op=nl.subtract, engine=nisa.engine.gpsimd)
    nisa.tensor_scalar(dst=end, data=end, op0=nl.right_shift, operand0=shift, op1=nl.left_shift, operand1=shift,
                       engine=nisa.engine.gpsimd)
    nisa.tensor_tensor(dst=end, data1=end, data2=vals[0:1, 0:1], op=nl.add, engine=nisa.engine.gpsimd)
    reg = nisa.register_alloc()
    nisa.register_load(reg, end)
    return reg


def _stream_heads(heads, setup, k_units, v_units, table, key_slots, unit, unit_keys, chunk_pairs, plan, ones_col,
                  d_spans, scale, softcap, dtype, pack=1, token_major=True, head_offset=0, per_gather=1):
    """The (b, split) stream of consecutive kv heads ``hk0 ..`` of sequence ``b`` (``unit`` = (b, hk0);
    ``heads``: per kv head, its (split states, q^T)), chunk by chunk as ``_stream``, with the key window
    of ``setup`` shared by the heads: per chunk one DMA of its unit ids (interior chunks: one per trip
    of a device loop of whole trips, then one chunk a trip, so a later chunk's gathers never queue for
    their ids behind the earlier chunks' gathers; a trip is ``IDS_AHEAD`` chunks, or with
    ``chunk_pairs`` of ``TRIP_PAIRS`` pairs one chunk per pair, alternating), gathers moving all those heads
    at once, the V cleaning of an edge chunk, then the heads' chunks as the jobs of one ``run_chunks``
    (their chains interleaved in lockstep, their K^T evictions shared by VectorE and ScalarE).

    Token-major pool (``token_major``, block rows of [token][kv head][D]): all kv heads, one gather of K
    per softmax step and one of V (each partition's M keys of a block are one contiguous run of
    M*Hkv*D, so M is chosen by the launcher to fit that run in a chunk buffer); each head's chunk is its
    (128, M, D) view (``slot_cols``). Head-major pool with one block per partition (M = block size):
    a run of the block's row holds the heads' [head][token][D], so one gather of K and one of V move
    ``per_gather`` heads at once (``gather_chunk`` ``heads``: one descriptor per partition for all of
    them), K then V of each such run in head order, so that the first heads' compute starts while the
    later heads land; each head's chunk is the (128, M*D) slice at ``(hk - hk0)*M*D``."""
    pmax = nl.tile_size.pmax
    m = key_slots.shape[1]
    b, hk0 = unit
    n_heads = len(heads)
    d = heads[0][0][0].acc.shape[1]
    units_per_chunk = m * pmax // unit_keys
    group_units = [(b, hk0 + h) for h in range(n_heads)]
    regs, window_sb = setup.regs, setup.window
    block_table, meta, _ = table

    def chunk(idx_sb, interior, pair=0):
        k_chunk, v_chunk = chunk_pairs[pair]
        k_views, v_views = (unit_views(c, group_units, m, d, token_major) for c in (k_chunk, v_chunk))
        if not interior:                            # units holding no key of [first, L_b) skipped
            skip_unneeded_units(idx_sb, meta.unit_keys, window_sb, k_units.shape[0])
        if token_major:
            for step in spans(m, plan[0]):
                gather_chunk_token_major(k_units, idx_sb, unit_keys, k_chunk, step)
            gather_chunk_token_major(v_units, idx_sb, unit_keys, v_chunk)
        for cache, buf in ((k_units, k_chunk), (v_units, v_chunk)) if not token_major else ():
            for j0 in range(0, n_heads, per_gather):
                cols = slice(j0 * m * d, (j0 + per_gather) * m * d)
                gather_chunk(cache, idx_sb, (hk0 + j0) * head_offset, unit_keys, buf[:, cols], heads=per_gather)
        jobs = [(split_states, q_t, k_views[h], v_views[h]) for h, (split_states, q_t) in enumerate(heads)]
        clean = None if interior else wave_cleaning(
            job_waves(n_heads, wave_jobs(len(heads[0][0]), len(d_spans))), len(spans(m, plan[0])),
            lambda i: zero_invisible_rows(v_views[i], key_slots, window_sb))
        run_chunks(jobs, plan, d_spans, m, ones_col, k_units.dtype, scale, softcap, dtype, before_pv=clean,
                   pack=pack)
        for split_states, _ in heads:
            _advance_bounds(split_states, m)
        nisa.tensor_scalar(dst=window_sb, data=window_sb, op0=nl.add, operand0=-float(m * pmax))

    ahead = len(chunk_pairs) if len(chunk_pairs) > 1 else IDS_AHEAD   # two pairs: a trip is a chunk per pair
    prefetch = token_major and len(chunk_pairs) > 1
    for r in range(len(regs) - 1):
        interior = r == INTERIOR_RANGE
        start = regs[r]
        if interior:                                # whole trips, then one chunk a trip
            start = _interior_trips(chunk, block_table, b, regs[r], regs[r + 1], units_per_chunk, ahead,
                                    len(chunk_pairs), prefetch)
        for col in nl.dynamic_range(start, regs[r + 1], units_per_chunk):
            chunk(_paged_unit_ids(block_table, b, col, units_per_chunk), interior)


def stream_budget(rows):
    """SBUF bytes per partition for a core's K/V chunk buffers with ``rows`` query rows per kv head:
    ``CHUNK_BUFFER_BUDGET`` shared with each row tile's scores and P^T."""
    return CHUNK_BUFFER_BUDGET // len(spans(rows, nl.tile_size.pmax))


def stream_head_groups(n_kv_heads, token_major, paged, unit_keys, m, d, itemsize, n_prog, budget):
    """(kv heads per multi-chunk stream, kv heads per gather) of ``_stream_heads``: for a token-major
    pool all of them, one gather; for a head-major paged pool with one block per partition on one
    core, per gather the most heads dividing Hkv whose chunk (heads x M x D) fits
    ``CHUNK_BUFFER_BYTES`` per partition (one descriptor per partition moves them all: the GpSimd
    descriptor work falls by that factor), per stream the most multiples of that dividing Hkv whose K
    and V chunks fit ``budget`` (one buffer pair: the gathers of a stream's next chunk then wait only
    for the compute of their own heads); else (1, 1): one stream per kv head (``_stream``)."""
    if token_major:
        return n_kv_heads, n_kv_heads
    if not paged or unit_keys != m or n_prog != 1:
        return 1, 1
    head_bytes = m * d * itemsize
    per_gather = max(g for g in range(1, n_kv_heads + 1) if n_kv_heads % g == 0 and g * head_bytes <= CHUNK_BUFFER_BYTES)
    per_stream = max([g for g in range(per_gather, n_kv_heads + 1, per_gather)
                      if n_kv_heads % g == 0 and 2 * g * head_bytes <= budget], default=per_gather)
    return (1, 1) if per_stream == 1 else (per_stream, per_gather)


def _stream_k_t(k_units, k_t, base, col, d, key_regs=None):
    """K^T (f*D, 128/pg, M/f, pg) (``pg = K_T_DGE_ROWS``, f = ``k_t_fold``) of a contiguous multi-chunk
    chunk whose first key is unit column ``col`` (a loop register) of the cache rows at ``base``, by
    hardware-DGE ``dma_transpose``s (the 4-d form, permutation (3, 1, 2, 0)) of its keys viewed as
    (pg partitions j, groups g, M/f slot folds, f*D = 128): f consecutive slots of a partition make one
    128-element source row (the hardware DGE's last-dim granule), so element [e, g, c', j] is dim
    e % D of key (g*pg + j)*M + f*c' + e // D, the key of partition g*pg + j, slot f*c' + e // D of
    the V chunk (K^T slot c is the view [(c % f)*D:(c % f + 1)*D, :, c // f, :]). Each DMA covers
    ``_k_t_groups`` partitions, so its K^T rows (one contiguous run per partition of K^T) are at least
    ``K_T_ROW_BYTES``. ``key_regs`` (an edge chunk: registers of [first, L_b) relative to the chunk):
    each DMA under ``_if_group_needed``, so only partition groups holding a needed key are read (the
    others keep stale data, masked by selection); None (an interior chunk): every group."""
    pmax = nl.tile_size.pmax
    rows, _, folds, pg = k_t.shape
    fold = rows // d
    m = folds * fold
    span = _k_t_groups(folds, k_units.itemsize)   # partitions per DMA: a power of two >= pg

    def load(p0, pn):
        src = k_units.ap([[m * d, pg], [pg * m * d, pn // pg], [rows, folds], [1, rows]],
                         offset=base + p0 * m * d, scalar_offset=col, indirect_dim=0)
        nisa.dma_transpose(dst=k_t[:, p0 // pg:(p0 + pn) // pg], src=src, dge_mode=nisa.dge_mode.hwdge)

    for p0, pn in spans(pmax, span):
        if key_regs is None:
            load(p0, pn)
        else:
            _if_group_needed(p0, pn, m, key_regs, lambda p0=p0, pn=pn: load(p0, pn))


def _load_needed_groups(cache_units, chunk_sb, base, m, key_regs, head_keys):
    """A contiguous chunk (keys p*M + c on partition p) by groups of ``LOAD_GROUP_PARTITIONS``
    of the ``chunk_partitions`` partitions holding the kv head's ``head_keys`` keys (a last one partly,
    ``partition_rows``), each with precomputed descriptors under ``_if_group_needed``: a group loads
    only if it holds a key of [first, L_b), so traffic follows L_b; in ``DIRECT_PIECE_SLOTS`` pieces,
    so the first scores start while the rest lands."""
    d = chunk_sb.shape[1] // m

    def load(p0, pn):
        for c0, n in spans(m, DIRECT_PIECE_SLOTS):
            for p, n_p, slots in partition_rows(p0, pn, m, head_keys):
                if c0 < slots:
                    width = min(n, slots - c0) * d
                    nisa.dma_copy(dst=chunk_sb[p:p + n_p, c0 * d:c0 * d + width],
                                  src=cache_units.ap([[m * d, n_p], [1, width]], offset=base + (p * m + c0) * d))

    for p0, pn in spans(chunk_partitions(head_keys, m), LOAD_GROUP_PARTITIONS):
        _if_group_needed(p0, pn, m, key_regs, lambda p0=p0, pn=pn: load(p0, pn))


def partition_rows(p0, pn, m, head_keys):
    """The loads of partitions [p0, p0 + pn) of a contiguous cache's only chunk (keys p*M + c on
    partition p) as ``(first partition, partitions, slots)``: its whole partitions (M slots each), then
    the one holding the head's last ``head_keys % M`` keys (a capacity that is not a whole number of
    partitions: 3000 keys at M = 32 -> 93 whole partitions and 24 keys on the 94th, docs/perf-log.md
    §39.1); its other slots, like the partitions past it, are never loaded."""
    whole, rest = divmod(head_keys, m)
    rows = [(p0, min(p0 + pn, whole) - p0, m)] if p0 < whole else []
    if rest and p0 <= whole < p0 + pn:
        rows.append((whole, 1, rest))
    return rows


def chunk_partitions(head_keys, m):
    """Partitions of a contiguous cache's only chunk (keys p*M + c on partition p) that hold keys of
    the kv head: all 128, or ``ceil(head_keys / M)`` when the capacity is below the chunk
    (``keys_per_partition`` rounds M up to a power of two: 3072 keys -> M = 32, 96 partitions; 3000 ->
    94, the last holding 24 keys, ``partition_rows``). The other partitions and slots are never loaded:
    their keys lie at or past the capacity, so past L_b (scores masked by selection, V rows zeroed as an
    edge chunk's, ``clean_edge_rows``)."""
    return min(nl.tile_size.pmax, ceil_div(head_keys, m))


def _if_group_needed(p0, pn, m, key_regs, body):
    """``body()`` inside two device loops of 0 or 1 trips (static start or stop, a key-window register
    on the other side, a step of one chunk): it runs only if partitions [p0, p0 + pn) of a chunk (keys
    p*M + c on partition p) hold a key of [first, L_b)."""
    first_reg, end_reg = key_regs
    chunk_keys = m * nl.tile_size.pmax
    for _ in nl.dynamic_range(p0 * m, end_reg, chunk_keys):               # L_b > the group's first key
        for _ in nl.dynamic_range(first_reg, (p0 + pn) * m, chunk_keys):  # first < its end
            body()


def k_by_transpose(seq_units, itemsize, d, m):
    """Whether the single-chunk path loads the K of its last unit (the last of this core's last group)
    as K^T by one ``dma_transpose`` (``_load_k_t``): a contiguous cache (one HBM run per
    partition), 2-byte K (the DMA transpose's dtypes), D <= 128 (K^T's partitions) and at most
    ``K_T_DMA_MAX_SLOTS`` keys per partition. That unit's K lands last; its PE transposes and K^T
    evictions (~1.7 us of hops after its last K byte at M = 16) gate its scores, and with them the
    softmax and P @ V of its whole wave, while the V transfer left after it is short (it grows with
    M). The DMA transpose costs 1/0.9 of that unit's K transfer instead (docs/perf-log.md §18.5)."""
    return seq_units is not None and itemsize == 2 and d <= nl.tile_size.pmax and m <= K_T_DMA_MAX_SLOTS


def every_k_by_transpose(seq_units, itemsize, d):
    """Whether the single-chunk path loads the K of *every* unit as K^T by ``dma_transpose``
    (``_load_k_t``; the multi-chunk path every chunk's, ``_stream_k_t``, given
    ``stream_k_by_transpose``): a contiguous cache, 2-byte K and D <= 64. A slot's PE transposes of K cost
    TensorE 128 cycles whatever D <= 128 (``max(P_in, min(64, F_in))``), as much as its score and
    P @ V matmuls together (64 cycles each), while its K/V bytes halve with D: at D = 64 TensorE, not
    HBM, binds (58.9 us TensorE vs 46.9 us DMA busy at B=1 Hq=64 Hkv=8 L=8192); by DMA transpose the
    K^T costs 1/0.9 of K's transfer and no TensorE, ScalarE or VectorE work (docs/perf-log.md §20.3;
    the multi-chunk path at L=32768: 237.0 us TensorE busy before, §22.3)."""
    return seq_units is not None and itemsize == 2 and 2 * d <= nl.tile_size.pmax


def stream_k_by_transpose(head_keys, m, itemsize, d):
    """Whether the multi-chunk path (``every_k_by_transpose`` given) loads K as K^T (``_stream_k_t``):
    when its slots fold into 128-element source rows (``k_t_fold``) and the keys of a kv head are a
    whole number of its DMAs' partition spans (``_k_t_groups`` partitions of M keys), so that a span
    holding a needed key lies inside the cache (a chunk may run past the capacity; the spans past it
    hold no needed key and are never read). Otherwise K is gathered and PE-transposed (a recorded
    choice: the hardware DGE takes no other source shape, docs/perf-log.md §24.1)."""
    fold = k_t_fold(d, m)
    return fold is not None and head_keys % (_k_t_groups(m // fold, itemsize) * m) == 0


def k_t_fold(d, m):
    """Slots f per 128-element source row of the multi-chunk path's hardware-DGE K^T transposes
    (their sources need a last dim that is a multiple of 128: f = 128/D consecutive slots of a
    partition, K^T slot c then on partitions (c % f)*D ..), or None when D does not divide 128, D is
    below the smallest PE row tile (``K_T_FOLD_MIN_D``) or M is not a multiple of f."""
    pmax = nl.tile_size.pmax
    fold = pmax // d
    return fold if pmax % d == 0 and d >= K_T_FOLD_MIN_D and m % fold == 0 else None


def _k_t_groups(m, itemsize, n_part=None):
    """Partitions per ``dma_transpose`` of a chunk's K^T: groups of ``LOAD_GROUP_PARTITIONS`` or more,
    so that each K^T row of a group (M slots x group keys) is at least ``K_T_ROW_BYTES``; halved
    (down to ``LOAD_GROUP_PARTITIONS``) when that makes them tile the ``n_part`` partitions a chunk
    loads (``chunk_partitions``), else kept: a group cut short goes through a tile of its own and a
    GpSimd copy (``_load_k_t``), which costs less than more groups when the halving cannot end in a
    tiling (measured, docs/perf-log.md §38.1 and §39.1)."""
    pmax = nl.tile_size.pmax
    pg = min(pmax, max(LOAD_GROUP_PARTITIONS, K_T_ROW_BYTES // (m * itemsize)))
    tiling = pg
    while n_part is not None and n_part % tiling and tiling > LOAD_GROUP_PARTITIONS:
        tiling //= 2
    return tiling if n_part is None or n_part % tiling == 0 else pg


def k_t_tile(dtype, m, d, pg=None, fold=1):
    """An SBUF tile for the K^T of one chunk, (f*D, 128/pg, M/f, pg): ``pg`` partitions per group, by
    default ``_k_t_groups`` (``_load_k_t``; the multi-chunk path's ``_stream_k_t`` takes ``K_T_DGE_ROWS``
    and ``fold`` = f = ``k_t_fold`` slots folded onto the partitions)."""
    pmax = nl.tile_size.pmax
    pg = pg or _k_t_groups(m, dtype.itemsize)
    return nl.ndarray((fold * d, pmax // pg, m // fold, pg), dtype=dtype, buffer=nl.sbuf)


def _load_k_t(k_units, base, m, d, setup, head_keys, k_t=None):
    """K^T (D, 128/pg, M, pg) of a unit's only chunk by ``dma_transpose`` (the 3-d form, permutation
    (2, 1, 0)) of its keys viewed per group of ``pg`` partitions as (pg partitions, M slots, D):
    element [d, g, c, j] is key (g*pg + j)*M + c, the key of partition g*pg + j, slot c of the V
    chunk, so K^T slot c is the (D, 128) view [:, :, c, :]. One group (``k_t_head_groups``): one DMA of
    the whole chunk, whatever L_b (keys outside [first, L_b) only give masked scores). Several: each
    group under ``_if_group_needed`` on the key-window registers of ``setup``, so only groups that
    hold a key of [first, L_b) are read; the others keep stale data, masked by selection. Only the
    partitions holding the head's ``head_keys`` keys are read (``partition_rows``). A group cut short
    (its whole partitions, then a partly filled last partition on its own) is transposed into a
    tile of its own, (D, slots, partitions): written straight into K^T its rows would be runs of
    one element per partition (2 B for the partial one), and one GpSimd copy (idle on this path)
    puts it in place (docs/perf-log.md §39.1)."""
    pmax = nl.tile_size.pmax
    pg = k_t_head_groups(m, k_units.itemsize, head_keys)
    if k_t is None:
        k_t = k_t_tile(k_units.dtype, m, d, pg)

    def load(p0, pn):
        g = p0 // pg
        for p, n_p, slots in partition_rows(p0, pn, m, head_keys):
            src = k_units.ap([[m * d, n_p], [d, slots], [1, d]], offset=base + p * m * d)
            if n_p == pg and slots == m:
                nisa.dma_transpose(dst=k_t[:, g], src=src)
                continue
            part_t = nl.ndarray((d, slots, n_p), dtype=k_units.dtype, buffer=nl.sbuf)
            nisa.dma_transpose(dst=part_t, src=src)
            j = p - g * pg
            nisa.tensor_copy(dst=k_t[:, g, 0:slots, j:j + n_p], src=part_t, engine=nisa.engine.gpsimd)

    n_part = chunk_partitions(head_keys, m)
    if pg == pmax:
        load(0, n_part)
        return k_t
    key_regs = _key_registers(setup)
    for p0, pn in spans(n_part, pg):
        _if_group_needed(p0, pn, m, key_regs, lambda p0=p0, pn=pn: load(p0, pn))
    return k_t


def k_t_head_groups(m, itemsize, head_keys):
    """Partitions per K^T group of a contiguous cache's only chunk holding ``head_keys`` keys per kv
    head: ``_k_t_groups`` tiling its ``chunk_partitions``."""
    return _k_t_groups(m, itemsize, chunk_partitions(head_keys, m))


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
    k_units, _, block_table, key_slots, unit_keys, head_offset, plan, meta = cache
    m = key_slots.shape[1]
    b, hk = unit
    if seq_offset is not None:
        _load_needed_groups(k_units, k_chunk, seq_offset + hk * head_offset, m, _key_registers(setup),
                            head_offset // (k_chunk.shape[1] // m))
        return None
    idx_sb = load_unit_ids(block_table, [b], meta.gate, meta.unit_keys, k_units.shape[0])[b]
    for step in spans(m, plan[0]):
        gather_chunk(k_units, idx_sb, hk * head_offset, unit_keys, k_chunk, step)
    return idx_sb


def _single_chunk_v(cache, unit, seq_offset, v_chunk, idx_sb, setup):
    """V of the only chunk (as ``_single_chunk_k``); an edge chunk's V rows outside [first, L_b) are
    zeroed later, right before its wave's P @ V (``wave_cleaning``)."""
    _, v_units, _, key_slots, unit_keys, head_offset, _, _ = cache
    m = key_slots.shape[1]
    b, hk = unit
    if seq_offset is not None:
        _load_needed_groups(v_units, v_chunk, seq_offset + hk * head_offset, m, _key_registers(setup),
                            head_offset // (v_chunk.shape[1] // m))
    else:
        gather_chunk(v_units, idx_sb, hk * head_offset, unit_keys, v_chunk)


def job_waves(n_jobs, width):
    """The jobs of each wave of ``run_chunks`` (``width`` = ``wave_jobs``): consecutive runs of ``width``."""
    return [list(range(j0, min(j0 + width, n_jobs))) for j0 in range(0, n_jobs, width)]


def wave_cleaning(waves, steps, clean_job, load_v=None):
    """``run_chunks``' ``before_pv`` that cleans edge chunks' V rows outside [first, L_b) wave by wave
    (``waves``: the jobs of each wave, ``job_waves``; ``steps``: softmax steps a job; ``clean_job(i)``
    zeroes job i's rows): right before a wave's first P @ V, so VectorE cleans between the compute of
    the waves before it, not every job's ahead of the first K^T evictions. ``load_v`` (V over K,
    ``overlay``): that wave's V loaded first."""
    def clean(w):
        if load_v is not None:
            load_v(w)
        if w % steps == 0:
            for i in waves[w // steps]:
                clean_job(i)
    return clean


def _chunk(split_states, q_t, k_chunk, v_chunk, plan, d_spans, m, ones_col, kv_dtype, scale, softcap, dtype, pack=1):
    """Scores, mask, softmax and P @ V of one loaded chunk for every row tile (``run_chunks`` with one
    job); then the row bounds move to the next chunk (-128*M keys)."""
    run_chunks([(split_states, q_t, k_chunk, v_chunk)], plan, d_spans, m, ones_col, kv_dtype, scale, softcap, dtype,
               pack=pack)
    _advance_bounds(split_states, m)


def _advance_bounds(split_states, m):
    """The row bounds of ``split_states`` moved to the next chunk (-128*M keys)."""
    chunk_keys = m * nl.tile_size.pmax
    for st in split_states:
        nisa.tensor_scalar(dst=st.bounds, data=st.bounds, op0=nl.add, operand0=-float(chunk_keys))
        if st.g_bounds is not None:
            group = st.acc.shape[0] // st.group_sq
            nisa.tensor_scalar(dst=st.g_bounds, data=st.g_bounds, op0=nl.add, operand0=-float(chunk_keys * group))


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
            peer.append(state_views(buf))
        received.append(peer)
    return received


class _UnitWork(nl.NKIObject):
    """What the streams of one (b, hk) unit need, prepared one unit ahead of them."""
    q_t: object       # per row tile: q^T chunks (dc, rn)
    states: object    # per split of this core: per row tile a SplitState
    setups: object    # per split of this core: its StreamSetup


def single_chunk_path(n_split, n_units, n_prog, capacity, chunk_keys):
    """Whether the kernel takes the single-chunk path: one split, whole units per core, and a capacity
    of at most one chunk of at most ``SINGLE_CHUNK_KEYS`` keys (a contiguous cache's below the chunk
    fills only its first ``chunk_partitions`` partitions). On that path a contiguous cache is loaded
    directly, without unit ids."""
    return n_split == 1 and n_units % n_prog == 0 and capacity <= chunk_keys <= SINGLE_CHUNK_KEYS


def reads_lengths(single, paged, first_is_zero, batch):
    """Whether the kernel takes the lengths alone instead of deriving split bounds and key windows
    (``decode_attention_fwd_meta``): the single-chunk path of a contiguous cache with first = 0 (no
    window, no cache start), whose only metadata are L_b (key windows [0, L_b), one edge range
    [L_b, C)), for at most 64 sequences (their windows fit one row of 128)."""
    return single and not paged and first_is_zero and 2 * batch <= nl.tile_size.pmax


@nki.jit
def decode_attention_fwd_kernel(q, k_units, v_units, block_table, cache_seqlens, cache_start, sink_rows,
                  n_kv_heads, head_offset, seq_units, unit_keys, keys_per_partition, n_split, n_cols,
                  scale, softcap, window_left, token_major=False):
    """Decode attention; see the module docstring for shapes and the algorithm."""
    pmax = nl.tile_size.pmax
    batch, n_q_heads, sq, d = q.shape
    group = n_q_heads // n_kv_heads
    rows = group * sq
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
    n_prog = nl.num_programs(0)
    pid = nl.program_id(0)
    units = tuple((b, hk) for b in range(batch) for hk in range(n_kv_heads))
    single = single_chunk_path(n_split, len(units), n_prog, n_cols * unit_keys, m * pmax)
    first_keys = window_left >= 0 or cache_start is not None     # first > 0 possible
    derive = not reads_lengths(single, seq_units is None, not first_keys, batch)
    shared = single and shared_gathers(seq_units, unit_keys, m)
    if token_major and (n_prog > 1 or single and not shared):
        raise ValueError("token_major: a token-major paged pool is read in place on one core, on the single-chunk "
                         "path with one block per partition (shared_gathers) or on the multi-chunk path "
                         "(decode_attention_fwd_plan._token_major_depth)")
    shard_units = len(units) % n_prog == 0          # LNC2: whole (b, hk) units per core ...
    mine = [u for u in range(len(units)) if not shard_units or u % n_prog == pid]
    unit_ids = {}                                   # shared gathers: each sequence's ids, skipping as soon
                                                    # as the lengths are on the partitions

    def early(gate, unit_key_tile):
        if shared:
            unit_ids.update(load_unit_ids(block_table, [units[u][0] for u in mine], gate, unit_key_tile,
                                          k_units.shape[0], first_keys))

    meta = load_meta(cache_seqlens, cache_start, n_split, derive, rows, sq, key_slots[:, 0:1], window_left,
                     m * pmax, unit_keys, single, early)
    every_k_t = every_k_by_transpose(seq_units, k_units.itemsize, d) and (
        single or stream_k_by_transpose(head_offset // d, m, k_units.itemsize, d))   # multi-chunk: ``_stream_k_t``
    head_keys = pmax * m if seq_units is None else head_offset // d   # single chunk: the keys it loads
    k_t_rows = (k_t_head_groups(m, k_units.itemsize, head_keys) if single   # partitions per K^T group; the
                else K_T_DGE_ROWS)                                         # multi-chunk path's hwdge form
    fold = 1 if single or not every_k_t else k_t_fold(d, m)   # multi-chunk K^T: slots per partition row
    k_row = pmax // fold if every_k_t else d        # K^T: 128 keys per slot on each of D partitions
    budget = stream_budget(rows)
    head_group, per_gather = (1, 1) if single else stream_head_groups(
        n_kv_heads, token_major, seq_units is None, unit_keys, m, d, max(k_units.itemsize, v_units.itemsize), n_prog,
        budget)
    streams_heads = head_group > 1                  # multi-chunk: (b, split) streams of several kv heads
    pair_bytes = m * (k_row * k_units.itemsize + d * v_units.itemsize) * head_group
    n_streams = batch * n_split * n_kv_heads // head_group
    n_pairs = max(1, min(n_streams * (TRIP_PAIRS if streams_heads else 1), budget // pair_bytes))
    stream_pair_count = TRIP_PAIRS if streams_heads and n_pairs >= TRIP_PAIRS * n_streams else 1
    if single:                                      # groups of units (one per buffer pair) of equal size:
        n_groups = ceil_div(len(units) // n_prog, n_pairs)   # the last group's tail no longer than the rest
        n_pairs = ceil_div(len(units) // n_prog, n_groups)
    chunk_bufs = []   # K/V buffer pairs, never cleared: rows a gather skips only hold keys that every row
                      # masks by selection, and edge chunks zero those V rows (0 * NaN)
    head_bytes = m * d * max(k_units.itemsize, v_units.itemsize)
    my_units = len(units) // n_prog
    overlay = shared and n_pairs < my_units and plan[0] == m and my_units * head_bytes <= budget
    if overlay:       # V over K: one (K, then V) chunk view per unit, all units in one group
        n_pairs = my_units
    if shared:        # one K and one V tile (overlay: the same), pair i their i-th (128, M*D) view
        tiles = [nl.ndarray((pmax, n_pairs * m * d), dtype=k_units.dtype, buffer=nl.sbuf)]
        tiles.append(tiles[0] if overlay else nl.ndarray((pmax, n_pairs * m * d), dtype=v_units.dtype,
                                                         buffer=nl.sbuf))
        chunk_bufs = [tuple(tile[:, i * m * d:(i + 1) * m * d] for tile in tiles) for i in range(n_pairs)]
    chunk_width = m * d * head_group
    for _ in range(0 if shared else n_pairs):
        pair = (k_t_tile(k_units.dtype, m, d, k_t_rows, fold) if every_k_t else nl.ndarray((pmax, chunk_width),
                                                                                       dtype=k_units.dtype, buffer=nl.sbuf),
                nl.ndarray((pmax, chunk_width), dtype=v_units.dtype, buffer=nl.sbuf))
        chunk_bufs.append(pair)

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

    key_pack = (slots_per_transpose(d, plan[2], m)   # K^T slots per PE transpose: the shared gathers'
                if shared or not (single or every_k_t) else 1)   # chunks and the multi-chunk streams' PE-transposed K
    q_copies = max(fold, key_pack)                  # q^T copies, one per partition block of folded K^T slots

    def unit_q_t(u):
        if units_per_q == 1:
            return [load_q_t(q, u * rows + r0, rn, d_spans, dtype, q_copies) for r0, rn in row_spans]
        g = u // units_per_q
        if g not in q_groups:
            n = min(units_per_q, len(units) - g * units_per_q)
            q_groups[g] = load_q_t(q, g * units_per_q * rows, n * rows, d_spans, dtype, q_copies)
        j = (u % units_per_q) * rows
        return [[q_t[:, j:j + rows] for q_t in q_groups[g]]]

    def prepare(u, setups=True):
        b, hk = units[u]
        if sink_rows is not None:
            for t in my_tiles:
                if (hk, t) not in sinks:
                    sinks[(hk, t)] = load_sink(sink_rows, hk, *row_spans[t], sq)
        engine = nisa.engine.gpsimd if single and seq_units is not None else None   # no swdge gathers
        fold = single and plan[0] == m              # one softmax step: the sink folds into it
        if fold and sink_rows is not None:
            for t in my_tiles:
                if (hk, t) not in neg_sinks:
                    neg_sinks[(hk, t)] = nl.ndarray((row_spans[t][1], 1), dtype=nl.float32, buffer=nl.sbuf)
                    nisa.tensor_scalar(dst=neg_sinks[(hk, t)], data=sinks[(hk, t)], op0=nl.multiply, operand0=-1.0,
                                       engine=nisa.engine.vector if shared else nisa.engine.gpsimd)
        return _UnitWork(q_t=unit_q_t(u),
                         states=[[_init_state(meta, b * n_split + s, r0, rn, d, plan[0], single, engine,
                                              (sinks.get((hk, t)), neg_sinks.get((hk, t))) if fold else None)
                                  for t, (r0, rn) in enumerate(row_spans)] for s in my_splits],
                         setups=[stream_setup(meta, b * n_split + s, single, unit_table_width(m, unit_keys))
                                 for s in my_splits] if setups else None)

    pending_out = []                                # (out rows, first row) awaiting their store

    def unit_merges(k, u, states):
        """The merge chains (per row tile of this core) of unit ``u``'s split states (column k of the
        lse tiles)."""
        return [merge_phases([st[t] for st in states], sinks.get((units[u][1], t)),
                             lse_tiles[t].neg_big[:, k:k + 1], lse_tiles[t].total[:, k:k + 1], dtype,
                             nisa.engine.vector if shared else nisa.engine.gpsimd)
                for t in my_tiles]

    def finish(done, outs=None, lag=OUT_STORE_LAG):
        """Merge the split states of units ``done`` ((k, u, states): column k of the lse tiles), their
        chains in lockstep -- or take their merged rows ``outs`` (per unit, per row tile), merged
        inside ``run_chunks``; their out stores trail the loads."""
        if outs is None:
            merges = []
            for k, u, states in done:
                if not shard_units:
                    states = states + _exchange(states, pid, first_pipe=u * n_split * len(row_spans))
                merges += unit_merges(k, u, states)
            outs = lockstep(merges)
        else:
            outs = [out_sb for unit_outs in outs for out_sb in unit_outs]
        rows0 = [u * rows + lse_tiles[t].r0 for _, u, _ in done for t in my_tiles]
        pending_out.extend(zip(outs, rows0))
        while len(pending_out) > lag * len(my_tiles):   # stores trail the loads they would block
            store_out(out, *pending_out.pop(0))

    def seq_offset(b):
        return None if seq_units is None else b * seq_units * k_units.shape[1]

    pack = (pack_size(len(units), rows, m, d, k_units.itemsize, n_prog)
            if single and seq_units is not None and len(row_spans) == 1 and head_offset == m * pmax * d else 1)
    columns = 1
    if single and seq_units is not None and len(row_spans) == 1 and head_offset == m * pmax * d and pack == 1:
        columns = column_pack_size(len(units), rows, sq, m, d, k_units.itemsize, n_prog)
    if pack > 1 or columns > 1:                     # several units per static chunk
        packed_path(q, k_units, v_units, sink_rows, out, lse, meta, max(pack, columns),
                     (n_kv_heads, m, unit_keys, d_spans, ones_col, scale, softcap), columns=columns > 1)
        return out, lse
    last_k_t = k_by_transpose(seq_units, k_units.itemsize, d, m)
    if single:                                      # static chunk per unit, pipelined across units
        for g0 in range(0, len(mine), n_pairs):
            group = list(enumerate(mine))[g0:g0 + n_pairs]
            works = [prepare(u) for _, u in group]
            cache = (k_units, v_units, block_table, key_slots, unit_keys, head_offset, plan, meta)
            k_bufs = [pair[0] for pair in chunk_bufs[:len(group)]]
            idx = []
            load_v = None
            setups = [work.setups[0] for work in works]
            per_wave = wave_jobs(len(row_spans), len(d_spans))
            waves = job_waves(len(group), per_wave)
            if shared:
                group_units = [units[u] for _, u in group]
                k_tile, v_tile = (tile[:, :len(group) * m * d] for tile in tiles)
                k_views, v_views = (unit_views(t, group_units, m, d, token_major) for t in (k_tile, v_tile))
                k_bufs = k_views
                if token_major:                # whole blocks of all kv heads: K, then V, one gather a sequence
                    gather_runs_token_major(k_units, group_units, unit_ids, k_tile, n_kv_heads, m, d)
                for wave in waves if not token_major else ():   # head-major: K per wave, so the first
                    gather_heads(cache, k_units, group_units, unit_ids, k_tile, wave)   # wave's scores start early

                def load_v(w, waves=waves, group_units=group_units, v_tile=v_tile):
                    if token_major:
                        if w == 0:
                            gather_runs_token_major(v_units, group_units, unit_ids, v_tile, n_kv_heads, m, d)
                    else:
                        parts = v_gather_parts(waves, w) if overlay else [waves[w]]
                        for part in parts:
                            if part:
                                gather_heads(cache, v_units, group_units, unit_ids, v_tile, part)

                if not overlay:                # else each wave's V lands over its K, after its K^T transposes
                    for w in range(len(waves)):
                        load_v(w)
                    load_v = None
            for i, ((_, u), work) in enumerate(zip(group, works)):
                b, hk = units[u]
                if shared:
                    idx.append(None)
                elif every_k_t or (last_k_t and g0 + n_pairs >= len(mine) and i == len(group) - 1):
                    k_bufs[i] = _load_k_t(k_units, seq_offset(b) + hk * head_offset, m, d, work.setups[0],
                                          head_keys,
                                          chunk_bufs[i][0] if every_k_t else None)
                    idx.append(None)
                else:
                    idx.append(_single_chunk_k(cache, units[u], seq_offset(b), chunk_bufs[i][0], work.setups[0]))
            for i, ((_, u), work) in enumerate(zip(group, works) if not shared else ()):
                _single_chunk_v(cache, units[u], seq_offset(units[u][0]), chunk_bufs[i][1], idx[i], work.setups[0])
            done = [(k, u, work.states) for (k, u), work in zip(group, works)]
            serial = shard_units and g0 + n_pairs < len(mine)   # a later group follows (no exchange)
            tails = [unit_merges(*unit) for unit in done] if serial else None
            v_bufs = v_views if shared else [pair[1] for pair in chunk_bufs[:len(group)]]
            before_pv = wave_cleaning(waves, len(spans(m, plan[0])),
                                      lambda i, v_bufs=v_bufs, setups=setups: clean_edge_rows(v_bufs[i], key_slots,
                                                                                             setups[i]), load_v)
            outs = run_chunks([(work.states[0], work.q_t, k_bufs[i], v_bufs[i]) for i, work in enumerate(works)],
                              plan, d_spans, m, ones_col, k_units.dtype, scale, softcap, dtype, fresh=True, tails=tails,
                              before_pv=before_pv, pack=key_pack)
            if plan[0] == m and g0 + n_pairs >= len(mine):   # folded merges need no exp: the log table
                nisa.activation(dst=warm, op=nl.log, data=ones_col)   # loads behind P @ V and the merges
                warm = None
            finish(done, outs)
    elif streams_heads:                             # one core, units (b, hk) in order: head groups of a sequence
        groups = [list(enumerate(mine))[k0:k0 + head_group] for k0 in range(0, len(mine), head_group)]
        works_next = [prepare(u, setups=i == 0) for i, (_, u) in enumerate(groups[0])]
        for g, group in enumerate(groups):
            k0 = g * head_group
            works = works_next
            if g + 1 < len(groups):                 # the next group's setup ahead of this group's loads
                works_next = [prepare(u, setups=i == 0) for i, (_, u) in enumerate(groups[g + 1])]
            for s_i, setup in enumerate(works[0].setups):
                _stream_heads([(work.states[s_i], work.q_t) for work in works], setup, k_units, v_units,
                              (block_table, meta, seq_units), key_slots, units[group[0][1]], unit_keys,
                              stream_pairs(chunk_bufs, k0 // head_group * len(works[0].setups) + s_i,
                                           stream_pair_count), plan, ones_col,
                              d_spans, scale, softcap, dtype, key_pack, token_major, head_offset, per_gather)
            finish([(k, u, work.states) for (k, u), work in zip(group, works)], lag=head_group)
    else:
        stream = 0                                  # this core's streams rotate over the buffer pairs
        work_next = prepare(mine[0])
        for k, u in enumerate(mine):
            b, hk = units[u]
            work = work_next
            if k + 1 < len(mine):                   # the next unit's setup ahead of this unit's loads
                work_next = prepare(mine[k + 1])
            for split_states, setup in zip(work.states, work.setups):
                _stream(split_states, setup, work.q_t, k_units, v_units, (block_table, meta, seq_units), key_slots, b,
                        hk * head_offset, seq_offset(b), unit_keys, chunk_bufs[stream % n_pairs], plan,
                        ones_col, d_spans, scale, softcap, dtype, key_pack)
                stream += 1
            finish([(k, u, work.states)])
    if warm is not None:
        nisa.activation(dst=warm, op=nl.log, data=ones_col)   # the log table loads behind the last merge's
    for out_sb, row0 in pending_out:                         # exps, while VectorE finishes L and out
        store_out(out, out_sb, row0)
    for t in my_tiles:
        store_lse(lse_tiles[t], lse, rows)
    return out, lse
