"""Hugging Face expert modules in nki-lib's layout (no transformers import: duck typing only).

transformers 5.x stores the experts of an MoE block as 3-D parameters on one module decorated
with ``use_experts_implementation`` (Mixtral ``MixtralExperts``, Qwen3-MoE ``Qwen3MoeExperts``,
gpt-oss ``GptOssExperts``). The decorator records the layout on the instance:

* ``is_transposed``: False -> ``gate_up_proj`` (E, 2I, H), ``down_proj`` (E, H, I) (nn.Linear
  layout, as the op takes them); True -> (E, H, 2I) and (E, I, H) (gpt-oss).
* ``is_concatenated``: True -> gate rows [0, I), up rows [I, 2I); False -> interleaved
  (gate 2i, up 2i + 1; gpt-oss).
* ``has_bias``: ``gate_up_proj_bias`` (E, 2I) and ``down_proj_bias`` (E, H) (gpt-oss).

:func:`expert_weights` returns differentiable views/copies in one of the op's weight layouts
(gradients flow back to the HF parameters); :func:`native_layout` names the op layout that
matches the module's own (``in_out`` for transposed weights: gpt-oss's experts then reach the op
with no transpose, only the de-interleave of the gate/up columns); :func:`hf_expert_tensors`
maps op-layout tensors back.
:func:`expert_activation` names the op activation of the module's gate, or raises
``Unsupported`` with the reason (the caller records the fallback).

Whole blocks (``MoE.from_hf`` / ``MoE.to_hf``): :func:`from_hf_block` reads a block's router
(``block.gate`` or ``block.router``: Mixtral's and Qwen3-MoE's softmax -> top-k (-> renormalise),
gpt-oss's top-k logits -> softmax, which is softmax -> top-k -> renormalise, with its logit bias)
and experts into MoE constructor arguments and parameters; :func:`to_hf_block` writes them
back. What has no MoE equivalent (router jitter, shared experts of another form, a custom gate)
raises ValueError naming it.
"""

from __future__ import annotations

import torch

from nki_lib.dispatch import Unsupported
from nki_lib.moe.moe_experts_reference import as_out_in

# transformers activation classes (ACT2FN values) -> the op's gate activation
_ACT_CLASSES = {
    "SiLUActivation": "silu", "SiLU": "silu",
    "GELUActivation": "gelu", "GELU": "gelu",
    "GELUTanh": "gelu_tanh", "NewGELUActivation": "gelu_tanh", "PytorchGELUTanh": "gelu_tanh",
}
_GPT_OSS_GATE = "GptOssExperts._apply_gate"


def expert_activation(experts) -> tuple[str, dict]:
    """(activation, activation flags) of an HF experts module, or Unsupported(reason)."""
    if not getattr(experts, "has_gate", True):
        raise Unsupported("experts without a gate (up_proj only)")
    if getattr(experts, "has_post_expert_norm", False):
        raise Unsupported("post-expert norm")
    if getattr(experts, "_is_expert_parallel", False):
        raise Unsupported("transformers expert parallelism (sentinel expert ids)")
    gate = getattr(type(experts), "_apply_gate", None)
    qualname = getattr(gate, "__qualname__", "")
    if qualname == _GPT_OSS_GATE:
        return "clamped_swiglu", dict(swiglu_alpha=float(experts.alpha), swiglu_limit=float(experts.limit))
    if qualname != "_default_apply_gate":
        raise Unsupported(f"custom gate {qualname or type(experts).__name__}")
    act = type(getattr(experts, "act_fn", None)).__name__
    if act not in _ACT_CLASSES:
        raise Unsupported(f"activation {act}")
    return _ACT_CLASSES[act], {}


def _to_concatenated(t: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Interleaved gate/up along ``dim`` (g0 u0 g1 u1 ...) -> concatenated (g..., u...)."""
    pairs = t.unflatten(dim, (-1, 2))              # (..., I, 2, ...): gate at 0, up at 1
    return torch.cat([pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)], dim=dim)


def _to_interleaved(t: torch.Tensor) -> torch.Tensor:
    """Concatenated gate/up along dim 1 -> interleaved."""
    gate, up = t.chunk(2, dim=1)
    return torch.stack([gate, up], dim=2).flatten(1, 2)


def native_layout(experts) -> str:
    """The op's ``weight_layout`` of the module's own weights: "in_out" when they are stored
    transposed ((E, H, 2I) and (E, I, H), gpt-oss), else "out_in"."""
    return "in_out" if getattr(experts, "is_transposed", False) else "out_in"


def expert_weights(experts, weight_layout: str = "out_in") -> dict[str, torch.Tensor | None]:
    """{w_gate_up, w_down, b_gate_up (E, 2I) or None, b_down (E, H) or None} in the op's
    ``weight_layout`` (out_in: (E, 2I, H), (E, H, I); in_out: (E, H, 2I), (E, I, H); gate first
    along 2I), differentiable in the HF parameters; a weight already in that layout is not copied."""
    concatenated = bool(getattr(experts, "is_concatenated", True))
    w_gate_up, w_down = experts.gate_up_proj, experts.down_proj
    if native_layout(experts) != weight_layout:   # the transpose maps either layout to the other
        w_gate_up, w_down = as_out_in(w_gate_up, "in_out"), as_out_in(w_down, "in_out")
    b_gate_up = experts.gate_up_proj_bias if getattr(experts, "has_bias", False) else None
    b_down = experts.down_proj_bias if getattr(experts, "has_bias", False) else None
    if not concatenated:
        w_gate_up = _to_concatenated(w_gate_up, dim=2 if weight_layout == "in_out" else 1)
        b_gate_up = None if b_gate_up is None else _to_concatenated(b_gate_up)
    return dict(w_gate_up=w_gate_up.contiguous(), w_down=w_down.contiguous(), b_gate_up=b_gate_up,
                b_down=b_down)


def hf_expert_tensors(experts, w_gate_up, w_down, b_gate_up=None, b_down=None, *,
                      weight_layout: str = "out_in") -> dict[str, torch.Tensor]:
    """Op-layout tensors (in ``weight_layout``) -> {parameter name: tensor} in ``experts``' own layout."""
    w_gate_up, w_down = as_out_in(w_gate_up, weight_layout), as_out_in(w_down, weight_layout)
    transposed = bool(getattr(experts, "is_transposed", False))
    concatenated = bool(getattr(experts, "is_concatenated", True))
    if not concatenated:
        w_gate_up = _to_interleaved(w_gate_up)
        b_gate_up = None if b_gate_up is None else _to_interleaved(b_gate_up)
    if transposed:
        w_gate_up, w_down = w_gate_up.transpose(1, 2), w_down.transpose(1, 2)
    out = dict(gate_up_proj=w_gate_up.contiguous(), down_proj=w_down.contiguous())
    if getattr(experts, "has_bias", False):
        if b_gate_up is None or b_down is None:
            raise ValueError(f"{type(experts).__name__} has expert biases: b_gate_up and b_down are required")
        out.update(gate_up_proj_bias=b_gate_up.contiguous(), down_proj_bias=b_down.contiguous())
    return out


# --------------------------------------------------------------------------- whole MoE blocks

# transformers router classes -> whether the top-k weights are renormalised. gpt-oss takes the
# softmax over the top-k logits, which equals softmax -> top-k -> renormalise.
_ROUTERS = {
    "MixtralTopKRouter": lambda router: True,
    "Qwen3MoeTopKRouter": lambda router: bool(router.norm_topk_prob),
    "GptOssTopKRouter": lambda router: True,
}


def _router(block):
    for name in ("gate", "router"):
        router = getattr(block, name, None)
        if router is not None and type(router).__name__ in _ROUTERS:
            return router
    raise ValueError(f"{type(block).__name__}: no supported router (block.gate / block.router of type "
                     f"{sorted(_ROUTERS)})")


def _check_block(block):
    if getattr(block, "jitter_noise", 0):
        raise ValueError(f"{type(block).__name__}: router jitter noise ({block.jitter_noise}) has no MoE equivalent")
    for name in ("shared_expert", "shared_experts"):
        if getattr(block, name, None) is not None:
            raise ValueError(f"{type(block).__name__}.{name}: shared experts of this form are not mapped")
    experts = getattr(block, "experts", None)
    if experts is None or not hasattr(experts, "gate_up_proj"):
        raise ValueError(f"{type(block).__name__}: no 3-D experts module (block.experts.gate_up_proj)")
    try:
        activation, flags = expert_activation(experts)
    except Unsupported as exc:
        raise ValueError(f"{type(experts).__name__}: {exc.reason} has no MoE equivalent") from None
    return experts, activation, flags


def from_hf_block(block, weight_layout: str | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """(MoE constructor arguments, {MoE parameter name: tensor}) of a transformers MoE block, the
    expert weights in ``weight_layout`` (None: the block's own, :func:`native_layout`)."""
    router = _router(block)
    experts, activation, flags = _check_block(block)
    weight_layout = native_layout(experts) if weight_layout is None else weight_layout
    weights = expert_weights(experts, weight_layout)
    num_experts, two_inter, hidden = as_out_in(weights["w_gate_up"], weight_layout).shape
    router_bias = getattr(router, "bias", None)
    config = dict(hidden_size=hidden, intermediate_size=two_inter // 2, num_experts=num_experts,
                  top_k=int(router.top_k), score_func="softmax", renormalize=_ROUTERS[type(router).__name__](router),
                  activation=activation, router_bias=router_bias is not None,
                  expert_biases=weights["b_gate_up"] is not None, weight_layout=weight_layout, **flags)
    tensors = dict(router_weight=router.weight, w_gate_up=weights["w_gate_up"], w_down=weights["w_down"])
    if router_bias is not None:
        tensors["router_bias"] = router_bias
    if weights["b_gate_up"] is not None:
        tensors.update(gate_up_bias=weights["b_gate_up"], down_bias=weights["b_down"])
    return config, {name: t.detach() for name, t in tensors.items()}


def to_hf_block(moe, block) -> None:
    """Copy an MoE's weights into a transformers MoE block (its layout and dtype)."""
    router = _router(block)
    experts, activation, _ = _check_block(block)
    if activation != moe.activation:
        raise ValueError(f"{type(experts).__name__} uses activation {activation!r}, the MoE {moe.activation!r}")
    if (getattr(router, "bias", None) is None) != (moe.router_bias is None):
        raise ValueError(f"router bias: the block has {'one' if router.bias is not None else 'none'}, the MoE "
                         f"{'has one' if moe.router_bias is not None else 'has none'}")
    if moe.shared_down is not None:
        raise ValueError("the MoE has shared experts, the block has none")
    tensors = hf_expert_tensors(experts, moe.w_gate_up, moe.w_down, moe.gate_up_bias, moe.down_bias,
                                weight_layout=moe.weight_layout)
    targets = [(getattr(experts, name), t, f"experts.{name}") for name, t in tensors.items()]
    targets.append((router.weight, moe.router_weight, "router weight"))
    if moe.router_bias is not None:
        targets.append((router.bias, moe.router_bias, "router bias"))
    for dst, src, name in targets:
        if dst.shape != src.shape:
            raise ValueError(f"{name}: the block has shape {tuple(dst.shape)}, the MoE gives {tuple(src.shape)}")
    with torch.no_grad():
        for dst, src, _ in targets:
            dst.copy_(src)
