"""Mixture of Experts: ``torch.ops.nki.moe_router``, ``moe_plan``, ``moe_experts`` (+ backward ops),
their functional wrappers, the ``MoE`` module and the router losses (docs/contract.md §4)."""

from __future__ import annotations

import torch

from nki_lib.moe import moe_experts_op, moe_plan_op, moe_router_op  # noqa: F401  (registers the ops)
from nki_lib.moe.expert_parallel import gather_moe, shard_moe
from nki_lib.moe.losses import load_balancing_loss, router_z_loss
from nki_lib.moe.module import MoE

__all__ = ["MoE", "load_balancing_loss", "router_z_loss", "moe_router", "moe_plan", "moe_experts",
           "shard_moe", "gather_moe"]


def moe_router(x: torch.Tensor, weight: torch.Tensor, expert_bias: torch.Tensor | None = None, *,
               top_k: int, score_func: str = "softmax", renormalize: bool = True, num_groups: int = 1,
               topk_groups: int = 1):
    """Router: ``(logits (T, E) f32, topk_weights (T, k) f32, topk_ids (T, k) int32)`` from
    x (T, H) and weight (E, H); see docs/contract.md §4.1."""
    return torch.ops.nki.moe_router(x, weight, expert_bias, top_k=top_k, score_func=score_func,
                                    renormalize=renormalize, num_groups=num_groups,
                                    topk_groups=topk_groups)


def moe_plan(topk_ids: torch.Tensor, *, num_experts: int, block_size: int):
    """Routing plan: ``(block_expert (NB,), slot_assignment (NB * block_size,),
    tokens_per_expert (E,))``, int32, NB = ceil(T * k / block_size) + E - 1."""
    return torch.ops.nki.moe_plan(topk_ids, num_experts=num_experts, block_size=block_size)


def moe_experts(x: torch.Tensor, topk_weights: torch.Tensor, block_expert: torch.Tensor,
                slot_assignment: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, *,
                activation: str = "silu") -> torch.Tensor:
    """Gated expert MLPs over the plan's blocks: y (T, H); see docs/contract.md §4.3."""
    return torch.ops.nki.moe_experts(x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down,
                                     activation=activation)
