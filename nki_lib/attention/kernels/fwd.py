"""Flash-attention forward NKI kernel (online softmax) and its launcher ``flash_fwd``.

Algorithm (FlashAttention-2 forward, api-contract §3 semantics). For every query tile the kernel
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
    section = run of consecutive visible key tiles (kn <= 512 each) of the group's plan, at most
              KEY_SECTION_BYTES of K^T per partition row (2048 keys in bf16/fp16, 1024 in fp32)
    step    = (group, section, query head of the pass)

Key tiles no query of the tile can see are skipped (``tiles.plan_row``); masks (one VectorE
``range_select`` against per-row key bounds) are applied to partial tiles only. The query heads
of a pass share each K/V load (GQA/MQA without duplicating K/V).

Per step (engines in brackets)::

    per score tile of the section:
      S (qn, kn) PSUM = sum over D chunks of matmul(q^T (dc, qn), k^T (dc, kn))          [PE]
      -> S_sec SBUF fp32: scale (+ tanh softcap) (+ mask) + partial row max            [DVE/ACT]
    row max of the section; neg_m, alpha; P = exp(S_sec - m) (qn, slen) in the P dtype with
      the row sum fused                                                                  [DVE, ACT]
    P^T: one TensorE transpose per 128-key block into bank-sized PSUM tiles, evicted by
      ScalarE                                                                            [PE, ACT]
    O (qn, D) PSUM = sum over the section's blocks of matmul(P^T (bn, qn), V (bn, D))     [PE]
    l = alpha * l + rowsum;  acc = alpha * acc + O                                       [DVE]

The steps run as a software pipeline (each engine executes its instruction stream in order):
iteration ``it`` loads the K^T of step ``it + SCORE_LEAD + 1`` and the V of ``it + 1``, issues
the softmax of ``it + 1``, QK^T and scores of ``it + SCORE_LEAD``, the transposes of ``it``, the
P^T eviction of ``it - 1``, P @ V of ``it - PV_LAG`` and the l/acc update of ``it - ACC_LAG``.
Every tile is a fresh allocation, so loads of later steps overlap compute (multi-buffering). A
group's output is stored after its last acc update; lse is finished in batches of ``LSE_BATCH``
(one ScalarE log per batch, a TensorE transpose so each row is stored contiguously).

DMA layouts: q^T/k^T tiles read contiguous rows of the launcher's (D, S) layouts (q^T one DMA
per head for QUERY_SECTION_TILES consecutive query tiles, K^T one DMA per section); V of a
section is read "interleaved" (partition p of block j holds key ``s0 + n_full * p + j``) so
every partition reads one contiguous run of ``n_full * D`` elements, and the transposes pick
the matching strided columns of P.

Shapes (HBM, prepared by the launcher; transposes are layout glue): q_t (B, Hq, D, Sq),
k_t (B, Hkv, D, Sk), v (B, Hkv, Sk, D), sinks (Hq,) float32, doc (2, S) float32 with the first
and last position of each position's document (cu_seqlens). Outputs: out (B, Hq, Sq, D) in q's
dtype, lse (B, Hq, Sq) float32.
Dimension legend: B batch, Hq/Hkv query/kv heads, G = Hq / Hkv, Sq/Sk lengths, D head dim,
dc head-dim chunk (<= 128), qn query rows of a tile (<= 128), kn keys of a tile (<= 512),
slen keys of a section, s0 its first key, bn keys of a block (<= 128).

Working set: independent of Sq and Sk (a few sections in flight plus the pass's per-head state,
at most a quarter of SBUF); at most 5 of 8 PSUM banks. Measured peaks are in DESIGN.md.

Limits: dtypes bf16/fp16/fp32 (P is cast to the V dtype for P @ V; fp32 stays fp32 throughout);
D <= 256 (two head-dim chunks above 128); Sq + Sk < 2**24 (key indices are float32 in the
masks). LNC2 (``NEURON_LOGICAL_NC_CONFIG=2``): the two NeuronCores take contiguous halves of
the groups (balanced by step count) and write disjoint rows of the shared outputs.
"""

from __future__ import annotations

import torch

from nki_lib._nki import nisa, nki, nl
from nki_lib.attention.kernels.tiles import (MAX_INDEX, STAT_INIT, MaskSpec, document_bounds,
                                             head_dim_chunks, heads_per_pass, key_blocks,
                                             key_tile_width, mask_scores, plan_row, query_tiles,
                                             row_bounds)
from nki_lib.backend import lnc_degree
from nki_lib.dispatch import Unsupported, call_kernel

__all__ = ["flash_fwd", "flash_fwd_kernel", "KERNEL_DTYPES"]

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
STATE_SBUF_SHARE = 4   # per-head resident state may use 1/4 of SBUF; the rest streams K/V/S/P
_FP32_BYTES = 4
_HALF_BYTES = 2        # bfloat16 / float16
SCORE_LEAD = 3         # QK^T and the row max of a step are issued this many iterations before
                       # its P^T, so the PE -> DVE -> ACT chain feeding each exp is covered
PV_LAG = 2             # P @ V of a step is issued this many iterations after its P^T (its V
                       # is loaded one iteration before the P^T)
ACC_LAG = 3            # the acc update of a step is issued this many iterations after its P^T
QUERY_SECTION_TILES = 4  # q^T of this many consecutive query tiles is loaded by one DMA per head
                         # (1 KiB rows in bf16 instead of 256 B)
LSE_BATCH = 32         # lse of this many (head, query tile) pairs is finished together: one
                       # ScalarE table switch to log and back per batch, 8 B/partition each
KEY_SECTION_BYTES = 4096  # a step covers consecutive visible key tiles whose K^T (and V) rows
                          # hold up to this many bytes per partition, past the ~2.4 KiB where a
                          # DMA row reaches bandwidth: 4 tiles of 512 keys in bf16/fp16, 2 in fp32


# --------------------------------------------------------------------------- kernel helpers

class _RowState(nl.NKIObject):
    """Online-softmax state of one query head over one query tile (all fp32 SBUF)."""
    neg_m: object   # (qn, 1) -running max
    l: object       # (qn, 1) running denominator  # noqa: E741
    acc: object     # (qn, D) unnormalised output


def _load_q(q_t, b, h, q0, qn, chunks):
    """q^T tiles (dc, qn) of head h for the queries [q0, q0 + qn), one per head-dim chunk."""
    q_tiles = []
    for c0, dc in chunks:
        q_sb = nl.ndarray((dc, qn), dtype=q_t.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=q_sb, src=q_t[b, h, c0:c0 + dc, q0:q0 + qn])
        q_tiles.append(q_sb)
    return q_tiles


def _load_k_section(k_t, b, hk, s0, slen, chunks):
    """k^T tiles (dc, slen) per head-dim chunk for the keys [s0, s0 + slen) of a key section."""
    k_tiles = []
    for c0, dc in chunks:
        k_sb = nl.ndarray((dc, slen), dtype=k_t.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=k_sb, src=k_t[b, hk, c0:c0 + dc, s0:s0 + slen])
        k_tiles.append(k_sb)
    return k_tiles


def _load_v(v, b, hk, k0, kn):
    """V of the keys [k0, k0 + kn) as (128, blocks, D) in the interleaved layout of
    :func:`_block_keys` (one contiguous HBM run of ``n_full * D`` elements per partition)."""
    _, hkv, sk, d = v.shape
    pmax = nl.tile_size.pmax
    blocks = key_blocks(kn)
    v_sb = nl.ndarray((pmax, len(blocks), d), dtype=v.dtype, buffer=nl.sbuf)
    n_full = kn // pmax
    if n_full > 0:
        first = ((b * hkv + hk) * sk + k0) * d
        nisa.dma_copy(dst=v_sb[:, 0:n_full, :],
                      src=v.ap(pattern=[[n_full * d, pmax], [d, n_full], [1, d]], offset=first))
    if n_full < len(blocks):
        j0, bn = blocks[n_full]
        nisa.dma_copy(dst=v_sb[0:bn, n_full, :], src=v[b, hk, k0 + j0:k0 + j0 + bn, :])
    return v_sb


def _block_keys(p_sb, j, n_full):
    """Columns of P (qn, kn) that block j of V holds on its partitions. The n_full full blocks
    interleave: partition p of block j is key ``n_full * p + j`` (so each partition's V rows are
    one contiguous HBM run); the remainder block holds the last ``kn % 128`` keys in order."""
    pmax = nl.tile_size.pmax
    if j < n_full:
        return p_sb[:, j:n_full * pmax:n_full]
    return p_sb[:, n_full * pmax:p_sb.shape[1]]


def _init_state(sinks, h, qn, d, has_sinks):
    neg_m = nl.ndarray((qn, 1), dtype=nl.float32, buffer=nl.sbuf)
    l_sb = nl.ndarray((qn, 1), dtype=nl.float32, buffer=nl.sbuf)
    if has_sinks:
        sink_sb = nl.ndarray((qn, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=sink_sb, src=sinks.ap(pattern=[[0, qn], [1, 1]], offset=h))
        nisa.tensor_scalar(dst=neg_m, data=sink_sb, op0=nl.maximum, operand0=STAT_INIT,
                           op1=nl.multiply, operand1=-1.0)
        nisa.activation(dst=l_sb, op=nl.exp, data=sink_sb, bias=neg_m)
    else:
        nisa.memset(dst=neg_m, value=-STAT_INIT)
        nisa.memset(dst=l_sb, value=0.0)
    acc = nl.ndarray((qn, d), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=acc, value=0.0)
    return _RowState(neg_m=neg_m, l=l_sb, acc=acc)


def _qk(q_tiles, k_tiles, qn, kn):
    """Raw scores (qn, kn) fp32 PSUM = q @ k^T, accumulated over the head-dim chunks [PE]."""
    s_psum = nl.ndarray((qn, kn), dtype=nl.float32, buffer=nl.psum)
    for c in range(len(q_tiles)):
        nisa.nc_matmul(dst=s_psum, stationary=q_tiles[c], moving=k_tiles[c], accumulate=c > 0)
    return s_psum


def _section_scores(q_tiles, k_tiles, sub_tiles, s0, scale, softcap, bounds):
    """Final scores (qn, slen) fp32 in SBUF of a key section and their row max (qn, 1).

    Per score tile (``sub_tiles`` = ``((k0, kn, masked), ...)``): QK^T into one PSUM bank, then
    one evict: scaled, capped, masked on partial tiles only, giving a partial row max; unmasked
    tiles take one VectorE tensor_scalar_reduce (evict + scale + max). The PSUM tile is released
    right after its evict, so at most two score banks are live."""
    qn = q_tiles[0].shape[1]
    slen = sub_tiles[-1][0] + sub_tiles[-1][1] - s0
    s_sb = nl.ndarray((qn, slen), dtype=nl.float32, buffer=nl.sbuf)
    partial_max = nl.ndarray((qn, len(sub_tiles)), dtype=nl.float32, buffer=nl.sbuf)
    for i, (k0, kn, masked) in enumerate(sub_tiles):
        s_tile = s_sb[:, k0 - s0:k0 - s0 + kn]
        tile_max = partial_max[:, i:i + 1]
        s_psum = _qk(q_tiles, [k_sb[:, k0 - s0:k0 - s0 + kn] for k_sb in k_tiles], qn, kn)
        src, factor = s_psum, scale
        if softcap > 0:
            nisa.activation(dst=s_tile, op=nl.tanh, data=src, scale=scale / softcap)
            src, factor = s_tile, softcap
        if masked:
            if softcap > 0:
                nisa.tensor_scalar(dst=s_tile, data=src, op0=nl.multiply, operand0=factor)
            else:
                nisa.activation(dst=s_tile, op=nl.copy, data=src, scale=factor)
            mask_scores(s_tile, bounds[0], bounds[1], k0, tile_max)
        else:
            nisa.tensor_scalar_reduce(dst=s_tile, data=src, op0=nl.multiply, operand0=factor,
                                      reduce_op=nl.maximum, reduce_res=tile_max)
    if len(sub_tiles) == 1:
        return s_sb, partial_max
    rowmax = nl.ndarray((qn, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=rowmax, op=nl.maximum, data=partial_max, axis=1)
    return s_sb, rowmax


def _softmax_step(state, s_sb, rowmax, p_dtype):
    """Update neg_m with the section; returns P = exp(s - m_new) (qn, slen), alpha = exp(m - m_new)
    and the row sum of P (qn, 1) (l is updated later, with acc, by :func:`_stage_acc`)."""
    qn, slen = s_sb.shape
    neg_m_new = nl.ndarray((qn, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=neg_m_new, data=rowmax, op0=nl.multiply, operand0=-1.0,
                       op1=nl.minimum, operand1=state.neg_m)
    alpha = nl.ndarray((qn, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=alpha, op=nl.exp, data=state.neg_m, scale=-1.0, bias=neg_m_new)
    p_sb = nl.ndarray((qn, slen), dtype=p_dtype, buffer=nl.sbuf)
    rowsum = nl.ndarray((qn, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=p_sb, op=nl.exp, data=s_sb, bias=neg_m_new, reduce_op=nl.add,
                    reduce_res=rowsum, reduce_cmd=nisa.reduce_cmd.reset_reduce)
    state.neg_m = neg_m_new
    return p_sb, alpha, rowsum


def _transpose_p(p_sb):
    """P^T in PSUM: one TensorE transpose per 128-key block of P (qn, slen), taking the block's
    key columns (:func:`_block_keys`); blocks are grouped into PSUM tiles of one bank each.
    Returns ``((first block, pt_psum (128, blocks, qn)), ...)``."""
    qn, slen = p_sb.shape
    pmax = nl.tile_size.pmax
    blocks = key_blocks(slen)
    n_full = slen // pmax
    p_bytes = _FP32_BYTES if p_sb.dtype == nl.float32 else _HALF_BYTES
    per_bank = max(1, nl.tile_size.psum_fmax * _FP32_BYTES // (pmax * p_bytes))
    pt_tiles = []
    for j0 in range(0, len(blocks), per_bank):
        nb = min(per_bank, len(blocks) - j0)
        pt_psum = nl.ndarray((pmax, nb, qn), dtype=p_sb.dtype, buffer=nl.psum)
        for j in range(j0, j0 + nb):
            nisa.nc_transpose(dst=pt_psum[0:blocks[j][1], j - j0, :],
                              data=_block_keys(p_sb, j, n_full), engine=nisa.engine.tensor)
        pt_tiles.append((j0, pt_psum))
    return pt_tiles


def _evict_pt(pt_tiles, slen):
    """P^T to SBUF (128, blocks, qn) on ScalarE, one instruction per PSUM tile (the remainder
    block only its rows)."""
    pmax = nl.tile_size.pmax
    n_blocks = len(key_blocks(slen))
    n_full = slen // pmax
    qn = pt_tiles[0][1].shape[2]
    pt_sb = nl.ndarray((pmax, n_blocks, qn), dtype=pt_tiles[0][1].dtype, buffer=nl.sbuf)
    for j0, pt_psum in pt_tiles:
        full = min(n_full, j0 + pt_psum.shape[1]) - j0
        if full > 0:
            nisa.activation(dst=pt_sb[:, j0:j0 + full, :], op=nl.copy, data=pt_psum[:, 0:full, :])
        if full < pt_psum.shape[1]:
            bn = slen - n_full * pmax
            nisa.activation(dst=pt_sb[0:bn, n_full, :], op=nl.copy,
                            data=pt_psum[0:bn, n_full - j0, :])
    return pt_sb


def _p_times_v(pt_sb, v_sb, slen):
    """O (qn, D) fp32 PSUM = P @ V, contracting the 128-key blocks of P^T on TensorE."""
    qn = pt_sb.shape[2]
    o_psum = nl.ndarray((qn, v_sb.shape[2]), dtype=nl.float32, buffer=nl.psum)
    for j, (_, bn) in enumerate(key_blocks(slen)):
        nisa.nc_matmul(dst=o_psum, stationary=pt_sb[0:bn, j, :], moving=v_sb[0:bn, j, :],
                       accumulate=j > 0)
    return o_psum


def _store_out(state, out, b, h, q0):
    """out = acc / max(l, 1) (rows with l = 0 have acc = 0 and get 0); frees acc."""
    qn, d = state.acc.shape
    l_safe = nl.ndarray((qn, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=l_safe, data=state.l, op0=nl.maximum, operand0=1.0)
    recip = nl.ndarray((qn, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.reciprocal(dst=recip, data=l_safe)
    out_sb = nl.ndarray((qn, d), dtype=out.dtype, buffer=nl.sbuf)
    nisa.activation(dst=out_sb, op=nl.copy, data=state.acc, scale=recip)
    nisa.dma_copy(dst=out[b, h, q0:q0 + qn, :], src=out_sb)
    state.acc = None


def _store_lse_batch(pending, lse):
    """lse = log(max(l, 1)) + m for a batch of (state, b, h, q0); rows with l = 0 get -inf.

    The statistics are gathered as columns of one (128, n) tile so that the ScalarE log runs
    once per batch, then transposed on TensorE so that each (head, query tile) is stored as one
    contiguous row (a single-partition DMA) instead of qn 4-byte pieces."""
    pmax = nl.tile_size.pmax
    n = len(pending)
    l_all = nl.ndarray((pmax, n), dtype=nl.float32, buffer=nl.sbuf)
    neg_m_all = nl.ndarray((pmax, n), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=l_all, value=0.0)
    nisa.memset(dst=neg_m_all, value=0.0)
    for i in range(n):
        state = pending[i][0]
        qn = state.l.shape[0]
        nisa.tensor_copy(dst=l_all[0:qn, i:i + 1], src=state.l)
        nisa.tensor_copy(dst=neg_m_all[0:qn, i:i + 1], src=state.neg_m)
    l_safe = nl.ndarray((pmax, n), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=l_safe, data=l_all, op0=nl.maximum, operand0=1.0)
    lse_all = nl.ndarray((pmax, n), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=lse_all, op=nl.log, data=l_safe)
    nisa.tensor_tensor(dst=lse_all, data1=lse_all, data2=neg_m_all, op=nl.subtract)
    empty = nl.ndarray((pmax, n), dtype=nl.uint8, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=empty, data=l_all, op0=nl.equal, operand0=0.0)
    neg_inf = nl.ndarray((pmax, n), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=neg_inf, value=float("-inf"))
    nisa.tensor_copy_predicated(dst=lse_all, src=neg_inf, predicate=empty)
    lse_t_psum = nl.ndarray((n, pmax), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_transpose(dst=lse_t_psum, data=lse_all, engine=nisa.engine.tensor)
    lse_t = nl.ndarray((n, pmax), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=lse_t, src=lse_t_psum)
    for i in range(n):
        state, b, h, q0 = pending[i]
        qn = state.l.shape[0]
        nisa.dma_copy(dst=lse[b, h, q0:q0 + qn], src=lse_t[i:i + 1, 0:qn])


# --------------------------------------------------------------------------- schedule

class _Ctx(nl.NKIObject):
    """Kernel-wide inputs, outputs and compile-time flags, passed to the step helpers."""


class _QuerySection(nl.NKIObject):
    """q^T of up to QUERY_SECTION_TILES consecutive query tiles of the same heads, loaded by one
    DMA per head and chunk, shared by the groups of those tiles (released after the last)."""


class _Group(nl.NKIObject):
    """One query tile [q0, q0 + qn) of one pass over (part of) the GQA group of kv head hk: the
    query heads it serves, its key-tile plan, and once opened its resident tiles."""


def _plan_groups(mask, n_batch, n_kv_heads, group, n_pass, section_keys):
    q_spans = query_tiles(mask.sq)
    n_tiles = len(q_spans)
    groups = []
    for b in range(n_batch):
        for hk in range(n_kv_heads):
            passes = [tuple(hk * group + g for g in range(g0, min(group, g0 + n_pass)))
                      for g0 in range(0, group, n_pass)]
            q_secs = []
            for t0 in range(0, n_tiles, QUERY_SECTION_TILES):
                t1 = min(n_tiles, t0 + QUERY_SECTION_TILES)
                first = q_spans[t0][0]
                span = q_spans[t1 - 1][0] + q_spans[t1 - 1][1] - first
                q_secs.append([_QuerySection(q0=first, length=span, users=0, tiles=None)
                               for _ in passes])
            for t, (q0, qn) in enumerate(q_spans):
                plan = plan_row(mask, q0, qn)
                for pi, heads in enumerate(passes):
                    groups.append(_Group(b=b, hk=hk, q0=q0, qn=qn, heads=heads, plan=plan,
                                         sections=_key_sections(plan, section_keys),
                                         q_sec=q_secs[t // QUERY_SECTION_TILES][pi],
                                         q_tiles=None, states=None, bounds=None, k=None, v=None))
    return groups


def _key_sections(plan, max_keys):
    """Key sections of a plan: runs of consecutive visible tiles (adjacent keys, at most
    ``max_keys``), the unit of one step. Returns ``((first tile, last tile), ...)``."""
    sections = []
    for ti in range(len(plan)):
        if len(sections) > 0:
            first, last = sections[-1]
            adjacent = plan[last][0] + plan[last][1] == plan[ti][0]
            if adjacent and plan[ti][0] + plan[ti][1] - plan[first][0] <= max_keys:
                sections[-1] = (first, ti)
                continue
        sections.append((ti, ti))
    return tuple(sections)


def _program_share(groups, n_prog, pid):
    """The contiguous run of groups program ``pid`` of ``n_prog`` (LNC2: one per NeuronCore)
    serves, cut so that every program gets about the same number of steps (causal rows differ)."""
    work = [max(1, len(grp.plan) * len(grp.heads)) for grp in groups]   # score tiles
    total = sum(work)
    lo, hi, done = 0, 0, 0
    for i in range(len(groups)):
        if done * n_prog < total * pid:
            lo = i + 1
        if done * n_prog < total * (pid + 1):
            hi = i + 1
        done += work[i]
    return groups[lo:hi]


def _plan_steps(groups):
    """Program order of the work: ``(group, key section, head)`` per step; a group with no
    visible key tile gets one step ``(group, -1, -1)`` (it only initialises and stores)."""
    steps = []
    for gi, grp in enumerate(groups):
        if len(grp.sections) == 0:
            steps.append((gi, -1, -1))
        for si in range(len(grp.sections)):
            for hi in range(len(grp.heads)):
                steps.append((gi, si, hi))
    return tuple(steps)


def _section_span(grp, si):
    """(first key, number of keys, its score tiles) of key section si of a group."""
    first, last = grp.sections[si]
    s0 = grp.plan[first][0]
    return s0, grp.plan[last][0] + grp.plan[last][1] - s0, grp.plan[first:last + 1]


def _load_k(ctx, groups, steps, s):
    """Issue the loads step s needs first: open its group (q^T, state init, mask bounds) and
    load the K^T of its key section (once per section, shared by the heads of the pass)."""
    if s < 0 or s >= len(steps):
        return
    gi, si, _ = steps[s]
    grp = groups[gi]
    if grp.states is None:
        sec = grp.q_sec
        if sec.tiles is None:
            sec.tiles = [_load_q(ctx.q_t, grp.b, h, sec.q0, sec.length, ctx.chunks)
                         for h in grp.heads]
        off = grp.q0 - sec.q0
        grp.q_tiles = [[q_sb[:, off:off + grp.qn] for q_sb in head_tiles]
                       for head_tiles in sec.tiles]
        grp.states = [_init_state(ctx.sinks, h, grp.qn, ctx.d, ctx.has_sinks) for h in grp.heads]
        grp.k = [None] * len(grp.sections)
        grp.v = [None] * len(grp.sections)
        if any(masked for _, _, masked in grp.plan):
            grp.bounds = row_bounds(ctx.mask, grp.q0, grp.qn, ctx.doc_lo, ctx.doc_hi)
    if si >= 0 and grp.k[si] is None:
        s0, slen, _ = _section_span(grp, si)
        grp.k[si] = _load_k_section(ctx.k_t, grp.b, grp.hk, s0, slen, ctx.chunks)


def _load_v_of(ctx, groups, steps, s):
    """Load the V of step s's key section (once per section)."""
    if _real(steps, s):
        gi, si, _ = steps[s]
        grp = groups[gi]
        if grp.v[si] is None:
            s0, slen, _ = _section_span(grp, si)
            grp.v[si] = _load_v(ctx.v, grp.b, grp.hk, s0, slen)


class _Work(nl.NKIObject):
    """In-flight tiles of one step between pipeline stages (dropped as soon as consumed)."""


def _real(steps, s):
    """Step s exists and computes something (not past the ends, not a keyless group)."""
    return 0 <= s < len(steps) and steps[s][1] >= 0


def _stage_scores(groups, steps, work, s, scale, softcap):
    """A: final scores of step s in SBUF and their row max: per score tile QK^T into one PSUM
    bank [PE], then its evict/scale/mask/max [DVE/ACT]; drops K^T after the last head."""
    if _real(steps, s):
        gi, si, hi = steps[s]
        grp = groups[gi]
        s0, _, sub_tiles = _section_span(grp, si)
        s_sb, rowmax = _section_scores(grp.q_tiles[hi], grp.k[si], sub_tiles, s0, scale, softcap,
                                       grp.bounds)
        work[s] = _Work(s_sb=s_sb, rowmax=rowmax)
        if hi == len(grp.heads) - 1:
            grp.k[si] = None


def _stage_softmax(groups, steps, work, s, p_dtype):
    """B1: online-softmax statistics and P of step s [DVE/ACT]."""
    if _real(steps, s):
        gi, _, hi = steps[s]
        w = work[s]
        w.p_sb, w.alpha, w.rowsum = _softmax_step(groups[gi].states[hi], w.s_sb, w.rowmax,
                                                  p_dtype)
        w.s_sb, w.rowmax = None, None


def _stage_transpose(steps, work, s):
    """B2a: P^T of step s in PSUM [PE]."""
    if _real(steps, s):
        w = work[s]
        w.pt_psum = _transpose_p(w.p_sb)
        w.p_sb = None


def _stage_evict_pt(groups, steps, work, s):
    """B2b: P^T of step s to SBUF [ACT]."""
    if _real(steps, s):
        gi, si, _ = steps[s]
        w = work[s]
        w.pt_sb = _evict_pt(w.pt_psum, _section_span(groups[gi], si)[1])
        w.pt_psum = None


def _stage_pv(groups, steps, work, s):
    """B2c: O = P @ V of step s [PE]; drops the K/V tile after the group's last head."""
    if _real(steps, s):
        gi, si, hi = steps[s]
        grp = groups[gi]
        w = work[s]
        w.o_psum = _p_times_v(w.pt_sb, grp.v[si], _section_span(grp, si)[1])
        w.pt_sb = None
        if hi == len(grp.heads) - 1:
            grp.v[si] = None


def _stage_acc(groups, steps, work, s, out, pending_lse):
    """B3: l = alpha * l + rowsum and acc = alpha * acc + O of step s [DVE]; closes the group
    after its last step."""
    if s < 0 or s >= len(steps):
        return
    gi, si, hi = steps[s]
    grp = groups[gi]
    if si >= 0:
        w = work[s]
        state = grp.states[hi]
        nisa.scalar_tensor_tensor(dst=state.l, data=state.l, op0=nl.multiply, operand0=w.alpha,
                                  op1=nl.add, operand1=w.rowsum)
        nisa.scalar_tensor_tensor(dst=state.acc, data=state.acc, op0=nl.multiply,
                                  operand0=w.alpha, op1=nl.add, operand1=w.o_psum)
        work[s] = None
    if si == len(grp.sections) - 1 and (si < 0 or hi == len(grp.heads) - 1):
        _close_group(grp, out, pending_lse)


def _close_group(grp, out, pending_lse):
    """Store the group's outputs now; queue its lse (computed in batches, see LSE_BATCH)."""
    for i in range(len(grp.heads)):
        _store_out(grp.states[i], out, grp.b, grp.heads[i], grp.q0)
        pending_lse.append((grp.states[i], grp.b, grp.heads[i], grp.q0))
    grp.q_sec.users -= 1
    if grp.q_sec.users == 0:
        grp.q_sec.tiles = None
    grp.q_tiles, grp.states, grp.bounds, grp.k, grp.v = None, None, None, None, None


@nki.jit
def flash_fwd_kernel(q_t, k_t, v, sinks, doc, has_sinks, has_docs, causal, scale, window_left,
                     window_right, softcap):
    """(out (B, Hq, Sq, D) in q's dtype, lse (B, Hq, Sq) float32); see the module docstring."""
    n_batch, n_q_heads, d, sq = q_t.shape
    n_kv_heads, sk = k_t.shape[1], k_t.shape[3]
    out = nl.ndarray((n_batch, n_q_heads, sq, d), dtype=q_t.dtype, buffer=nl.shared_hbm)
    lse = nl.ndarray((n_batch, n_q_heads, sq), dtype=nl.float32, buffer=nl.shared_hbm)
    mask = MaskSpec(sq=sq, sk=sk, causal=causal, window_left=window_left,
                    window_right=window_right, has_docs=has_docs)
    chunks = head_dim_chunks(d)
    q_bytes = _FP32_BYTES if q_t.dtype == nl.float32 else _HALF_BYTES
    state_bytes = (len(chunks) * QUERY_SECTION_TILES * nl.tile_size.pmax * q_bytes
                   + (d + 2) * _FP32_BYTES)
    group = n_q_heads // n_kv_heads
    n_pass = heads_per_pass(group, state_bytes,
                            nl.tile_size.total_available_sbuf_size // STATE_SBUF_SHARE)
    ctx = _Ctx(q_t=q_t, k_t=k_t, v=v, sinks=sinks, has_sinks=has_sinks, d=d, chunks=chunks,
               mask=mask, doc_lo=doc[0] if has_docs else None, doc_hi=doc[1] if has_docs else None)
    section_keys = max(key_tile_width(), KEY_SECTION_BYTES // q_bytes)
    groups = _program_share(_plan_groups(mask, n_batch, n_kv_heads, group, n_pass, section_keys),
                            nl.num_programs(axes=0), nl.program_id(axis=0))
    for grp in groups:              # query sections are released after their last group here
        grp.q_sec.users = 0
    for grp in groups:
        grp.q_sec.users += 1
    steps = _plan_steps(groups)
    n_steps = len(steps)
    work = [None] * n_steps
    pending_lse = []

    # Software pipeline over the steps. Each engine runs its stream in program order, so
    # iteration it emits the stages of several steps, ordered so that in the steady state an
    # engine only waits on work emitted in earlier iterations (except the short neg_m -> exp
    # and QK -> row max hand-offs):
    #   load K^T(it + SCORE_LEAD + 1), V(it + 1)
    #   softmax(it + 1) [DVE, ACT]   QK^T + scores(it + SCORE_LEAD) [PE, DVE/ACT]
    #   P^T(it) [PE]   evict P^T(it - 1) [ACT]   P @ V(it - PV_LAG) [PE]
    #   l, acc(it - ACC_LAG) [DVE] (+ the group's output stores after its last step)
    _load_k(ctx, groups, steps, 0)
    for it in nl.sequential_range(-SCORE_LEAD, n_steps + ACC_LAG):
        _load_k(ctx, groups, steps, it + SCORE_LEAD + 1)
        _load_v_of(ctx, groups, steps, it + 1)
        _stage_softmax(groups, steps, work, it + 1, v.dtype)
        _stage_scores(groups, steps, work, it + SCORE_LEAD, scale, softcap)
        _stage_transpose(steps, work, it)
        _stage_evict_pt(groups, steps, work, it - 1)
        _stage_pv(groups, steps, work, it - PV_LAG)
        _stage_acc(groups, steps, work, it - ACC_LAG, out, pending_lse)
        if len(pending_lse) >= LSE_BATCH or (it == n_steps + ACC_LAG - 1 and len(pending_lse) > 0):
            _store_lse_batch(pending_lse, lse)
            pending_lse = []
    return out, lse


# --------------------------------------------------------------------------- launcher

def flash_fwd(q, k, v, sinks, cu_seqlens, *, causal, scale, window_left, window_right, softcap):
    """Launch :func:`flash_fwd_kernel` for ``nki::flash_attention`` (arguments already validated,
    ``scale`` resolved). Returns ``(out (B, Hq, Sq, D) in q's dtype, lse (B, Hq, Sq) float32)``."""
    if q.dtype not in KERNEL_DTYPES:
        raise Unsupported(f"dtype {q.dtype} (the kernel handles bfloat16, float16, float32)")
    sq, sk = q.shape[2], k.shape[2]
    if sq + sk >= MAX_INDEX:
        raise Unsupported(f"Sq + Sk = {sq + sk} >= 2**24 (key indices are float32 in the kernel)")
    q_t = q.transpose(2, 3).contiguous()
    k_t = k.transpose(2, 3).contiguous()
    sinks_c = None if sinks is None else sinks.contiguous()
    doc = None if cu_seqlens is None else document_bounds(cu_seqlens, sq)
    return call_kernel(flash_fwd_kernel, q_t, k_t, v.contiguous(), sinks_c, doc,
                       sinks is not None, cu_seqlens is not None, bool(causal), float(scale),
                       int(window_left), int(window_right), float(softcap), grid=lnc_degree())
