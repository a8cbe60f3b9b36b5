"""Hugging Face expert modules in nki-lib's layout (no transformers import: duck typing only).

transformers 5.x stores the experts of an MoE block as 3-D parameters on one module decorated
with ``use_experts_implementation`` (Mixtral ``MixtralExperts``, Qwen3-MoE ``Qwen3MoeExperts``,
gpt-oss ``GptOssExperts``). The decorator records the layout on the instance:

* ``is_transposed``: False -> ``gate_up_proj`` (E, 2I, H), ``down_proj`` (E, H, I) (nn.Linear
  layout, as the op takes them); True -> (E, H, 2I) and (E, I, H) (gpt-oss).
* ``is_concatenated``: True -> gate rows [0, I), up rows [I, 2I); False -> interleaved
  (gate 2i, up 2i + 1; gpt-oss).
* ``has_bias``: ``gate_up_proj_bias`` (E, 2I) and ``down_proj_bias`` (E, H) (gpt-oss).

:func:`expert_weights` returns differentiable views/copies in the op's layout (gradients flow
back to the HF parameters); :func:`hf_expert_tensors` maps op-layout tensors back.
:func:`expert_activation` names the op activation of the module's gate, or raises
``Unsupported`` with the reason (the caller records the fallback).
"""

from __future__ import annotations

import torch

from nki_lib.dispatch import Unsupported

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


def _to_concatenated(t: torch.Tensor) -> torch.Tensor:
    """Interleaved gate/up along dim 1 (g0 u0 g1 u1 ...) -> concatenated (g..., u...)."""
    return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1)


def _to_interleaved(t: torch.Tensor) -> torch.Tensor:
    """Concatenated gate/up along dim 1 -> interleaved."""
    gate, up = t.chunk(2, dim=1)
    return torch.stack([gate, up], dim=2).flatten(1, 2)


def expert_weights(experts) -> dict[str, torch.Tensor | None]:
    """{w_gate_up (E, 2I, H), w_down (E, H, I), b_gate_up (E, 2I) or None, b_down (E, H) or None}
    in the op's layout (gate rows first), differentiable in the HF parameters."""
    transposed = bool(getattr(experts, "is_transposed", False))
    concatenated = bool(getattr(experts, "is_concatenated", True))
    w_gate_up, w_down = experts.gate_up_proj, experts.down_proj
    if transposed:
        w_gate_up, w_down = w_gate_up.transpose(1, 2), w_down.transpose(1, 2)
    b_gate_up = experts.gate_up_proj_bias if getattr(experts, "has_bias", False) else None
    b_down = experts.down_proj_bias if getattr(experts, "has_bias", False) else None
    if not concatenated:
        w_gate_up = _to_concatenated(w_gate_up)
        b_gate_up = None if b_gate_up is None else _to_concatenated(b_gate_up)
    return dict(w_gate_up=w_gate_up.contiguous(), w_down=w_down.contiguous(), b_gate_up=b_gate_up,
                b_down=b_down)


def hf_expert_tensors(experts, w_gate_up, w_down, b_gate_up=None, b_down=None) -> dict[str, torch.Tensor]:
    """Op-layout tensors -> {parameter name: tensor} in ``experts``' own layout."""
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
