"""``nki_lib.moe.MoE`` (router -> plan -> experts, + shared experts) and the router losses.

docs/contract.md §4.4 "Module and losses". The module composes the three ops, so it runs on whatever
path the backend selects (simulator/device kernels, or the PyTorch reference). Shapes: T tokens
(all leading dims of x flattened), H hidden, I intermediate, E experts, k = top_k.

* ``MoE.forward(x (..., H)) -> y (..., H)``; keeps ``last_logits`` (T, E) (with grad, for the
  losses), ``last_topk_ids`` (T, k) and ``last_tokens_per_expert`` (E,).
* ``aux_loss_free=True``: a float32 ``expert_bias`` buffer steers selection only (DeepSeek-V3);
  ``update_expert_bias(rate)`` moves it by ``rate * sign(mean load - load)`` using the tokens per
  expert accumulated over the training forwards since the last update.
* ``router_bias=True``: a learned (E,) bias added to the router logits (gpt-oss), served by the
  router op on [x, 1] and [W | b] (the bias as one more weight column: its gradient is that
  column's); ``expert_biases=True``: learned ``gate_up_bias`` (E, 2I) and ``down_bias`` (E, H).
* ``activation="clamped_swiglu"`` (gpt-oss, with ``swiglu_alpha`` / ``swiglu_limit``) or the
  plain gates (``moe_experts_reference``).
* ``MoE.from_hf(block)`` / ``moe.to_hf(block)``: weights from / into a transformers MoE block
  (Mixtral, Qwen3-MoE, gpt-oss; :mod:`nki_lib.moe.hf`).
* ``weight_layout``: how ``w_gate_up`` / ``w_down`` are stored, chosen once at construction (or
  load): "out_in" (default, nn.Linear: (E, 2I, H), (E, H, I)) or "in_out" (the contraction dim
  first: (E, H, 2I), (E, I, H)), which the forward kernel multiplies with no weight transposes (the backward kernel takes
  out_in, so an in_out backward transposes the weights and their gradients on the host each call:
  in_out suits inference, out_in training);
  ``from_hf`` keeps the block's own layout (gpt-oss: in_out) unless told otherwise.
* ``load_balancing_loss`` (Switch/GShard ``E * sum_e f_e * P_e``, or transformers' scale with
  ``convention="hf"``) and ``router_z_loss`` (``mean_t logsumexp(logits_t)^2``), both
  differentiable in the logits (:mod:`nki_lib.moe.losses`).
"""

from __future__ import annotations

import torch
from torch import nn

from nki_lib.moe import hf, moe_experts_op, moe_plan_op, moe_router_op  # noqa: F401  (registers the MoE ops)
from nki_lib.moe.expert_parallel import DEFAULT_CAPACITY_FACTOR, ExpertParallel
from nki_lib.moe.losses import check_positive_int as _positive_int
from nki_lib.moe.losses import load_balancing_loss, router_z_loss  # noqa: F401  (public here too)
from nki_lib.moe.moe_experts_reference import ACTIVATIONS, SWIGLU_ALPHA, SWIGLU_LIMIT, check_weight_layout, gate
from nki_lib.moe.moe_router_op import validate as validate_router


class MoE(nn.Module):
    """Token-choice top-k Mixture of Experts with gated (GLU) experts and optional shared experts.

    ``ep_group``: a torch.distributed process group of P ranks for expert parallelism (each rank
    owns num_experts / P experts; tokens travel by all-to-all with a per-rank capacity of
    ``ep_capacity_factor``, None = dropless); see ``nki_lib.moe.expert_parallel``.
    """

    # per-expert parameters (dim 0 = expert): what expert parallelism shards (the biases are None
    # unless expert_biases=True)
    EXPERT_PARAMETERS = ("w_gate_up", "w_down", "gate_up_bias", "down_bias")

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, *,
                 score_func: str = "softmax", renormalize: bool = True, num_groups: int = 1,
                 topk_groups: int = 1, activation: str = "silu", block_size: int = 128,
                 aux_loss_free: bool = False, num_shared_experts: int = 0, router_bias: bool = False,
                 expert_biases: bool = False, swiglu_alpha: float = SWIGLU_ALPHA,
                 swiglu_limit: float = SWIGLU_LIMIT, ep_group=None,
                 ep_capacity_factor: float | None = DEFAULT_CAPACITY_FACTOR, weight_layout: str = "out_in"):
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size),
                            ("num_experts", num_experts), ("block_size", block_size)):
            _positive_int(name, value)
        if not isinstance(num_shared_experts, int) or isinstance(num_shared_experts, bool) or num_shared_experts < 0:
            raise ValueError(f"num_shared_experts must be an int >= 0, got {num_shared_experts!r}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        check_weight_layout(weight_layout)
        self.weight_layout = weight_layout
        self.router_flags = dict(top_k=top_k, score_func=score_func, renormalize=renormalize,
                                 num_groups=num_groups, topk_groups=topk_groups)
        # the router op's own checks, on a meta probe (no data)
        probe = torch.empty(0, hidden_size, device="meta")
        validate_router(probe, torch.empty(num_experts, hidden_size, device="meta"), None, **self.router_flags)
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.top_k = num_experts, top_k
        self.activation, self.block_size = activation, block_size
        self.aux_loss_free = aux_loss_free
        self.gate_flags = dict(swiglu_alpha=float(swiglu_alpha), swiglu_limit=float(swiglu_limit))
        for name, value in self.gate_flags.items():
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        self.expert_parallel = None if ep_group is None else ExpertParallel(ep_group, num_experts, ep_capacity_factor)
        local_experts = num_experts if ep_group is None else self.expert_parallel.num_local

        self.router_weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        gate_up, down = (2 * intermediate_size, hidden_size), (hidden_size, intermediate_size)
        if weight_layout == "in_out":
            gate_up, down = gate_up[::-1], down[::-1]
        self.w_gate_up = nn.Parameter(torch.empty(local_experts, *gate_up))
        self.w_down = nn.Parameter(torch.empty(local_experts, *down))
        self.router_bias = nn.Parameter(torch.empty(num_experts)) if router_bias else None
        self.gate_up_bias = nn.Parameter(torch.empty(local_experts, 2 * intermediate_size)) if expert_biases else None
        self.down_bias = nn.Parameter(torch.empty(local_experts, hidden_size)) if expert_biases else None
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
        """nn.Linear-style uniform init (weights and biases) with bound 1/sqrt(fan_in)."""
        h_bound, i_bound = self.hidden_size ** -0.5, self.intermediate_size ** -0.5
        with torch.no_grad():
            for p, bound in ((self.router_weight, h_bound), (self.w_gate_up, h_bound), (self.w_down, i_bound),
                             (self.router_bias, h_bound), (self.gate_up_bias, h_bound), (self.down_bias, i_bound)):
                if p is not None:
                    p.uniform_(-bound, bound)

    def _experts(self, x2, topk_weights, topk_ids):
        """This module's experts on (T, H) rows: ``(y, tokens_per_expert)``."""
        block_expert, slot_assignment, tokens_per_expert = torch.ops.nki.moe_plan(
            topk_ids, num_experts=self.w_gate_up.shape[0], block_size=self.block_size)
        y = torch.ops.nki.moe_experts(x2, topk_weights, block_expert, slot_assignment, self.w_gate_up,
                                      self.w_down, self.gate_up_bias, self.down_bias, activation=self.activation,
                                      weight_layout=self.weight_layout, **self.gate_flags)
        return y, tokens_per_expert

    def ep_stats(self) -> dict | None:
        """Expert-parallel statistics (capacity, dropped assignments), None without ep_group."""
        return None if self.expert_parallel is None else self.expert_parallel.stats()

    def _shared(self, x2):
        g, u = self.shared_gate_up(x2).chunk(2, dim=-1)
        return self.shared_down(gate(g, u, self.activation, self.gate_flags["swiglu_alpha"],
                                     self.gate_flags["swiglu_limit"]))

    def _router_operands(self, x2):
        """(x, weight) of the router op; with a router bias, [x, 1] and [W | b]."""
        if self.router_bias is None:
            return x2, self.router_weight
        ones = torch.ones(x2.shape[0], 1, dtype=x2.dtype, device=x2.device)
        weight = torch.cat([self.router_weight, self.router_bias[:, None].to(self.router_weight.dtype)], dim=1)
        return torch.cat([x2, ones], dim=1), weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 1 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x must have shape (..., {self.hidden_size}), got {tuple(x.shape)}")
        x2 = x.reshape(-1, self.hidden_size)
        bias = None
        if self.expert_bias is not None:
            bias = self.expert_bias.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
        logits, topk_weights, topk_ids = torch.ops.nki.moe_router(*self._router_operands(x2), bias,
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

    @classmethod
    def from_hf(cls, block, weight_layout: str | None = None, **kwargs) -> "MoE":
        """An MoE with the router, experts and weights of a transformers MoE block (Mixtral,
        Qwen3-MoE, gpt-oss), in the block's dtype and device; ``weight_layout`` None keeps the
        block's own (gpt-oss's transposed experts: "in_out", no transpose); ``kwargs`` (e.g.
        ``block_size``) go to the constructor. ValueError names what does not map."""
        config, tensors = hf.from_hf_block(block, weight_layout)
        moe = cls(**config, **kwargs).to(device=tensors["w_gate_up"].device, dtype=tensors["w_gate_up"].dtype)
        params = dict(moe.named_parameters())
        if set(params) != set(tensors):
            raise ValueError(f"MoE.from_hf: the block maps {sorted(tensors)}, the MoE has {sorted(params)}")
        with torch.no_grad():
            for name, t in tensors.items():
                params[name].copy_(t)
        return moe

    @torch.no_grad()
    def to_hf(self, block):
        """Copy this module's weights into a transformers MoE block of matching shapes (in the
        block's layout and dtype); returns the block."""
        hf.to_hf_block(self, block)
        return block

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
                f"weight_layout={self.weight_layout!r}, "
                f"aux_loss_free={self.aux_loss_free}, router_bias={self.router_bias is not None}, "
                f"expert_biases={self.down_bias is not None}, "
                f"num_shared_experts={0 if self.shared_down is None else self.shared_down.in_features // self.intermediate_size}")

