"""moe_plan properties (hypothesis), on the reference path and on the NKI kernel (simulator,
strict): every assignment exactly once, experts own consecutive blocks in ascending order with
ascending assignments, padding -1, NB the static bound, counts right; edges (all tokens to one
expert, experts with no tokens, T * k < block_size, T = 0); kernel == reference exactly; what
the kernel cannot serve falls back visibly; bad ids rejected."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import nki_lib
import nki_lib.moe  # noqa: F401  (registers the ops)
from nki_lib.moe import moe_plan_op, moe_plan_reference
from nki_lib.numerics.oppar import op_parity


def plan(ids, e, block_size, path="reference"):
    with nki_lib.use_backend(path), nki_lib.strict(path != "reference"):
        return torch.ops.nki.moe_plan(ids, num_experts=e, block_size=block_size)


def check_plan(ids: torch.Tensor, e: int, block_size: int, path="reference"):
    block_expert, slots, counts = plan(ids, e, block_size, path)
    t, k = ids.shape
    n = t * k
    nb = -(-n // block_size) + e - 1
    assert block_expert.shape == (nb,) and slots.shape == (nb * block_size,) and counts.shape == (e,)
    assert block_expert.dtype == slots.dtype == counts.dtype == torch.int32
    flat = ids.reshape(-1).long()

    # counts
    assert torch.equal(counts.long(), torch.bincount(flat, minlength=e))
    # every assignment exactly once, the rest padding
    used = slots[slots >= 0].long()
    assert torch.equal(torch.sort(used).values, torch.arange(n))
    assert bool((slots[slots < 0] == -1).all())
    # blocks: used ones first, experts ascending, ceil(count / block) blocks each
    valid = block_expert >= 0
    n_used = int(valid.sum())
    assert bool(valid[:n_used].all()) and not bool(valid[n_used:].any())
    owners = block_expert[:n_used].long()
    assert bool((owners[1:] >= owners[:-1]).all())
    expected_blocks = (counts.long() + block_size - 1) // block_size
    assert torch.equal(torch.bincount(owners, minlength=e), expected_blocks)
    # within each expert's blocks: its assignments, ascending, packed at the front
    grid = slots.reshape(nb, block_size)
    for expert in range(e):
        mine = grid[block_expert == expert].reshape(-1)
        c = int(counts[expert])
        assert torch.equal(mine[:c].long(), torch.nonzero(flat == expert).reshape(-1))
        assert bool((mine[c:] == -1).all())
    assert bool((grid[~valid] == -1).all())


@st.composite
def plan_cases(draw):
    e = draw(st.integers(1, 12))
    t = draw(st.integers(0, 60))
    k = draw(st.integers(1, 4))
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16, 128]))
    mode = draw(st.sampled_from(["random", "distinct", "one", "skewed"]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 999)))
    if mode == "one":
        ids = torch.full((t, k), draw(st.integers(0, e - 1)))
    elif mode == "distinct" and k <= e:
        ids = torch.argsort(torch.rand(t, e, generator=gen), dim=1)[:, :k]
    elif mode == "skewed":           # experts with no tokens
        ids = torch.randint(0, max(1, e // 3), (t, k), generator=gen)
    else:
        ids = torch.randint(0, e, (t, k), generator=gen)
    return ids.to(draw(st.sampled_from([torch.int32, torch.int64]))), e, block_size


@given(plan_cases())
@example((torch.full((9, 2), 3, dtype=torch.int32), 5, 4))          # all tokens to one expert
@example((torch.tensor([[0, 2]], dtype=torch.int32), 6, 128))       # T * k < block_size
@example((torch.zeros((0, 2), dtype=torch.int32), 4, 8))            # T = 0
@example((torch.tensor([[1], [1], [1]], dtype=torch.int32), 2, 1))   # expert 0 empty
def test_plan_properties(case):
    ids, e, block_size = case
    check_plan(ids, e, block_size)
    check_plan(ids.to(torch.int32), e, block_size, "simulator")


@pytest.mark.parametrize("sample", moe_plan_op.SPEC.samples(torch.int32, False) + [
    moe_plan_op.make_sample(300, 8, 512, 128, seed=3),       # E at the PSUM-row limit, several tiles
    moe_plan_op.make_sample(130, 1, 1, 1),                   # E = 1, block_size = 1
], ids=lambda s: s.label)
def test_kernel_equals_reference(sample):
    result = op_parity(moe_plan_op.SPEC, sample)
    assert result.ok, str(result)


def test_int64_ids_are_served_by_the_kernel():
    ids = torch.tensor([[2, 0], [1, 2], [0, 1], [2, 1]], dtype=torch.int64)
    got = plan(ids, 3, 4, "simulator")                      # strict: no fallback
    for a, b in zip(got, moe_plan_reference.moe_plan(ids.to(torch.int32), num_experts=3, block_size=4)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("ids, e, block_size, reason", [
    (torch.zeros(4, 2, dtype=torch.int32), 3, 6, "power of two"),
    (torch.zeros(4, 2, dtype=torch.int32), 600, 4, "PSUM bank"),
])
def test_kernel_limits_fall_back_visibly(ids, e, block_size, reason):
    nki_lib.reset_coverage()
    with nki_lib.use_backend("simulator"):
        got = torch.ops.nki.moe_plan(ids, num_experts=e, block_size=block_size)
    for a, b in zip(got, moe_plan_reference.moe_plan(ids, num_experts=e, block_size=block_size)):
        assert torch.equal(a, b)
    assert reason in str(nki_lib.coverage())
    with pytest.raises(nki_lib.NKIFallbackError, match=reason):
        plan(ids, e, block_size, "simulator")


def test_plan_matches_fake_shapes_under_compile():
    ids = torch.randint(0, 6, (10, 2), dtype=torch.int32)
    compiled = torch.compile(lambda i: torch.ops.nki.moe_plan(i, num_experts=6, block_size=4), fullgraph=True,
                             backend="aot_eager")
    for got, want in zip(compiled(ids), plan(ids, 6, 4)):
        assert torch.equal(got, want)


def test_reference_num_blocks_is_tight():
    """The bound is reached: E - 1 experts with one assignment and one with the rest."""
    e, block_size = 4, 4
    ids = torch.tensor([[0], [1], [2]] + [[3]] * 5, dtype=torch.int32)
    block_expert, _, _ = plan(ids, e, block_size)
    assert block_expert.shape[0] == moe_plan_reference.num_blocks(ids.numel(), e, block_size)
    assert bool((block_expert >= 0).all())


@pytest.mark.parametrize("bad, match", [
    (torch.tensor([[0, 4]], dtype=torch.int32), "topk_ids"),
    (torch.tensor([[-1, 0]], dtype=torch.int32), "topk_ids"),
])
def test_out_of_range_ids(bad, match):
    with pytest.raises(ValueError, match=match):
        plan(bad, 4, 8)


def test_bad_arguments():
    ids = torch.zeros(3, 2, dtype=torch.int32)
    with pytest.raises(TypeError, match="topk_ids"):
        plan(ids.float(), 4, 8)
    with pytest.raises(ValueError, match="topk_ids"):
        plan(ids.reshape(-1), 4, 8)
    with pytest.raises(ValueError, match="num_experts"):
        plan(ids, 0, 8)
    with pytest.raises(ValueError, match="block_size"):
        plan(ids, 4, 0)
