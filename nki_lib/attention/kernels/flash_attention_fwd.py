"""Flash-attention forward NKI kernel (online softmax) and its launcher ``launch_flash_attention_fwd``.

Algorithm (FlashAttention-2 forward, docs/contract.md §3.1 semantics). For every query tile the kernel
streams the visible key tiles once and keeps, per query row, the running max ``m`` (stored
negated, ``neg_m``), the running denominator ``l`` and the unnormalised output ``acc`` in fp32::

    s      = scale * q @ k^T                 (softcap: s = softcap * tanh(s / softcap); then mask)
    m_new  = max(m, rowmax(s));   alpha = exp(m - m_new)
    p      = exp(s - m_new);      l = alpha * l + rowsum(p)
    acc    = alpha * acc + p @ v
    out    = acc / l;             lse = m + log(l)

Sinks join the denominator as a virtual key with no value: the state starts at
``m = max(sink, STAT_INIT)``, ``l = exp(sink - m)``, ``acc = 0``. Masked scores are
``MASK_FILL`` and the running max starts at the finite ``STAT_INIT``, so masked keys contribute
exactly 0 and a row that sees no key (and no sink) ends with ``l = 0``: ``out = 0`` and
``lse = -inf`` (set by a predicated copy), never NaN.

Work decomposition (compile time, all loops unrolled)::

    group   = (batch b, kv head hk, query tile [q0, q0 + qn) with qn <= 128,
               pass = up to heads_per_pass query heads of hk's GQA group)
    section = run of consecutive visible key tiles (kn <= 512 each) of the group's plan inside
              one aligned span of KEY_SECTION_BYTES of K^T per partition row (2048 keys in
              bf16/fp16, 1024 in fp32)
    step    = (group, section, query head of the pass)

The exp table is loaded by a dummy exp at the start (``warm_table``), under the first
loads, instead of delaying the first softmax.

Key tiles no query of the tile can see are skipped (``tiles.plan_row``) and the visible ones are
cut to the 128-key blocks some query sees (``flash_attention_fwd_plan.trim_plan``: the causal diagonal tile
keeps 128 j keys); masks (one VectorE ``range_select`` against per-row key bounds) are applied
to partial tiles only. The query heads of a pass share each V load, and K^T of a kv head is
loaded once and shared by all its query tiles when it fits K_CACHE_SBUF_SHARE of SBUF; so is V
(``flash_attention_fwd_values.ValueCache``) when K^T and V in both its layouts fit that share.

Per step (engines in brackets)::

    per score tile of the section:
      S (qn, kn) PSUM = sum over D chunks of matmul(q^T (dc, qn), k^T (dc, kn))          [PE]
      -> S_sec SBUF fp32 (+ tanh softcap on ACT) (+ mask, straight from PSUM), row max
         chained over the section's tiles in the VectorE accumulator: one range_select per
         tile (all-key bounds when unmasked) with unscaled scores, else
         tensor_scalar_reduce                                                           [DVE]
    neg_m = min(neg_m, -scale' * rowmax) [POOL]; alpha [ACT]; P = exp(scale' S_sec - m)
      (qn, slen) in the P dtype with the row sum fused                                  [ACT]
    P^T: one TensorE transpose per 128-key block into bank-sized PSUM tiles, evicted
      PT_DVE_SHARE on VectorE, the rest on ScalarE                                  [PE, DVE/ACT]
      (or, for the long sections ``flash_attention_fwd_plan.dma_transposed_steps`` picks,
      one SBUF -> SBUF DMA transpose of P: no PE transpose, no PSUM eviction)           [DMA]
    O (qn, D) PSUM = sum over the section's blocks of matmul(P^T (bn, qn), V (bn, D))     [PE]
    l = alpha * l + rowsum [POOL];  acc = alpha * acc [POOL] + O [DVE]

``scale'`` is the softmax scale when it lies in [RAW_SCALE_MIN, 1] and there is no softcap (the
scores stay unscaled, so a masked tile needs no ScalarE pass), else 1 (the evict scales). The
first section of a state without sinks needs no alpha (l = rowsum, acc = O). Small SBUF-only
state ops run on GpSimd so that ScalarE and VectorE carry only the per-key work.

The steps run as a software pipeline (each engine executes its instruction stream in order):
iteration ``it`` loads the K^T of step ``it + SCORE_LEAD + 1`` and the V of ``it + 1``, evicts
the P^T of ``it - 1``, issues the softmax of ``it + 1``, QK^T and scores of ``it + SCORE_LEAD``
(with softcap: of SOFTCAP_BATCH steps every SOFTCAP_BATCH iterations, so the tanh/exp table
switches happen once per batch), P @ V of ``it - PV_LAG``, the transposes of ``it`` and the
acc update of ``it - ACC_LAG``; a group's output is stored ``CLOSE_LAG`` (``CLOSE_LAG_HEADS`` with several heads per pass) iterations after its
last acc update. The last ``DRAIN_STEPS`` steps evict all their P^T blocks on VectorE; with P^T by DMA for some
long sections the steps of the first ``PT_EARLY_UNTIL`` of the program evict a larger share
(``PT_DVE_SHARE_EARLY``) on VectorE than the later ones. Every tile is a fresh allocation, so loads of later steps overlap compute
(multi-buffering). lse is gathered column by column after each head's last l update and finished
in batches of ``LSE_BATCH`` (one ScalarE log per batch, a TensorE transpose so each row is stored
contiguously); the last batch at the last step, before its acc update, with its row stores after
the last outputs, and the exp -> log table switch right after the last exp, so that the lse chain
overlaps the drain.

DMA layouts: q^T/k^T tiles (q^T one DMA per head and chunk for QUERY_SECTION_TILES consecutive
query tiles, K^T one per aligned span) are DMA transposes of natural rows or contiguous rows of
the launcher's (D, S) layouts (``flash_attention_transposed_loads``); V is
read "interleaved" in runs of up to 8 blocks (4 in fp32; partition p of block g0 + i holds key
``128 g0 + c p + i``) so every partition reads one contiguous run of ``c * D`` elements per run,
and the transposes read the matching columns of P with a stride of at most 16 B; cached V uses
natural 128-key blocks where a section covers only part of an aligned run (the causal
diagonal), see ``flash_attention_fwd_values``.

Shapes (HBM): q (B, Hq, Sq, D), k (B, Hkv, Sk, D) in natural layout (``natural``: 2-byte
dtypes, D <= 128; q^T/k^T tiles by DMA transposes, ``flash_attention_transposed_loads``), else their transposes
(B, Hq, D, Sq), (B, Hkv, D, Sk) from the launcher (layout glue); v (B, Hkv, Sk, D), sinks (Hq,)
float32, doc (B, pmax, NT, 2) float32 per-row key bounds [lo, hi] (``nki_lib.attention.key_bounds``:
documents, key padding, with the causal/window rules intersected; ``tiles.bounds_layout``, NT query
tiles) or None. Outputs: out (B, Hq, Sq, D) in q's
dtype, lse (B, Hq, Sq) float32.
Dimension legend: B batch, Hq/Hkv query/kv heads, G = Hq / Hkv, Sq/Sk lengths, D head dim,
dc head-dim chunk (<= 128), qn query rows of a tile (<= 128), kn keys of a tile (<= 512),
slen keys of a section, s0 its first key, bn keys of a block (<= 128).

Working set: a few sections in flight plus the pass's per-head state (at most a quarter of SBUF)
plus the K^T and V caches (together at most K_CACHE_SBUF_SHARE of SBUF, else V, then K^T,
streams per section);
at most 5 of 8 PSUM banks. Measured peaks are in DESIGN.md.

Limits: dtypes bf16/fp16/fp32 (P is cast to the V dtype for P @ V; fp32 stays fp32 throughout);
D <= 256 (two head-dim chunks above 128); Sq + Sk < 2**24 (key indices are float32 in the
masks). LNC2 (``NEURON_LOGICAL_NC_CONFIG=2``): the two NeuronCores take contiguous halves of
the groups (balanced by step count) and write disjoint rows of the shared outputs.

Files: this one (kernel entry, pipeline loop, launcher), ``flash_attention_fwd_plan.py`` (compile-time work
decomposition), ``flash_attention_fwd_pipeline.py`` (stages), ``flash_attention_fwd_step.py`` (per-step tile work),
``flash_attention_fwd_values.py`` (V of a section: streamed or from the kv head's cache),
``flash_attention_fwd_state.py`` (online-softmax state, out/lse finalisation).
"""

from __future__ import annotations

import torch

from nki_lib._nki import nki, nl
from nki_lib.attention.kernels.flash_attention_fwd_pipeline import (
    close_group,
    load_k,
    load_v_of,
    stage_acc,
    stage_evict_pt,
    stage_l,
    stage_pv,
    stage_scores,
    stage_softmax,
    stage_transpose,
)
from nki_lib.attention.kernels.flash_attention_fwd_plan import (
    QUERY_SECTION_TILES,
    Ctx,
    dma_transposed_steps,
    plan_groups,
    plan_steps,
    program_share,
)
from nki_lib.attention.kernels.flash_attention_fwd_state import flush_lse, load_sinks, new_lse_batch, store_lse_rows
from nki_lib.attention.kernels.flash_attention_fwd_step import (
    PT_DVE_SHARE,
    PT_DVE_SHARE_DMA_PT,
    PT_DVE_SHARE_EARLY,
    PT_DVE_SHARE_SOFTCAP,
    PT_EARLY_UNTIL,
    warm_table,
)
from nki_lib.attention.kernels.flash_attention_fwd_values import (
    PADDED_RUN_MIN_RUNS,
    PADDED_RUNS,
    ValueCache,
    cache_bytes,
    interleave_blocks,
)
from nki_lib.attention.kernels.flash_attention_transposed_loads import as_kernel_layout, on_chip
from nki_lib.attention.kernels.tiles import (
    MAX_INDEX,
    STAT_INIT,
    KeyRows,
    MaskSpec,
    all_key_bounds,
    bounds_layout,
    head_dim_chunks,
    heads_per_pass,
    key_tile_width,
)
from nki_lib.backend import lnc_degree
from nki_lib.dispatch import KernelLaunch, Unsupported
from nki_lib.sizes import FP32_BYTES, HALF_BYTES, ceil_div

__all__ = ["launch_flash_attention_fwd", "flash_attention_fwd_kernel", "KERNEL_DTYPES"]


KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
STATE_SBUF_SHARE = 4   # per-head resident state may use 1/4 of SBUF; the rest streams K/V/S/P
SCORE_LEAD = 3         # QK^T and the row max of a step are issued this many iterations before
                       # its P^T, so the PE -> DVE -> ACT chain feeding each exp is covered
PV_LAG = 3             # P @ V of a step is issued this many iterations after its P^T (its V
                       # is loaded one iteration before the P^T), and before the iteration's
                       # transposes: those wait on the newest exp, P @ V on evictions issued two
                       # iterations earlier, so TensorE's in-order stream stalls less
ACC_LAG = 3            # the acc update of a step is issued this many iterations after its P^T
                       # (the iteration of its P @ V: the add reads O right after TensorE)
SOFTCAP_BATCH = 4      # softcap: steps whose tanh scores are issued together (2 table switches
                       # per batch, 1.3 us each on trn2); costs 3 more S sections in SBUF
DRAIN_STEPS = 4        # the last steps' P^T blocks are all evicted by VectorE: its score work is
                       # done by then, while ScalarE still has their exps (the drain)
CLOSE_LAG = 3          # a group's outputs are scaled and stored this many iterations after its
                       # last acc update: the in-order GpSimd and DMA streams would otherwise hold
                       # the next steps' neg_m and K/V loads behind the output, which waits for it
                       # (3, not 2: at dma_chunk_floor_ns=178 the stores wait on the DMA queue
                       # less, 125.7 -> 124.3 us at 4096 causal; docs/perf-log.md §12.4)
CLOSE_LAG_HEADS = 2    # the same with several query heads per pass (one output store per head
                       # per close): measured, lag 3 costs the DMA-bound GQA prefill cases 1-2 %
LSE_BATCH = 32         # lse of this many (head, query tile) pairs is finished together: one
                       # ScalarE table switch to log and back per batch, 8 B/partition each
K_CACHE_SBUF_SHARE = 4  # K^T of a whole kv head stays resident (loaded once, reused by every
                        # query tile) when it needs at most 1/4 of SBUF per partition
RAW_SCALE_MIN = 2.0 ** -20  # scales in [RAW_SCALE_MIN, 1] (no softcap) keep the scores unscaled
                            # and apply the scale in the exp: scale * MASK_FILL / 2 stays finite
                            # and far below any real score, so masked keys still give exp() = 0
KEY_SECTION_BYTES = 4096  # a step covers consecutive visible key tiles whose K^T (and V) rows
                          # hold up to this many bytes per partition, past the ~2.4 KiB where a
                          # DMA row reaches bandwidth: 4 tiles of 512 keys in bf16/fp16, 2 in fp32


@nki.jit
def flash_attention_fwd_kernel(q, k, v, sinks, doc, has_sinks, has_docs, causal, scale, window_left,
                     window_right, softcap, natural):
    """(out (B, Hq, Sq, D) in q's dtype, lse (B, Hq, Sq) float32); see the module docstring."""
    n_batch, n_q_heads = q.shape[0], q.shape[1]
    sq, d = (q.shape[2], q.shape[3]) if natural else (q.shape[3], q.shape[2])
    n_kv_heads, sk = k.shape[1], v.shape[2]
    out = nl.ndarray((n_batch, n_q_heads, sq, d), dtype=q.dtype, buffer=nl.shared_hbm)
    lse = nl.ndarray((n_batch, n_q_heads, sq), dtype=nl.float32, buffer=nl.shared_hbm)
    mask = MaskSpec(sq=sq, sk=sk, causal=causal, window_left=window_left,
                    window_right=window_right, has_docs=has_docs)
    chunks = head_dim_chunks(d)
    q_bytes = FP32_BYTES if q.dtype == nl.float32 else HALF_BYTES
    state_bytes = (len(chunks) * QUERY_SECTION_TILES * nl.tile_size.pmax * q_bytes
                   + (d + 2) * FP32_BYTES)
    group = n_q_heads // n_kv_heads
    n_pass = heads_per_pass(group, state_bytes,
                            nl.tile_size.total_available_sbuf_size // STATE_SBUF_SHARE)
    ctx = Ctx(q=q, k=k, natural=natural, v=v, sinks=sinks, has_sinks=has_sinks, d=d, chunks=chunks,
              mask=mask, key_rows=KeyRows(doc) if has_docs else None)
    ctx.sinks_sb = load_sinks(sinks, n_q_heads) if has_sinks else None
    section_keys = max(key_tile_width(), KEY_SECTION_BYTES // q_bytes)
    n_spans = ceil_div(sk, section_keys)
    k_fits = (len(chunks) * sk * q_bytes
              <= nl.tile_size.total_available_sbuf_size // K_CACHE_SBUF_SHARE)
    ctx.section_keys = section_keys
    # unscaled scores (the exp applies the scale): masked tiles are selected straight from PSUM
    exp_scale = scale if softcap == 0 and RAW_SCALE_MIN <= scale <= 1.0 else 1.0
    ctx.stat_init = STAT_INIT * exp_scale
    ctx.k_cache = [None] * n_spans if k_fits else None
    ctx.k_owner = None
    # V of the kv head stays too when K^T and V (both layouts) fit the same SBUF share
    v_fits = k_fits and (len(chunks) * sk * q_bytes + cache_bytes(sk, d, v.dtype)
                         <= nl.tile_size.total_available_sbuf_size // K_CACHE_SBUF_SHARE)
    run_keys = interleave_blocks(v.dtype) * nl.tile_size.pmax
    padded_runs = PADDED_RUNS if n_pass == 1 and softcap == 0 and sk >= PADDED_RUN_MIN_RUNS * run_keys else 0
    ctx.v_cache = (ValueCache(owner=None, natural={}, runs={}, padded_runs=padded_runs)
                   if v_fits else None)
    groups = program_share(plan_groups(mask, n_batch, n_kv_heads, group, n_pass, section_keys),
                           nl.num_programs(axes=0), nl.program_id(axis=0))
    for grp in groups:              # query sections are released after their last group here
        grp.q_sec.users = 0
    for grp in groups:
        grp.q_sec.users += 1
    steps = plan_steps(groups)
    n_steps = len(steps)
    dma_pt = (dma_transposed_steps(groups, steps, DRAIN_STEPS, padded_runs if v_fits else 0) if q_bytes == HALF_BYTES and softcap == 0
              else frozenset())
    work = [None] * n_steps
    lse_batch = new_lse_batch(lse, LSE_BATCH)

    # Software pipeline over the steps. Each engine runs its stream in program order, so
    # iteration it emits the stages of several steps, ordered so that in the steady state an
    # engine only waits on work emitted in earlier iterations (except the short neg_m -> exp
    # and QK -> row max hand-offs):
    #   load K^T(it + SCORE_LEAD + 1), V(it + 1)   evict P^T(it - 1) [ACT, DVE]
    #   softmax(it + 1) [POOL, ACT]   QK^T + scores(it + SCORE_LEAD) [PE, DVE (+ ACT tanh)]
    #   P @ V(it - PV_LAG) [PE]   P^T(it) [PE]   l, acc(it - ACC_LAG) [POOL, DVE]
    #   outputs of the groups whose last acc update was CLOSE_LAG iterations ago [POOL, DMA]
    # with softcap, the scores (tanh) of SOFTCAP_BATCH steps are issued together, so ScalarE
    # switches between the tanh and exp tables twice per batch instead of twice per step
    score_batch = SOFTCAP_BATCH if softcap > 0 else 1
    pt_dve_share = PT_DVE_SHARE_SOFTCAP if softcap > 0 else PT_DVE_SHARE_DMA_PT if dma_pt else PT_DVE_SHARE
    pt_dve_early = PT_DVE_SHARE_EARLY if dma_pt else pt_dve_share
    close_lag = CLOSE_LAG if n_pass == 1 else CLOSE_LAG_HEADS
    all_keys = all_key_bounds() if softcap == 0 and exp_scale == scale else None
    seed_sb = None
    if softcap == 0:    # with softcap the first function is tanh
        seed_sb = warm_table(nl.exp)
    load_k(ctx, groups, steps, 0)
    closing = []
    lse_rows = []   # the last lse batch's row stores, issued after the last outputs
    for it in nl.sequential_range(-SCORE_LEAD, n_steps + ACC_LAG + 1):   # + 1: the last closes
        load_k(ctx, groups, steps, it + SCORE_LEAD + score_batch)
        load_v_of(ctx, groups, steps, it + 1)
        stage_evict_pt(groups, steps, work, it - 1,
                       1.0 if it - 1 >= n_steps - DRAIN_STEPS
                       else pt_dve_early if it - 1 < PT_EARLY_UNTIL * n_steps else pt_dve_share)
        stage_softmax(groups, steps, work, it + 1, v.dtype, exp_scale)
        if it + 1 == n_steps - 1:   # ScalarE's last exp is issued: switch to log for the lse
            warm_table(nl.log, seed_sb)
        if (it + SCORE_LEAD) % score_batch == 0:
            for s in range(it + SCORE_LEAD, it + SCORE_LEAD + score_batch):
                load_k(ctx, groups, steps, s)
                stage_scores(groups, steps, work, s, scale / exp_scale, softcap, all_keys)
        stage_pv(groups, steps, work, it - PV_LAG)
        stage_transpose(groups, steps, work, it, it in dma_pt)
        lse_rows += stage_l(groups, steps, work, it - ACC_LAG, lse_batch)
        if it - ACC_LAG == n_steps - 1:     # the last step (its lse batch finished): the groups
            for pending in closing:         # finished before it are stored now, not after its
                for grp in pending:         # acc update
                    close_group(grp, out)
            closing = []
        closing.append([])
        stage_acc(groups, steps, work, it - ACC_LAG, closing[-1], softcap == 0)
        if len(closing) > close_lag:
            for grp in closing.pop(0):
                close_group(grp, out)
    for pending in closing:
        for grp in pending:
            close_group(grp, out)
    flush_lse(lse_batch)        # (empty unless the program has no step)
    store_lse_rows(lse_rows)
    return out, lse


# --------------------------------------------------------------------------- launcher

def launch_flash_attention_fwd(q, k, v, sinks, key_bounds, *, causal, scale, window_left, window_right, softcap):
    """The launch of :func:`flash_attention_fwd_kernel` for ``nki::flash_attention`` (arguments already
    validated, ``scale`` resolved; ``key_bounds`` (B, 2, Sq) float32 or None and the flags from
    ``key_bounds.plan``); it returns ``(out (B, Hq, Sq, D) in q's dtype, lse (B, Hq, Sq)
    float32)``. Raises :class:`Unsupported` for what the kernel cannot serve."""
    if q.dtype not in KERNEL_DTYPES:
        raise Unsupported(f"dtype {q.dtype} (the kernel handles bfloat16, float16, float32)")
    sq, sk = q.shape[2], k.shape[2]
    if sq + sk >= MAX_INDEX:
        raise Unsupported(f"Sq + Sk = {sq + sk} >= 2**24 (key indices are float32 in the kernel)")
    natural = on_chip(q)   # q^T / k^T by DMA transposes of the natural rows, else host transposes
    sinks_c = None if sinks is None else sinks.contiguous()
    return KernelLaunch(flash_attention_fwd_kernel,
                        (as_kernel_layout(q, natural), as_kernel_layout(k, natural), v.contiguous(), sinks_c,
                         None if key_bounds is None else bounds_layout(key_bounds), sinks is not None,
                         key_bounds is not None, bool(causal), float(scale), int(window_left),
                         int(window_right), float(softcap), natural),
                        grid=lnc_degree())
