"""``experts_implementation="nki"`` for transformers 5.x MoE models (extra ``hf``).

transformers routes the forward of every expert module decorated with
``use_experts_implementation`` (Mixtral, Qwen3-MoE, gpt-oss, ...) through its
``ExpertsInterface``: ``forward(self, hidden_states (T, H), top_k_index (T, k),
top_k_weights (T, k)) -> (T, H)``. :func:`register_experts` adds ``"nki"`` to that interface;
:func:`nki_experts_forward` serves the call with ``torch.ops.nki.moe_plan`` and
``torch.ops.nki.moe_experts`` on the HF parameters themselves (checkpoints load unchanged, the
HF router, its router-logit capture and its auxiliary loss are untouched). :func:`register`
adds the name (``nki_lib.integrations.transformers.register`` calls it):

* layouts: concatenated or interleaved gate/up rows, plain or transposed weights, expert biases
  (:mod:`nki_lib.moe.hf`);
* activations: silu, gelu, gelu-tanh gates and gpt-oss's clamped swiglu (its alpha and limit);
* anything else (a custom gate, post-expert norms, transformers' expert parallelism) runs the
  module's own eager forward, and the reason is recorded in the coverage ledger under
  ``moe_experts`` / path ``hf_experts`` (``NKIFallbackError`` in strict mode): never silently.
"""

from __future__ import annotations

import torch

import nki_lib.moe  # noqa: F401  (registers the MoE ops)
from nki_lib import backend
from nki_lib.coverage import LEDGER
from nki_lib.dispatch import NKIFallbackError, Unsupported
from nki_lib.moe.hf import expert_activation, expert_weights, native_layout

IMPLEMENTATION = "nki"
FALLBACK_PATH = "hf_experts"      # the coverage-ledger path of calls this integration hands back
BLOCK_SIZE = 128                  # plan block size (slots per block), the MoE module's default


def _eager_forward(experts):
    """The module's own forward, as written in its modeling file (under the decorator)."""
    forward = type(experts).forward
    return getattr(forward, "__wrapped__", forward)


def record_fallback(reason: str) -> None:
    """Ledger entry of a call handed back to HF's eager experts (strict mode: raise)."""
    if backend.is_strict():
        raise NKIFallbackError(f"nki::moe_experts (experts_implementation='nki'): {reason}")
    LEDGER.record_fallback("moe_experts", FALLBACK_PATH, reason)
    LEDGER.record_call("moe_experts", "hf_eager")


def nki_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ``ExpertsInterface`` function: y (T, H) = sum_j w[t, j] * expert_{ids[t, j]}(x_t)."""
    try:
        activation, flags = expert_activation(self)
    except Unsupported as exc:
        record_fallback(exc.reason)
        return _eager_forward(self)(self, hidden_states, top_k_index, top_k_weights)
    layout = native_layout(self)      # the parameters' own layout: transposed experts need no transpose
    weights = expert_weights(self, layout)
    block_expert, slot_assignment, _ = torch.ops.nki.moe_plan(
        top_k_index, num_experts=weights["w_gate_up"].shape[0], block_size=BLOCK_SIZE)
    return torch.ops.nki.moe_experts(hidden_states, top_k_weights, block_expert, slot_assignment,
                                     weights["w_gate_up"], weights["w_down"], weights["b_gate_up"],
                                     weights["b_down"], activation=activation, weight_layout=layout, **flags)


def register(name: str = IMPLEMENTATION) -> None:
    """Make ``experts_implementation=name`` (default ``"nki"``) available to every transformers
    model (idempotent); ``nki_lib.integrations.transformers.register`` calls it."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(name, nki_experts_forward)
