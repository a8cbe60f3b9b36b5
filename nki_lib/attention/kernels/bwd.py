"""Flash-attention backward: the NKI kernel and its launcher ``flash_bwd``.

Math (``reference.flash_attention_backward``), per query row i and key j, with s = scale * q.k
(then ``softcap * tanh(s / softcap)`` when softcap > 0) and masked pairs excluded:

    P = exp(s - lse)                 recomputed from the forward's lse (no softmax statistics pass)
    delta = rowsum(dO * O) - dlse    the gradient through lse shifts the row term
    dV += P^T dO,  dP = dO V^T,  dS = P * (dP - delta) [* (1 - tanh^2) under softcap]
    dQ = scale * dS K,  dK += scale * dS^T Q,  dsinks[h] = -sum_i exp(sink_h - lse_i) * delta_i

Loop structure (KV-outer, FlashAttention-2 backward):

    phase 0 (bwd_prep): per (h, b, query tile): delta, -lse, mask bounds -> stats scratch;
                        Q^T, dO^T -> HBM scratch; dsinks
    for b, kv head hk, key tile j (<= 512 keys: one fp32 PSUM bank of scores):
        load K (keys on partitions) and K^T, V^T (head dim on partitions, TensorE transposes)
        dK, dV accumulators for the key tile stay in PSUM (fp32)
        for each query head h of hk's GQA group, for each query tile i (128 rows) that sees j:
            S = Q K^T, dP = dO V^T                    TensorE -> PSUM fp32
            mask (range_select, partial tiles only)   VectorE, PSUM -> SBUF
            P = exp(scale * S - lse)                  ScalarE
            dS = (dP - delta) * P                     VectorE, one scalar_tensor_tensor
            dV += P^T dO, dK += dS^T Q                TensorE, per 128-key block (no transposes:
                                                      queries are the contraction dim)
            dS^T (TensorE transposes), evicted half on ScalarE, half on VectorE
            dQ_part = dS K                            TensorE -> PSUM fp32
            dQ accumulation: fp32 HBM scratch, in key-tile order (first visit stores, later
            visits load + fused multiply-add, the last visit writes dq in the output dtype)
        dK = scale * acc (ScalarE), dV = acc (VectorE) -> HBM

GQA: dK/dV of a kv head accumulate over all query heads of its group in the same PSUM tiles.
Deterministic: one fixed accumulation order everywhere, no atomics. Whole-tile skipping and
masks follow ``tiles.plan_row`` / ``tiles.row_bounds`` exactly like the forward; 128-key blocks
that no query of the tile sees are also skipped for the dV/dK/dQ matmuls.

Working set (per partition; D <= 128, 16-bit inputs): SBUF ~ 12 KiB + 24 B per query tile of
stats, independent of the sequence lengths otherwise; PSUM 6 banks (dK, dV, S, dP, dS^T, dQ),
8 banks for D in (128, 256].

Shapes: q, out, dout (B, Hq, Sq, D); k, v (B, Hkv, Sk, D); lse, dlse (B, Hq, Sq) fp32;
sinks (Hq,) fp32; doc_lo, doc_hi (Sq,) fp32 first/last position of each position's document.
Dimension legend: B batch, Hq/Hkv query/kv heads (G = Hq // Hkv), Sq/Sk lengths, D head dim,
qn/kn rows/keys of the current tile, NT query tiles.
Limits: D <= 256 (two contraction chunks); bf16/fp16/fp32; Sq, Sk < 2**24; with masks and no
softcap, scale > 0 (masked scores are filled with the most negative float32 before exp).
"""

from __future__ import annotations

import torch

from nki_lib._nki import nki, nisa, nl
from nki_lib.attention import masks
from nki_lib.attention.kernels import bwd_prep, tiles
from nki_lib.attention.kernels.bwd_prep import DELTA, HI, LO, NEG_LSE
from nki_lib.dispatch import Unsupported, call_kernel

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_HEAD_DIM = 256


class _Config(nl.NKIObject):
    """Compile-time settings shared by the helpers of one kernel launch."""

    def __init__(self, mask, scale: float, softcap: float, head_dim: int, num_stats: int):
        self.mask = mask
        self.scale = scale
        self.softcap = softcap
        self.head_dim = head_dim
        self.num_stats = num_stats


def _acc_stride(head_dim: int) -> int:
    """Free stride of one 128-key block in the dK/dV PSUM accumulators: the next power of two
    >= D, so no block straddles a 2 KiB bank (a matmul result must fit one bank)."""
    return 1 << (head_dim - 1).bit_length()


# --------------------------------------------------------------------------- K/V tile

def _transposed(x_sb, blocks, head_dim):
    """``(pmax, nchunks, kn)``: x^T with the head dim on partitions, per 128-key block through one
    PSUM bank per head-dim chunk (TensorE transposes, ScalarE eviction)."""
    pmax = nl.tile_size.pmax
    chunks = tiles.head_dim_chunks(head_dim)
    kn = blocks[-1][0] + blocks[-1][1]
    xT_sb = nl.ndarray((pmax, len(chunks), kn), dtype=x_sb.dtype, buffer=nl.sbuf)
    for ch, (d0, dc) in enumerate(chunks):
        t_psum = nl.ndarray((pmax, kn), dtype=x_sb.dtype, buffer=nl.psum)
        for c, (s0, sn) in enumerate(blocks):
            nisa.nc_transpose(dst=t_psum[:dc, s0:s0 + sn], data=x_sb[:sn, c, d0:d0 + dc],
                              engine=nisa.engine.tensor)
        nisa.tensor_copy(dst=xT_sb[:dc, ch, :], src=t_psum[:dc, :], engine=nisa.engine.scalar)
    return xT_sb


def _load_kv(k, v, b, hk, k0, blocks, head_dim):
    """K as ``(pmax, nblocks, D)`` (keys on partitions), K^T and V^T as ``(pmax, nchunks, kn)``."""
    pmax = nl.tile_size.pmax
    k_sb = nl.ndarray((pmax, len(blocks), head_dim), dtype=k.dtype, buffer=nl.sbuf)
    v_sb = nl.ndarray((pmax, len(blocks), head_dim), dtype=v.dtype, buffer=nl.sbuf)
    for c, (s0, sn) in enumerate(blocks):
        nisa.dma_copy(dst=k_sb[:sn, c, :], src=k[b, hk, k0 + s0:k0 + s0 + sn, :])
        nisa.dma_copy(dst=v_sb[:sn, c, :], src=v[b, hk, k0 + s0:k0 + s0 + sn, :])
    return k_sb, _transposed(k_sb, blocks, head_dim), _transposed(v_sb, blocks, head_dim)


def _store_kv_grads(dk, dv, b, hk, k0, blocks, dk_psum, dv_psum, started, cfg):
    """dK = scale * acc (ScalarE), dV = acc (VectorE); blocks no query saw get zeros."""
    pmax = nl.tile_size.pmax
    d = cfg.head_dim
    for c, (s0, sn) in enumerate(blocks):
        dk_sb = nl.ndarray((pmax, d), dtype=dk.dtype, buffer=nl.sbuf)
        dv_sb = nl.ndarray((pmax, d), dtype=dv.dtype, buffer=nl.sbuf)
        if started[c]:
            nisa.activation(dst=dk_sb[:sn, :], op=nl.copy, data=dk_psum[:sn, c, :d], scale=cfg.scale)
            nisa.tensor_copy(dst=dv_sb[:sn, :], src=dv_psum[:sn, c, :d], engine=nisa.engine.vector)
        else:
            nisa.memset(dst=dk_sb[:sn, :], value=0.0)
            nisa.memset(dst=dv_sb[:sn, :], value=0.0)
        nisa.dma_copy(dst=dk[b, hk, k0 + s0:k0 + s0 + sn, :], src=dk_sb[:sn, :])
        nisa.dma_copy(dst=dv[b, hk, k0 + s0:k0 + s0 + sn, :], src=dv_sb[:sn, :])


# --------------------------------------------------------------------------- one score tile

def _probs(s_psum, stat, k0, qn, kn, tile_masked, cfg, mm_dtype):
    """P (qn, kn) in the matmul dtype; under softcap also tanh^2 (fp32, for the chain rule)."""
    pmax = nl.tile_size.pmax
    kw = tiles.key_tile_width()
    neg_lse = stat[:qn, NEG_LSE]
    p_sb = nl.ndarray((pmax, kw), dtype=mm_dtype, buffer=nl.sbuf)
    if cfg.softcap > 0:
        t_sb = nl.ndarray((pmax, kw), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=t_sb[:qn, :kn], op=nl.tanh, data=s_psum[:qn, :kn], scale=cfg.scale / cfg.softcap)
        tsq_sb = nl.ndarray((pmax, kw), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=tsq_sb[:qn, :kn], op=nl.square, data=t_sb[:qn, :kn])
        if tile_masked:
            _mask(t_sb[:qn, :kn], t_sb[:qn, :kn], stat, k0, qn)
        nisa.activation(dst=p_sb[:qn, :kn], op=nl.exp, data=t_sb[:qn, :kn], scale=cfg.softcap, bias=neg_lse)
        return p_sb, tsq_sb
    src = s_psum[:qn, :kn]
    if tile_masked:
        sm_sb = nl.ndarray((pmax, kw), dtype=nl.float32, buffer=nl.sbuf)
        _mask(sm_sb[:qn, :kn], src, stat, k0, qn)
        src = sm_sb[:qn, :kn]
    nisa.activation(dst=p_sb[:qn, :kn], op=nl.exp, data=src, scale=cfg.scale, bias=neg_lse)
    return p_sb, None


def _mask(dst, scores, stat, k0, qn):
    """dst = scores where lo <= key <= hi (the row's visible interval), else MASK_FILL."""
    nisa.range_select(dst=dst, on_true_tile=scores, comp_op0=nl.greater_equal, comp_op1=nl.less_equal,
                      bound0=stat[:qn, LO], bound1=stat[:qn, HI], range_start=k0,
                      on_false_value=tiles.MASK_FILL)


def _dscores(dp_psum, p_sb, tsq_sb, stat, qn, kn, mm_dtype):
    """dS = (dP - delta) * P, times (1 - tanh^2) under softcap (VectorE)."""
    pmax = nl.tile_size.pmax
    kw = tiles.key_tile_width()
    factor = p_sb[:qn, :kn]
    if tsq_sb is not None:
        g_sb = nl.ndarray((pmax, kw), dtype=nl.float32, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(dst=g_sb[:qn, :kn], data=tsq_sb[:qn, :kn], op0=nl.subtract, operand0=1.0,
                                  reverse0=True, op1=nl.multiply, operand1=factor)
        factor = g_sb[:qn, :kn]
    ds_sb = nl.ndarray((pmax, kw), dtype=mm_dtype, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(dst=ds_sb[:qn, :kn], data=dp_psum[:qn, :kn], op0=nl.subtract,
                              operand0=stat[:qn, DELTA], op1=nl.multiply, operand1=factor)
    return ds_sb


def _update_dq(dq, dq_acc, b, h, q0, qn, dq_psum, first, last, cfg):
    """Accumulate scale * dQ_part into the fp32 scratch; the last visit writes dq (output dtype)."""
    pmax = nl.tile_size.pmax
    d = cfg.head_dim
    res_sb = nl.ndarray((pmax, d), dtype=dq.dtype if last else nl.float32, buffer=nl.sbuf)
    if first:
        nisa.activation(dst=res_sb[:qn, :], op=nl.copy, data=dq_psum[:qn, :], scale=cfg.scale)
    else:
        acc_sb = nl.ndarray((pmax, d), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=acc_sb[:qn, :], src=dq_acc[b, h, q0:q0 + qn, :])
        nisa.scalar_tensor_tensor(dst=res_sb[:qn, :], data=dq_psum[:qn, :], op0=nl.multiply,
                                  operand0=cfg.scale, op1=nl.add, operand1=acc_sb[:qn, :])
    target = dq if last else dq_acc
    nisa.dma_copy(dst=target[b, h, q0:q0 + qn, :], src=res_sb[:qn, :])


def _tile_step(ins, scratch, kv, stats_sb, b, h, t, tile_masked, k0, kn, first, last, cfg):
    """All work of one (query tile, key tile) pair; see the module docstring."""
    dout, q, dq = ins
    qT_hbm, doT_hbm, dq_acc = scratch
    k_sb, kT_sb, vT_sb, dk_psum, dv_psum, started = kv
    pmax = nl.tile_size.pmax
    kw = tiles.key_tile_width()
    d = cfg.head_dim
    q0 = t * pmax
    qn = min(pmax, q.shape[2] - q0)
    mm_dtype = q.dtype
    chunks = tiles.head_dim_chunks(d)
    blocks = tiles.key_blocks(kn)
    stat = stats_sb[:, t, :]

    q_sb = nl.ndarray((pmax, d), dtype=q.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=q_sb[:qn, :], src=q[b, h, q0:q0 + qn, :])
    do_sb = nl.ndarray((pmax, d), dtype=dout.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=do_sb[:qn, :], src=dout[b, h, q0:q0 + qn, :])
    qT_sb = nl.ndarray((pmax, len(chunks), pmax), dtype=q.dtype, buffer=nl.sbuf)
    doT_sb = nl.ndarray((pmax, len(chunks), pmax), dtype=dout.dtype, buffer=nl.sbuf)
    for ch, (d0, dc) in enumerate(chunks):
        nisa.dma_copy(dst=qT_sb[:dc, ch, :qn], src=qT_hbm[b, h, d0:d0 + dc, q0:q0 + qn])
        nisa.dma_copy(dst=doT_sb[:dc, ch, :qn], src=doT_hbm[b, h, d0:d0 + dc, q0:q0 + qn])

    s_psum = nl.ndarray((pmax, kw), dtype=nl.float32, buffer=nl.psum)
    dp_psum = nl.ndarray((pmax, kw), dtype=nl.float32, buffer=nl.psum)
    for ch, (d0, dc) in enumerate(chunks):
        nisa.nc_matmul(dst=s_psum[:qn, :kn], stationary=qT_sb[:dc, ch, :qn], moving=kT_sb[:dc, ch, :kn],
                       accumulate=ch > 0)
    for ch, (d0, dc) in enumerate(chunks):
        nisa.nc_matmul(dst=dp_psum[:qn, :kn], stationary=doT_sb[:dc, ch, :qn], moving=vT_sb[:dc, ch, :kn],
                       accumulate=ch > 0)
    p_sb, tsq_sb = _probs(s_psum, stat, k0, qn, kn, tile_masked, cfg, mm_dtype)
    ds_sb = _dscores(dp_psum, p_sb, tsq_sb, stat, qn, kn, mm_dtype)

    seen = [c for c, (s0, sn) in enumerate(blocks) if cfg.mask.tile_visible(q0, qn, k0 + s0, sn)]
    dsT_psum = nl.ndarray((pmax, len(blocks), pmax), dtype=mm_dtype, buffer=nl.psum)
    dsT_sb = nl.ndarray((pmax, len(blocks), pmax), dtype=mm_dtype, buffer=nl.sbuf)
    for c in seen:
        s0, sn = blocks[c]
        nisa.nc_matmul(dst=dv_psum[:sn, c, :d], stationary=p_sb[:qn, s0:s0 + sn], moving=do_sb[:qn, :],
                       accumulate=started[c])
        nisa.nc_matmul(dst=dk_psum[:sn, c, :d], stationary=ds_sb[:qn, s0:s0 + sn], moving=q_sb[:qn, :],
                       accumulate=started[c])
        started[c] = True
        nisa.nc_transpose(dst=dsT_psum[:sn, c, :qn], data=ds_sb[:qn, s0:s0 + sn], engine=nisa.engine.tensor)
        evict_engine = nisa.engine.scalar if c % 2 == 0 else nisa.engine.vector
        nisa.tensor_copy(dst=dsT_sb[:sn, c, :qn], src=dsT_psum[:sn, c, :qn], engine=evict_engine)
    dq_psum = nl.ndarray((pmax, d), dtype=nl.float32, buffer=nl.psum)
    for n, c in enumerate(seen):
        s0, sn = blocks[c]
        nisa.nc_matmul(dst=dq_psum[:qn, :], stationary=dsT_sb[:sn, c, :qn], moving=k_sb[:sn, c, :],
                       accumulate=n > 0)
    if seen:
        _update_dq(dq, dq_acc, b, h, q0, qn, dq_psum, first, last, cfg)
    else:
        _update_dq_without_part(dq, dq_acc, b, h, q0, qn, first, last, cfg)


def _update_dq_without_part(dq, dq_acc, b, h, q0, qn, first, last, cfg):
    """A visited key tile whose every 128-key block is invisible (only possible when whole-tile
    planning is coarser than the blocks): keep the dQ accumulation chain intact."""
    pmax = nl.tile_size.pmax
    d = cfg.head_dim
    res_sb = nl.ndarray((pmax, d), dtype=dq.dtype if last else nl.float32, buffer=nl.sbuf)
    if first:
        nisa.memset(dst=res_sb[:qn, :], value=0.0)
    else:
        nisa.dma_copy(dst=res_sb[:qn, :], src=dq_acc[b, h, q0:q0 + qn, :])
    target = dq if last else dq_acc
    nisa.dma_copy(dst=target[b, h, q0:q0 + qn, :], src=res_sb[:qn, :])


# --------------------------------------------------------------------------- kernel

def _visits(plans, k0):
    """``((query tile, masked), ...)`` of the query tiles whose plan visits key tile ``k0``."""
    return tuple((t, masked) for t, plan in enumerate(plans) for pk0, _, masked in plan if pk0 == k0)


@nki.jit
def flash_bwd_kernel(dout, dlse, q, k, v, out, lse, sinks, doc_lo, doc_hi, causal, scale,
                     window_left, window_right, softcap):
    """Returns ``(dq, dk, dv, dsinks)``; see the module docstring."""
    batch, num_heads, seqlen_q, head_dim = q.shape
    num_kv_heads, seqlen_k = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    pmax = nl.tile_size.pmax
    mask = tiles.MaskSpec(seqlen_q, seqlen_k, causal, window_left, window_right, doc_lo is not None)
    masked = mask.causal or mask.window_left >= 0 or mask.window_right >= 0 or mask.has_docs
    cfg = _Config(mask, scale, softcap, head_dim, bwd_prep.num_stats(masked))
    q_tiles = tiles.query_tiles(seqlen_q)

    dq = nl.ndarray(q.shape, dtype=q.dtype, buffer=nl.shared_hbm)
    dk = nl.ndarray(k.shape, dtype=k.dtype, buffer=nl.shared_hbm)
    dv = nl.ndarray(v.shape, dtype=v.dtype, buffer=nl.shared_hbm)
    dsinks = nl.ndarray((num_heads,), dtype=nl.float32, buffer=nl.shared_hbm)
    stats_hbm = nl.ndarray((batch, num_heads, pmax, len(q_tiles), cfg.num_stats), dtype=nl.float32,
                           buffer=nl.private_hbm)
    qT_hbm = nl.ndarray((batch, num_heads, head_dim, seqlen_q), dtype=q.dtype, buffer=nl.private_hbm)
    doT_hbm = nl.ndarray((batch, num_heads, head_dim, seqlen_q), dtype=dout.dtype, buffer=nl.private_hbm)
    dq_acc = nl.ndarray(q.shape, dtype=nl.float32, buffer=nl.private_hbm)

    bwd_prep.prepare(dout, dlse, q, out, lse, sinks, doc_lo, doc_hi, mask, dsinks, stats_hbm, qT_hbm, doT_hbm)

    plans = [tiles.plan_row(mask, q0, qn) for q0, qn in q_tiles]
    acc_shape_free = _acc_stride(head_dim)
    for b in nl.sequential_range(batch):
        for hk in nl.sequential_range(num_kv_heads):
            for k0, kn in tiles.key_tiles(seqlen_k):
                blocks = tiles.key_blocks(kn)
                visits = _visits(plans, k0)
                dk_psum = nl.ndarray((pmax, len(blocks), acc_shape_free), dtype=nl.float32, buffer=nl.psum)
                dv_psum = nl.ndarray((pmax, len(blocks), acc_shape_free), dtype=nl.float32, buffer=nl.psum)
                started = [False] * len(blocks)
                if visits:
                    k_sb, kT_sb, vT_sb = _load_kv(k, v, b, hk, k0, blocks, head_dim)
                    kv = (k_sb, kT_sb, vT_sb, dk_psum, dv_psum, started)
                    for g in nl.sequential_range(group):
                        h = hk * group + g
                        stats_sb = nl.ndarray((pmax, len(q_tiles), cfg.num_stats), dtype=nl.float32,
                                              buffer=nl.sbuf)
                        nisa.dma_copy(dst=stats_sb, src=stats_hbm[b, h])
                        for t, tile_masked in visits:
                            first = plans[t][0][0] == k0
                            last = plans[t][-1][0] == k0
                            _tile_step((dout, q, dq), (qT_hbm, doT_hbm, dq_acc), kv, stats_sb, b, h, t,
                                       tile_masked, k0, kn, first, last, cfg)
                _store_kv_grads(dk, dv, b, hk, k0, blocks, dk_psum, dv_psum, started, cfg)
        for h in nl.sequential_range(num_heads):
            for t, (q0, qn) in enumerate(q_tiles):
                if not plans[t]:
                    zeros_sb = nl.ndarray((pmax, head_dim), dtype=dq.dtype, buffer=nl.sbuf)
                    nisa.memset(dst=zeros_sb[:qn, :], value=0.0)
                    nisa.dma_copy(dst=dq[b, h, q0:q0 + qn, :], src=zeros_sb[:qn, :])
    return dq, dk, dv, dsinks


# --------------------------------------------------------------------------- launcher

def document_bounds(cu_seqlens: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Host metadata: first and last position (float32, (length,)) of each position's document."""
    seg = masks.segment_ids(cu_seqlens, length).long()
    cu = cu_seqlens.long()
    return cu[seg].to(torch.float32), (cu[seg + 1] - 1).to(torch.float32)


def flash_bwd(dout, dlse, q, k, v, out, lse, sinks, cu_seqlens, *, causal, scale, window_left,
              window_right, softcap):
    """Launch the backward kernel: ``(dq, dk, dv, dsinks)`` (dsinks float32 (Hq,), zeros without
    sinks). Raises :class:`Unsupported` before launching when the kernel cannot serve the call."""
    if q.dtype not in KERNEL_DTYPES:
        raise Unsupported(f"dtype {q.dtype}: the backward kernel handles bf16/fp16/fp32")
    if q.shape[-1] > MAX_HEAD_DIM:
        raise Unsupported(f"head dim {q.shape[-1]} > {MAX_HEAD_DIM}")
    if max(q.shape[2], k.shape[2]) >= tiles.MAX_INDEX:
        raise Unsupported(f"sequence length >= {tiles.MAX_INDEX} (key indices are float32 in the kernel)")
    has_mask = causal or window_left >= 0 or window_right >= 0 or cu_seqlens is not None
    if has_mask and softcap == 0 and scale <= 0:
        raise Unsupported("scale <= 0 with a mask: masked scores would not vanish under exp")
    doc_lo = doc_hi = None
    if cu_seqlens is not None:
        doc_lo, doc_hi = document_bounds(cu_seqlens.to(q.device), q.shape[2])
    f32 = lambda t: t.to(torch.float32).contiguous()  # noqa: E731  (lse/dlse/sinks are fp32 already)
    sinks_arg = None if sinks is None else f32(sinks)
    return call_kernel(flash_bwd_kernel, dout.contiguous(), f32(dlse), q.contiguous(), k.contiguous(),
                       v.contiguous(), out.contiguous(), f32(lse), sinks_arg, doc_lo, doc_hi,
                       causal=causal, scale=float(scale), window_left=window_left,
                       window_right=window_right, softcap=float(softcap))
