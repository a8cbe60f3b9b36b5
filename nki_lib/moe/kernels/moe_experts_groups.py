"""Host-side index metadata for the expert-MLP forward: consecutive blocks of one expert merged
into groups that share every weight tile.

Why: the forward kernel loads and PE-transposes all 3*H*I weights of a block's expert once per
block, so a plan with small blocks pays the weight DMA and the transposes once per 128 slots. An
expert's blocks are consecutive in the plan (``moe_plan``), so up to G of them are merged into one
group of G*B slots: the kernel then loads each weight tile once per group, and slot tiles (128
slots) that hold only padding are skipped by a per-tile guard (no gather, matmul or scatter), so a
partly filled group costs what its real slots cost, apart from the shared weight work.

Shapes (dimension legend): NB blocks of B slots in the plan; G blocks per group; S = G*B slots per
group; NG groups (a static bound, see :func:`group_count`); ST = ceil(S / 128) slot tiles per group.
Every output is index metadata built with torch index ops: no op math runs here.
"""

from __future__ import annotations

import torch


def group_count(n_blocks, n_experts, group_blocks, n_runs=0):
    """Groups for a plan of ``n_blocks`` blocks: the static bound min(NB, (NB + E (G-1)) // G) (an
    expert run of n blocks makes ceil(n / G) groups), or more when the caller says the plan has
    ``n_runs`` > E runs (an expert's blocks not consecutive: never a plan the op accepts)."""
    runs = max(n_experts, n_runs)
    return min(n_blocks, (n_blocks + runs * (group_blocks - 1)) // group_blocks)


def merge_blocks(block_expert, slot_assignment, group_blocks, n_experts, n_runs=0):
    """(group_expert (NG,) int32, group_slots (NG*S,) int32).

    Runs of consecutive blocks with one expert (>= 0) are cut into groups of at most
    ``group_blocks`` blocks, in plan order; a group's slots are its blocks' slots in order, then -1
    padding (the kernel derives each slot tile's live flag from them on chip). Blocks with
    expert -1 are dropped; unused groups have expert -1 and no live tiles. Static shapes: dropped
    blocks get the spare group NG past the end (one row of group_expert, one group of slots, cut
    off), so the ops trace with fixed shapes and read no data (no device-to-host sync). NG is
    :func:`group_count`'s bound for at most E runs, which holds for every plan the launchers see
    (the op's ``validate_plan_values`` raises for an expert's blocks not consecutive on real
    tensors; a traced plan is ``moe_plan``'s); a direct caller with more runs passes ``n_runs``.
    Each line is one torch op where it can be (each is a launch on a device: the whole-op estimate
    charges them)."""
    n_blocks = block_expert.numel()
    block = slot_assignment.numel() // max(n_blocks, 1)
    group_slots_n = group_blocks * block
    dev = block_expert.device
    idx = torch.arange(n_blocks, device=dev)
    valid = block_expert >= 0
    prev = torch.nn.functional.pad(block_expert[:-1], (1, 0), value=-2)    # the previous block's expert
    run_start = valid & (block_expert != prev)
    pos = idx - torch.cummax(torch.where(run_start, idx, 0), 0).values      # block index inside its run
    in_group = pos % group_blocks
    n_groups = group_count(n_blocks, n_experts, group_blocks, n_runs)
    group_id = torch.where(valid, torch.cumsum(valid & (in_group == 0), 0) - 1, n_groups)
    group_expert = torch.full((n_groups + 1,), -1, dtype=torch.int32, device=dev)
    group_expert.scatter_(0, group_id, block_expert.to(torch.int32))
    block_at = torch.add(in_group, group_id, alpha=group_blocks)            # the block's place in groups
    dst = torch.add(torch.arange(block, device=dev)[None, :], block_at[:, None], alpha=block).reshape(-1)
    group_slots = torch.full(((n_groups + 1) * group_slots_n,), -1, dtype=torch.int32, device=dev)
    group_slots.scatter_(0, dst, slot_assignment.reshape(-1).to(torch.int32))
    return group_expert[:n_groups], group_slots[:n_groups * group_slots_n]

