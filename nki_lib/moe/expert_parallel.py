"""Expert parallelism for ``nki_lib.moe.MoE`` on torch.distributed (``MoE(..., ep_group=group)``).

With a group of P ranks and E experts (E % P == 0), rank r owns experts
``[r E / P, (r + 1) E / P)``; the router, its bias and the shared experts are replicated, and each
rank routes its own tokens. Per forward (T local tokens, k = top_k, A = T k assignments):

1. dispatch: every assignment goes to the rank owning its expert. Each (source, destination) pair
   has a fixed budget of C slots, so every buffer has a static shape (no data-dependent
   indexing: a dropped assignment is written to a spare row that is cut off): the send buffer is
   (P C, H), slot ``d C + j`` holding the j-th assignment (in token-major order) bound for rank d,
   with its local expert id and its routing weight; empty slots carry weight 0.
2. ``all_to_all`` (equal splits, differentiable) of tokens, weights and expert ids.
3. the owner runs ``moe_plan`` + ``moe_experts`` on its P C received rows with its local experts
   (weighted rows, exactly the single-process kernel's arithmetic per row).
4. ``all_to_all`` back, and each token sums its returned rows (``index_add``).

Gradients take the same path backwards (the all-to-all's backward is the reverse all-to-all), so
they reach x, the router (through the weights) and, outside this module, the shared experts.

Capacity (the documented choice): ``capacity_factor=f`` gives ``C = ceil(f A / P)`` (at least 1,
at most A). Assignments beyond C for one destination are dropped, last-in-token-order first:
their contribution is 0 (the weights of the kept ones are not renormalised), and they are
counted: ``last_dropped`` / ``dropped_total`` (also in ``MoE.ep_stats()``). ``capacity_factor=None``
is dropless with static shapes: C = A, the worst case of every assignment going to one rank.
Cost per rank and forward: tokens ``P C H`` elements sent and as many received, twice (there and
back), plus ``P C`` weights and ids; the experts run on ``P C`` rows, empty slots included. With
f = 1.25 that is 1.25 A rows against A for an exact (dynamic-shape) exchange; dropless pays P
times A. Tokens whose k experts share an owner are sent once per assignment (no dedup).
"""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist
from torch import nn

from nki_lib.collectives import all_to_all, as_group, group_info

DEFAULT_CAPACITY_FACTOR = 1.25


def _check_capacity_factor(value):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"ep_capacity_factor must be None (dropless) or a finite number > 0, got {value!r}")
    return float(value)


def capacity_slots(assignments: int, size: int, capacity_factor: float | None) -> int:
    """C: slots per (source, destination) pair (see the module doc)."""
    if capacity_factor is None:
        return max(1, assignments)
    return max(1, min(assignments, math.ceil(capacity_factor * assignments / size)))


class ExpertParallel:
    """The expert-parallel layout of one MoE layer and its dispatch/combine (see module doc)."""

    def __init__(self, group, num_experts: int, capacity_factor: float | None = DEFAULT_CAPACITY_FACTOR):
        group = as_group(group)
        self.size, self.rank = group_info(group)
        if num_experts % self.size:
            raise ValueError(f"num_experts ({num_experts}) must be a multiple of the ep_group size "
                             f"({self.size}): each rank owns num_experts / size experts")
        self.group, self.num_experts = group, num_experts
        self.num_local = num_experts // self.size
        self.local_experts = slice(self.rank * self.num_local, (self.rank + 1) * self.num_local)
        self.capacity_factor = _check_capacity_factor(capacity_factor)
        self.last_capacity = 0
        self.last_dropped = torch.zeros((), dtype=torch.int64)
        self.dropped_total = torch.zeros((), dtype=torch.int64)

    def capacity(self, assignments: int) -> int:
        """Slots per (source, destination) pair for ``assignments`` local assignments."""
        return capacity_slots(assignments, self.size, self.capacity_factor)

    def stats(self) -> dict:
        return {"capacity": self.last_capacity, "last_dropped": int(self.last_dropped),
                "dropped_total": int(self.dropped_total)}

    def __call__(self, x, topk_weights, topk_ids, run_local):
        """``(y (T, H), tokens_per_expert (E,) int32)``; ``run_local(x_rows, weights (R, 1),
        ids (R, 1) int32)`` runs the local experts on R received rows."""
        tokens, top_k = topk_ids.shape
        ids = topk_ids.reshape(-1).long()
        token_of = torch.arange(tokens, device=x.device).repeat_interleave(top_k)
        dest = ids // self.num_local
        order = torch.nn.functional.one_hot(dest, self.size).cumsum(0).gather(1, dest[:, None])[:, 0] - 1
        cap = self.capacity(ids.numel())
        rows = self.size * cap
        keep = order < cap
        # every assignment has a slot; dropped ones land in a spare row past the end (static shapes)
        slot = torch.where(keep, dest * cap + order, torch.full_like(order, rows))
        self._count(cap, (~keep).sum())

        send_x = x.new_zeros(rows + 1, x.shape[1]).index_copy(0, slot, x[token_of])[:rows]
        weights = topk_weights.reshape(-1)
        send_w = weights.new_zeros(rows + 1).index_copy(0, slot, weights)[:rows]
        send_e = torch.full((rows + 1,), -1, dtype=torch.int64, device=x.device)
        send_e = send_e.index_copy(0, slot, ids % self.num_local)[:rows]

        recv_x, recv_w = all_to_all(send_x, self.group), all_to_all(send_w, self.group)
        recv_e = all_to_all(send_e, self.group)
        local_ids = recv_e.clamp(min=0).to(torch.int32)[:, None]   # empty slots: weight 0
        y_rows = all_to_all(run_local(recv_x, recv_w[:, None], local_ids), self.group)
        y_rows = torch.cat([y_rows, y_rows.new_zeros(1, y_rows.shape[1])])   # the spare row: 0
        y = x.new_zeros(x.shape).index_add(0, token_of, y_rows[slot])
        tokens_per_expert = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device)
        tokens_per_expert.index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        return y, tokens_per_expert

    def _count(self, cap, dropped):
        """Record the drops without a host sync (``stats()`` reads them)."""
        self.last_capacity = cap
        self.last_dropped = dropped.detach()
        self.dropped_total = self.dropped_total.to(dropped.device) + self.last_dropped

    def __deepcopy__(self, memo):
        """Copies of a module share its process group (a handle) and start with fresh counters."""
        clone = copy.copy(self)
        clone.last_capacity = 0
        clone.last_dropped = torch.zeros((), dtype=torch.int64)
        clone.dropped_total = torch.zeros((), dtype=torch.int64)
        return clone

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the group in place (e.g. the expert loads of aux-loss-free balancing)."""
        dist.all_reduce(t, group=self.group)
        return t


# --------------------------------------------------------------------------- checkpoints

def shard_moe(module, group, *, capacity_factor: float | None = DEFAULT_CAPACITY_FACTOR):
    """A copy of a single-process ``MoE`` laid out on ``group``: replicated router and shared
    experts, this rank's E / P experts (every name in ``module.EXPERT_PARAMETERS``)."""
    if module.expert_parallel is not None:
        raise ValueError("shard_moe needs a single-process MoE (ep_group=None); this one is already sharded")
    ep = ExpertParallel(group, module.num_experts, capacity_factor)
    sharded = copy.deepcopy(module)
    sharded.expert_parallel = ep
    for name in module.EXPERT_PARAMETERS:
        full = getattr(module, name)
        if full is None:                 # an optional parameter the module does not have
            continue
        setattr(sharded, name, nn.Parameter(full.detach()[ep.local_experts].clone(),
                                            requires_grad=full.requires_grad))
    return sharded


def gather_moe(module):
    """The single-process ``MoE`` of an expert-parallel one (all ranks call it; every rank gets
    the full experts)."""
    ep = module.expert_parallel
    if ep is None:
        raise ValueError("gather_moe needs an expert-parallel MoE (built with ep_group)")
    full = copy.deepcopy(module)
    full.expert_parallel = None
    for name in module.EXPERT_PARAMETERS:
        if getattr(module, name) is None:
            continue
        local = getattr(module, name).detach().contiguous()
        parts = [torch.empty_like(local) for _ in range(ep.size)]
        dist.all_gather(parts, local, group=ep.group)
        setattr(full, name, nn.Parameter(torch.cat(parts), requires_grad=getattr(module, name).requires_grad))
    return full
