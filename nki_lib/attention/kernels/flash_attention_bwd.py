"""Flash-attention backward: the NKI kernel and its launcher ``launch_flash_attention_bwd``.

Math (``reference.flash_attention_backward``), per query row i and key j, with s = scale * q.k
(then ``softcap * tanh(s / softcap)`` when softcap > 0) and masked pairs excluded:

    P = exp(s - lse)                 recomputed from the forward's lse (no softmax statistics pass)
    delta = rowsum(dO * O) - dlse    the gradient through lse shifts the row term
    dV += P^T dO,  dP = dO V^T,  dS = P * (dP - delta) [* (1 - tanh^2) under softcap]
    dQ = scale * dS K,  dK += scale * dS^T Q,  dsinks[h] = -sum_i exp(sink_h - lse_i) * delta_i

Files: this one (launcher, kernel, LNC2 work split), ``flash_attention_bwd_pipeline`` (the software pipeline of
one kv head's pass, ``STAGES``), ``flash_attention_bwd_groups`` (query groups: loads, dQ accumulators),
``flash_attention_bwd_kv`` (key tiles: K/V loads, dK/dV accumulators and stores), ``flash_attention_bwd_rows``
(row-group layout glue), ``flash_attention_bwd_tile`` (the stages of one query tile x key tile pair),
``flash_attention_bwd_prep`` (phase 0: per-row statistics, dsinks).

Loop structure (KV-outer, FlashAttention-2 backward; all loops unrolled at trace time):

    for (b, kv head hk) units (one pass each, LNC2: shared between the programs):
        issue the first key tile's loads; phase 0 (bwd_prep) of hk's query heads: -lse of all
        rows (and the per-row key bounds, when given, one DMA) now, -delta of a query group when
        the pass first loads it (its O/dO rows prefetched STATS_AHEAD groups earlier), all kept in
        SBUF; dsinks partials at the end of the pass
        pairs = [(key tile [k0, k0 + kn), kn <= 512, query head h, query group, query tile)
                 for every key tile, query head of the group, visiting query tile]
        one software pipeline over all pairs (STAGES; pair j's stage runs at step j + lag):
            scores   S = Q K^T, dP = dO V^T          TensorE -> PSUM fp32 (diagonal tiles: up to
                                                     the last visible 128-key block)
            probs    P = exp(scale * S - lse)        ScalarE (reads PSUM); masks of partial tiles:
                                                     GpSimd affine_select on P (causal/window),
                                                     key bounds: VectorE range_select before exp;
                     dP - delta                      ScalarE eviction (the bias of a copy), fp32
            dscores  dS = (dP - delta) * P           GpSimd, one product
            dv       dV += P^T dO                    TensorE, per visible 128-key block (queries
                                                     are the contraction dim: no transpose)
            dk       dK += dS^T Q, dS^T              TensorE, per visible block; interior pairs
                                                     (every row sees the whole key tile) go in
                                                     couples of neighbours whose dS^T is ONE
                                                     SBUF -> SBUF DMA transpose (``DsCouple``)
            evict    dS^T PSUM -> SBUF               VectorE (pairs outside couples)
            dq       dQ_part = dS K                  TensorE -> PSUM fp32
            acc      acc (+)= dQ_part                ScalarE (first visit) / VectorE
        loads run one unit ahead: a key tile's K^T, V^T (with the next key tile's: one DMA each
        for two) when the previous key tile starts, its K rows (TensorE transposes of K^T, D <=
        128; else a DMA of natural rows) behind its first scores; a query group's Q^T, dO^T
        (one DMA each, with the next group's when cached) and its Q, dO, O rows (one DMA,
        shared with phase 0) when the previous group starts, kept for the kv head's later key
        tiles when they fit (``q_cached``, else reloaded per visit); after a group's last pair:
        dq = scale * acc in the output dtype for the tiles whose last key tile this is; after a
        key tile's last pair: dK = scale * acc (ScalarE), dV = acc (VectorE) -> HBM (one DMA for both).

dQ accumulates over key tiles in fp32, in key-tile order: in SBUF for the whole pass when the
GQA group's accumulators take at most half a partition (``dq_resident``; Sq <= 16384 at G = 1,
D = 128), else in an fp32 HBM scratch (loaded / stored per group visit, one DMA each). dK/dV of
a kv head accumulate over every query head of its GQA group in the same PSUM tiles.
Deterministic: one fixed accumulation order, no atomics. Whole-tile skipping and masks follow
``tiles.plan_row`` / ``tiles.row_bounds`` exactly like the forward; 128-key blocks no query of
the tile sees also skip the dV/dK/dQ matmuls.

LNC2 (``NEURON_LOGICAL_NC_CONFIG=2``): the two programs share the (batch, kv head) units
(``program_units``: every other unit of the batch-major order), each with its GQA group's query
heads, so every dq/dk/dv row has one writer and no barrier is needed; with one kv head and
B >= 2 the cores split the batch. dsinks is one row when each query head's units run on one
program, else one row of partial sums per program, added by the launcher (``dsinks_writers``).
With an odd number of (batch, kv head) units and a GQA group the programs divide (B = 1,
Hkv = 1, Hq = 8), the programs split every kv head's query heads instead (``head_split``) and
write fp32 partial dK/dV, added by the launcher; otherwise (one unit and one query head) the
second program idles.

Engine balance (cost model, D = 128, bf16, trn2): per 128 x 512 score tile TensorE does S, dP,
4 x (dV, dK, dQ) (2560 cycles, all useful) plus, outside couples, 4 dS^T transposes (512 more);
ScalarE the exp and the dP - delta eviction (854 ns); VectorE the dQ accumulation and, outside
couples, the dS^T evictions (133 + 267 ns); GpSimd dS (427 ns) and the causal/window masks of
diagonal tiles; DMA one 2 KiB-per-partition dS^T transpose per couple (1.42 us per two tiles).
Busy times at Sq = Sk = 4096 causal: TensorE 149 us, ScalarE 124, DMA 114, GpSimd 69, VectorE
38; estimated 172 us (79% of the engine-aware roofline; docs/perf-log.md §12.5, §18.2).
Every streamed DMA moves one contiguous run of >= 1 KiB per partition (Q^T and dO^T 1 KiB
each per group, 2 KiB per two groups when cached; Q/dO/O rows 3 KiB per group, dO/O rows 2 KiB
when the Q rows are TensorE transposes of Q^T (``q_rows_on_chip``, once per group and pass); K^T and V^T
2 KiB per two key tiles; dK + dV 2 KiB per key tile; dS^T 2 KiB per couple). K rows: 4 TensorE
transposes of the key tile's K^T (bit-exact, 0.2 us of TensorE) and one VectorE PSUM copy, no HBM
traffic and no host copy (at D > 128 a DMA of the natural rows, one D-element run per block).
Q^T, dO^T, K^T and V^T are DMA transposes of the natural (B, H, S, D) inputs for 2-byte dtypes
with D <= 128 (``flash_attention_transposed_loads``; no host transposes), else rows of host transposes.

Working set (per partition; D <= 128, 16-bit inputs): SBUF: thirteen pairs with their
couples' dS and dS^T tiles, three query groups and up to four key tiles' K^T/V^T in flight,
phase-0 rows of the next group (81 KiB peak in all, the cached groups and resident dQ included,
at Sq = Sk = 4096 causal, G = 1, bf16; simulator report) plus 24 B per query
tile and query head of the GQA group (statistics, lse/dlse columns), plus, when resident,
4 * D B of fp32 dQ accumulator per query tile and query head of the GQA group, plus, when
``q_cached``, a group's Q^T, dO^T and Q, dO, O rows (5 KiB at D = 128, bf16) per query group and
query head of the GQA group.
PSUM: dK, dV (one bank each, two each for D in (128, 256]) and one S, dP, dS^T and dQ tile each
(every PSUM tile is consumed one pipeline step after it is made), plus at D <= 128 the K-row or
Q-row transposes' tile (one bank, from the transposes to their VectorE copy): at most 7 banks at
D <= 128 (6 at peak at Sq = Sk = 4096 causal, simulator report), 8 at D = 256.

Shapes (HBM; the row layouts are layout glue, one host op each): q_rows
(B, Hq, NG, pmax, R, per, D) (Q, dO and O rows in row-group layout, ``query_rows``: [.., g, p, i, s, :] = row
(g * per + s) * pmax + p of input i, zero rows past Sq; R = 2, dO and O only, when the kernel makes
the Q rows from Q^T: ``q_rows_on_chip``, natural inputs whose groups stay in SBUF); q_src, do_src (B, Hq, Sq, D), k_src,
v_src (B, Hkv, Sk, D) natural (``natural``), else their (B, H, D, S) transposes;
k (B, Hkv, Sk, D) natural (K rows at D > 128; its shape otherwise); lse (B, Hq, Sq) fp32; dlse the same, or None
when no gradient reaches lse (delta is then rowsum(dO * O): no zeros tensor); sinks (Hq,) fp32;
doc (B, pmax, NT, 2) fp32 per-row key bounds [lo, hi] (``nki_lib.attention.key_bounds``:
documents, key padding, the causal/window rules intersected; ``tiles.bounds_layout``) or None.
Outputs dq (B, Hq, NG, pmax, per, D) and
dkv (B, Hkv, NKT, pmax, 2, per, D) (dK then dV rows of each partition, one 2 KiB store per key
tile) in row-group layout (the launcher turns them back).
Scratch (non-resident dQ): dq_acc like dq, fp32.
Dimension legend: B batch, Hq/Hkv query/kv heads (G = Hq // Hkv), Sq/Sk lengths, D head dim,
pmax partitions, per = 128-row tiles per group (= 128-key blocks per key tile, 4), NG query
groups, NKT key tiles, qn/kn rows/keys of the current tile, NT query tiles.
Limits: D <= 256 (two contraction chunks); bf16/fp16/fp32; Sq + Sk < 2**24 (float32 key
indices); with per-row key bounds (cu_seqlens, attn_mask) and no softcap, scale > 0 (scores
outside the bounds are filled with the most negative float32 before exp), else ``Unsupported``.
"""

from __future__ import annotations

from functools import partial

import torch

from nki_lib._nki import nisa, nki, nl
from nki_lib.attention.attention_args import MAX_HEAD_DIM
from nki_lib.attention.kernels import flash_attention_bwd_prep, tiles
from nki_lib.attention.kernels.flash_attention_bwd_groups import Streams, dq_resident, q_cached
from nki_lib.attention.kernels.flash_attention_bwd_pipeline import kv_pass
from nki_lib.attention.kernels.flash_attention_bwd_rows import from_row_groups, group_tiles, query_rows
from nki_lib.attention.kernels.flash_attention_bwd_tile import Config
from nki_lib.attention.kernels.flash_attention_transposed_loads import as_kernel_layout, on_chip
from nki_lib.backend import lnc_degree
from nki_lib.dispatch import KernelLaunch, Unsupported
from nki_lib.sizes import ceil_div

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def head_split(batch, num_kv_heads, group, num_progs):
    """Whether the programs split every kv head's query heads (LNC2 with an odd number of
    (batch, kv head) units and a GQA group the programs divide): no core idles, each writes fp32
    partial dK/dV that the launcher adds."""
    return num_progs > 1 and (batch * num_kv_heads) % num_progs != 0 and group % num_progs == 0


def program_units(batch, num_kv_heads, group, num_progs, pid):
    """The units ``(b, hk, gs)`` program ``pid`` of ``num_progs`` serves (LNC2: one program per
    NeuronCore), ``gs`` the query heads ``hk * group + g`` it takes of kv head hk. Whole kv heads:
    every ``num_progs``-th (batch, kv head) of the batch-major order, so the cores share batch and
    heads alike (with one kv head and B = 2 each core takes one batch; with an even number of kv
    heads a kv head's units all land on one program). Under :func:`head_split` every program
    takes its share of every kv head's query heads."""
    units = [(b, hk) for b in range(batch) for hk in range(num_kv_heads)]
    if head_split(batch, num_kv_heads, group, num_progs):
        share = group // num_progs
        return [(b, hk, tuple(range(pid * share, (pid + 1) * share))) for b, hk in units]
    return [(b, hk, tuple(range(group))) for b, hk in units[pid::num_progs]]


def dsinks_writers(batch, num_kv_heads, group, num_progs):
    """Rows of the kernel's dsinks output: 1 when each query head's units all run on one program
    (it owns dsinks[h]), else one row of partial sums per program (the launcher adds them)."""
    whole = num_kv_heads % num_progs == 0 or batch == 1 or head_split(batch, num_kv_heads, group, num_progs)
    return 1 if whole else num_progs


@nki.jit
def flash_attention_bwd_kernel(q_rows, q_src, do_src, dlse, k, k_src, v_src, lse, sinks, doc, causal, scale,
                               window_left, window_right, softcap, natural):
    """Returns ``(dq, dkv, dsinks)`` (dq, dkv in row-group layout); see the module docstring."""
    batch, num_heads, seqlen_q = lse.shape
    num_kv_heads, seqlen_k, head_dim = k.shape[1], k.shape[2], k.shape[3]
    q_on_chip = q_rows.shape[4] == 2   # (dO, O) rows: Q rows are transposes of Q^T (q_rows_on_chip)
    qdo_rows = q_rows if q_on_chip else q_rows[:, :, :, :, 0:2]    # Q, dO (reloads of a group after its phase 0)
    group = num_heads // num_kv_heads
    pmax = nl.tile_size.pmax
    per = group_tiles()
    mask = tiles.MaskSpec(seqlen_q, seqlen_k, causal, window_left, window_right, doc is not None)
    cfg = Config(mask, scale, softcap, head_dim, flash_attention_bwd_prep.num_stats(mask.has_docs))
    q_tiles = tiles.query_tiles(seqlen_q)
    num_groups = q_rows.shape[2]

    # LNC2: the programs share the (batch, kv head) units (see program_units); each unit owns its
    # GQA group's dq/dk/dv rows, so every output row has one writer
    num_progs = nl.num_programs(0) if nl.program_ndim() > 0 else 1
    pid = nl.program_id(0) if num_progs > 1 else 0
    units = program_units(batch, num_kv_heads, group, num_progs, pid)
    writers = dsinks_writers(batch, num_kv_heads, group, num_progs) if sinks is not None else 1
    split = head_split(batch, num_kv_heads, group, num_progs)

    dq = nl.ndarray(q_rows.shape[:4] + (per, head_dim), dtype=q_rows.dtype, buffer=nl.shared_hbm)
    dkv_shape = (batch, num_kv_heads, ceil_div(seqlen_k, per * pmax), pmax, 2, per, head_dim)   # dK, dV rows side by side
    if split:   # one fp32 partial dK/dV per program, added by the launcher
        dkv = nl.ndarray((num_progs,) + dkv_shape, dtype=nl.float32, buffer=nl.shared_hbm)
        dkv_out = dkv[pid]
    else:
        dkv = dkv_out = nl.ndarray(dkv_shape, dtype=k.dtype, buffer=nl.shared_hbm)
    dsinks = nl.ndarray((writers, num_heads), dtype=nl.float32, buffer=nl.shared_hbm)
    resident = dq_resident(group, seqlen_q, head_dim)
    keep_q = q_cached(group, seqlen_q, head_dim, 4 if q_rows.dtype == nl.float32 else 2)
    dq_acc = None if resident else nl.ndarray(dq.shape, dtype=nl.float32, buffer=nl.private_hbm)
    ins = Streams(qdo_rows, q_src, do_src, natural, dq, dq_acc, seqlen_q, q_on_chip)

    heads = sorted({hk * group + g for _, hk, gs in units for g in gs})
    prep = flash_attention_bwd_prep.Prep(q_rows, dlse, lse, sinks, doc, mask, cfg.num_stats)
    row = pid if writers > 1 else 0
    # without sinks program 0 zero-fills dsinks; with per-program partial rows each program
    # zero-fills its own row first (heads it serves no unit of keep 0)
    zero_row = pid == 0 if sinks is None else writers > 1
    flash_attention_bwd_prep.start(prep, dsinks[row], heads, zero_dsinks=zero_row)

    plans = [tiles.plan_row(mask, q0, qn) for q0, qn in q_tiles]
    for b, hk, gs in units:
        if resident:
            ins.dq_res = nl.ndarray((pmax, group, num_groups * per, head_dim), dtype=nl.float32, buffer=nl.sbuf)
        ins.q_cache = {} if keep_q else None
        kv_pass(ins, (k, k_src, v_src, dkv_out), prep, b, hk, group, gs, plans, cfg)
        ins.dq_res = ins.q_cache = None
        for h in (hk * group + g for g in gs):
            for t, (q0, qn) in enumerate(q_tiles):
                if not plans[t]:
                    zeros_sb = nl.ndarray((pmax, head_dim), dtype=dq.dtype, buffer=nl.sbuf)
                    nisa.memset(dst=zeros_sb[:qn, :], value=0.0)
                    nisa.dma_copy(dst=dq[b, h, t // per, :qn, t % per, :], src=zeros_sb[:qn, :])
    flash_attention_bwd_prep.finish(prep, dsinks[row])
    return dq, dkv, dsinks


# --------------------------------------------------------------------------- launcher

def q_rows_on_chip(q, k):
    """Whether the kernel makes a query group's Q rows from its Q^T (TensorE transposes, once
    per kv head's pass) instead of reading host row-group copies: when the groups stay in SBUF
    (``q_cached``), so each group is transposed once, not once per key tile visit."""
    group = q.shape[1] // k.shape[1]
    return q_cached(group, q.shape[2], q.shape[3], q.element_size())


def launch_flash_attention_bwd(dout, dlse, q, k, v, out, lse, sinks, key_bounds, *, causal, scale, window_left,
              window_right, softcap):
    """The launch of the backward kernel (``key_bounds`` (B, 2, Sq) float32 or None and the flags
    from ``key_bounds.plan``); it returns ``(dq, dk, dv, dsinks)`` (dsinks float32 (Hq,),
    zeros without sinks); ``dlse`` None: no gradient through lse. Raises :class:`Unsupported` when the kernel cannot serve the call."""
    if q.dtype not in KERNEL_DTYPES:
        raise Unsupported(f"dtype {q.dtype} (the backward kernel handles bfloat16, float16, float32)")
    if q.shape[-1] > MAX_HEAD_DIM:
        raise Unsupported(f"head dim {q.shape[-1]} > {MAX_HEAD_DIM}")
    if q.shape[2] + k.shape[2] >= tiles.MAX_INDEX:
        raise Unsupported(f"Sq + Sk = {q.shape[2] + k.shape[2]} >= 2**24 (key indices are float32 in the kernel)")
    if key_bounds is not None and softcap == 0 and scale <= 0:
        raise Unsupported("scale <= 0 with per-row key bounds (cu_seqlens, attn_mask): masked scores "
                          "would not vanish under exp")
    grid = lnc_degree()
    natural = on_chip(q)   # Q^T, dO^T, K^T, V^T by DMA transposes of the natural rows, else host transposes
    srcs = [as_kernel_layout(x, natural) for x in (q, dout, k, v)]
    return KernelLaunch(
        flash_attention_bwd_kernel,
        (query_rows(q, dout, out, natural and q_rows_on_chip(q, k)), srcs[0], srcs[1], None if dlse is None else dlse.contiguous(), k.contiguous(), srcs[2],
         srcs[3],
         lse.contiguous(), None if sinks is None else sinks.contiguous(),
         None if key_bounds is None else tiles.bounds_layout(key_bounds)),
        dict(causal=bool(causal), scale=float(scale), window_left=int(window_left), window_right=int(window_right),
             softcap=float(softcap), natural=natural),
        grid=grid, unpack=partial(_unpack_grads, q.shape[2], k.shape[2], k.dtype))


def _unpack_grads(seqlen_q, seqlen_k, kv_dtype, grads):
    """The kernel's ``(dq, dkv, dsinks)`` in row groups -> the op's ``(B, H, S, D)`` gradients
    (dK and dV are ``dkv[:, :, :, :, 0]`` and ``[.., 1]``); per-program partial dK/dV (LNC2 head
    split, fp32) and dsinks rows are added here."""
    dq, dkv, dsinks = grads
    dsinks = dsinks[0] if dsinks.shape[0] == 1 else dsinks.sum(dim=0)
    partial_sums = dkv.dim() == dq.dim() + 2
    if partial_sums:
        dkv = dkv.sum(dim=0)
    kv = [from_row_groups(dkv[:, :, :, :, i], seqlen_k, kv_dtype if partial_sums else None) for i in (0, 1)]
    return from_row_groups(dq, seqlen_q), kv[0], kv[1], dsinks
