"""PyTorch reference for ``nki::flash_attention`` (what CPU and CUDA users run by default).

Same argument names as the op. It never materializes the full ``Sq x Sk`` score matrix and
computes only what some query can see:

* **Segments.** Packed documents (``cu_seqlens`` / ``cu_seqlens_k``) are computed one by one on
  their own slices (bottom-right aligned within each document), so keys of other documents are
  never scored.
* **Fused path.** Where PyTorch's fused CPU attention can express a segment (no softcap; full or
  top-left-causal structure, or a chunk of a windowed / offset structure with a small chunk
  mask), it runs ``aten._scaled_dot_product_flash_attention_for_cpu``, which also returns the
  logsumexp, in the inputs' dtype (fp32 accumulation inside), and its backward. GQA is native.
* **Chunked path.** Otherwise (softcap; a gradient arriving through ``lse``) queries are taken in
  chunks and each chunk scores only the key span its rows can see (windows skip everything
  outside), in float32 (float64 stays float64); the backward recomputes probabilities from
  ``lse`` chunk by chunk (flash-attention's recurrence). Memory is O(chunk * span + S * D).
* **Sinks** join the normalizer after the fused/chunked pass: ``lse' = logaddexp(lse, sink)``,
  ``out' = out * exp(lse - lse')``; the backward with ``lse'`` and ``out'`` is the sink-aware one.

Rows that see no key (and no sink) give ``out = 0`` and ``lse = -inf``.

Shapes: B batch, Hq query heads, Hkv kv heads, G = Hq // Hkv, Sq/Sk lengths, D head dim.
``attn_mask`` (optional) is bool (True = attend) or additive float, broadcastable to
(B, Hq, Sq, Sk) with 4 dims; it is combined with the causal/window rules.

``naive`` is the dense formula (one softmax over the full masked score matrix) in the inputs'
dtype, differentiable by autograd: the fp64 oracle and low-precision baseline of the tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from nki_lib.attention import masks
from nki_lib.attention.attention_args import lse_dtype, resolve_scale

_CHUNK_ELEMS = 1 << 24  # score elements per chunk of the chunked path (64 MiB in float32)
_FUSED_CHUNK_ROWS = 512  # query rows per masked fused call (windows / offsets / user masks)

_aten_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_aten_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _unit_stride(t):
    # the fused CPU kernels misread operands whose last dim is strided (measured: wrong values)
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def _fused_fwd(q, k, v, dropout_p, is_causal, *, attn_mask=None, scale):
    q, k, v = (_unit_stride(t) for t in (q, k, v))
    return _aten_fwd(q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)


def _fused_bwd(dout, q, k, v, out, lse, dropout_p, is_causal, *, attn_mask=None, scale):
    dout, q, k, v, out = (_unit_stride(t) for t in (dout, q, k, v, out))
    return _aten_bwd(dout, q, k, v, out, lse, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class Rules:
    """Causal/window/softcap rules of one call; ``offset`` aligns query i with key ``i + offset``."""

    causal: bool
    window_left: int
    window_right: int
    softcap: float
    scale: float

    def key_span(self, q0: int, q1: int, offset: int, sk: int) -> tuple[int, int]:
        """Keys ``[lo, hi)`` some query of ``[q0, q1)`` may see."""
        lo = max(0, q0 + offset - self.window_left) if self.window_left >= 0 else 0
        right = [0] if self.causal else []
        if self.window_right >= 0:
            right.append(self.window_right)
        hi = min(sk, q1 - 1 + offset + min(right) + 1) if right else sk
        return lo, max(lo, hi)

    def visible(self, q0, q1, k0, k1, offset, device):
        """Bool ``[q1 - q0, k1 - k0]`` of the causal/window rules."""
        q_idx = torch.arange(q0, q1, device=device)
        k_idx = torch.arange(k0, k1, device=device)
        return masks.visible_at(q_idx, k_idx, offset=offset, causal=self.causal,
                                window_left=self.window_left, window_right=self.window_right)

    def unmasked(self, sq: int, sk: int, offset: int) -> bool:
        """Does the structure alone mask nothing (no causal/window cut inside [0,Sq) x [0,Sk))?"""
        lo, hi = self.key_span(0, 1, offset, sk)
        lo_last, hi_last = self.key_span(sq - 1, sq, offset, sk)
        return not self.causal and lo == 0 and lo_last == 0 and hi == sk and hi_last == sk


# --------------------------------------------------------------------------- segments

def segments(sq: int, sk: int, cu_seqlens, cu_seqlens_k):
    """``(q0, q1, k0, k1)`` per document (one segment without ``cu_seqlens``)."""
    if cu_seqlens is None:
        return [(0, sq, 0, sk)]
    cu_q = [int(x) for x in cu_seqlens.tolist()]
    cu_k = cu_q if cu_seqlens_k is None else [int(x) for x in cu_seqlens_k.tolist()]
    return [(cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]) for i in range(len(cu_q) - 1)]


def _mask_slice(attn_mask, q0, q1, k0, k1):
    if attn_mask is None:
        return None
    rows = slice(None) if attn_mask.shape[2] == 1 else slice(q0, q1)
    return attn_mask[:, :, rows, k0:k1]


def _additive(struct, user, dtype):
    """One additive mask [B|1, H|1, C, K] (0 / -inf, plus a float user mask) from the structure
    [C, K] and a user mask."""
    struct = struct[None, None]
    neg = torch.tensor(-math.inf, dtype=dtype, device=struct.device)
    if user is None:
        keep = struct
    elif user.dtype == torch.bool:
        keep = struct & user
    else:
        return torch.where(struct, user.to(dtype), neg)
    zero = torch.zeros((), dtype=dtype, device=struct.device)
    return torch.where(keep, zero, neg)


def _empty_rows(additive):
    """Rows (broadcast over B, H) whose keys are all masked."""
    return torch.isneginf(additive).all(dim=-1)


# --------------------------------------------------------------------------- forward

def flash_attention(q, k, v, sinks=None, cu_seqlens=None, cu_seqlens_k=None, attn_mask=None, *,
                    causal=False, scale=None, window_left=-1, window_right=-1, softcap=0.0):
    """Returns ``(out [B,Hq,Sq,D] in q's dtype, lse [B,Hq,Sq] float32)`` (float64 for float64)."""
    rules = Rules(causal, window_left, window_right, float(softcap), resolve_scale(scale, q.shape[-1]))
    sq, sk = q.shape[2], k.shape[2]
    segs = segments(sq, sk, cu_seqlens, cu_seqlens_k)
    if len(segs) == 1 and segs[0] == (0, sq, 0, sk):
        out, lse = _attend(q, k, v, attn_mask, sk - sq, rules)
        return _with_sinks(out, lse, sinks)
    out = q.new_zeros(q.shape)
    lse = torch.full(q.shape[:3], -math.inf, dtype=lse_dtype(q.dtype), device=q.device)
    for q0, q1, k0, k1 in segs:
        if q1 > q0 and k1 > k0:
            o, s = _attend(q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1],
                           _mask_slice(attn_mask, q0, q1, k0, k1), (k1 - k0) - (q1 - q0), rules)
            out[:, :, q0:q1] = o
            lse[:, :, q0:q1] = s
    return _with_sinks(out, lse, sinks)


def _with_sinks(out, lse, sinks):
    if sinks is None:
        return out, lse
    total = torch.logaddexp(lse, sinks.to(lse.dtype)[None, :, None])
    out = (out.to(lse.dtype) * torch.exp(lse - total)[..., None]).to(out.dtype)
    return out, total


def _fusable(q, rules, attn_mask):
    return rules.softcap == 0 and q.dtype != torch.float64


def _attend(q, k, v, attn_mask, offset, rules):
    """Attention of one segment (no sinks): ``(out, lse)`` with empty rows ``0`` / ``-inf``."""
    sq, sk = q.shape[2], k.shape[2]
    if _fusable(q, rules, attn_mask) and attn_mask is None:
        if rules.unmasked(sq, sk, offset):
            out, lse = _fused_fwd(q, k, v, 0.0, False, scale=rules.scale)
            return out, lse.to(lse_dtype(q.dtype))
        if rules.causal and offset == 0 and rules.window_left < 0:
            out, lse = _fused_fwd(q, k, v, 0.0, True, scale=rules.scale)
            return out, lse.to(lse_dtype(q.dtype))
    out = q.new_zeros(q.shape)
    lse = torch.full(q.shape[:3], -math.inf, dtype=lse_dtype(q.dtype), device=q.device)
    fused = _fusable(q, rules, attn_mask)
    step = _FUSED_CHUNK_ROWS if fused else _chunk_rows(q, sk)
    for q0 in range(0, sq, step):
        q1 = min(sq, q0 + step)
        k0, k1 = rules.key_span(q0, q1, offset, sk)
        if k1 <= k0:
            continue
        struct = rules.visible(q0, q1, k0, k1, offset, q.device)
        user = _mask_slice(attn_mask, q0, q1, k0, k1)
        if fused:
            additive = _additive(struct, user, q.dtype)
            o, s = _fused_fwd(q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], 0.0, False,
                              attn_mask=additive, scale=rules.scale)
            s = s.to(lse.dtype).masked_fill(_empty_rows(additive), -math.inf)
        else:
            o, s = _chunk_forward(q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1],
                                  _additive(struct, user, _compute_dtype(q.dtype)), rules)
        out[:, :, q0:q1] = o
        lse[:, :, q0:q1] = s
    return out, lse


def _chunk_rows(q, span):
    b, h = q.shape[0], q.shape[1]
    return max(1, _CHUNK_ELEMS // max(1, b * h * span))


def _grouped(x, hkv):
    b, h, s, d = x.shape
    return x.reshape(b, hkv, h // hkv, s, d)


def _scores(q_c, k, rules):
    """Raw and capped scores of a query chunk: q_c [B,Hkv,G,C,D], k [B,Hkv,K,D] -> [B,Hkv,G,C,K]."""
    s = torch.einsum("bhgcd,bhkd->bhgck", q_c, k) * rules.scale
    if rules.softcap > 0:
        t = torch.tanh(s / rules.softcap)
        return rules.softcap * t, t
    return s, None


def _grouped_mask(additive, hkv):
    """[B|1, Hq|1, C, K] -> broadcastable to [B, Hkv, G, C, K]."""
    b, h = additive.shape[0], additive.shape[1]
    if h == 1:
        return additive[:, :, None]
    return additive.reshape(b, hkv, h // hkv, *additive.shape[2:])


def _chunk_forward(q_c, k_s, v_s, additive, rules):
    """Explicit scores of one chunk in the compute dtype: ``(out in q's dtype, lse)``."""
    cdt = _compute_dtype(q_c.dtype)
    hkv = k_s.shape[1]
    b, hq, c, d = q_c.shape
    s, _ = _scores(_grouped(q_c.to(cdt), hkv), k_s.to(cdt), rules)
    s = s + _grouped_mask(additive, hkv)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    out = torch.einsum("bhgck,bhkd->bhgcd", p, v_s.to(cdt))
    return out.reshape(b, hq, c, d).to(q_c.dtype), lse.reshape(b, hq, c)


# --------------------------------------------------------------------------- backward

def flash_attention_backward(dout, dlse, q, k, v, out, lse, sinks=None, cu_seqlens=None,
                             cu_seqlens_k=None, attn_mask=None, *, causal=False, scale=None,
                             window_left=-1, window_right=-1, softcap=0.0):
    """Gradients ``(dq, dk, dv, dsinks)`` of ``flash_attention``, including the gradient arriving
    through ``lse``: ``dS = P * (dP - delta)`` with ``delta = rowsum(dO * O) - dlse``.
    ``dsinks`` is float32 (Hq,) (zeros when ``sinks`` is None)."""
    rules = Rules(causal, window_left, window_right, float(softcap), resolve_scale(scale, q.shape[-1]))
    sq, sk = q.shape[2], k.shape[2]
    cdt = _compute_dtype(q.dtype)
    delta = (dout.to(cdt) * out.to(cdt)).sum(-1) - dlse.to(cdt)          # [B,Hq,Sq]
    lse_c = lse.to(cdt)
    segs = segments(sq, sk, cu_seqlens, cu_seqlens_k)
    if len(segs) == 1 and segs[0] == (0, sq, 0, sk):
        dq, dk, dv = _attend_bwd(dout, dlse, q, k, v, out, lse_c, delta, attn_mask, sk - sq, rules)
    else:
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for q0, q1, k0, k1 in segs:
            if q1 > q0 and k1 > k0:
                rows, keys = slice(q0, q1), slice(k0, k1)
                g = _attend_bwd(dout[:, :, rows], dlse[:, :, rows], q[:, :, rows], k[:, :, keys],
                                v[:, :, keys], out[:, :, rows], lse_c[:, :, rows],
                                delta[:, :, rows], _mask_slice(attn_mask, q0, q1, k0, k1),
                                (k1 - k0) - (q1 - q0), rules)
                dq[:, :, rows], dk[:, :, keys], dv[:, :, keys] = g
    if sinks is not None:
        sink = sinks.to(cdt)[None, :, None]
        p_sink = torch.exp(sink - torch.where(torch.isinf(lse_c), math.inf, lse_c))
        dsinks = -(p_sink * delta).sum(dim=(0, 2))
    else:
        dsinks = torch.zeros(q.shape[1], dtype=cdt, device=q.device)
    return dq, dk, dv, dsinks.to(lse_dtype(q.dtype))


def _safe_lse(lse):
    """lse of empty rows (-inf) -> +inf, so that recomputed probabilities are exactly 0."""
    return torch.where(torch.isneginf(lse), math.inf, lse)


def _attend_bwd(dout, dlse, q, k, v, out, lse, delta, attn_mask, offset, rules):
    sq, sk = q.shape[2], k.shape[2]
    fused = _fusable(q, rules, attn_mask) and not bool(dlse.any())
    lse_f = _safe_lse(lse).to(torch.float32) if fused else None
    if fused and attn_mask is None:
        whole = rules.unmasked(sq, sk, offset)
        if whole or (rules.causal and offset == 0 and rules.window_left < 0):
            dq, dk, dv = _fused_bwd(dout, q, k, v, out, lse_f, 0.0, not whole, scale=rules.scale)
            return dq, dk, dv
    cdt = _compute_dtype(q.dtype)
    dq = torch.zeros_like(q, dtype=q.dtype if fused else cdt)
    dk = torch.zeros_like(k, dtype=cdt)
    dv = torch.zeros_like(v, dtype=cdt)
    step = _FUSED_CHUNK_ROWS if fused else _chunk_rows(q, sk)
    for q0 in range(0, sq, step):
        q1 = min(sq, q0 + step)
        k0, k1 = rules.key_span(q0, q1, offset, sk)
        if k1 <= k0:
            continue
        rows, keys = slice(q0, q1), slice(k0, k1)
        struct = rules.visible(q0, q1, k0, k1, offset, q.device)
        user = _mask_slice(attn_mask, q0, q1, k0, k1)
        if fused:
            g = _fused_bwd(dout[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys],
                           out[:, :, rows], lse_f[:, :, rows], 0.0, False,
                           attn_mask=_additive(struct, user, q.dtype), scale=rules.scale)
        else:
            g = _chunk_backward(dout[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys],
                                lse[:, :, rows], delta[:, :, rows], _additive(struct, user, cdt),
                                rules)
        dq[:, :, rows] = g[0]
        dk[:, :, keys] += g[1]
        dv[:, :, keys] += g[2]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _chunk_backward(do_c, q_c, k_s, v_s, lse_c, delta_c, additive, rules):
    cdt = _compute_dtype(q_c.dtype)
    hkv = k_s.shape[1]
    b, hq, c, d = q_c.shape
    qg, kc, vc = _grouped(q_c.to(cdt), hkv), k_s.to(cdt), v_s.to(cdt)
    dog = _grouped(do_c.to(cdt), hkv)
    g = hq // hkv
    lse_g = _safe_lse(lse_c).reshape(b, hkv, g, c)
    s, tanh_s = _scores(qg, kc, rules)
    p = torch.exp(s + _grouped_mask(additive, hkv) - lse_g[..., None])
    dv = torch.einsum("bhgck,bhgcd->bhkd", p, dog)
    dp = torch.einsum("bhgcd,bhkd->bhgck", dog, vc)
    ds = p * (dp - delta_c.reshape(b, hkv, g, c)[..., None])
    if tanh_s is not None:
        ds = ds * (1.0 - tanh_s * tanh_s)
    dq = torch.einsum("bhgck,bhkd->bhgcd", ds, kc).reshape(b, hq, c, d) * rules.scale
    dk = torch.einsum("bhgck,bhgcd->bhkd", ds, qg) * rules.scale
    return dq, dk, dv


# --------------------------------------------------------------------------- oracle

def naive(q, k, v, sinks=None, cu_seqlens=None, cu_seqlens_k=None, attn_mask=None, *,
          causal=False, scale=None, window_left=-1, window_right=-1, softcap=0.0):
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
                           cu_seqlens=cu_seqlens, cu_seqlens_k=cu_seqlens_k, device=q.device)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        mask = mask & attn_mask
    elif attn_mask is not None:   # -inf entries mask (so an empty row's gradient is 0, not NaN)
        blocked = attn_mask == -math.inf
        mask = mask & ~blocked
        s = s + attn_mask.masked_fill(blocked, 0).to(s.dtype)
    s = s.masked_fill(~mask, -math.inf)
    if sinks is not None:
        sink_col = sinks.to(s.dtype).reshape(1, hq, 1, 1).expand(b, hq, sq, 1)
        lse = torch.logsumexp(torch.cat([s, sink_col], dim=-1), dim=-1)
    else:
        lse = torch.logsumexp(s, dim=-1)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - safe[..., None])
    out = torch.matmul(p, vr)
    return out.to(q.dtype), lse.to(lse_dtype(q.dtype))
