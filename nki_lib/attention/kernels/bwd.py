"""Flash-attention backward: the NKI kernel and its launcher ``flash_bwd``.

Math (``reference.flash_attention_backward``), per query row i and key j, with s = scale * q.k
(then ``softcap * tanh(s / softcap)`` when softcap > 0) and masked pairs excluded:

    P = exp(s - lse)                 recomputed from the forward's lse (no softmax statistics pass)
    delta = rowsum(dO * O) - dlse    the gradient through lse shifts the row term
    dV += P^T dO,  dP = dO V^T,  dS = P * (dP - delta) [* (1 - tanh^2) under softcap]
    dQ = scale * dS K,  dK += scale * dS^T Q,  dsinks[h] = -sum_i exp(sink_h - lse_i) * delta_i

Files: this one (launcher, kernel, loops, query groups, K/V tiles), ``bwd_tile`` (the work of
one query tile x key tile pair), ``bwd_prep`` (phase 0: per-row statistics, dsinks).

Loop structure (KV-outer, FlashAttention-2 backward; all loops unrolled at trace time):

    phase 0 (bwd_prep): per (h, b, query tile): delta, -lse (and the per-row key bounds with
                        documents) -> stats scratch; dsinks
    for b, kv head hk, key tile [k0, k0 + kn), kn <= 512 (one fp32 PSUM bank of scores):
        load K (keys on partitions), K^T and V^T (head dim on partitions)
        dK, dV accumulators of the key tile stay in PSUM (fp32) until the tile is done
        for each query head h of hk's GQA group:
            load the head's statistics (one DMA)
            for each query group (4 aligned 128-row tiles) with a tile that sees the key tile
            (loads issued one group ahead; tile pairs pipelined across group boundaries):
                load Q^T, dO^T of the group (one DMA per head-dim chunk, 1 KiB per partition)
                load the group's fp32 dQ accumulator (tiles not visited before; one DMA)
                for each query tile of the group that sees the key tile (scores half of tile
                i + 1 issued before the gradients half of tile i: software pipelining):
                    Q, dO rows-on-partitions     TensorE transposes, ScalarE eviction
                    S = Q K^T, dP = dO V^T       TensorE -> PSUM fp32
                    P = exp(scale * S - lse)     ScalarE (reads PSUM)
                    mask (partial tiles only)    GpSimd affine_select on P (causal/window);
                                                 documents: VectorE range_select before exp
                    dS = (dP - delta) * P        VectorE, one scalar_tensor_tensor
                    per visible 128-key block:
                      dV += P^T dO, dK += dS^T Q   TensorE (queries are the contraction dim:
                                                   no transpose of P or dS needed)
                      dS^T                         TensorE transpose, ScalarE eviction
                    dQ_part = dS K               TensorE -> PSUM fp32
                    acc = scale * dQ_part (+ acc)  ScalarE (first visit) / VectorE
                    last visit of the tile: dq = acc in the output dtype -> HBM
                store the group's accumulator for tiles visited again later (one DMA)
        dK = scale * acc (ScalarE), dV = acc (VectorE) -> HBM

dQ accumulates over key tiles in fp32 (SBUF per visit, an fp32 HBM scratch between key tiles,
in key-tile order); dK/dV of a kv head accumulate over every query head of its GQA group in the
same PSUM tiles. Deterministic: one fixed accumulation order, no atomics. Whole-tile skipping
and masks follow ``tiles.plan_row`` / ``tiles.row_bounds`` exactly like the forward; 128-key
blocks no query of the tile sees also skip the dV/dK/dQ matmuls.

LNC2 (``NEURON_LOGICAL_NC_CONFIG=2``): the two programs split the kv heads (hk % 2), each with
its GQA group's query heads, so every output row and dsinks entry has one writer and no
barrier is needed; with a single kv head the second program idles.

Engine balance (cost model, D = 128, bf16, trn2): per 128 x 512 score tile TensorE does S, dP,
4 x (dV, dK, dS^T, dQ); ScalarE the exp and all PSUM evictions of dS^T/Q/dO; VectorE dS and
the dQ accumulation; GpSimd (otherwise idle) the causal/window masks of diagonal tiles. The
cost model's busy times at Sq = Sk = 8192 causal: TensorE 741 us, VectorE 751, ScalarE 592,
DMA 795 (nki_lib.simulator.profile.estimate).
The streamed traffic (Q^T, dO^T, dQ accumulators) moves 1-2 KiB per partition per DMA (one
DMA per query group, not per tile); small DMAs remain once per query tile (phase 0, final dq
store) and once per key tile (K rows, dK/dV stores).

Working set (per partition; D <= 128, 16-bit inputs): SBUF about 18 KiB (two query groups and
two score tiles in flight) plus 16 B of statistics per query tile (19.8 KiB at Sq = 16384),
otherwise independent of the sequence lengths. PSUM: the dK and dV accumulators (one bank each,
two each for D in (128, 256]) plus two banks of the current half step (S and dP, or dS^T and
dQ; the Q/dO transposes take one before S exists): 4 banks at D <= 128, at most 8 at D = 256.

Shapes (HBM; the launcher prepares the transposed copies, layout glue): q, out, dout
(B, Hq, Sq, D); q_t, dout_t (B, Hq, D, Sq); k (B, Hkv, Sk, D); k_t, v_t (B, Hkv, D, Sk);
lse, dlse (B, Hq, Sq) fp32; sinks (Hq,) fp32; doc (2, Sq) fp32 first/last position of each
position's document (cu_seqlens). Scratch: dq_acc (B, Hq, NG, 128, 4, D) fp32 (query group
layout: one contiguous run per partition), stats (bwd_prep).
Dimension legend: B batch, Hq/Hkv query/kv heads (G = Hq // Hkv), Sq/Sk lengths, D head dim,
qn/kn rows/keys of the current tile, NT query tiles, NG query groups.
Limits: D <= 256 (two contraction chunks); bf16/fp16/fp32; Sq + Sk < 2**24 (float32 key
indices); with cu_seqlens and no softcap, scale > 0 (document-masked scores are filled with the
most negative float32 before exp), else ``Unsupported``.
"""

from __future__ import annotations

import os

import torch

from nki_lib._nki import nki, nisa, nl
from nki_lib.attention.kernels import bwd_prep, tiles
from nki_lib.attention.kernels.bwd_tile import (Config, Pair, acc_stage, dk_stage, dq_stage, dscores_stage, dv_stage,
                                                evict_stage, probs_stage, scores_stage)
from nki_lib.dispatch import Unsupported, call_kernel

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_HEAD_DIM = 256


def _acc_stride(head_dim: int) -> int:
    """Free stride of one 128-key block in the dK/dV PSUM accumulators: the next power of two
    >= D, so no block straddles a 2 KiB bank (a matmul result must fit one bank)."""
    return 1 << (head_dim - 1).bit_length()


# --------------------------------------------------------------------------- K/V tile

def _full_blocks(blocks):
    """Number of leading full (pmax-row) blocks; a partial last block moves on its own."""
    pmax = nl.tile_size.pmax
    return sum(1 for _, sn in blocks if sn == pmax)


def _move_rows(hbm_rows, sb, blocks, to_sbuf):
    """A key tile's rows in row-group layout ``(pmax, nblocks, D)`` between HBM and SBUF: one DMA for
    the full blocks (one contiguous run per partition), one for a partial last block."""
    nfull = _full_blocks(blocks)
    pairs = [(hbm_rows[:, :nfull, :], sb[:, :nfull, :])] if nfull else []
    if nfull < len(blocks):
        sn = blocks[nfull][1]
        pairs.append((hbm_rows[:sn, nfull, :], sb[:sn, nfull, :]))
    for hbm, tile in pairs:
        nisa.dma_copy(dst=tile if to_sbuf else hbm, src=hbm if to_sbuf else tile)


def _load_kv(k_rows, k_t, v_t, b, hk, kt, k0, kn, head_dim):
    """K as ``(pmax, nblocks, D)`` (keys on partitions, one 128-key block per middle index) for
    dQ; K^T and V^T as ``(pmax, nchunks, kn)`` (head dim on partitions) for S and dP."""
    pmax = nl.tile_size.pmax
    blocks = tiles.key_blocks(kn)
    chunks = tiles.head_dim_chunks(head_dim)
    k_sb = nl.ndarray((pmax, len(blocks), head_dim), dtype=k_rows.dtype, buffer=nl.sbuf)
    _move_rows(k_rows[b, hk, kt], k_sb, blocks, True)
    kT_sb = nl.ndarray((pmax, len(chunks), kn), dtype=k_t.dtype, buffer=nl.sbuf)
    vT_sb = nl.ndarray((pmax, len(chunks), kn), dtype=v_t.dtype, buffer=nl.sbuf)
    for ch, (d0, dc) in enumerate(chunks):
        nisa.dma_copy(dst=kT_sb[:dc, ch, :], src=k_t[b, hk, d0:d0 + dc, k0:k0 + kn])
        nisa.dma_copy(dst=vT_sb[:dc, ch, :], src=v_t[b, hk, d0:d0 + dc, k0:k0 + kn])
    return k_sb, kT_sb, vT_sb


def _store_kv_grads(dk, dv, b, hk, kt, blocks, dk_psum, dv_psum, dk_started, dv_started, cfg):
    """dK = scale * acc (ScalarE), dV = acc (VectorE), one DMA each per key tile; blocks no query saw
    get zeros."""
    pmax = nl.tile_size.pmax
    d = cfg.head_dim
    dk_sb = nl.ndarray((pmax, len(blocks), d), dtype=dk.dtype, buffer=nl.sbuf)
    dv_sb = nl.ndarray((pmax, len(blocks), d), dtype=dv.dtype, buffer=nl.sbuf)
    for c, (s0, sn) in enumerate(blocks):
        if dk_started[c]:
            nisa.activation(dst=dk_sb[:sn, c, :], op=nl.copy, data=dk_psum[:sn, c, :d], scale=cfg.scale)
        else:
            nisa.memset(dst=dk_sb[:sn, c, :], value=0.0)
        if dv_started[c]:
            nisa.tensor_copy(dst=dv_sb[:sn, c, :], src=dv_psum[:sn, c, :d], engine=nisa.engine.vector)
        else:
            nisa.memset(dst=dv_sb[:sn, c, :], value=0.0)
    _move_rows(dk[b, hk, kt], dk_sb, blocks, False)
    _move_rows(dv[b, hk, kt], dv_sb, blocks, False)


# --------------------------------------------------------------------------- query groups

def _q_groups(visits):
    """``((group id, visits of the group), ...)`` by aligned query group (``_group_tiles`` query
    tiles each): one DMA moves a group's Q^T, dO^T, Q, dO or dQ rows (>= 1 KiB per partition)."""
    per = _group_tiles()
    gids = []
    for t, _ in visits:
        if t // per not in gids:
            gids.append(t // per)
    return tuple((gid, tuple(v for v in visits if v[0] // per == gid)) for gid in gids)


def _group_tiles():
    """Query tiles per group: as many 128-row tiles as a key tile has 128-key blocks (queries and
    keys share the row-group HBM layout of :func:`row_groups`)."""
    return tiles.key_tile_width() // nl.tile_size.pmax


def _runs(slots, partial_slot):
    """Maximal runs ``(start, stop)`` of consecutive slots; the partial last tile is its own run."""
    runs = []
    for s in slots:
        if runs and runs[-1][1] == s and s != partial_slot and runs[-1][0] != partial_slot:
            runs[-1] = (runs[-1][0], s + 1)
        else:
            runs.append((s, s + 1))
    return runs


def _load_q_group(ins, b, h, gid, seqlen_q, head_dim):
    """Q^T, dO^T ``(pmax, nchunks, group rows)`` (one DMA per chunk) and Q, dO rows-on-partitions
    ``(pmax, group tiles, D)`` (one DMA each, from the row-group copies)."""
    dout_rows, dout_t, q_rows, q_t = ins[:4]
    pmax = nl.tile_size.pmax
    per = _group_tiles()
    width = per * pmax
    g0 = gid * width
    gn = min(width, seqlen_q - g0)
    chunks = tiles.head_dim_chunks(head_dim)
    qT_sb = nl.ndarray((pmax, len(chunks), width), dtype=q_t.dtype, buffer=nl.sbuf)
    doT_sb = nl.ndarray((pmax, len(chunks), width), dtype=dout_t.dtype, buffer=nl.sbuf)
    for ch, (d0, dc) in enumerate(chunks):
        nisa.dma_copy(dst=qT_sb[:dc, ch, :gn], src=q_t[b, h, d0:d0 + dc, g0:g0 + gn])
        nisa.dma_copy(dst=doT_sb[:dc, ch, :gn], src=dout_t[b, h, d0:d0 + dc, g0:g0 + gn])
    q_sb = nl.ndarray((pmax, per, head_dim), dtype=q_rows.dtype, buffer=nl.sbuf)
    do_sb = nl.ndarray((pmax, per, head_dim), dtype=dout_rows.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=q_sb, src=q_rows[b, h, gid])
    nisa.dma_copy(dst=do_sb, src=dout_rows[b, h, gid])
    return qT_sb, doT_sb, q_sb, do_sb


def _move_dq(dq_grp, hbm_grp, runs, q_tiles, gid, to_sbuf):
    """Group rows ``(pmax, group tiles, D)`` <-> a row-group HBM tensor (the fp32 scratch or dq),
    one DMA per run of slots (each partition moves one contiguous run)."""
    per = _group_tiles()
    for s0, s1 in runs:
        rows = q_tiles[gid * per + s0][1]
        hbm = hbm_grp[:rows, s0:s1, :]
        sb = dq_grp[:rows, s0:s1, :]
        nisa.dma_copy(dst=sb if to_sbuf else hbm, src=hbm if to_sbuf else sb)


def _group_flags(group, gid, k0, plans, num_q_tiles, last_rows):
    """Slots of the group's visiting tiles, whether this is their first / last key tile, and the
    slot of the partial last query tile (-1 if none in this group)."""
    pmax = nl.tile_size.pmax
    per = _group_tiles()
    partial = num_q_tiles - 1 - gid * per if last_rows < pmax else -1
    slots = [t - gid * per for t, _ in group]
    first = [plans[t][0][0] == k0 for t, _ in group]
    last = [plans[t][-1][0] == k0 for t, _ in group]
    return slots, first, last, partial


def _load_group(ins, b, h, gid, flags, cfg):
    """Q^T, dO^T, Q, dO and the dQ accumulator (tiles visited before) of one query group."""
    seqlen_q = ins[3].shape[3]
    dq_acc = ins[5]
    q_tiles = tiles.query_tiles(seqlen_q)
    slots, first, _, partial = flags
    loaded = _load_q_group(ins, b, h, gid, seqlen_q, cfg.head_dim)
    dq_grp = nl.ndarray((nl.tile_size.pmax, _group_tiles(), cfg.head_dim), dtype=nl.float32, buffer=nl.sbuf)
    loads = _runs([s for s, f in zip(slots, first) if not f], partial)
    _move_dq(dq_grp, dq_acc[b, h, gid], loads, q_tiles, gid, True)
    return (*loaded, dq_grp)


def _finish_group(ins, loaded, b, h, gid, flags, q_tiles, cfg):
    """After the group's last pair on this key tile: dq (scale applied, output dtype) leaves for
    the tiles whose last key tile this is; the other accumulators return to the fp32 scratch."""
    dq, dq_acc = ins[4], ins[5]
    slots, _, last, partial = flags
    per = _group_tiles()
    dq_grp = loaded[4]
    done = [s for s, f in zip(slots, last) if f]
    if done:
        out_sb = nl.ndarray((nl.tile_size.pmax, per, cfg.head_dim), dtype=dq.dtype, buffer=nl.sbuf)
        for s in done:
            qn = q_tiles[gid * per + s][1]
            nisa.activation(dst=out_sb[:qn, s, :], op=nl.copy, data=dq_grp[:qn, s, :], scale=cfg.scale)
        _move_dq(out_sb, dq[b, h, gid], _runs(done, partial), q_tiles, gid, False)
    stores = _runs([s for s, f in zip(slots, last) if not f], partial)
    _move_dq(dq_grp, dq_acc[b, h, gid], stores, q_tiles, gid, False)


# Software pipeline: the stage of pair j issued at step j + lag. Per step, the program order below
# puts each engine's work whose inputs were produced in earlier steps first, so no in-order engine
# queue waits behind a result of the same step (PSUM tiles are consumed before new ones are made:
# at most dK, dV, S, dP, dS^T and dQ tiles are live, 6 banks).
STAGES = (  # (lag, stage)
    (5, "acc"),       # VectorE/ScalarE: dQ_part into the group accumulator (then a group may finish)
    (3, "evict"),     # VectorE: dS^T PSUM -> SBUF
    (1, "probs"),     # ScalarE: P = exp(...), dP - delta; GpSimd masks
    (1, "dscores"),   # VectorE: dS
    (0, "scores"),    # TensorE: S, dP
    (2, "dv"),        # TensorE: dV += P^T dO
    (4, "dq"),        # TensorE: dQ_part = dS K
    (2, "dk"),        # TensorE: dK += dS^T Q, dS^T
)
PIPELINE_LAG = max(lag for lag, _ in STAGES)


def _head_pass(ins, kv, stats_sb, b, h, visits, k0, kn, plans, cfg):
    """All visits of query head h to the key tile ``k0``, software-pipelined over the (query tile,
    key tile) pairs by :data:`STAGES`; a query group's loads are issued when its predecessor's
    first pair is scored, and it finishes (dq out / accumulators back) after its last pair."""
    seqlen_q = ins[3].shape[3]
    q_tiles = tiles.query_tiles(seqlen_q)
    groups = _q_groups(visits)
    flags = [_group_flags(grp, gid, k0, plans, len(q_tiles), q_tiles[-1][1]) for gid, grp in groups]
    order = [(n, i) for n, (_, grp) in enumerate(groups) for i in range(len(grp))]
    loaded = [None] * len(groups)
    pairs = [None] * len(order)

    def ensure(n):
        if n < len(groups) and loaded[n] is None:
            loaded[n] = _load_group(ins, b, h, groups[n][0], flags[n], cfg)

    for step in range(len(order) + PIPELINE_LAG):
        for lag, stage in STAGES:
            j = step - lag
            if not 0 <= j < len(order):
                continue
            n, i = order[j]
            if stage == "scores":
                ensure(n)
                ensure(n + 1)
                t, tile_masked = groups[n][1][i]
                pairs[j] = Pair(loaded[n], flags[n][0][i], t, q_tiles[t][1], tile_masked, flags[n][1][i])
                scores_stage(pairs[j], kv, k0, kn, cfg)
            elif stage == "probs":
                probs_stage(pairs[j], stats_sb, k0, kn, cfg)
            elif stage == "dscores":
                dscores_stage(pairs[j], kn)
            elif stage == "dv":
                dv_stage(pairs[j], kv, k0, kn, cfg)
            elif stage == "dk":
                dk_stage(pairs[j], kv, k0, kn, cfg)
            elif stage == "evict":
                evict_stage(pairs[j], k0, kn, cfg)
            elif stage == "dq":
                dq_stage(pairs[j], kv, k0, kn, cfg)
            else:
                acc_stage(pairs[j])
                pairs[j] = None
                if i == len(groups[n][1]) - 1:
                    _finish_group(ins, loaded[n], b, h, groups[n][0], flags[n], q_tiles, cfg)
                    loaded[n] = None


# --------------------------------------------------------------------------- kernel

def _visits(plans, k0):
    """``((query tile, masked), ...)`` of the query tiles whose plan visits key tile ``k0``."""
    return tuple((t, masked) for t, plan in enumerate(plans) for pk0, _, masked in plan if pk0 == k0)


@nki.jit
def flash_bwd_kernel(dout_rows, dout_t, dlse, q_rows, q_t, k_rows, k_t, v_t, out_rows, lse, sinks, doc, causal,
                     scale, window_left, window_right, softcap):
    """Returns ``(dq, dk, dv, dsinks)`` (dq, dk, dv in row-group layout); see the module docstring."""
    batch, num_heads, head_dim, seqlen_q = q_t.shape
    num_kv_heads, seqlen_k = k_t.shape[1], k_t.shape[3]
    group = num_heads // num_kv_heads
    pmax = nl.tile_size.pmax
    mask = tiles.MaskSpec(seqlen_q, seqlen_k, causal, window_left, window_right, doc is not None)
    cfg = Config(mask, scale, softcap, head_dim, bwd_prep.num_stats(mask.has_docs))
    q_tiles = tiles.query_tiles(seqlen_q)

    dq = nl.ndarray(q_rows.shape, dtype=q_rows.dtype, buffer=nl.shared_hbm)
    dk = nl.ndarray(k_rows.shape, dtype=k_rows.dtype, buffer=nl.shared_hbm)
    dv = nl.ndarray(k_rows.shape, dtype=v_t.dtype, buffer=nl.shared_hbm)
    dsinks = nl.ndarray((num_heads,), dtype=nl.float32, buffer=nl.shared_hbm)
    stats_hbm = nl.ndarray((batch, num_heads, pmax, len(q_tiles), cfg.num_stats), dtype=nl.float32,
                           buffer=nl.private_hbm)
    dq_acc = nl.ndarray(q_rows.shape, dtype=nl.float32, buffer=nl.private_hbm)

    # LNC2: the programs split the kv heads (each owns its GQA group's dq/dk/dv rows and dsinks)
    num_progs = nl.num_programs(0) if nl.program_ndim() > 0 else 1
    pid = nl.program_id(0) if num_progs > 1 else 0
    kv_heads = list(range(pid, num_kv_heads, num_progs))
    heads = [hk * group + g for hk in kv_heads for g in range(group)]
    bwd_prep.prepare(dout_rows, dlse, out_rows, lse, sinks, doc, mask, dsinks, stats_hbm, heads,
                     zero_dsinks=sinks is None and pid == 0)

    plans = [tiles.plan_row(mask, q0, qn) for q0, qn in q_tiles]
    acc_free = _acc_stride(head_dim)
    ins = (dout_rows, dout_t, q_rows, q_t, dq, dq_acc)
    per = _group_tiles()
    for b in nl.sequential_range(batch):
        for hk in kv_heads:
            for kt, (k0, kn) in enumerate(tiles.key_tiles(seqlen_k)):
                blocks = tiles.key_blocks(kn)
                visits = _visits(plans, k0)
                dk_started = [False] * len(blocks)
                dv_started = [False] * len(blocks)
                if not visits:
                    _store_kv_grads(dk, dv, b, hk, kt, blocks, None, None, dk_started, dv_started, cfg)
                    continue
                kv_tiles = _load_kv(k_rows, k_t, v_t, b, hk, kt, k0, kn, head_dim)
                dk_psum = nl.ndarray((pmax, len(blocks), acc_free), dtype=nl.float32, buffer=nl.psum)
                dv_psum = nl.ndarray((pmax, len(blocks), acc_free), dtype=nl.float32, buffer=nl.psum)
                kv = (*kv_tiles, dk_psum, dv_psum, dk_started, dv_started)
                for g in nl.sequential_range(group):
                    h = hk * group + g
                    stats_sb = nl.ndarray((pmax, len(q_tiles), cfg.num_stats), dtype=nl.float32, buffer=nl.sbuf)
                    nisa.dma_copy(dst=stats_sb, src=stats_hbm[b, h])
                    _head_pass(ins, kv, stats_sb, b, h, visits, k0, kn, plans, cfg)
                _store_kv_grads(dk, dv, b, hk, kt, blocks, dk_psum, dv_psum, dk_started, dv_started, cfg)
        for h in heads:
            for t, (q0, qn) in enumerate(q_tiles):
                if not plans[t]:
                    zeros_sb = nl.ndarray((pmax, head_dim), dtype=dq.dtype, buffer=nl.sbuf)
                    nisa.memset(dst=zeros_sb[:qn, :], value=0.0)
                    nisa.dma_copy(dst=dq[b, h, t // per, :qn, t % per, :], src=zeros_sb[:qn, :])
    return dq, dk, dv, dsinks


# --------------------------------------------------------------------------- launcher

def lnc_degree() -> int:
    """Logical NeuronCore degree to launch with: ``NEURON_LOGICAL_NC_CONFIG`` (1 or 2, the
    runtime's setting that a kernel launch must match), 1 when unset."""
    value = os.environ.get("NEURON_LOGICAL_NC_CONFIG", "1").strip()
    if value not in ("1", "2"):
        raise ValueError(f"NEURON_LOGICAL_NC_CONFIG must be 1 or 2, got {value!r}")
    return int(value)


def flash_bwd(dout, dlse, q, k, v, out, lse, sinks, cu_seqlens, *, causal, scale, window_left,
              window_right, softcap):
    """Launch the backward kernel: ``(dq, dk, dv, dsinks)`` (dsinks float32 (Hq,), zeros without
    sinks). Raises :class:`Unsupported` before launching when the kernel cannot serve the call."""
    if q.dtype not in KERNEL_DTYPES:
        raise Unsupported(f"dtype {q.dtype} (the backward kernel handles bfloat16, float16, float32)")
    if q.shape[-1] > MAX_HEAD_DIM:
        raise Unsupported(f"head dim {q.shape[-1]} > {MAX_HEAD_DIM}")
    if q.shape[2] + k.shape[2] >= tiles.MAX_INDEX:
        raise Unsupported(f"Sq + Sk = {q.shape[2] + k.shape[2]} >= 2**24 (key indices are float32 in the kernel)")
    if cu_seqlens is not None and softcap == 0 and scale <= 0:
        raise Unsupported("scale <= 0 with cu_seqlens: document-masked scores would not vanish under exp")
    grid = lnc_degree()
    transposed = lambda t: t.transpose(2, 3).contiguous()  # noqa: E731
    doc = None if cu_seqlens is None else tiles.document_bounds(cu_seqlens, q.shape[2])
    dq, dk, dv, dsinks = call_kernel(
        flash_bwd_kernel, row_groups(dout), transposed(dout), dlse.contiguous(), row_groups(q), transposed(q),
        row_groups(k), transposed(k), transposed(v), row_groups(out), lse.contiguous(),
        None if sinks is None else sinks.contiguous(), doc, causal=bool(causal), scale=float(scale),
        window_left=int(window_left), window_right=int(window_right), softcap=float(softcap), grid=grid)
    return from_row_groups(dq, q.shape[2]), from_row_groups(dk, k.shape[2]), from_row_groups(dv, k.shape[2]), dsinks


def row_groups(x):
    """Layout glue: ``(B, H, S, D)`` -> ``(B, H, NG, pmax, per, D)`` with
    ``[.., g, p, s, :] = x[.., (g * per + s) * pmax + p, :]`` (zero rows past S), so one DMA moves a
    group of ``per`` row tiles with one contiguous run per partition."""
    per, pmax = _group_tiles(), nl.tile_size.pmax
    b, h, s, d = x.shape
    ng = -(-s // (per * pmax))
    padded = x.new_zeros((b, h, ng * per * pmax, d))
    padded[:, :, :s] = x
    return padded.reshape(b, h, ng, per, pmax, d).transpose(3, 4).contiguous()


def from_row_groups(y, s):
    """Inverse of :func:`row_groups` (drops the padding rows)."""
    b, h, ng, pmax, per, d = y.shape
    return y.transpose(3, 4).reshape(b, h, ng * per * pmax, d)[:, :, :s].contiguous()
