"""``torch.ops.nki.flash_attention`` and its backward op: validation, fake, autograd, paths.

Forward:  flash_attention(q, k, v, sinks=None, cu_seqlens=None, cu_seqlens_k=None,
                          attn_mask=None, *, causal=False, scale=None, window_left=-1,
                          window_right=-1, softcap=0.0) -> (out, lse)
Backward: flash_attention_backward(dout, dlse, q, k, v, out, lse, sinks=None, cu_seqlens=None,
                                   cu_seqlens_k=None, attn_mask=None, *, causal, scale,
                                   window_left, window_right, softcap) -> (dq, dk, dv, dsinks)
``dlse`` may be None (no gradient reached lse: the kernel takes delta = rowsum(dO * O), no
zeros tensor). Semantics: docs/contract.md §3.1. Shapes: q (B, Hq, Sq, D), k/v (B, Hkv, Sk, D), lse (B, Hq, Sq).
``sinks`` (Hq,) in any floating dtype (math in fp32, gradient in the sinks' dtype);
``cu_seqlens`` / ``cu_seqlens_k`` int32 or int64 (N+1,) document offsets of the packed queries /
keys (B == 1; without ``cu_seqlens_k`` the keys share the query offsets and Sq == Sk);
``attn_mask`` bool (True = attend) or additive float, 4-D, broadcastable to (B, Hq, Sq, Sk),
combined with the causal/window rules (key padding: (B, 1, 1, Sk)); it gets no gradient.
"""

from __future__ import annotations

import math

import torch

from nki_lib import registry
from nki_lib.attention import flash_attention_reference, key_bounds
from nki_lib.attention.attention_args import MAX_HEAD_DIM, lse_dtype, resolve_scale
from nki_lib.autograd import forbid_double_backward, masked_grads, zeros_if_none
from nki_lib.autograd.autocast import follow_sdpa_autocast
from nki_lib.dispatch import dispatch
from nki_lib.registry import OpSpec, Sample
from nki_lib.validation import INDEX_DTYPES, check_int, check_same_device, check_same_dtype, layout_hint, on_host
from nki_lib.validation import check_tensor as _check_tensor

# --------------------------------------------------------------------------- validation

def validate(q, k, v, sinks, cu_seqlens, cu_seqlens_k, attn_mask, *, causal, scale,
             window_left, window_right, softcap):
    """Shape/dtype/argument checks (no data access: safe under fake tensors)."""
    _check_tensor("q", q, rank=4)
    _check_tensor("k", k, rank=4)
    _check_tensor("v", v, rank=4)
    check_same_dtype("k", k, "q", q)
    check_same_dtype("v", v, "q", q)
    check_same_device("q", q, k=k, v=v)
    b, hq, sq, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if k.shape[0] != b:
        raise ValueError(f"k must have batch size {b} (from q), got {k.shape[0]}")
    if k.shape[3] != d:
        raise ValueError(f"k must have head dim {d} (from q), got {k.shape[3]}")
    hkv = k.shape[1]
    if hkv < 1 or hq % hkv != 0:
        raise ValueError(f"the number of q heads ({hq}) must be a multiple of the number of k/v "
                         f"heads ({hkv}){layout_hint(q, k)}")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"q head dim D must be in [1, {MAX_HEAD_DIM}], got {d}")
    if sq < 1 or k.shape[2] < 1:
        raise ValueError(f"q and k sequence lengths must be >= 1, got Sq={sq}, Sk={k.shape[2]}")
    for name, w in (("window_left", window_left), ("window_right", window_right)):
        check_int(name, w, low=-1)  # -1: unbounded
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if scale is not None and (not isinstance(scale, (int, float)) or not math.isfinite(scale)):
        raise ValueError(f"scale must be None or a finite float, got {scale!r}")
    if not isinstance(softcap, (int, float)) or not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be a finite float >= 0, got {softcap!r}")
    if sinks is not None:
        _check_tensor("sinks", sinks, rank=1)
        if sinks.shape[0] != hq:
            raise ValueError(f"sinks must have shape ({hq},) (one logit per q head), got "
                             f"{tuple(sinks.shape)}{layout_hint(q, k)}")
        check_same_device("q", q, sinks=sinks)
    _validate_packing(q, k, cu_seqlens, cu_seqlens_k)
    if attn_mask is not None:
        validate_attn_mask(attn_mask, q, k)


def _validate_packing(q, k, cu_seqlens, cu_seqlens_k):
    b, sq, sk = q.shape[0], q.shape[2], k.shape[2]
    if cu_seqlens_k is not None and cu_seqlens is None:
        raise ValueError("cu_seqlens_k needs cu_seqlens (the query offsets of the same documents)")
    if cu_seqlens is None:
        return
    _check_tensor("cu_seqlens", cu_seqlens, rank=1, dtypes=INDEX_DTYPES)
    if b != 1:
        raise ValueError(f"cu_seqlens requires batch size 1 (packed documents), got B={b}")
    if cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens must have N+1 >= 2 entries, got {cu_seqlens.shape[0]}")
    check_same_device("q", q, cu_seqlens=cu_seqlens)
    if cu_seqlens_k is None:
        if sq != sk:
            raise ValueError(f"cu_seqlens without cu_seqlens_k requires Sq == Sk, got Sq={sq}, "
                             f"Sk={sk} (pass cu_seqlens_k with the key offsets)")
        return
    _check_tensor("cu_seqlens_k", cu_seqlens_k, rank=1, dtypes=INDEX_DTYPES)
    if cu_seqlens_k.shape[0] != cu_seqlens.shape[0]:
        raise ValueError(f"cu_seqlens_k must have the {cu_seqlens.shape[0]} entries of cu_seqlens "
                         f"(one offset per document boundary), got {cu_seqlens_k.shape[0]}")
    check_same_device("q", q, cu_seqlens_k=cu_seqlens_k)


def validate_attn_mask(attn_mask, q, k):
    """attn_mask: 4-D bool or float, each dim 1 or the full size of (B, Hq, Sq, Sk)."""
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor, got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise TypeError(f"attn_mask must be bool (True = attend) or floating (additive), got {attn_mask.dtype}")
    full = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    if attn_mask.dim() != 4 or any(m not in (1, f) for m, f in zip(attn_mask.shape, full)):
        raise ValueError(f"attn_mask must have 4 dims, each 1 or the size of (B, Hq, Sq, Sk) = "
                         f"{full}, got shape {tuple(attn_mask.shape)}")
    if attn_mask.requires_grad:
        raise ValueError("attn_mask must not require grad (nki::flash_attention returns no gradient for it)")
    check_same_device("q", q, attn_mask=attn_mask)


def validate_offsets_values(name, offsets, total):
    """Data checks of cu_seqlens / cu_seqlens_k (real tensors only, on a host copy:
    ``nki_lib.validation.on_host``)."""
    with on_host(offsets) as (copy,):
        values = copy.to(torch.int64)
        if int(values[0]) != 0:
            raise ValueError(f"{name} must start at 0, got {int(values[0])}")
        if bool((values[1:] < values[:-1]).any()):
            raise ValueError(f"{name} must be non-decreasing")
        if int(values[-1]) != total:
            raise ValueError(f"{name} must end at the sequence length {total}, got {int(values[-1])}")


def validate_cu_seqlens_values(cu_seqlens, seqlen):
    validate_offsets_values("cu_seqlens", cu_seqlens, seqlen)


def _lse_dtype(q):
    return lse_dtype(q.dtype)


def _prepare(q, k, sinks, cu_seqlens, cu_seqlens_k, attn_mask):
    """Real-tensor checks and the canonical forms the paths take: sinks in the lse dtype, the
    mask's key dim expanded, cu_seqlens_k equal to cu_seqlens dropped."""
    if cu_seqlens is not None:
        validate_offsets_values("cu_seqlens", cu_seqlens, q.shape[2])
    if cu_seqlens_k is not None:
        validate_offsets_values("cu_seqlens_k", cu_seqlens_k, k.shape[2])
        if cu_seqlens_k.shape == cu_seqlens.shape and bool((cu_seqlens_k == cu_seqlens).all()):
            cu_seqlens_k = None
    if sinks is not None:
        sinks = sinks.to(_lse_dtype(q))
    if attn_mask is not None and attn_mask.shape[3] != k.shape[2]:
        attn_mask = attn_mask.expand(-1, -1, -1, k.shape[2])
    return sinks, cu_seqlens_k, attn_mask


def _kernel_mask(q, k, cu_seqlens, cu_seqlens_k, attn_mask, resolved):
    """The kernels' per-row key bounds and static flags (``key_bounds.plan``), with ``resolved``'s
    causal/window flags replaced by the ones the kernels apply; a mask they cannot express
    raises ``Unsupported`` (a recorded fallback)."""
    from nki_lib.dispatch import Unsupported
    rules = {name: resolved[name] for name in ("causal", "window_left", "window_right")}
    found = key_bounds.plan(q, k, cu_seqlens, cu_seqlens_k, attn_mask, **rules)
    if isinstance(found, str):
        raise Unsupported(found)
    return found.bounds, dict(resolved, **found.flags)


# --------------------------------------------------------------------------- forward op

@torch.library.custom_op("nki::flash_attention", mutates_args=())
def flash_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       sinks: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                       cu_seqlens_k: torch.Tensor | None = None,
                       attn_mask: torch.Tensor | None = None, *,
                       causal: bool = False, scale: float | None = None, window_left: int = -1,
                       window_right: int = -1, softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    flags = dict(causal=causal, scale=scale, window_left=window_left, window_right=window_right,
                 softcap=softcap)
    validate(q, k, v, sinks, cu_seqlens, cu_seqlens_k, attn_mask, **flags)
    sinks, cu_seqlens_k, attn_mask = _prepare(q, k, sinks, cu_seqlens, cu_seqlens_k, attn_mask)
    if q.shape[0] == 0:
        return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=_lse_dtype(q))
    resolved = dict(flags, scale=resolve_scale(scale, q.shape[-1]))

    def launch():
        bounds, kernel_flags = _kernel_mask(q, k, cu_seqlens, cu_seqlens_k, attn_mask, resolved)
        from nki_lib.attention.kernels import flash_attention_fwd
        return flash_attention_fwd.launch_flash_attention_fwd(q, k, v, sinks, bounds, **kernel_flags)

    out, lse = dispatch("flash_attention", (q, k, v, sinks), launch=launch,
                        reference=lambda: flash_attention_reference.flash_attention(
                            q, k, v, sinks, cu_seqlens, cu_seqlens_k, attn_mask, **flags))
    return out.contiguous(), lse.contiguous()


@flash_attention_op.register_fake
def _(q, k, v, sinks=None, cu_seqlens=None, cu_seqlens_k=None, attn_mask=None, *, causal=False,
      scale=None, window_left=-1, window_right=-1, softcap=0.0):
    validate(q, k, v, sinks, cu_seqlens, cu_seqlens_k, attn_mask, causal=causal, scale=scale,
             window_left=window_left, window_right=window_right, softcap=softcap)
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=_lse_dtype(q))


# --------------------------------------------------------------------------- backward op

@torch.library.custom_op("nki::flash_attention_backward", mutates_args=())
def flash_attention_backward_op(dout: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor,
                                k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                                lse: torch.Tensor, sinks: torch.Tensor | None = None,
                                cu_seqlens: torch.Tensor | None = None,
                                cu_seqlens_k: torch.Tensor | None = None,
                                attn_mask: torch.Tensor | None = None, *, causal: bool = False,
                                scale: float | None = None, window_left: int = -1,
                                window_right: int = -1, softcap: float = 0.0
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    flags = dict(causal=causal, scale=scale, window_left=window_left, window_right=window_right,
                 softcap=softcap)
    if q.shape[0] == 0:
        return (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v),
                q.new_zeros(q.shape[1], dtype=_lse_dtype(q)))
    sinks, cu_seqlens_k, attn_mask = _prepare(q, k, sinks, cu_seqlens, cu_seqlens_k, attn_mask)
    resolved = dict(flags, scale=resolve_scale(scale, q.shape[-1]))

    def launch():
        bounds, kernel_flags = _kernel_mask(q, k, cu_seqlens, cu_seqlens_k, attn_mask, resolved)
        from nki_lib.attention.kernels import flash_attention_bwd
        return flash_attention_bwd.launch_flash_attention_bwd(dout, dlse, q, k, v, out, lse, sinks, bounds,
                                                              **kernel_flags)

    grads = dispatch("flash_attention_backward", (dout, q, k, v, sinks), launch=launch,
                     reference=lambda: flash_attention_reference.flash_attention_backward(
                         dout, dlse, q, k, v, out, lse, sinks, cu_seqlens, cu_seqlens_k,
                         attn_mask, **flags))
    return tuple(g.contiguous() for g in grads)


@flash_attention_backward_op.register_fake
def _(dout, dlse, q, k, v, out, lse, sinks=None, cu_seqlens=None, cu_seqlens_k=None,
      attn_mask=None, *, causal=False, scale=None, window_left=-1, window_right=-1, softcap=0.0):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            q.new_empty((q.shape[1],), dtype=_lse_dtype(q)))


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    q, k, v, sinks, cu_seqlens, cu_seqlens_k, attn_mask = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, sinks, cu_seqlens, cu_seqlens_k, attn_mask)
    ctx.flags = dict(keyword_only_inputs)
    ctx.set_materialize_grads(False)   # an unused lse's gradient stays None (no zeros tensor, kernel flag)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, sinks, cu_seqlens, cu_seqlens_k, attn_mask = ctx.saved_tensors
    dq, dk, dv, dsinks = torch.ops.nki.flash_attention_backward(
        zeros_if_none(dout, out), None if dlse is None else dlse.contiguous(), q, k, v, out, lse, sinks, cu_seqlens,
        cu_seqlens_k, attn_mask, **ctx.flags)
    dsinks = None if sinks is None else dsinks.to(sinks.dtype)
    return masked_grads(ctx.needs_input_grad, (dq, dk, dv, dsinks, None, None, None))


flash_attention_op.register_autograd(_backward, setup_context=_setup_context)
forbid_double_backward(flash_attention_backward_op, "flash_attention")
follow_sdpa_autocast("flash_attention")


# --------------------------------------------------------------------------- registry entry

def _make(shape_q, shape_kv, dtype, requires_grad, *, sinks=False, seed=0, **kwargs):
    """One sample. ``sinks``: False, True (fp32 / fp64 logits) or a dtype; ``cu_seqlens`` /
    ``cu_seqlens_k``: offsets as lists (``offsets_dtype``, default int32); ``key_padding``:
    per-row valid key ranges ``[(start, end), ...]`` as a bool (B, 1, 1, Sk) mask;
    ``additive_mask``: a random float (B, 1, Sq, Sk) mask with some -inf."""
    gen = torch.Generator().manual_seed(seed)
    mk = lambda s: torch.randn(s, generator=gen, dtype=torch.float32).to(dtype).requires_grad_(requires_grad)  # noqa: E731
    args = [mk(shape_q), mk(shape_kv), mk(shape_kv)]
    sinks_t = None
    if sinks is not False:
        sink_dtype = (sinks if isinstance(sinks, torch.dtype)
                      else torch.float64 if dtype == torch.float64 else torch.float32)
        sinks_t = torch.randn(shape_q[1], generator=gen).to(sink_dtype).requires_grad_(requires_grad)
    offsets_dtype = kwargs.pop("offsets_dtype", torch.int32)
    cu, cu_k = (kwargs.pop(name, None) for name in ("cu_seqlens", "cu_seqlens_k"))
    cu, cu_k = (None if c is None else torch.tensor(c, dtype=offsets_dtype) for c in (cu, cu_k))
    mask, label_mask = _sample_mask(shape_q, shape_kv, dtype, gen, kwargs.pop("key_padding", None),
                                    kwargs.pop("additive_mask", False))
    label = f"q{tuple(shape_q)} kv{tuple(shape_kv)} {str(dtype).replace('torch.', '')}"
    label += "".join(f" {k}={v}" for k, v in kwargs.items())
    label += f" sinks({str(sinks_t.dtype).replace('torch.', '')})" if sinks_t is not None else ""
    label += " packed" if cu is not None else ""
    label += " varlen-k" if cu_k is not None else ""
    label += label_mask
    return Sample((*args, sinks_t, cu, cu_k, mask), kwargs, label)


def _sample_mask(shape_q, shape_kv, dtype, gen, key_padding, additive):
    b, sq, sk = shape_q[0], shape_q[2], shape_kv[2]
    if key_padding is not None:
        keys = torch.arange(sk)
        rows = [(keys >= lo) & (keys < hi) for lo, hi in key_padding]
        return torch.stack(rows).reshape(b, 1, 1, sk), f" key_padding={key_padding}"
    if additive:
        mask = torch.randn(b, 1, sq, sk, generator=gen, dtype=torch.float32)
        mask = mask.masked_fill(torch.rand(b, 1, sq, sk, generator=gen) < 0.2, -math.inf)
        return mask.to(dtype), " additive-mask"
    return None, ""


def _samples(dtype, requires_grad):
    return [
        _make((1, 2, 17, 8), (1, 2, 17, 8), dtype, requires_grad),
        _make((2, 4, 33, 16), (2, 2, 20, 16), dtype, requires_grad, causal=True),
        _make((1, 2, 24, 8), (1, 1, 40, 8), dtype, requires_grad, sinks=True, window_left=5,
              window_right=3, softcap=5.0, scale=0.3),
        _make((1, 2, 30, 8), (1, 2, 30, 8), dtype, requires_grad, causal=True,
              cu_seqlens=[0, 7, 7, 19, 30]),
        _make((1, 2, 12, 8), (1, 1, 25, 8), dtype, requires_grad, causal=True, window_left=4,
              cu_seqlens=[0, 3, 3, 12], cu_seqlens_k=[0, 9, 14, 25], offsets_dtype=torch.int64),
        _make((3, 2, 14, 8), (3, 2, 14, 8), dtype, requires_grad, causal=True, sinks=dtype,
              key_padding=[(0, 14), (5, 14), (0, 9)]),
        _make((2, 2, 9, 8), (2, 2, 13, 8), dtype, requires_grad, additive_mask=True),
    ]


def _report_samples():
    bf16 = torch.bfloat16
    return [
        _make((1, 2, 512, 128), (1, 2, 512, 128), bf16, True, causal=True),
        _make((1, 4, 384, 64), (1, 1, 640, 64), bf16, True, causal=True),
        _make((1, 2, 300, 128), (1, 2, 300, 128), bf16, True, sinks=True, window_left=128,
              window_right=0, softcap=30.0),
        _make((1, 2, 256, 64), (1, 2, 256, 64), bf16, True, causal=True,
              cu_seqlens=[0, 100, 130, 256]),
        _make((1, 2, 200, 256), (1, 2, 136, 256), torch.float32, True),
        _make((1, 2, 333, 96), (1, 2, 333, 96), torch.float16, True, window_left=64, window_right=64),
        _make((1, 1, 4096, 128), (1, 1, 4096, 128), bf16, True, causal=True),
        _make((2, 2, 512, 128), (2, 2, 512, 128), bf16, True, causal=True,
              key_padding=[(0, 512), (200, 512)]),
        _make((1, 2, 256, 64), (1, 2, 384, 64), bf16, True, causal=True, cu_seqlens=[0, 100, 256],
              cu_seqlens_k=[0, 150, 384]),
    ]


SPEC = registry.register(OpSpec(
    name="flash_attention",
    naive=flash_attention_reference.naive,
    samples=_samples,
    report_samples=_report_samples,
    backward_name="flash_attention_backward",
    family="attention",
    launchers=(
        "nki_lib.attention.kernels.flash_attention_fwd.launch_flash_attention_fwd",
        "nki_lib.attention.kernels.flash_attention_bwd.launch_flash_attention_bwd",
    ),
    kernels=(
        "nki_lib.attention.kernels.flash_attention_fwd.flash_attention_fwd_kernel",
        "nki_lib.attention.kernels.flash_attention_bwd.flash_attention_bwd_kernel",
    ),
))
