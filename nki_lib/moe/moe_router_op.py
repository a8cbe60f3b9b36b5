"""``torch.ops.nki.moe_router`` and its backward op: validation, fake, autograd, paths, OpSpec.

Forward:  moe_router(x, weight, expert_bias=None, *, top_k, score_func="softmax",
                     renormalize=True, num_groups=1, topk_groups=1)
          -> (logits (T, E) f32, topk_weights (T, k) f32, topk_ids (T, k) int32)
Backward: moe_router_backward(dlogits, dtopk_weights, x, weight, logits, topk_ids, *,
                              score_func, renormalize) -> (dx (T, H), dweight (E, H))
Semantics: docs/contract.md §4.1. Shapes: T tokens, H hidden, E experts, k = top_k.
The selection bias and the group limit steer selection only and carry no gradient.
"""

from __future__ import annotations

import torch

from nki_lib import registry
from nki_lib.autograd import forbid_double_backward, masked_grads, zeros_if_none
from nki_lib.autograd.autocast import follow_sdpa_autocast
from nki_lib.dispatch import dispatch
from nki_lib.moe import moe_router_reference
from nki_lib.registry import OpSpec, Sample
from nki_lib.validation import check_int as _check_int
from nki_lib.validation import check_same_device, check_same_dtype
from nki_lib.validation import check_tensor as _check_tensor

# --------------------------------------------------------------------------- validation

def _aux_dtype(x):
    """dtype of logits/topk_weights/expert_bias: float32, or float64 for float64 inputs."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def validate(x, weight, expert_bias, *, top_k, score_func, renormalize, num_groups, topk_groups):
    """Shape/dtype/argument checks (no data access: safe under fake tensors)."""
    _check_tensor("x", x, rank=2)
    _check_tensor("weight", weight, rank=2)
    check_same_dtype("weight", weight, "x", x)
    check_same_device("x", x, weight=weight)
    num_experts, hidden = weight.shape
    if x.shape[1] != hidden:
        raise ValueError(f"x must have hidden size {hidden} (weight is (E, H) = {tuple(weight.shape)}), "
                         f"got x of shape {tuple(x.shape)}")
    if num_experts < 1 or hidden < 1:
        raise ValueError(f"weight must have E >= 1 experts and H >= 1, got shape {tuple(weight.shape)}")
    if expert_bias is not None:
        _check_tensor("expert_bias", expert_bias, rank=1, dtypes=(_aux_dtype(x),))
        if expert_bias.shape[0] != num_experts:
            raise ValueError(f"expert_bias must have shape ({num_experts},), got {tuple(expert_bias.shape)}")
        check_same_device("x", x, expert_bias=expert_bias)
    _check_int("top_k", top_k, low=1, high=num_experts)
    if score_func not in moe_router_reference.SCORE_FUNCS:
        raise ValueError(f"score_func must be one of {moe_router_reference.SCORE_FUNCS}, got {score_func!r}")
    if not isinstance(renormalize, bool):
        raise TypeError(f"renormalize must be a bool, got {type(renormalize).__name__}")
    _check_int("num_groups", num_groups, low=1, high=num_experts)
    if num_experts % num_groups != 0:
        raise ValueError(f"num_groups ({num_groups}) must divide the number of experts ({num_experts})")
    _check_int("topk_groups", topk_groups, low=1, high=num_groups)
    if topk_groups * (num_experts // num_groups) < top_k:
        raise ValueError(f"topk_groups ({topk_groups}) groups of {num_experts // num_groups} experts "
                         f"cannot hold top_k={top_k} experts")


def _empty_outputs(x, weight, top_k):
    t, e = x.shape[0], weight.shape[0]
    aux = _aux_dtype(x)
    return (x.new_empty((t, e), dtype=aux), x.new_empty((t, top_k), dtype=aux),
            x.new_empty((t, top_k), dtype=torch.int32))


# --------------------------------------------------------------------------- forward op

@torch.library.custom_op("nki::moe_router", mutates_args=())
def moe_router_op(x: torch.Tensor, weight: torch.Tensor, expert_bias: torch.Tensor | None = None, *,
                  top_k: int, score_func: str = "softmax", renormalize: bool = True,
                  num_groups: int = 1, topk_groups: int = 1
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    flags = dict(top_k=top_k, score_func=score_func, renormalize=renormalize,
                 num_groups=num_groups, topk_groups=topk_groups)
    validate(x, weight, expert_bias, **flags)
    if x.shape[0] == 0:
        return _empty_outputs(x, weight, top_k)

    def launch():
        from nki_lib.moe.kernels import moe_router_fwd
        return moe_router_fwd.launch_moe_router_fwd(x, weight, expert_bias, **flags)

    outs = dispatch("moe_router", (x, weight, expert_bias), launch=launch,
                    reference=lambda: moe_router_reference.moe_router(x, weight, expert_bias, **flags))
    return tuple(o.contiguous() for o in outs)


@moe_router_op.register_fake
def _(x, weight, expert_bias=None, *, top_k, score_func="softmax", renormalize=True, num_groups=1,
      topk_groups=1):
    validate(x, weight, expert_bias, top_k=top_k, score_func=score_func, renormalize=renormalize,
             num_groups=num_groups, topk_groups=topk_groups)
    return _empty_outputs(x, weight, top_k)


# --------------------------------------------------------------------------- backward op

@torch.library.custom_op("nki::moe_router_backward", mutates_args=())
def moe_router_backward_op(dlogits: torch.Tensor, dtopk_weights: torch.Tensor, x: torch.Tensor,
                           weight: torch.Tensor, logits: torch.Tensor, topk_ids: torch.Tensor, *,
                           score_func: str = "softmax", renormalize: bool = True
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    if x.shape[0] == 0:
        return torch.zeros_like(x), torch.zeros_like(weight)
    flags = dict(score_func=score_func, renormalize=renormalize)

    def launch():
        from nki_lib.moe.kernels import moe_router_bwd
        return moe_router_bwd.launch_moe_router_bwd(dlogits, dtopk_weights, x, weight, logits, topk_ids, **flags)

    grads = dispatch("moe_router_backward", (dlogits, x, weight), launch=launch,
                     reference=lambda: moe_router_reference.moe_router_backward(
                         dlogits, dtopk_weights, x, weight, logits, topk_ids, **flags))
    return tuple(g.contiguous() for g in grads)


@moe_router_backward_op.register_fake
def _(dlogits, dtopk_weights, x, weight, logits, topk_ids, *, score_func="softmax", renormalize=True):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    x, weight = inputs[0], inputs[1]
    logits, _, topk_ids = output
    ctx.save_for_backward(x, weight, logits, topk_ids)
    ctx.flags = {k: keyword_only_inputs[k] for k in ("score_func", "renormalize") if k in keyword_only_inputs}


def _backward(ctx, dlogits, dtopk_weights, _dtopk_ids):
    x, weight, logits, topk_ids = ctx.saved_tensors
    dx, dweight = torch.ops.nki.moe_router_backward(
        zeros_if_none(dlogits, logits), zeros_if_none(dtopk_weights, topk_ids.to(logits.dtype)),
        x, weight, logits, topk_ids, **ctx.flags)
    return masked_grads(ctx.needs_input_grad, (dx, dweight, None))


moe_router_op.register_autograd(_backward, setup_context=_setup_context)
forbid_double_backward(moe_router_backward_op, "moe_router")
# SDPA's autocast policy for the projection operands; the outputs keep the contract's dtypes
# (float32 logits and weights, int32 ids) and the selection-only expert_bias stays float32
follow_sdpa_autocast("moe_router", cast_args=("x", "weight"))


# --------------------------------------------------------------------------- registry entry

def make_sample(t, h, e, dtype, requires_grad, *, bias=False, seed=0, **flags) -> Sample:
    """Random router inputs with well-separated logits (x ~ N(0, 1), weight ~ N(0, 1/H))."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=gen).to(dtype).requires_grad_(requires_grad)
    weight = (torch.randn(e, h, generator=gen) * h ** -0.5).to(dtype).requires_grad_(requires_grad)
    expert_bias = None
    if bias:
        aux = torch.float64 if dtype == torch.float64 else torch.float32
        expert_bias = (0.1 * torch.randn(e, generator=gen)).to(aux)
    flags.setdefault("top_k", min(2, e))
    label = f"x({t},{h}) E={e} {str(dtype).replace('torch.', '')}"
    label += "".join(f" {k}={v}" for k, v in flags.items()) + (" bias" if bias else "")
    return Sample((x, weight, expert_bias), flags, label)


def _samples(dtype, requires_grad):
    return [
        make_sample(17, 24, 8, dtype, requires_grad, top_k=2),
        make_sample(33, 40, 12, dtype, requires_grad, top_k=3, score_func="sigmoid", bias=True),
        make_sample(20, 16, 16, dtype, requires_grad, top_k=4, num_groups=4, topk_groups=2,
                    score_func="sigmoid", bias=True, seed=1),
        make_sample(9, 8, 4, dtype, requires_grad, top_k=4, renormalize=False, seed=2),
    ]


def _report_samples():
    bf16 = torch.bfloat16
    return [
        make_sample(256, 1024, 64, bf16, True, top_k=8, score_func="sigmoid", bias=True,
                    num_groups=8, topk_groups=4),
        make_sample(256, 512, 8, bf16, True, top_k=2),
        make_sample(200, 768, 128, bf16, True, top_k=4),
    ]


SPEC = registry.register(OpSpec(
    name="moe_router",
    naive=moe_router_reference.naive,
    samples=_samples,
    report_samples=_report_samples,
    backward_name="moe_router_backward",
    family="moe",
    launchers=(
        "nki_lib.moe.kernels.moe_router_fwd.launch_moe_router_fwd",
        "nki_lib.moe.kernels.moe_router_bwd.launch_moe_router_bwd",
    ),
    kernels=(
        "nki_lib.moe.kernels.moe_router_fwd.moe_router_fwd_kernel",
        "nki_lib.moe.kernels.moe_router_bwd.moe_router_bwd_kernel",
    ),
))
