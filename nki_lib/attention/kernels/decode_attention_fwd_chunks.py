"""Decode-attention kernel: the online-softmax state of a split and the compute of loaded chunks.

Algorithm: for loaded K/V chunks (keys on the 128 partitions, ``M`` slots per partition) and the
q^T of their rows, ``run_chunks`` issues the scores, mask, softmax update and P @ V of every
softmax step (``chunk_plan``) of every job, software-pipelined over the steps of all jobs: the
scores of item i+1 before the softmax of item i, the P @ V of item i after the softmax of item
i+1, the chains of a wave interleaved phase by phase (``lockstep``), the K^T transposes of a wave
issued ahead across its items (``KtPipeline``). The steps themselves are in
``decode_attention_fwd_steps``; ``decode_attention_fwd`` (streams, single-chunk path) and
``decode_attention_fwd_packed`` (packed single-chunk path) drive this module; column-tiled packs
take their scores from K^T (``step_scores_columns``) and their P @ V and merge from
``decode_attention_fwd_columns``.

Loop structure::

    for wave (up to LOCKSTEP_CHAINS chains of jobs, step-major):
      scores of the next wave (K^T blocks pipelined across its items)
      mask, row max, exp of this wave (lockstep)
      P @ V and state updates of the previous wave (lockstep)
    P @ V of the last wave

Shapes: a state's ``packed`` (rn, D + 2) fp32 = acc | l | neg_m; ``bounds`` (128, rn, 2); K/V
chunks (128, M*D); q^T chunks (dc, rn). Dimension legend as in ``decode_attention_fwd``.

Limits: those of ``decode_attention_fwd`` (D <= 256, bf16/fp16/fp32, positions < 2**24); a
chunk of at most 128 slots per partition.
"""

from __future__ import annotations

from nki_lib._nki import nisa, nl
from nki_lib.attention.kernels.decode_attention_fwd_columns import column_pv_merge_phases
from nki_lib.attention.kernels.decode_attention_fwd_steps import (
    MIN_II_ELEMS,
    KtPipeline,
    PvTileSum,
    lockstep_batched,
    pv_direct,
    step_probs_phases,
    step_pv_phases,
    step_scores,
    step_scores_columns,
)
from nki_lib.sizes import floor_pow2, spans

__all__ = ["SplitState", "block_slots", "chunk_plan", "run_chunks", "state_views", "wave_jobs", "LOCKSTEP_CHAINS"]

STEP_SCORE_ELEMS = 4096           # fp32 scores per partition of one softmax step (16 KiB of SBUF)
STEP_SLOTS = 64                   # slots per softmax step: >= 64 keeps the per-row range_select at
                                  # one element per cycle; a chunk has >= 2 steps to pipeline
LOCKSTEP_CHAINS = 4               # softmax / P @ V chains (row tile x head-dim chunk) interleaved in lockstep:
                                  # each holds ~3 PSUM banks while in flight, 8 banks in all
KT_ACT_EVERY = 2                  # several jobs of one unit per chunk: every 2nd K^T eviction on ScalarE
                                  # (VectorE also runs each unit's mask/max/shift passes: 14.9 vs 8.7 us
                                  # busy at B=8 Sq=4 L=1024 with every 4th; docs/perf-log.md §12.1)
COLUMN_MERGE_CHAINS = 4           # column-tiled packs' P @ V + merge chains in lockstep: 2 PSUM banks each
KT_ACT_EVERY_PACKED = 4           # packed chunks: every 4th (every 2nd measured 0.2 us slower in order)



def block_slots(itemsize: int = 4) -> int:
    """Key slots per K^T block: 128 keys per slot, one PSUM bank of ``itemsize``-byte K^T columns."""
    return nl.tile_size.psum_bank_fmax_bytes // (itemsize * nl.tile_size.pmax)


def chunk_plan(m, rows_max, rows_total, itemsize):
    """(step slots, score-block slots, K^T-block slots) for a chunk of M slots, row tiles of at
    most ``rows_max`` rows (``rows_total`` rows in all) and K/V of ``itemsize`` bytes; all powers of
    two dividing M. A score block's fp32 S^T (128, n*rn) fills at most one PSUM bank, so does a K^T
    block; a softmax step covers at most ``STEP_SLOTS`` slots and ``STEP_SCORE_ELEMS`` fp32 scores
    per partition over all row tiles (their scores are live together)."""
    blk = min(m, floor_pow2(nl.tile_size.psum_bank_fmax // rows_max))
    kt = min(blk, block_slots(itemsize))
    step = max(blk, min(m, STEP_SLOTS, floor_pow2(STEP_SCORE_ELEMS // rows_total)))
    return step, blk, kt


class SplitState(nl.NKIObject):
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
    columns: bool     # packed with column-tiled scores: partition p holds the R rows of its own unit only
                      # (the score tile has R rows, not U*R, token-major: r' = t*G + g), and the K chunk is
                      # K^T (D, U*M, 128); P @ V and the merge per pack (decode_attention_fwd_columns)
    unit_sinks: object  # columns: per unit its token-major sinks (R, 1), folded into its max; or None
    lse_cols: object  # columns: (-M, L) views (R, U) of the lse tiles' columns of the pack's units
    out_tile: object  # columns: the pack's out tile (U*G, Sq*D), set by its merge
    folded: bool      # single-chunk path, one softmax step: the sink is folded into that step (its -m
                      # includes -sink, ``sink_term`` = exp(sink - m)), so the merge needs no exp
    sink: object      # folded: the sink logits (rn, 1) of the rows, or None (no sinks)
    neg_sink: object  # folded: -sink (rn, 1), or None
    sink_term: object  # folded with sinks: exp(sink - m) (rn, 1), written by the step


def state_views(packed, bounds=None, group_sq=None, g_bounds=None, pack=1, units=None, sinks=(None, None),
                 folded=False, columns=False):
    d = packed.shape[1] - 2
    sink, neg_sink = sinks
    sink_term = nl.ndarray((packed.shape[0], 1), dtype=nl.float32, buffer=nl.sbuf) if sink is not None else None
    return SplitState(packed=packed, acc_l=packed[:, 0:d + 1], acc=packed[:, 0:d], l=packed[:, d:d + 1],
                       neg_m=packed[:, d + 1:d + 2], bounds=bounds, group_sq=group_sq, g_bounds=g_bounds,
                       pack=pack, units=units, columns=columns, unit_sinks=None, lse_cols=None, out_tile=None,
                       folded=folded, sink=sink, neg_sink=neg_sink, sink_term=sink_term)


class _EvictionRota:
    """Engines of consecutive K^T evictions across the units of a wave: every ``every``-th on ScalarE
    (otherwise idle between exps), the rest on VectorE (the busiest engine at short rows). ``first``:
    the first of every ``every`` on ScalarE instead of the last, so that a wave's last K^T block (the
    last unit's, on the critical path: its eviction gates that unit's scores) leaves by the faster
    VectorE copy (0.53 vs 0.85 us for a 16-bit (128, 1024) block)."""

    def __init__(self, every, first=False):
        self.every = every
        self.phase = 1 if first else 0
        self.count = 0

    def next(self):
        self.count += 1
        return nisa.engine.scalar if self.count % self.every == self.phase % self.every else nisa.engine.vector


def _tile_pack(state):
    """Units whose rows share a partition's columns of the score tile: U for a shared packed tile, 1
    for column-tiled packs (each partition holds its own unit's rows) and unpacked states."""
    return 1 if state.columns else state.pack


def wave_jobs(n_tiles, n_d_spans):
    """Jobs per wave of ``run_chunks`` (their chains run in lockstep; PSUM bounds it)."""
    return max(1, LOCKSTEP_CHAINS // (n_tiles * n_d_spans))


def run_chunks(jobs, plan, d_spans, m, ones_col, kv_dtype, scale, softcap, dtype, fresh=False, tails=None,
               before_pv=None, pack=1):
    """Scores, mask, softmax and P @ V of loaded chunks -- ``jobs`` of (states per row tile, q^T,
    K chunk, V chunk), one softmax step (``plan[0]`` slots) at a time, software-pipelined over the
    steps of all jobs in order: the scores of item i+1 are issued before the softmax of item i, and
    the P @ V of item i after the softmax of item i+1 (TensorE transposes and multiplies while
    VectorE/ScalarE run the mask, max and exp chain of the item before). Several jobs (units of the
    single-chunk path) so overlap their chains in program order. ``fresh``: the jobs' states are
    newly initialised, so their first step needs no running max and no rescaling.

    A step's -m_prev is the state's own (first step of a job) or the previous wave's item of the
    same job (its state update is still deferred).

    ``tails``: per job, per row tile a phase generator (its merge), issued right after that job's P @ V,
    job after job (``_pv_then_merges``), when the jobs fit one wave of one step; returns their results
    per job, or None when not taken (the caller then merges after this returns).

    ``before_pv``: called with a wave's index right before its P @ V is issued (after the scores, so
    the K^T transposes, of that wave and the next): the V of a one-step wave may then load over its
    own K (``decode_attention_fwd`` ``overlay``).

    ``pack`` > 1: K^T of ``pack`` slots per PE transpose, folded onto the partitions, and the jobs'
    q^T in ``pack`` copies (``decode_attention_fwd_pairs``)."""
    pmax = nl.tile_size.pmax
    width = wave_jobs(len(jobs[0][0]), len(d_spans))
    packed = any(st.pack > 1 for st in jobs[0][0])
    rota = (_EvictionRota(KT_ACT_EVERY_PACKED) if packed else _EvictionRota(KT_ACT_EVERY, first=True)) \
        if len(jobs) > 1 else None
    waves = [[(job, step) for job in jobs[j0:j0 + width]] for j0 in range(0, len(jobs), width)
             for step in spans(m, plan[0])]   # step-major within each wave of jobs

    def scores(wave):
        """S^T of every item of a wave, their K^T blocks pipelined across the items."""
        kt = KtPipeline()
        for (split_states, _, k_chunk, _), step in wave:
            if not split_states[0].columns:         # column-tiled packs load K^T by DMA
                kt.add(k_chunk, step, plan, d_spans, m, kv_dtype, rota, pack)
        out = []
        for (split_states, q_t, k_chunk, _), step in wave:
            n = step[1]
            s_sb = [nl.ndarray((pmax, st.group_sq, _tile_pack(st), n, st.acc.shape[0] // (st.group_sq * _tile_pack(st))),
                               dtype=nl.float32, buffer=nl.sbuf) if st.group_sq and n < MIN_II_ELEMS else
                    nl.ndarray((pmax, st.acc.shape[0], n), dtype=nl.float32, buffer=nl.sbuf) for st in split_states]
            if split_states[0].columns:
                out.append((s_sb, s_sb, 1.0))
                step_scores_columns(s_sb[0], q_t[0], k_chunk, step, split_states[0].pack, scale, softcap)
                continue
            # one score block, per-row exps, left in PSUM until its probs phase: only with one wave,
            # since the next wave's scores are made before this wave's probs (two waves of fused
            # blocks overflow PSUM: D = 64 at an 8k cache, perf-log §18.7)
            fused = softcap == 0 and MIN_II_ELEMS <= n <= plan[1] and len(waves) == 1
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
            if before_pv is not None:
                before_pv(w - 1)
            _flush_pv(pending, ones_col, d_spans, fresh)
        pending = (wave, probs)
    chained = tails if len(waves) == 1 and all(st.pack == 1 for st in jobs[0][0]) else None
    if before_pv is not None:
        before_pv(len(waves) - 1)
    return _flush_pv(pending, ones_col, d_spans, fresh, fresh and len(waves) == 1, chained)


def _then(first, second):
    """The phases of generator ``first`` and then those of ``second``; returns the latter's result."""
    yield from first
    return (yield from second)


def _flush_pv(pending, ones_col, d_spans, fresh, in_place=False, tails=None):
    """P @ V and the state updates of one wave, in lockstep over its items and row tiles (a packed
    tile: over its units, each contracting over its own partitions into its own state). ``in_place``:
    the only wave of fresh single-step jobs, whose merges follow at once -- a folded state then takes
    its P @ V result where it is (PSUM; no later wave allocates PSUM before the merges free it)."""
    wave, probs = pending
    phases, columns = [], []
    tile_sum = PvTileSum()
    for ((split_states, _, _, v_chunk), step), item_probs in zip(wave, probs):
        first = fresh and step[0] == 0
        for st, (p_t, neg_m_new) in zip(split_states, item_probs):
            if st.pack == 1:
                phases.append(step_pv_phases(st, p_t, neg_m_new, v_chunk, step[0], ones_col, d_spans,
                                             pv_direct(*st.acc.shape), first, in_place=in_place,
                                             tile_sum=tile_sum))
                continue
            if st.columns:
                columns.append(column_pv_merge_phases(st, p_t, neg_m_new, v_chunk, ones_col, step[0], st.unit_sinks,
                                                      st.lse_cols, p_t.dtype, _copy_engine(len(columns))))
                continue
            rows, part = st.units[0].acc.shape[0], nl.tile_size.pmax // st.pack
            phases += [step_pv_phases(ust, p_t[:, u * rows:(u + 1) * rows, :], neg_m_new[u], v_chunk, step[0],
                                      ones_col, d_spans, pv_direct(*ust.acc.shape), first, (u * part, part),
                                      tile_sum=tile_sum)
                       for u, ust in enumerate(st.units)]
    width = max(1, LOCKSTEP_CHAINS // len(d_spans))
    if tails is not None:
        return _pv_then_merges(phases, tails, width)
    lockstep_batched(phases, width)
    lockstep_batched(columns, COLUMN_MERGE_CHAINS)
    return None


def _pv_then_merges(phases, tails, width):
    """P @ V chains ``phases`` (per job, per row tile, in job order), each followed by its merge ``tails``
    (per job, per row tile): one job after the other (its row tiles in lockstep), so a job's merge is
    issued right behind its own P @ V, not behind the wave's last P @ V; returns the merges' results per job."""
    out, k = [], 0
    for job_tails in tails:
        out.append(lockstep_batched([_then(phases[k + t], tail) for t, tail in enumerate(job_tails)], width))
        k += len(job_tails)
    return out


def _copy_engine(i):
    """Engine of the i-th column-tiled pack's out-tile copy (PSUM -> SBUF): ScalarE and VectorE in turn."""
    return nisa.engine.scalar if i % 2 == 0 else nisa.engine.vector
