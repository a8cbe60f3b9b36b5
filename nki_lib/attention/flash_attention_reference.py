"""PyTorch reference for ``nki::flash_attention`` (what CPU and CUDA users run by default).

Same argument names as the op. Low-precision inputs are computed in float32 (float64 stays
float64). It never materializes the full ``Sq x Sk`` score matrix: queries are processed in
chunks of at most ``_CHUNK_ELEMS / Sk`` rows, and the backward recomputes probabilities from
``lse`` chunk by chunk (flash-attention's recurrence), so memory is O(chunk * Sk + S * D).
GQA is computed by grouping query heads per kv head (K/V are never repeated).

Shapes: B batch, Hq query heads, Hkv kv heads, G = Hq // Hkv, Sq/Sk lengths, D head dim.

``naive`` is the dense formula (one softmax over the full masked score matrix) in the inputs'
dtype, differentiable by autograd: the fp64 oracle and low-precision baseline of the tests.
"""

from __future__ import annotations

import math

import torch

from nki_lib.attention import masks

_CHUNK_ELEMS = 1 << 24  # score elements per chunk (64 MiB in float32)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def resolve_scale(scale: float | None, head_dim: int) -> float:
    return head_dim ** -0.5 if scale is None else float(scale)


def _chunk_rows(b: int, h: int, sk: int) -> int:
    return max(1, _CHUNK_ELEMS // max(1, b * h * sk))


def _scores(q_c, k, *, scale, softcap):
    """Raw and capped scores of a query chunk: q_c [B,Hkv,G,C,D], k [B,Hkv,Sk,D] -> [B,Hkv,G,C,Sk]."""
    s = torch.einsum("bhgcd,bhkd->bhgck", q_c, k) * scale
    if softcap > 0:
        t = torch.tanh(s / softcap)
        return softcap * t, t
    return s, None


def _chunk_mask(q0, q1, *, sq, sk, causal, window_left, window_right, seg, device):
    q_idx = torch.arange(q0, q1, device=device)
    k_idx = torch.arange(sk, device=device)
    mask = masks.visible(q_idx, k_idx, sq=sq, sk=sk, causal=causal, window_left=window_left,
                         window_right=window_right)
    if seg is not None:
        mask &= seg[q0:q1, None] == seg[None, :]
    return mask


def _grouped(q, hkv):
    b, hq, sq, d = q.shape
    return q.reshape(b, hkv, hq // hkv, sq, d)


def flash_attention(q, k, v, sinks=None, cu_seqlens=None, *, causal=False, scale=None,
                    window_left=-1, window_right=-1, softcap=0.0):
    """Returns ``(out [B,Hq,Sq,D] in q's dtype, lse [B,Hq,Sq] float32)`` (float64 for float64)."""
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    cdt = _compute_dtype(q.dtype)
    scale = resolve_scale(scale, d)
    qg, kc, vc = _grouped(q.to(cdt), hkv), k.to(cdt), v.to(cdt)
    g = hq // hkv
    seg = masks.segment_ids(cu_seqlens, sq) if cu_seqlens is not None else None
    sink_g = None if sinks is None else sinks.to(cdt).reshape(1, hkv, g, 1)
    out = torch.empty(b, hkv, g, sq, d, dtype=cdt, device=q.device)
    lse = torch.empty(b, hkv, g, sq, dtype=cdt, device=q.device)
    step = _chunk_rows(b, hq, sk)
    for q0 in range(0, sq, step):
        q1 = min(sq, q0 + step)
        s, _ = _scores(qg[:, :, :, q0:q1], kc, scale=scale, softcap=softcap)
        mask = _chunk_mask(q0, q1, sq=sq, sk=sk, causal=causal, window_left=window_left,
                           window_right=window_right, seg=seg, device=q.device)
        s = s.masked_fill(~mask, -math.inf)
        lse_c = torch.logsumexp(s, dim=-1)
        if sink_g is not None:
            lse_c = torch.logaddexp(lse_c, sink_g.expand_as(lse_c))
        p = torch.exp(s - torch.where(torch.isinf(lse_c), 0.0, lse_c)[..., None])
        out[:, :, :, q0:q1] = torch.einsum("bhgck,bhkd->bhgcd", p, vc)
        lse[:, :, :, q0:q1] = lse_c
    out = out.reshape(b, hq, sq, d).to(q.dtype)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return out, lse.reshape(b, hq, sq).to(lse_dtype)


def flash_attention_backward(dout, dlse, q, k, v, out, lse, sinks=None, cu_seqlens=None, *,
                             causal=False, scale=None, window_left=-1, window_right=-1, softcap=0.0):
    """Gradients ``(dq, dk, dv, dsinks)`` of ``flash_attention``, including the gradient arriving
    through ``lse``: ``dS = P * (dP - delta)`` with ``delta = rowsum(dO * O) - dlse``.
    ``dsinks`` is float32 (Hq,) (zeros when ``sinks`` is None)."""
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    g = hq // hkv
    cdt = _compute_dtype(q.dtype)
    scale = resolve_scale(scale, d)
    qg, kc, vc = _grouped(q.to(cdt), hkv), k.to(cdt), v.to(cdt)
    dog, og = _grouped(dout.to(cdt), hkv), _grouped(out.to(cdt), hkv)
    lse_g = lse.to(cdt).reshape(b, hkv, g, sq)
    dlse_g = dlse.to(cdt).reshape(b, hkv, g, sq)
    delta = (dog * og).sum(-1) - dlse_g                       # [B,Hkv,G,Sq]
    seg = masks.segment_ids(cu_seqlens, sq) if cu_seqlens is not None else None
    dq = torch.zeros_like(qg)
    dk = torch.zeros_like(kc)
    dv = torch.zeros_like(vc)
    step = _chunk_rows(b, hq, sk)
    for q0 in range(0, sq, step):
        q1 = min(sq, q0 + step)
        s, tanh_s = _scores(qg[:, :, :, q0:q1], kc, scale=scale, softcap=softcap)
        mask = _chunk_mask(q0, q1, sq=sq, sk=sk, causal=causal, window_left=window_left,
                           window_right=window_right, seg=seg, device=q.device)
        lse_c = lse_g[:, :, :, q0:q1]
        p = torch.exp(s - torch.where(torch.isinf(lse_c), 0.0, lse_c)[..., None])
        p = p.masked_fill(~mask, 0.0)
        do_c = dog[:, :, :, q0:q1]
        dv += torch.einsum("bhgck,bhgcd->bhkd", p, do_c)
        dp = torch.einsum("bhgcd,bhkd->bhgck", do_c, vc)
        ds = p * (dp - delta[:, :, :, q0:q1, None])
        if tanh_s is not None:
            ds = ds * (1.0 - tanh_s * tanh_s)
        dq[:, :, :, q0:q1] = torch.einsum("bhgck,bhkd->bhgcd", ds, kc) * scale
        dk += torch.einsum("bhgck,bhgcd->bhkd", ds, qg[:, :, :, q0:q1]) * scale
    if sinks is not None:
        sink_g = sinks.to(cdt).reshape(1, hkv, g, 1)
        p_sink = torch.exp(sink_g - torch.where(torch.isinf(lse_g), math.inf, lse_g))
        dsinks = -(p_sink * delta).sum(dim=(0, 3)).reshape(hq)
    else:
        dsinks = torch.zeros(hq, dtype=cdt, device=q.device)
    sink_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return (dq.reshape(b, hq, sq, d).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
            dsinks.to(sink_dtype))


def naive(q, k, v, sinks=None, cu_seqlens=None, *, causal=False, scale=None, window_left=-1,
          window_right=-1, softcap=0.0):
    """Dense attention in the inputs' dtype (autograd-differentiable oracle / baseline)."""
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    scale = resolve_scale(scale, d)
    kr = k.repeat_interleave(hq // hkv, dim=1)
    vr = v.repeat_interleave(hq // hkv, dim=1)
    s = torch.matmul(q, kr.transpose(-1, -2)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    mask = masks.full_mask(sq, sk, causal=causal, window_left=window_left, window_right=window_right,
                           cu_seqlens=cu_seqlens, device=q.device)
    s = s.masked_fill(~mask, -math.inf)
    if sinks is not None:
        sink_col = sinks.to(s.dtype).reshape(1, hq, 1, 1).expand(b, hq, sq, 1)
        lse = torch.logsumexp(torch.cat([s, sink_col], dim=-1), dim=-1)
    else:
        lse = torch.logsumexp(s, dim=-1)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - safe[..., None])
    out = torch.matmul(p, vr)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return out.to(q.dtype), lse.to(lse_dtype)
