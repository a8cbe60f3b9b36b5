"""PyTorch reference of the MoE routing plan (docs/contract.md §4.2), plain and clear.

Same argument names as the op; what every path but the NKI kernel runs.

Shapes: T tokens, E experts, k = top_k, N = T * k assignments, NB = ceil(N / block_size) + E - 1
blocks.

* ``moe_plan``: stable sort of the assignments by expert, block layout, per-expert counts.
* ``num_blocks``: NB, the static number of blocks.
"""

from __future__ import annotations

import torch

from nki_lib.sizes import ceil_div


def num_blocks(num_assignments: int, num_experts: int, block_size: int) -> int:
    """NB = ceil(N / block_size) + E - 1: the tight static bound on blocks (each expert wastes at
    most one partly filled block)."""
    return ceil_div(num_assignments, block_size) + num_experts - 1


def moe_plan(topk_ids, *, num_experts, block_size):
    """Returns ``(block_expert (NB,), slot_assignment (NB * block_size,), tokens_per_expert (E,))``,
    all int32. Static shapes, no host sync: stable sort by expert, one-hot counts, cumsums."""
    device = topk_ids.device
    flat_ids = topk_ids.reshape(-1).long()                                  # (N,) expert per assignment
    n = flat_ids.shape[0]
    nb = num_blocks(n, num_experts, block_size)
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
    blocks_per_expert = (counts + block_size - 1) // block_size
    block_end = torch.cumsum(blocks_per_expert, dim=0)                      # (E,)
    block_start = block_end - blocks_per_expert
    block_ids = torch.arange(nb, device=device)
    owner = (block_ids[:, None] >= block_end[None, :]).sum(dim=1)           # (NB,) expert or E
    block_expert = torch.where(owner < num_experts, owner, torch.full_like(owner, -1))

    sorted_ids, order = torch.sort(flat_ids, stable=True)                   # order: assignments by expert
    first_of_expert = torch.cumsum(counts, dim=0) - counts                  # (E,) exclusive cumsum
    rank = torch.arange(n, device=device) - first_of_expert[sorted_ids]     # position within expert
    slot = block_start[sorted_ids] * block_size + rank
    slot_assignment = torch.full((nb * block_size,), -1, dtype=torch.long, device=device)
    slot_assignment.scatter_(0, slot, order)
    return (block_expert.to(torch.int32), slot_assignment.to(torch.int32), counts.to(torch.int32))
