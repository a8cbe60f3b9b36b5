"""Mixture of Experts: ``torch.ops.nki.moe_router``, ``moe_plan``, ``moe_experts`` (+ backward ops),
the ``MoE`` module and the router losses (api-contract §4)."""

from __future__ import annotations

from nki_lib.moe import ops  # noqa: F401  (registers the ops)
from nki_lib.moe.module import MoE, load_balancing_loss, router_z_loss

__all__ = ["MoE", "load_balancing_loss", "router_z_loss"]
