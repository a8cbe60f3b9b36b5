"""``nki_lib.moe.MoE`` (router -> plan -> experts, + shared experts) and the router losses.

docs/contract.md §4.4 "Module and losses". The module composes the three ops, so it runs on whatever
path the backend selects (simulator/device kernels, or the PyTorch reference). Shapes: T tokens
(all leading dims of x flattened), H hidden, I intermediate, E experts, k = top_k.

* ``MoE.forward(x (..., H)) -> y (..., H)``; keeps ``last_logits`` (T, E) (with grad, for the
  losses), ``last_topk_ids`` (T, k) and ``last_tokens_per_expert`` (E,).
* ``aux_loss_free=True``: a float32 ``expert_bias`` buffer steers selection only (DeepSeek-V3);
  ``update_expert_bias(rate)`` moves it by ``rate * sign(mean load - load)`` using the tokens per
  expert accumulated over the training forwards since the last update.
* ``load_balancing_loss`` (Switch/GShard: ``E * sum_e f_e * P_e``) and ``router_z_loss``
  (``mean_t logsumexp(logits_t)^2``), both differentiable in the logits.
"""

from __future__ import annotations

import torch
from torch import nn

from nki_lib.moe import moe_experts_op, moe_plan_op, moe_router_op  # noqa: F401  (registers the MoE ops)
from nki_lib.moe.expert_parallel import DEFAULT_CAPACITY_FACTOR, ExpertParallel
from nki_lib.moe.moe_experts_reference import ACTIVATIONS, act
from nki_lib.moe.moe_router_op import validate as validate_router


def _positive_int(name, value):
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


class MoE(nn.Module):
    """Token-choice top-k Mixture of Experts with gated (GLU) experts and optional shared experts.

    ``ep_group``: a torch.distributed process group of P ranks for expert parallelism (each rank
    owns num_experts / P experts; tokens travel by all-to-all with a per-rank capacity of
    ``ep_capacity_factor``, None = dropless); see ``nki_lib.moe.expert_parallel``.
    """

    # per-expert parameters (dim 0 = expert): what expert parallelism shards
    EXPERT_PARAMETERS = ("w_gate_up", "w_down")

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, *,
                 score_func: str = "softmax", renormalize: bool = True, num_groups: int = 1,
                 topk_groups: int = 1, activation: str = "silu", block_size: int = 128,
                 aux_loss_free: bool = False, num_shared_experts: int = 0, ep_group=None,
                 ep_capacity_factor: float | None = DEFAULT_CAPACITY_FACTOR):
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size),
                            ("num_experts", num_experts), ("block_size", block_size)):
            _positive_int(name, value)
        if not isinstance(num_shared_experts, int) or isinstance(num_shared_experts, bool) or num_shared_experts < 0:
            raise ValueError(f"num_shared_experts must be an int >= 0, got {num_shared_experts!r}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        self.router_flags = dict(top_k=top_k, score_func=score_func, renormalize=renormalize,
                                 num_groups=num_groups, topk_groups=topk_groups)
        # the router op's own checks, on a meta probe (no data)
        probe = torch.empty(0, hidden_size, device="meta")
        validate_router(probe, torch.empty(num_experts, hidden_size, device="meta"), None, **self.router_flags)
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.top_k = num_experts, top_k
        self.activation, self.block_size = activation, block_size
        self.aux_loss_free = aux_loss_free
        self.expert_parallel = None if ep_group is None else ExpertParallel(ep_group, num_experts, ep_capacity_factor)
        local_experts = num_experts if ep_group is None else self.expert_parallel.num_local

        self.router_weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.w_gate_up = nn.Parameter(torch.empty(local_experts, 2 * intermediate_size, hidden_size))
        self.w_down = nn.Parameter(torch.empty(local_experts, hidden_size, intermediate_size))
        shared_size = intermediate_size * num_shared_experts
        self.shared_gate_up = nn.Linear(hidden_size, 2 * shared_size, bias=False) if shared_size else None
        self.shared_down = nn.Linear(shared_size, hidden_size, bias=False) if shared_size else None
        if aux_loss_free:
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))
            self.register_buffer("_load", torch.zeros(num_experts, dtype=torch.float32))
        else:
            self.expert_bias = None
        self.last_logits = self.last_topk_ids = self.last_tokens_per_expert = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear-style uniform init with bound 1/sqrt(fan_in)."""
        h_bound, i_bound = self.hidden_size ** -0.5, self.intermediate_size ** -0.5
        with torch.no_grad():
            self.router_weight.uniform_(-h_bound, h_bound)
            self.w_gate_up.uniform_(-h_bound, h_bound)
            self.w_down.uniform_(-i_bound, i_bound)

    def _experts(self, x2, topk_weights, topk_ids):
        """This module's experts on (T, H) rows: ``(y, tokens_per_expert)``."""
        block_expert, slot_assignment, tokens_per_expert = torch.ops.nki.moe_plan(
            topk_ids, num_experts=self.w_gate_up.shape[0], block_size=self.block_size)
        y = torch.ops.nki.moe_experts(x2, topk_weights, block_expert, slot_assignment, self.w_gate_up,
                                      self.w_down, activation=self.activation)
        return y, tokens_per_expert

    def ep_stats(self) -> dict | None:
        """Expert-parallel statistics (capacity, dropped assignments), None without ep_group."""
        return None if self.expert_parallel is None else self.expert_parallel.stats()

    def _shared(self, x2):
        gate, up = self.shared_gate_up(x2).chunk(2, dim=-1)
        return self.shared_down(act(gate, self.activation) * up)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 1 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x must have shape (..., {self.hidden_size}), got {tuple(x.shape)}")
        x2 = x.reshape(-1, self.hidden_size)
        bias = None
        if self.expert_bias is not None:
            bias = self.expert_bias.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
        logits, topk_weights, topk_ids = torch.ops.nki.moe_router(x2, self.router_weight, bias,
                                                                 **self.router_flags)
        if self.expert_parallel is None:
            y, tokens_per_expert = self._experts(x2, topk_weights, topk_ids)
        else:
            y, tokens_per_expert = self.expert_parallel(x2, topk_weights, topk_ids,
                                                        lambda *rows: self._experts(*rows)[0])
        if self.shared_gate_up is not None:
            y = y + self._shared(x2)
        self.last_logits, self.last_topk_ids = logits, topk_ids
        self.last_tokens_per_expert = tokens_per_expert
        if self.aux_loss_free and self.training:
            with torch.no_grad():
                self._load += tokens_per_expert.to(self._load.dtype)
        return y.reshape(x.shape)

    @torch.no_grad()
    def update_expert_bias(self, rate: float) -> None:
        """DeepSeek-V3 aux-loss-free balancing: ``expert_bias += rate * sign(mean load - load)``
        over the tokens routed since the last update (training forwards); then reset the count."""
        if not self.aux_loss_free:
            raise RuntimeError("update_expert_bias needs MoE(..., aux_loss_free=True)")
        if not isinstance(rate, (int, float)) or isinstance(rate, bool) or rate < 0:
            raise ValueError(f"rate must be a float >= 0, got {rate!r}")
        load = self._load if self.expert_parallel is None else self.expert_parallel.all_reduce_(self._load)
        self.expert_bias += rate * torch.sign(load.mean() - load)
        self._load.zero_()

    def __getstate__(self):
        """Copies and pickles drop the last router statistics (non-leaf tensors of a past graph)."""
        state = self.__dict__.copy()
        state.update(last_logits=None, last_topk_ids=None, last_tokens_per_expert=None)
        return state

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"num_experts={self.num_experts}, top_k={self.top_k}, "
                f"score_func={self.router_flags['score_func']!r}, activation={self.activation!r}, "
                f"aux_loss_free={self.aux_loss_free}, "
                f"num_shared_experts={0 if self.shared_down is None else self.shared_down.in_features // self.intermediate_size}")


def _check_logits(logits, num_experts=None):
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError(f"logits must be a floating torch.Tensor, got {type(logits).__name__}")
    if logits.dim() < 2:
        raise ValueError(f"logits must have shape (..., E), got {tuple(logits.shape)}")
    if num_experts is not None and logits.shape[-1] != num_experts:
        raise ValueError(f"logits must have last dim num_experts={num_experts}, got {tuple(logits.shape)}")


def load_balancing_loss(logits: torch.Tensor, topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch/GShard auxiliary loss ``E * sum_e f_e * P_e``: ``f_e`` = share of the T * k
    assignments routed to expert e (no gradient), ``P_e`` = mean over tokens of softmax(logits)_e.
    Equals 1 for perfectly uniform routing. ``logits`` (..., E), ``topk_ids`` (..., k)."""
    _positive_int("num_experts", num_experts)
    _check_logits(logits, num_experts)
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError("topk_ids must be an int32/int64 torch.Tensor")
    if topk_ids.shape[:-1] != logits.shape[:-1]:
        raise ValueError(f"topk_ids must have the leading shape of logits {tuple(logits.shape[:-1])}, "
                         f"got {tuple(topk_ids.shape)}")
    probs = torch.softmax(logits.reshape(-1, num_experts).to(_loss_dtype(logits)), dim=-1)
    if probs.shape[0] == 0:
        return probs.sum()
    ids = topk_ids.reshape(-1).long()
    counts = torch.zeros(num_experts, dtype=probs.dtype, device=probs.device)
    counts.scatter_add_(0, ids, torch.ones_like(ids, dtype=probs.dtype))
    fraction = counts / ids.numel()
    return num_experts * (fraction * probs.mean(dim=0)).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss ``mean over tokens of logsumexp(logits)^2``; ``logits`` (..., E)."""
    _check_logits(logits)
    lse = torch.logsumexp(logits.to(_loss_dtype(logits)), dim=-1)
    return lse.square().mean() if lse.numel() else lse.sum()


def _loss_dtype(logits):
    return torch.float64 if logits.dtype == torch.float64 else torch.float32
