"""Host-side grouping of an expert's consecutive blocks for the expert-MLP forward
(``nki_lib.moe.kernels.moe_experts_groups.merge_blocks``): every slot kept exactly once and in order,
groups of one expert, live-tile flags, and a group count that does not depend on the routing."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import nki_lib
import nki_lib.moe  # noqa: F401  (registers torch.ops.nki.moe_plan)
from nki_lib.moe.kernels.moe_experts_groups import group_count, merge_blocks


def plan(topk_ids, experts, block):
    block_expert, slot_assignment, _ = torch.ops.nki.moe_plan(topk_ids.to(torch.int32), num_experts=experts,
                                                               block_size=block)
    return block_expert, slot_assignment


def check_groups(block_expert, slot_assignment, group_blocks, experts, n_runs=0):
    n_blocks = block_expert.numel()
    block = slot_assignment.numel() // n_blocks
    group_expert, group_slots = merge_blocks(block_expert, slot_assignment, group_blocks, experts, n_runs)
    group = group_blocks * block
    by_group = group_slots.reshape(-1, group)
    assert by_group.shape[0] == group_expert.numel()
    # Expected: walk the plan; runs of one expert cut every group_blocks blocks.
    expected_slots, expected_experts, prev, in_group = [], [], None, 0
    for b in range(n_blocks):
        e = int(block_expert[b])
        if e < 0:
            prev = None
            continue
        if e != prev or in_group == group_blocks:
            expected_slots.append([])
            expected_experts.append(e)
            in_group = 0
        expected_slots[-1].extend(slot_assignment[b * block:(b + 1) * block].tolist())
        prev, in_group = e, in_group + 1
    n_used = len(expected_experts)
    assert group_expert[:n_used].tolist() == expected_experts
    assert (group_expert[n_used:] == -1).all()
    for g, slots in enumerate(expected_slots):
        assert by_group[g].tolist() == slots + [-1] * (group - len(slots))
    assert (by_group[n_used:] == -1).all()
    return group_expert


@given(t=st.integers(1, 300), experts=st.integers(1, 6), k=st.integers(1, 3), block=st.integers(1, 200),
       group_blocks=st.integers(1, 9), seed=st.integers(0, 99))
@example(t=300, experts=2, k=2, block=64, group_blocks=8, seed=0)     # several live slot tiles per group
@example(t=100, experts=2, k=1, block=48, group_blocks=10, seed=1)    # slot tiles spanning blocks
def test_groups_of_moe_plan(t, experts, k, block, group_blocks, seed):
    k = min(k, experts)
    gen = torch.Generator().manual_seed(seed)
    topk_ids = torch.argsort(torch.rand(t, experts, generator=gen), dim=1)[:, :k]
    block_expert, slot_assignment = plan(topk_ids, experts, block)
    group_expert = check_groups(block_expert, slot_assignment, group_blocks, experts)
    # The number of groups is a function of the plan's size only (one kernel specialization).
    n_blocks = block_expert.numel()
    assert group_expert.numel() == group_count(n_blocks, experts, group_blocks, 0)


NON_CONSECUTIVE = [1, 0, 1, 1, -1, 1, 2, -1]     # expert 1 in three runs: 5 runs of 3 experts


def test_non_consecutive_blocks_and_idle_blocks_with_their_run_count():
    """A direct caller's plan whose expert blocks are not consecutive (the op refuses it, see below)
    keeps every slot when the caller passes its run count (``n_runs``): the groups are sized for
    5 runs, where the static bound (runs <= experts) has room for fewer."""
    block_expert = torch.tensor(NON_CONSECUTIVE, dtype=torch.int32)
    slot_assignment = torch.arange(16, dtype=torch.int32)
    slot_assignment[8:10] = -1
    slot_assignment[14:] = -1
    slot_assignment[3] = -1
    assert group_count(8, 3, 2, 5) > group_count(8, 3, 2)
    group_expert = check_groups(block_expert, slot_assignment, 2, 3, n_runs=5)
    assert group_expert.tolist()[:5] == [1, 0, 1, 1, 2]


@pytest.mark.parametrize("requires_grad", [False, True])
def test_the_op_refuses_non_consecutive_blocks_before_any_launch(requires_grad):
    """Every launch (forward, training forward, and the backward after it) sees a plan that passed
    ``validate_plan_values`` or a traced ``moe_plan`` plan, so ``merge_blocks`` sizes its groups by
    the static bound with no run count read from the plan: a non-consecutive plan raises first."""
    from nki_lib.moe.moe_experts_op import make_sample

    s = make_sample(6, 16, 16, 3, 2, 2, torch.float32, requires_grad)    # 12 assignments
    x, topk_weights, _, _, w_gate_up, w_down = s.args[:6]
    block_expert = torch.tensor(NON_CONSECUTIVE, dtype=torch.int32)    # 6 live blocks of 2 slots
    slot_assignment = torch.full((2, 8), -1, dtype=torch.int32)
    slot_assignment[:, block_expert >= 0] = torch.arange(12, dtype=torch.int32).reshape(6, 2).T
    slot_assignment = slot_assignment.T.reshape(-1)
    with nki_lib.use_backend("simulator"), pytest.raises(ValueError, match="must be consecutive"):
        torch.ops.nki.moe_experts(x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down, **s.kwargs)


def test_a_direct_backward_call_checks_the_plan_and_autograd_does_not_check_twice():
    """``torch.ops.nki.moe_experts_backward`` called directly validates the plan's values (a plan
    whose expert blocks are not consecutive would give wrong weight gradients: the kernel sums an
    expert's gradients across one run); the autograd formula passes ``plan_checked=True`` (its
    forward validated the same saved tensors), so a training step copies the plan to the host once,
    in the forward."""
    from nki_lib.bench.whole_op import TO_HOST, record_host_ops
    from nki_lib.moe.moe_experts_op import make_sample

    s = make_sample(6, 16, 16, 3, 2, 2, torch.float32, True)    # 12 assignments
    x, topk_weights, _, _, w_gate_up, w_down = (a.detach() for a in s.args[:6])
    block_expert = torch.tensor(NON_CONSECUTIVE, dtype=torch.int32)    # 6 live blocks of 2 slots
    slot_assignment = torch.full((2, 8), -1, dtype=torch.int32)
    slot_assignment[:, block_expert >= 0] = torch.arange(12, dtype=torch.int32).reshape(6, 2).T
    slot_assignment = slot_assignment.T.reshape(-1)
    dy = torch.ones_like(x)
    with nki_lib.use_backend("simulator"), pytest.raises(ValueError, match="must be consecutive"):
        torch.ops.nki.moe_experts_backward(dy, x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down,
                                           **s.kwargs)

    args = [a.detach().clone().requires_grad_(a.requires_grad) if a.is_floating_point() else a for a in s.args]
    with nki_lib.use_backend("simulator"):
        with record_host_ops() as step:
            y = torch.ops.nki.moe_experts(*args, **s.kwargs)
            torch.autograd.grad(y.sum(), [args[i] for i in (0, 1, 4, 5)])
        with record_host_ops() as direct:
            torch.ops.nki.moe_experts_backward(torch.ones_like(y), *(a.detach() for a in args), **s.kwargs)

    def copies(op, calls):
        return sorted(o.bytes_read for o in calls if o.op == op and o.name == TO_HOST)

    plan_copies = sorted(t.numel() * t.element_size() for t in args[2:4])
    assert set(plan_copies) <= set(copies("moe_experts", step))     # the training forward's check
    assert copies("moe_experts_backward", step) == []                # not again in its backward
    assert copies("moe_experts_backward", direct) == plan_copies     # a direct call checks


@given(slots=st.lists(st.integers(-1, 23), min_size=1, max_size=40), k=st.integers(1, 4),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_slot_tables_per_slot(slots, k, dtype):
    """The launchers' per-slot tables (``moe_experts_host``): the token id a // k and the routing
    weight of each slot's assignment a, -1 and 0 for padding (a = -1)."""
    from nki_lib.moe.kernels.moe_experts_host import slot_tokens, slot_weights

    group_slots = torch.tensor(slots, dtype=torch.int32)
    topk_weights = torch.rand(6, 4).to(dtype)
    flat = topk_weights.reshape(-1).float().tolist()
    tokens, weights = slot_tokens(group_slots, k), slot_weights(topk_weights, group_slots)
    assert tokens.dtype == torch.int32 and weights.dtype == torch.float32
    assert tokens.tolist() == [a // k if a >= 0 else -1 for a in slots]
    assert weights.tolist() == [flat[a] if a >= 0 else 0.0 for a in slots]
