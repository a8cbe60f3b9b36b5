"""PyTorch reference for ``nki::flash_attention`` (what CPU and CUDA users run by default).

Same argument names as the op. It never materializes the full ``Sq x Sk`` score matrix and
computes only what some query can see:

* **Segments.** Packed documents (``cu_seqlens`` / ``cu_seqlens_k``) are computed one by one on
  their own slices (bottom-right aligned within each document), so keys of other documents are
  never scored.
* **Fused path.** Where PyTorch's fused CPU attention can express a segment (no softcap, not
  float64, no gradient through ``lse``) it runs ``aten._scaled_dot_product_flash_attention_for_cpu``,
  which also returns the logsumexp, in the inputs' dtype (fp32 accumulation inside), and its
  backward; GQA is native. Full and top-left-causal segments take one call; windows, offsets and
  user masks take chunks of ``_FUSED_CHUNK_ROWS`` query rows, each over the key span its rows can
  see, with a small additive chunk mask. A call or chunk whose lse comes out NaN (an +inf score
  meeting a -inf mask entry, or a row of +inf scores, whose lse the CPU kernel gives as NaN on some
  CPUs and +inf on others) is recomputed on the explicit path, which gives the contract's
  ``lse = +inf``.
* **Explicit path.** Otherwise (softcap; float64; a gradient arriving through ``lse``) queries
  are taken in chunks of about ``_CHUNK_ELEMS`` scores; each chunk scores only the key span its
  rows can see (causal/window chunks skip every fully masked key), the G query heads of a kv
  head stacked into one matmul, in float32 (float64 stays float64; k and v are converted once per
  call, not per chunk). The rules mask only the column bands they cut (cached patterns); scores
  are transformed in place (:class:`ScoreMap`: softcap through one ``exp`` for bf16/fp16, through
  ``tanh`` for float32/float64). The backward recomputes probabilities from ``lse`` chunk by
  chunk (flash-attention's recurrence). Memory is O(chunk + S * D).
* **Sinks** join the normalizer after the fused/explicit pass: ``lse' = logaddexp(lse, sink)``,
  ``out' = out * exp(lse - lse')`` (exact); the backward with ``lse'`` and ``out'`` is the
  sink-aware one, so sinks + windows also run on the fused kernel.

Rows that see no key (and no sink) give ``out = 0`` and ``lse = -inf``.

Shapes: B batch, Hq query heads, Hkv kv heads, G = Hq // Hkv, Sq/Sk lengths, D head dim.
``attn_mask`` (optional) is bool (True = attend) or additive float, broadcastable to
(B, Hq, Sq, Sk) with 4 dims; it is combined with the causal/window rules.

``naive`` is the dense formula (one softmax over the full masked score matrix) in the inputs'
dtype, differentiable by autograd: the fp64 oracle and low-precision baseline of the tests.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from nki_lib.attention import masks
from nki_lib.attention.attention_args import lse_dtype, resolve_scale

_CHUNK_ELEMS = 1 << 20  # score elements per chunk of the explicit path (4 MiB in float32)
_MIN_CHUNK_ROWS = 16    # fewest query rows per explicit chunk (few rows: per-op overhead dominates)
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


def _fusable(q, rules):
    return rules.softcap == 0 and q.dtype != torch.float64


def _attend(q, k, v, attn_mask, offset, rules):
    """Attention of one segment (no sinks): ``(out, lse)`` with empty rows ``0`` / ``-inf``."""
    sq, sk = q.shape[2], k.shape[2]
    fused = _fusable(q, rules)
    one_call = _one_call(rules, sq, sk, offset, attn_mask)
    if fused and one_call is not None:
        out, lse = _fused_fwd(q, k, v, 0.0, one_call, attn_mask=_key_additive(attn_mask, q.dtype),
                              scale=rules.scale)
        lse = lse.to(lse_dtype(q.dtype))
        if attn_mask is not None:
            lse = lse.masked_fill(_keyless_rows(attn_mask, sq, one_call), -math.inf)
        if not bool(torch.isnan(lse).any()):
            return out, lse
        # an +inf score met a -inf mask entry, or a row of +inf scores (the CPU kernel's lse is
        # NaN there on some CPUs, +inf on others): the explicit path gives lse = +inf
        fused = False
    out = q.new_zeros(q.shape)
    lse = torch.full(q.shape[:3], -math.inf, dtype=lse_dtype(q.dtype), device=q.device)
    if not fused:
        return _explicit_forward(q, k, v, attn_mask, offset, rules, out, lse)
    for q0, q1, k0, k1 in _row_chunks(rules, sq, sk, offset, _FUSED_CHUNK_ROWS):
        rows, keys = slice(q0, q1), slice(k0, k1)
        user = _mask_slice(attn_mask, q0, q1, k0, k1)
        o_s = _fused_chunk_fwd(q[:, :, rows], k[:, :, keys], v[:, :, keys],
                               rules.visible(q0, q1, k0, k1, offset, q.device), user, rules)
        if o_s is None:   # NaN lse rows: the explicit path states them exactly
            o_s = _explicit_forward(q[:, :, rows], k[:, :, keys], v[:, :, keys],
                                    user, offset + q0 - k0, rules,
                                    out[:, :, rows], lse[:, :, rows])
        out[:, :, rows], lse[:, :, rows] = o_s
    return out, lse


def _one_call(rules, sq, sk, offset, attn_mask):
    """``is_causal`` of a whole-segment fused call (False: no structure, True: top-left causal),
    or None where the structure or a per-row user mask needs chunks. A user mask that is the same
    for every query row (key padding, (B|1, H|1, 1, Sk)) rides along as it is."""
    if attn_mask is not None and attn_mask.shape[2] != 1:
        return None
    if rules.unmasked(sq, sk, offset):
        return False
    if rules.causal and offset == 0 and rules.window_left < 0:
        return True
    return None


def _key_additive(attn_mask, dtype):
    """A per-key user mask (B|1, H|1, 1, Sk) as the fused kernel's additive mask (None stays None)."""
    if attn_mask is None or attn_mask.dtype != torch.bool:
        return None if attn_mask is None else attn_mask.to(dtype)
    return torch.where(attn_mask, torch.zeros((), dtype=dtype), torch.full((), -math.inf, dtype=dtype))


def _keyless_rows(attn_mask, sq, causal):
    """Bool (B|1, H|1, Sq|1): rows of a whole-segment call whose visible keys the per-key mask
    hides all of (with top-left causal, row i sees keys [0, i]; Sq == Sk there)."""
    keep = attn_mask[:, :, 0] if attn_mask.dtype == torch.bool else ~torch.isneginf(attn_mask[:, :, 0])
    if causal:
        return keep.cumsum(dim=-1)[..., :sq] == 0
    return ~keep.any(dim=-1, keepdim=True)


def _fused_chunk_fwd(q_rows, k_span, v_span, struct, user, rules):
    """One chunk on the fused kernel with an additive mask; None where a row's lse came out NaN
    (an +inf score met a -inf mask entry: the explicit path then gives the contract's +inf)."""
    additive = _additive(struct, user, q_rows.dtype)
    out, lse = _fused_fwd(q_rows, k_span, v_span, 0.0, False, attn_mask=additive, scale=rules.scale)
    lse = lse.masked_fill(_empty_rows(additive), -math.inf)
    return None if bool(torch.isnan(lse).any()) else (out, lse)


def _explicit_rows(q, sk):
    """Query rows per chunk of the explicit path (about ``_CHUNK_ELEMS`` scores per chunk)."""
    b, h = q.shape[0], q.shape[1]
    return max(_MIN_CHUNK_ROWS, _CHUNK_ELEMS // max(1, b * h * sk))


def _group_rows(x_rows, hkv):
    """[B, Hq, C, ...] -> [B, Hkv, G * C, ...] (the G query heads of a kv head stacked; a view
    for G == 1)."""
    b, h, c = x_rows.shape[:3]
    return x_rows.reshape(b, hkv, (h // hkv) * c, *x_rows.shape[3:])


def _ungroup_rows(x_g, hq):
    """[B, Hkv, G * C, ...] -> [B, Hq, C, ...] (inverse of :func:`_group_rows`)."""
    b, hkv, gc = x_g.shape[:3]
    return x_g.reshape(b, hq, gc // (hq // hkv), *x_g.shape[3:])


def _grouped_mask(mask, hkv):
    """[B|1, Hq|1, C|1, K] -> broadcastable to [B, Hkv, G, C, K]."""
    b, h = mask.shape[0], mask.shape[1]
    if h == 1:
        return mask[:, :, None]
    return mask.reshape(b, hkv, h // hkv, *mask.shape[2:])


@functools.lru_cache(maxsize=64)
def _hidden_band(rel, rows, width, causal, window_left, window_right, device):
    """Bool [rows, width], True where query i does not see key column j of a band whose first
    column is ``rel`` keys right of row 0's aligned key (cached: aligned chunks repeat it)."""
    return ~masks.visible_at(torch.arange(rows, device=device),
                             torch.arange(rel, rel + width, device=device), offset=0,
                             causal=causal, window_left=window_left, window_right=window_right)


@dataclass(frozen=True)
class ExplicitChunk:
    """One query chunk of the explicit path: rows ``[q0, q1)``, key span ``[k0, k1)``, ``offset``
    (query i aligned with key i + offset) and the user mask slice (or None)."""

    q0: int
    q1: int
    k0: int
    k1: int
    offset: int
    user: torch.Tensor | None

    def mask_(self, z, rules, hkv):
        """In place on the chunk's log-domain scores z [B, Hkv, G * C, K]: add a float user
        mask; -inf where a bool user mask or the causal/window rules hide the key (the rules
        only on the column bands they cut)."""
        b, _, gc, kk = z.shape
        c = self.q1 - self.q0
        z5 = z.view(b, hkv, gc // c, c, kk)
        if self.user is not None and self.user.dtype == torch.bool:
            z5.masked_fill_(_grouped_mask(~self.user, hkv), -math.inf)
        elif self.user is not None:
            z5.add_(_grouped_mask(self.user.to(z.dtype), hkv))
        for c0, c1 in self._bands(rules):
            z5[..., c0:c1].masked_fill_(
                _hidden_band(self.k0 + c0 - self.q0 - self.offset, c, c1 - c0, rules.causal,
                             rules.window_left, rules.window_right, z.device), -math.inf)

    def _bands(self, rules):
        """Column ranges (relative to k0) where the rules hide some key of some row."""
        width, bands = self.k1 - self.k0, []
        right = [r for r in ((0 if rules.causal else -1), rules.window_right) if r >= 0]
        if right:   # keys right of row q0's limit
            start = self.q0 + self.offset + min(right) + 1 - self.k0
            if start < width:
                bands.append((max(0, start), width))
        if rules.window_left >= 0:   # keys left of row q1 - 1's limit
            stop = min(width, self.q1 - 1 + self.offset - rules.window_left - self.k0)
            if stop > 0:
                bands.append((0, stop))
        return bands


@dataclass(frozen=True)
class ScoreMap:
    """How the explicit path turns ``x = q_s . k`` (q_s = q * ``factor``) into log-domain scores
    ``z`` and, for the backward, ``dz/ds`` up to the constant ``grad_scale / scale``.

    * no softcap: ``factor = scale``, ``z = x``;
    * softcap ``c``, float32/float64 inputs: ``factor = scale / c``, ``z = c tanh(x)``,
      ``dz/ds = 1 - tanh(x)^2``;
    * softcap, bf16/fp16 inputs: the same function through one ``exp`` (a third of ``tanh``'s
      cost on CPU): ``factor = 2 scale / c``, ``r = 1 / (1 + exp(x))``, ``tanh = 1 - 2r``,
      ``z = c - 2c r``, ``1 - tanh^2 = 4 r (1 - r)``. Its absolute error (about 1e-7 in tanh) is
      far below bf16/fp16 input rounding; float32 keeps ``torch.tanh``.
    """

    softcap: float
    scale: float
    via_exp: bool

    @staticmethod
    def of(rules, dtype):
        return ScoreMap(rules.softcap, rules.scale,
                        rules.softcap > 0 and dtype in (torch.bfloat16, torch.float16))

    @property
    def factor(self) -> float:
        if self.softcap == 0:
            return self.scale
        return (2.0 if self.via_exp else 1.0) * self.scale / self.softcap

    @property
    def grad_scale(self) -> float:
        """dq = (dS * dz/ds) @ k * grad_scale (d/ds of z is carried without its constant 4)."""
        return 4.0 * self.scale if self.via_exp else self.scale

    def scores(self, x, keep_grad=False):
        """x (consumed) -> (z, dz/ds / const or None)."""
        c = self.softcap
        if c == 0:
            return x, None
        if self.via_exp:
            r = x.exp_().add_(1.0).reciprocal_()
            if not keep_grad:
                return r.mul_(-2.0 * c).add_(c), None
            return torch.mul(r, -2.0 * c).add_(c), torch.addcmul(r, r, r, value=-1.0)
        t = x.tanh_()
        if not keep_grad:
            return t.mul_(c), None
        return t * c, torch.addcmul(torch.ones_like(t), t, t, value=-1.0)


def _explicit_scores(q_g, k_span, chunk, smap, rules, keep_grad=False):
    """Masked log-domain scores z [B, Hkv, G * C, K] of a chunk (q_g pre-multiplied by
    ``smap.factor``) and, when ``keep_grad``, dz/ds up to a constant (softcap only)."""
    z, dz = smap.scores(torch.matmul(q_g, k_span.transpose(-1, -2)), keep_grad)
    chunk.mask_(z, rules, k_span.shape[1])
    return z, dz


def _explicit_forward(q, k, v, attn_mask, offset, rules, out, lse):
    """Fills ``out`` / ``lse`` chunk by chunk with explicit scores in the compute dtype. Empty
    rows give 0 / -inf; a row with an +inf score gives lse = +inf."""
    cdt = _compute_dtype(q.dtype)
    hq, hkv, sk = q.shape[1], k.shape[1], k.shape[2]
    smap = ScoreMap.of(rules, q.dtype)
    q_s, k_c, v_c = q.to(cdt) * smap.factor, k.to(cdt), v.to(cdt)
    tiny = torch.finfo(cdt).tiny
    for q0, q1, k0, k1 in _row_chunks(rules, q.shape[2], sk, offset, _explicit_rows(q, sk)):
        chunk = ExplicitChunk(q0, q1, k0, k1, offset, _mask_slice(attn_mask, q0, q1, k0, k1))
        z, _ = _explicit_scores(_group_rows(q_s[:, :, q0:q1], hkv), k_c[:, :, k0:k1], chunk, smap,
                                rules)
        m = z.amax(dim=-1, keepdim=True).nan_to_num_(nan=math.nan, posinf=0.0, neginf=0.0)
        p = z.sub_(m).exp_()
        total = p.sum(dim=-1, keepdim=True)
        lse_c = total.log().add_(m)
        o = torch.matmul(p, v_c[:, :, k0:k1]).div_(total.clamp_(min=tiny))
        out[:, :, q0:q1] = _ungroup_rows(o, hq)
        lse[:, :, q0:q1] = _ungroup_rows(lse_c, hq).squeeze(-1)
    return out, lse


# --------------------------------------------------------------------------- backward

def flash_attention_backward(dout, dlse, q, k, v, out, lse, sinks=None, cu_seqlens=None,
                             cu_seqlens_k=None, attn_mask=None, *, causal=False, scale=None,
                             window_left=-1, window_right=-1, softcap=0.0):
    """Gradients ``(dq, dk, dv, dsinks)`` of ``flash_attention``, including the gradient arriving
    through ``lse``: ``dS = P * (dP - delta)`` with ``delta = rowsum(dO * O) - dlse`` (``dlse``
    None: no gradient through lse).
    ``dsinks`` is float32 (Hq,) (zeros when ``sinks`` is None)."""
    rules = Rules(causal, window_left, window_right, float(softcap), resolve_scale(scale, q.shape[-1]))
    sq, sk = q.shape[2], k.shape[2]
    cdt = _compute_dtype(q.dtype)
    fused = _fusable(q, rules) and (dlse is None or not bool(dlse.any()))
    delta = None
    if sinks is not None or not fused:   # the fused kernel forms its own delta
        delta = (dout.to(cdt) * out.to(cdt)).sum(-1)      # [B,Hq,Sq]
        if dlse is not None:
            delta = delta - dlse.to(cdt)
    grad = _FusedGrad(rules) if fused else _ExplicitGrad(rules, delta)
    segs = segments(sq, sk, cu_seqlens, cu_seqlens_k)
    if len(segs) == 1 and segs[0] == (0, sq, 0, sk):
        dq, dk, dv = grad.segment(dout, q, k, v, out, lse, attn_mask, sk - sq)
    else:
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for q0, q1, k0, k1 in segs:
            if q1 > q0 and k1 > k0:
                rows, keys = slice(q0, q1), slice(k0, k1)
                dq[:, :, rows], dk[:, :, keys], dv[:, :, keys] = grad.segment(
                    dout[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys], out[:, :, rows],
                    lse[:, :, rows], _mask_slice(attn_mask, q0, q1, k0, k1), (k1 - k0) - (q1 - q0),
                    rows=rows)
    if sinks is not None:
        sink = sinks.to(cdt)[None, :, None]
        lse_c = lse.to(cdt)
        p_sink = torch.exp(sink - torch.where(torch.isinf(lse_c), math.inf, lse_c))
        dsinks = -(p_sink * delta).sum(dim=(0, 2))
    else:
        dsinks = torch.zeros(q.shape[1], dtype=cdt, device=q.device)
    return dq, dk, dv, dsinks.to(lse_dtype(q.dtype))


def _safe_lse(lse):
    """lse of empty rows (-inf) -> +inf, so that recomputed probabilities are exactly 0."""
    return torch.where(torch.isneginf(lse), math.inf, lse)


class _FusedGrad:
    """Backward of segments on the fused kernel (no gradient through lse)."""

    def __init__(self, rules):
        self.rules = rules

    def segment(self, dout, q, k, v, out, lse, attn_mask, offset, rows=None):
        rules, sq, sk = self.rules, q.shape[2], k.shape[2]
        lse_f = _safe_lse(lse).to(torch.float32)
        one_call = _one_call(rules, sq, sk, offset, attn_mask)
        if one_call is not None:
            return _fused_bwd(dout, q, k, v, out, lse_f, 0.0, one_call,
                              attn_mask=_key_additive(attn_mask, q.dtype), scale=rules.scale)
        dq = torch.zeros_like(q)
        dk = torch.zeros_like(k, dtype=torch.float32)
        dv = torch.zeros_like(v, dtype=torch.float32)
        for q0, q1, k0, k1 in _row_chunks(rules, sq, sk, offset, _FUSED_CHUNK_ROWS):
            r, s = slice(q0, q1), slice(k0, k1)
            additive = _additive(rules.visible(q0, q1, k0, k1, offset, q.device),
                                 _mask_slice(attn_mask, q0, q1, k0, k1), q.dtype)
            dq[:, :, r], dk_c, dv_c = _fused_bwd(dout[:, :, r], q[:, :, r], k[:, :, s], v[:, :, s],
                                                 out[:, :, r], lse_f[:, :, r], 0.0, False,
                                                 attn_mask=additive, scale=rules.scale)
            dk[:, :, s] += dk_c
            dv[:, :, s] += dv_c
        return dq, dk.to(k.dtype), dv.to(v.dtype)


class _ExplicitGrad:
    """Backward of segments with explicit scores, chunk by chunk (softcap, float64, dlse):
    probabilities recomputed from lse, ``dS = P * (dP - delta)`` (times ``1 - t^2`` under
    softcap, t = tanh(s / softcap)), in the compute dtype."""

    def __init__(self, rules, delta):
        self.rules, self.delta = rules, delta

    def segment(self, dout, q, k, v, out, lse, attn_mask, offset, rows=None):
        rules, hq, hkv, sk = self.rules, q.shape[1], k.shape[1], k.shape[2]
        cdt = _compute_dtype(q.dtype)
        delta = self.delta if rows is None else self.delta[:, :, rows]
        smap = ScoreMap.of(rules, q.dtype)
        q_s, k_c, v_c, do_c = q.to(cdt) * smap.factor, k.to(cdt), v.to(cdt), dout.to(cdt)
        lse_c = _safe_lse(lse).to(cdt)
        dq = torch.zeros_like(q_s)
        dk, dv = torch.zeros_like(k_c), torch.zeros_like(v_c)
        for q0, q1, k0, k1 in _row_chunks(rules, q.shape[2], sk, offset, _explicit_rows(q, sk)):
            r, s = slice(q0, q1), slice(k0, k1)
            chunk = ExplicitChunk(q0, q1, k0, k1, offset, _mask_slice(attn_mask, q0, q1, k0, k1))
            q_g, do_g = _group_rows(q_s[:, :, r], hkv), _group_rows(do_c[:, :, r], hkv)
            z, dz = _explicit_scores(q_g, k_c[:, :, s], chunk, smap, rules, keep_grad=True)
            p = z.sub_(_group_rows(lse_c[:, :, r, None], hkv)).exp_()
            dv[:, :, s] += torch.matmul(p.transpose(-1, -2), do_g)
            ds = torch.matmul(do_g, v_c[:, :, s].transpose(-1, -2))
            ds.sub_(_group_rows(delta[:, :, r, None], hkv)).mul_(p)
            if dz is not None:
                ds.mul_(dz)
            dq[:, :, r] = _ungroup_rows(torch.matmul(ds, k_c[:, :, s]), hq)
            dk[:, :, s] += torch.matmul(ds.transpose(-1, -2), q_g)
        # q_s carries smap.factor: dk = dS^T q * grad_scale = dS^T q_s * grad_scale / factor
        return ((dq * smap.grad_scale).to(q.dtype), (dk * (smap.grad_scale / smap.factor)).to(k.dtype),
                dv.to(v.dtype))


def _row_chunks(rules, sq, sk, offset, step):
    """``(q0, q1, k0, k1)``: query chunks of ``step`` rows and the key span each can see
    (chunks that see no key are skipped)."""
    for q0 in range(0, sq, step):
        q1 = min(sq, q0 + step)
        k0, k1 = rules.key_span(q0, q1, offset, sk)
        if k1 > k0:
            yield q0, q1, k0, k1


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
