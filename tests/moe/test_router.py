"""moe_router parity on the simulator path (strict) against the fp64 oracle: outputs AND gradients.

Inputs are built on a dyadic grid (x in {-1, 0, 1}, weight = small ints * 2^-s) so that logits
are exact in every precision: distinct logits differ by >= 2^-s and equal logits tie exactly in
the kernel and the oracle alike, so integer ids compare exactly. With a random expert bias a
near tie of the keys is still possible; such draws are rejected (``assume``) when two keys of a
row are closer than ``_KEY_MARGIN`` without being equal.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, example, given
from hypothesis import strategies as st

import nki_lib
import nki_lib.moe  # noqa: F401  (registers the ops)
from nki_lib.moe import moe_router_op, moe_router_reference
from nki_lib.numerics.oppar import op_parity
from nki_lib.registry import Sample

_KEY_MARGIN = 1e-4          # reject draws with distinct fp64 keys closer than this (near ties)
_WEIGHT_INT_RANGE = 4       # weight = randint(-4, 4) * 2^-shift
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grid_sample(t, h, e, dtype, *, top_k, bias=False, seed=0, identical_rows=(), **flags) -> Sample:
    """Router inputs with exact logits; ``identical_rows`` copies weight row 0 of each group onto
    the others (exact score ties)."""
    gen = torch.Generator().manual_seed(seed)
    shift = 2 + math.ceil(math.log2(max(1.0, math.sqrt(h))))
    x = torch.randint(-1, 2, (t, h), generator=gen).to(torch.float32)
    weight = torch.randint(-_WEIGHT_INT_RANGE, _WEIGHT_INT_RANGE + 1, (e, h), generator=gen) * 2.0 ** -shift
    for rows in identical_rows:
        weight[list(rows[1:])] = weight[rows[0]].clone()
    expert_bias = (0.05 * torch.randn(e, generator=gen)) if bias else None
    args = (x.to(dtype).requires_grad_(True), weight.to(dtype).requires_grad_(True), expert_bias)
    kwargs = dict(top_k=top_k, **flags)
    label = f"grid x({t},{h}) E={e} {str(dtype).replace('torch.', '')} {kwargs}" + (" bias" if bias else "")
    return Sample(args, kwargs, label)


def _near_tie(values: torch.Tensor, count: int) -> bool:
    """True if, in some row, two of the ``count`` + 1 largest values are distinct but closer than
    the margin (ranks beyond those never matter)."""
    top = torch.sort(values, dim=-1, descending=True).values[:, :count + 1]
    gaps = top[:, :-1] - top[:, 1:]
    finite = torch.isfinite(gaps)
    return bool(((gaps > 0) & (gaps < _KEY_MARGIN) & finite).any())


def keys_separated(sample: Sample) -> bool:
    """No near ties among the fp64 selection keys (and group scores) that decide the ids."""
    x, weight, bias = (None if a is None else a.detach().double() for a in sample.args)
    kw = sample.kwargs
    scores = moe_router_reference.scores_from_logits(x @ weight.T, kw.get("score_func", "softmax"))
    key = scores if bias is None else scores + bias
    groups = kw.get("num_groups", 1)
    if groups > 1:
        grouped = torch.sort(key.reshape(key.shape[0], groups, -1), dim=-1, descending=True).values
        if _near_tie(grouped[..., :2].sum(-1), kw.get("topk_groups", 1)):
            return False
        ids = moe_router_reference.select_experts(scores, bias, top_k=kw["top_k"], num_groups=groups,
                                       topk_groups=kw.get("topk_groups", 1))
        key = torch.full_like(key, -torch.inf).scatter(1, ids, key.gather(1, ids))
    return not _near_tie(key, kw["top_k"])


def check(sample: Sample):
    result = op_parity(moe_router_op.SPEC, sample)
    assert result.ok, str(result)


@st.composite
def router_cases(draw):
    groups = draw(st.sampled_from([1, 1, 2, 4]))
    group_size = draw(st.integers(1, 6))
    e = groups * group_size if groups > 1 else draw(st.integers(1, 40))
    topk_groups = draw(st.integers(1, groups))
    top_k = draw(st.integers(1, min(e, topk_groups * (e // groups))))
    return grid_sample(
        draw(st.integers(1, 260)), draw(st.integers(1, 160)), e, draw(st.sampled_from(_DTYPES)),
        top_k=top_k, bias=draw(st.booleans()), seed=draw(st.integers(0, 99)),
        score_func=draw(st.sampled_from(moe_router_reference.SCORE_FUNCS)), renormalize=draw(st.booleans()),
        num_groups=groups, topk_groups=topk_groups)


@given(router_cases())
@example(grid_sample(1, 8, 4, torch.float32, top_k=2))                                 # T = 1
@example(grid_sample(130, 33, 6, torch.bfloat16, top_k=2, bias=True))                  # T % 128 != 0
@example(grid_sample(7, 16, 1, torch.float32, top_k=1))                                # E = 1
@example(grid_sample(9, 24, 12, torch.bfloat16, top_k=12, score_func="sigmoid"))       # k = E > 8
@example(grid_sample(20, 300, 10, torch.float16, top_k=3, renormalize=False))          # H > pmax
@example(grid_sample(6, 16, 8, torch.float32, top_k=2, num_groups=8, topk_groups=4))   # groups of 1
def test_router_parity(sample):
    assume(keys_separated(sample))
    check(sample)


@pytest.mark.parametrize("dtype", _DTYPES)
def test_registered_samples(dtype):
    for sample in moe_router_op.SPEC.samples(dtype, True):
        check(sample)


def test_many_experts_tiled_moving():
    """E > gemm_moving_fmax: logits come from several PSUM banks."""
    sample = grid_sample(5, 16, 520, torch.bfloat16, top_k=3, bias=True, seed=3)
    assert keys_separated(sample)
    check(sample)


def _ids(sample, path="simulator"):
    with nki_lib.use_backend(path), nki_lib.strict(path != "reference"):
        return torch.ops.nki.moe_router(*sample.args, **sample.kwargs)[2]


@pytest.mark.parametrize("score_func", moe_router_reference.SCORE_FUNCS)
def test_exact_ties_go_to_lower_id(score_func):
    """Experts 1, 4 and 6 share one weight row (identical scores): they are picked as 1, 4, 6."""
    sample = grid_sample(40, 16, 8, torch.bfloat16, top_k=8, identical_rows=[(1, 4, 6)],
                         score_func=score_func)
    ids = _ids(sample)
    assert torch.equal(ids, _ids(sample, "reference"))
    pos = {e: (ids == e).int().argmax(dim=1) for e in (1, 4, 6)}
    assert bool((pos[1] < pos[4]).all() and (pos[4] < pos[6]).all())
    check(sample)


def test_ties_across_max8_rounds():
    """All 16 experts tie: the ids are 0..k-1 in order, also across the 8-wide max8 rounds."""
    sample = grid_sample(3, 8, 16, torch.float32, top_k=11, identical_rows=[tuple(range(16))])
    ids = _ids(sample)
    assert torch.equal(ids, torch.arange(11, dtype=torch.int32).expand(3, 11))
    check(sample)


def test_group_ties_go_to_lower_group():
    """Two identical groups tie for the one kept group: the lower group (experts 0-3) wins."""
    sample = grid_sample(10, 16, 8, torch.float32, top_k=2, num_groups=2, topk_groups=1,
                         identical_rows=[(i, i + 4) for i in range(4)], score_func="sigmoid")
    ids = _ids(sample)
    assert bool((ids < 4).all())
    check(sample)


def test_bias_steers_selection_only():
    """A large bias on expert 0 forces its selection; its weight stays its unbiased score (the
    oracle comparison in ``check`` covers the weights)."""
    sample = grid_sample(12, 16, 6, torch.float32, top_k=2, renormalize=False)
    x, weight, _ = sample.args
    sample = Sample((x, weight, torch.tensor([10.0, 0, 0, 0, 0, 0])), sample.kwargs, sample.label + " bias0")
    assert bool((_ids(sample)[:, 0] == 0).all())
    check(sample)


def test_empty_batch():
    x = torch.empty(0, 8)
    logits, w, ids = torch.ops.nki.moe_router(x, torch.randn(4, 8), top_k=2)
    assert logits.shape == (0, 4) and w.shape == (0, 2) and ids.shape == (0, 2) and ids.dtype == torch.int32


def test_float64_falls_back_visibly():
    sample = grid_sample(5, 8, 4, torch.float64, top_k=2)
    nki_lib.reset_coverage()
    with nki_lib.use_backend("simulator"):
        out = torch.ops.nki.moe_router(*sample.args, **sample.kwargs)
    assert out[0].dtype == torch.float64 and out[1].dtype == torch.float64
    assert "float64" in str(nki_lib.coverage())
    with nki_lib.use_backend("simulator"), nki_lib.strict(True), pytest.raises(nki_lib.NKIFallbackError):
        torch.ops.nki.moe_router(*sample.args, **sample.kwargs)


@pytest.mark.parametrize("num_groups", [1, 2])
def test_nan_and_inf_inputs_propagate_without_crashing(num_groups):
    """NaN/inf propagate as in the reference; ids stay valid (NaN experts rank first, as in a
    stable descending sort), so the plan accepts them."""
    sample = grid_sample(6, 8, 12, torch.float32, top_k=3, bias=True, num_groups=num_groups,
                         topk_groups=num_groups)
    x, weight, bias = (a.detach().clone() for a in sample.args)
    x[1, 3], x[2, 0], bias[7] = float("nan"), float("inf"), float("nan")
    with nki_lib.use_backend("simulator"), nki_lib.strict(True):
        logits, w, ids = torch.ops.nki.moe_router(x, weight, bias, **sample.kwargs)
    ref_logits, ref_w, ref_ids = moe_router_reference.moe_router(x, weight, bias, **sample.kwargs)
    assert torch.equal(ids, ref_ids)
    assert torch.equal(torch.isnan(w), torch.isnan(ref_w))
    assert torch.equal(torch.isnan(logits), torch.isnan(ref_logits))
    torch.ops.nki.moe_plan(ids, num_experts=12, block_size=4)


def test_runs_unchanged_on_trn3():
    from nki_lib import simulator

    previous = simulator.get_target()
    simulator.set_target("trn3")
    try:
        for sample in moe_router_op.SPEC.samples(torch.bfloat16, True):
            check(sample)
    finally:
        simulator.set_target(previous)


def test_lnc2_splits_token_tiles(monkeypatch):
    """NEURON_LOGICAL_NC_CONFIG=2: both kernels launch on two cores (alternate token tiles; the
    backward adds the cores' dweight partials), same parity, odd tile count and 2 E blocks."""
    from nki_lib.dispatch import collect_runs

    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    sample = grid_sample(300, 40, 140, torch.bfloat16, top_k=10, num_groups=4, topk_groups=2, score_func="sigmoid",
                         seed=1)
    assert keys_separated(sample)
    with collect_runs() as runs:
        check(sample)
    assert [(op, report.grid) for op, report in runs] == [("moe_router", 2), ("moe_router_backward", 2)]
