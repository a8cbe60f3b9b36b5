"""Pipeline stages of the flash-attention forward kernel (``flash_attention_fwd.py``): each stage emits the
instructions of one step (index ``s`` into the planned steps) and hands its tiles to the next
stage through ``work[s]``; the kernel's loop issues the stages of different steps in one
iteration (software pipeline, see ``flash_attention_fwd.py``).
"""

from __future__ import annotations

from nki_lib._nki import nisa, nl
from nki_lib.attention.kernels.flash_attention_fwd_plan import section_span
from nki_lib.attention.kernels.flash_attention_fwd_state import add_lse, flush_lse, init_state, store_out
from nki_lib.attention.kernels.flash_attention_fwd_step import (
    dma_transpose_p,
    evict_pt,
    natural_suffix,
    p_times_v,
    section_scores,
    softmax_step,
    transpose_p,
)
from nki_lib.attention.kernels.flash_attention_fwd_values import cached_v, load_v, padded_width
from nki_lib.attention.kernels.flash_attention_transposed_loads import load_transposed, load_transposed_into
from nki_lib.attention.kernels.tiles import row_bounds

__all__ = ["load_k", "section_k", "load_v_of", "stage_scores", "stage_softmax", "stage_transpose",
           "stage_evict_pt", "stage_pv", "stage_l", "stage_acc", "close_group"]


FIRST_K_KEYS = 512  # with two padded V runs (flash_attention_fwd_values.PADDED_RUNS: one long
                   # single-head kv head, whose start waits for its first loads) the kernel's first
                   # K^T span is loaded by two DMA transposes, its first FIRST_K_KEYS keys first, so
                   # the first QK^T waits for a quarter of the span (4096 causal 108.4 / 106.0 ->
                   # 107.6 / 105.3 us, every corner better; elsewhere the extra DMA chunk per
                   # partition cost more than it saved, docs/perf-log.md §16.3)


def load_k(ctx, groups, steps, s):
    """Issue the loads step s needs first: open its group (q^T, state init, mask bounds) and
    load the K^T of its key section (once per section, shared by the heads of the pass)."""
    if s < 0 or s >= len(steps):
        return
    gi, si, _ = steps[s]
    grp = groups[gi]
    if grp.states is None:
        sec = grp.q_sec
        if sec.tiles is None:
            sec.tiles = [load_transposed(ctx.q, ctx.natural, grp.b, h, sec.q0, sec.length, ctx.chunks)
                         for h in grp.heads]
        off = grp.q0 - sec.q0
        grp.q_tiles = [[q_sb[:, off:off + grp.qn] for q_sb in head_tiles]
                       for head_tiles in sec.tiles]
        grp.states = [init_state(ctx.sinks_sb, h, grp.qn, ctx.d, ctx.has_sinks,
                                 len(grp.sections) == 0, ctx.stat_init) for h in grp.heads]
        grp.k = [None] * len(grp.sections)
        grp.v = [None] * len(grp.sections)
        if any(masked for _, _, masked in grp.plan):
            grp.bounds = row_bounds(ctx.mask, grp.q0, grp.qn, ctx.key_rows, grp.b)
    if si >= 0 and grp.k[si] is None:
        s0, slen, _ = section_span(grp, si)
        grp.k[si] = section_k(ctx, grp, s0, slen)


def section_k(ctx, grp, s0, slen):
    """K^T tiles (dc, slen) of the keys [s0, s0 + slen) of a section of ``grp``.

    With ``ctx.k_cache`` (K^T of the whole key range fits its SBUF budget) K^T is loaded once
    per (batch, kv head) in aligned spans of ``ctx.section_keys`` keys, one DMA per span and
    chunk (the kernel's first span in two, ``FIRST_K_KEYS`` first, with two padded V runs), and
    every query tile and head of that kv head slices it; the cache is dropped when the kv head
    changes. Without it, each group loads its own sections."""
    if ctx.k_cache is None:
        return load_transposed(ctx.k, ctx.natural, grp.b, grp.hk, s0, slen, ctx.chunks)
    first_load = ctx.k_owner is None
    if ctx.k_owner != (grp.b, grp.hk):
        ctx.k_cache = [None] * len(ctx.k_cache)
        ctx.k_owner = (grp.b, grp.hk)
    a = s0 // ctx.section_keys
    a0 = a * ctx.section_keys
    if ctx.k_cache[a] is None:
        span = min(ctx.mask.sk, a0 + ctx.section_keys) - a0
        split = (first_load and ctx.v_cache is not None and ctx.v_cache.padded_runs >= 2
                 and s0 - a0 < FIRST_K_KEYS < span)
        cuts = (0, FIRST_K_KEYS, span) if split else (0, span)   # split: the span's head comes first
        ctx.k_cache[a] = []
        for c0, dc in ctx.chunks:
            k_sb = nl.ndarray((dc, span), dtype=ctx.k.dtype, buffer=nl.sbuf)
            for h0, h1 in zip(cuts, cuts[1:]):
                load_transposed_into(k_sb[:, h0:h1], ctx.k, ctx.natural, grp.b, grp.hk,
                                     a0 + h0, h1 - h0, c0, dc)
            ctx.k_cache[a].append(k_sb)
    return [k_sb[:, s0 - a0:s0 - a0 + slen] for k_sb in ctx.k_cache[a]]


def load_v_of(ctx, groups, steps, s):
    """Load the V of step s's key section (once per section): from the kv head's V cache when
    ``ctx.v_cache`` is set (each key loaded once per kv head), else streamed for the section."""
    if real(steps, s):
        gi, si, _ = steps[s]
        grp = groups[gi]
        if grp.v[si] is None:
            s0, slen, _ = section_span(grp, si)
            if ctx.v_cache is None:
                grp.v[si] = load_v(ctx.v, grp.b, grp.hk, s0, slen)
            else:
                grp.v[si] = cached_v(ctx.v, ctx.v_cache, grp.b, grp.hk, s0, slen)


class Work(nl.NKIObject):
    """In-flight tiles of one step between pipeline stages (dropped as soon as consumed)."""
    s_sb: object           # scores (qn, slen) fp32
    rowmax: object         # (qn, 1) section row max
    p_sb: object           # probabilities (qn, slen)
    alpha: object          # (qn, 1) rescale of the previous state
    rowsum: object         # (qn, 1) section row sums
    p_width: int           # columns of P (the section, or a padded V run's end)
    pt_cols: int           # P columns transposed on TensorE (the rest by DMA)
    pt_psum: object        # P^T in PSUM
    pt_sb: object          # P^T in SBUF
    o_psum: object         # P V (qn, D) in PSUM


def real(steps, s):
    """Step s exists and computes something (not past the ends, not a keyless group)."""
    return 0 <= s < len(steps) and steps[s][1] >= 0


def stage_scores(groups, steps, work, s, scale, softcap, all_keys=None):
    """A: final scores of step s in SBUF and their row max: per score tile QK^T into one PSUM
    bank [PE], then its evict/scale/mask/max [DVE/ACT]; drops K^T after the last head."""
    if real(steps, s):
        gi, si, hi = steps[s]
        grp = groups[gi]
        s0, _, sub_tiles = section_span(grp, si)
        s_sb, rowmax = section_scores(grp.q_tiles[hi], grp.k[si], sub_tiles, s0, scale,
                                        softcap, grp.bounds, all_keys)
        work[s] = Work(s_sb=s_sb, rowmax=rowmax)
        if hi == len(grp.heads) - 1:
            grp.k[si] = None


def stage_softmax(groups, steps, work, s, p_dtype, exp_scale):
    """B1: online-softmax statistics and P of step s [DVE/ACT]."""
    if real(steps, s):
        gi, _, hi = steps[s]
        w = work[s]
        gi, si, hi = steps[s]
        width = padded_width(groups[gi].v[si], w.s_sb.shape[1])
        w.p_sb, w.alpha, w.rowsum = softmax_step(groups[gi].states[hi], w.s_sb, w.rowmax,
                                                 p_dtype, exp_scale, width)
        w.s_sb, w.rowmax = None, None


def stage_transpose(groups, steps, work, s, dma_pt=False):
    """B2a: P^T of step s in PSUM [PE], its blocks in the order of the section's V blocks; with
    ``dma_pt`` (and V in natural blocks) P^T straight to SBUF by one DMA transpose [DMA], which
    leaves :func:`stage_evict_pt` nothing to do."""
    if real(steps, s):
        gi, si, _ = steps[s]
        v_blocks = groups[gi].v[si]
        w = work[s]
        width = w.p_sb.shape[1]
        j0 = natural_suffix(w.p_sb.dtype, v_blocks, width) if dma_pt else len(v_blocks)
        w.pt_cols = width
        if j0 < len(v_blocks):
            w.pt_sb = dma_transpose_p(w.p_sb, j0)
            w.pt_cols = j0 * nl.tile_size.pmax
        if j0 > 0:
            w.pt_psum = transpose_p(w.p_sb, v_blocks[:j0])
        w.p_width = width
        w.p_sb = None


def stage_evict_pt(groups, steps, work, s, dve_share):
    """B2b: P^T of step s to SBUF [ACT]."""
    if real(steps, s):
        gi, si, _ = steps[s]
        w = work[s]
        if w.pt_psum is not None:
            w.pt_sb = evict_pt(w.pt_psum, w.pt_cols, dve_share, w.pt_sb)
        w.pt_psum = None


def stage_pv(groups, steps, work, s):
    """B2c: O = P @ V of step s [PE]; drops the K/V tile after the group's last head."""
    if real(steps, s):
        gi, si, hi = steps[s]
        grp = groups[gi]
        w = work[s]
        w.o_psum = p_times_v(w.pt_sb, grp.v[si])
        w.pt_sb = None
        if hi == len(grp.heads) - 1:
            grp.v[si] = None


def stage_l(groups, steps, work, s, lse_batch):
    """B3a: l = alpha * l + rowsum of step s [GpSimd]; after a head's last section (every head of a
    keyless group) its lse is queued in ``lse_batch`` (l and neg_m are final then), and at the
    program's last step the batch is finished at once (``flush_lse`` with ``last``), so that the
    lse chain overlaps the last P @ V and output instead of following them. Returns the lse row
    stores left for after the last outputs (``flush_lse``), else []."""
    if s < 0 or s >= len(steps):
        return []
    gi, si, hi = steps[s]
    grp = groups[gi]
    if si >= 0:
        w = work[s]
        state = grp.states[hi]
        if w.alpha is None:     # fresh state: l = 0 + rowsum
            state.l = w.rowsum
        else:
            nisa.tensor_scalar(dst=state.l, data=state.l, op0=nl.multiply, operand0=w.alpha,
                               op1=nl.add, operand1=w.rowsum, engine=nisa.engine.gpsimd)
    last = s == len(steps) - 1
    if si == len(grp.sections) - 1:
        for i in (range(len(grp.heads)) if si < 0 else (hi,)):
            add_lse(lse_batch, grp.states[i], grp.b, grp.heads[i], grp.q0, not last)
    return flush_lse(lse_batch, last=True) if last else []


def stage_acc(groups, steps, work, s, closing, copy_on_scalar=True):
    """B3b: acc = alpha * acc [GpSimd] + O [DVE] of step s (after :func:`stage_l`);
    ``copy_on_scalar``: the first section's ``acc = O`` copy runs on ScalarE (else VectorE);
    queues the group in ``closing`` after its last step (its outputs are stored later,
    :func:`close_group`, so that the in-order GpSimd stream does not hold the next steps' neg_m
    behind the output scaling, which waits for this acc update)."""
    if s < 0 or s >= len(steps):
        return
    gi, si, hi = steps[s]
    grp = groups[gi]
    if si >= 0:
        w = work[s]
        state = grp.states[hi]
        if si == 0 and copy_on_scalar:  # first section: acc is unset, alpha * 0 + O = O
            nisa.activation(dst=state.acc, op=nl.copy, data=w.o_psum)
        elif si == 0:   # (on VectorE when ScalarE is the busier engine: softcap's tanh)
            nisa.tensor_copy(dst=state.acc, src=w.o_psum)
        else:           # alpha * acc on GpSimd (SBUF only), + O on VectorE (one PSUM pass)
            nisa.tensor_scalar(dst=state.acc, data=state.acc, op0=nl.multiply, operand0=w.alpha,
                               engine=nisa.engine.gpsimd)
            nisa.tensor_tensor(dst=state.acc, data1=state.acc, data2=w.o_psum, op=nl.add)
        work[s] = None
    if si == len(grp.sections) - 1 and (si < 0 or hi == len(grp.heads) - 1):
        closing.append(grp)


def close_group(grp, out):
    """Store the group's outputs now (its lse was queued by :func:`stage_l`)."""
    for i in range(len(grp.heads)):
        store_out(grp.states[i], out, grp.b, grp.heads[i], grp.q0)
    grp.q_sec.users -= 1
    if grp.q_sec.users == 0:
        grp.q_sec.tiles = None
    grp.q_tiles, grp.states, grp.bounds, grp.k, grp.v = None, None, None, None, None
