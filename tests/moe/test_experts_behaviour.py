"""moe_experts behaviour: bitwise determinism, free idle blocks, empty inputs, NaN propagation,
visible fallbacks, and bad inputs raising errors that name the argument (docs/contract.md §4.3, §5)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import nki_lib
import nki_lib.moe  # noqa: F401  (registers the ops)
from nki_lib.dispatch import NKIFallbackError, collect_runs
from nki_lib.moe import moe_experts_op, moe_experts_reference


def sample(t=9, h=24, inter=16, e=4, k=2, block=4, dtype=torch.bfloat16, activation="silu", **kw):
    return moe_experts_op.make_sample(t, h, inter, e, k, block, dtype, True, activation=activation, **kw)


def run_with_grads(s, path="simulator"):
    """y and the four gradients (of sum(y * r) for a fixed r) on ``path`` (strict)."""
    args = [a.detach().clone().requires_grad_(a.requires_grad) if a.is_floating_point() else a
            for a in s.args]
    with nki_lib.use_backend(path), nki_lib.strict(True):
        y = torch.ops.nki.moe_experts(*args, **s.kwargs)
        weight = torch.linspace(-1, 1, y.numel(), dtype=torch.float32).reshape(y.shape).to(y.dtype)
        grads = torch.autograd.grad((y * weight).sum(), [args[i] for i in (0, 1, 4, 5)])
    return (y.detach(), *grads)


def with_idle_blocks(s, extra):
    x, tw, block_expert, slots, wgu, wd = s.args
    block = slots.numel() // block_expert.numel()
    block_expert = torch.cat([block_expert, torch.full((extra,), -1, dtype=torch.int32)])
    slots = torch.cat([slots, torch.full((extra * block,), -1, dtype=torch.int32)])
    return type(s)((x, tw, block_expert, slots, wgu, wd), s.kwargs, s.label + f" +{extra} idle")


# --------------------------------------------------------------------------- determinism, cost

@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_bitwise_deterministic_forward_and_backward(activation):
    s = sample(t=14, k=3, e=5, activation=activation, seed=4)
    first, second = run_with_grads(s), run_with_grads(s)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def _engine_counts(s):
    with collect_runs() as runs:
        run_with_grads(s)
    counts = []
    for _, report in runs:
        by_engine = {}
        for entry in report.trace:
            if entry.engine != "sync":
                by_engine[entry.engine] = by_engine.get(entry.engine, 0) + 1
        counts.append(by_engine)
    return counts


def test_idle_blocks_cost_no_dma_or_compute():
    """Blocks with expert -1 are skipped by the dynamic guard: the same DMA and engine work."""
    s = sample(t=6, e=3, k=2, block=4)
    base, padded = _engine_counts(s), _engine_counts(with_idle_blocks(s, 5))
    assert len(base) == 2 and base == padded


def test_idle_blocks_do_not_change_results():
    s = sample(t=6, e=3, k=2, block=4)
    for a, b in zip(run_with_grads(s), run_with_grads(with_idle_blocks(s, 3))):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------- empty, NaN

@pytest.mark.parametrize("experts", [1, 3])
def test_empty_batch(experts):
    s = sample(t=0, e=experts, k=1, dtype=torch.float32)
    y, dx, dtw, dwgu, dwd = run_with_grads(s)
    assert y.shape == (0, 24) and dx.shape == (0, 24) and dtw.shape == (0, 1)
    assert not dwgu.any() and not dwd.any()


def test_nan_propagates_like_the_reference():
    s = sample(t=8, dtype=torch.float32)
    x = s.args[0].detach().clone()
    x[3, 5] = float("nan")
    args = (x, *s.args[1:])
    with nki_lib.use_backend("simulator"), nki_lib.strict(True):
        y = torch.ops.nki.moe_experts(*args, **s.kwargs)
    ref = moe_experts_reference.moe_experts(*[a.detach() for a in args], **s.kwargs)
    assert torch.equal(torch.isnan(y), torch.isnan(ref)) and torch.isnan(y[3]).all()
    assert torch.isfinite(y[torch.arange(8) != 3]).all()


# --------------------------------------------------------------------------- fallbacks

def test_oversized_block_falls_back_visibly():
    s = sample(t=4, block=4 * 128 + 8)
    nki_lib.reset_coverage()
    with nki_lib.use_backend("simulator"):
        torch.ops.nki.moe_experts(*s.args, **s.kwargs)
    reasons = nki_lib.coverage()["moe_experts"]["simulator"].fallbacks
    assert any("block_size" in r for r in reasons)
    with nki_lib.use_backend("simulator"), nki_lib.strict(True):
        with pytest.raises(NKIFallbackError, match="block_size"):
            torch.ops.nki.moe_experts(*s.args, **s.kwargs)


def test_float64_falls_back_to_the_reference():
    s = sample(dtype=torch.float64)
    with nki_lib.use_backend("simulator"), nki_lib.strict(True), pytest.raises(NKIFallbackError, match="float64"):
        torch.ops.nki.moe_experts(*s.args, **s.kwargs)


# --------------------------------------------------------------------------- bad inputs

def _replace(s, index=None, value=None, **kwargs):
    args = list(a.detach() if isinstance(a, torch.Tensor) else a for a in s.args)
    if index is not None:
        args[index] = value(args[index])
    return args, dict(s.kwargs, **kwargs)


def _set(t, pos, value):
    t = t.clone()
    t[pos] = value
    return t


BAD = [
    ("x rank", dict(index=0, value=lambda t: t[None]), ValueError, "x"),
    ("x dtype", dict(index=0, value=lambda t: t.to(torch.int32)), TypeError, "x"),
    ("topk_weights dtype", dict(index=1, value=lambda t: t.to(torch.int32)), TypeError, "topk_weights"),
    ("topk_weights rows", dict(index=1, value=lambda t: t[1:]), ValueError, "topk_weights"),
    ("block_expert dtype", dict(index=2, value=lambda t: t.to(torch.int16)), TypeError, "block_expert"),
    ("slot_assignment length", dict(index=3, value=lambda t: t[1:]), ValueError, "slot_assignment"),
    ("w_gate_up dtype", dict(index=4, value=lambda t: t.float()), TypeError, "w_gate_up"),
    ("w_gate_up hidden", dict(index=4, value=lambda t: t[:, :, 1:]), ValueError, "w_gate_up"),
    ("w_gate_up odd rows", dict(index=4, value=lambda t: t[:, 1:]), ValueError, "w_gate_up"),
    ("w_down shape", dict(index=5, value=lambda t: t[:, :, 1:]), ValueError, "w_down"),
    ("w_down experts", dict(index=5, value=lambda t: t[1:]), ValueError, "w_down"),
    ("expert out of range", dict(index=2, value=lambda t: _set(t, 0, 4)), ValueError, "block_expert"),
    ("assignment out of range", dict(index=3, value=lambda t: _set(t, 0, 18)), ValueError, "slot_assignment"),
    ("assignment twice", dict(index=3, value=lambda t: _set(t, t.tolist().index(1), 0)), ValueError,
     "slot_assignment"),
    ("assignment in an idle block", dict(index=3, value=lambda t: _set(_set(t, t == 0, -1), -1, 0)), ValueError,
     "block_expert is -1"),
    ("expert blocks not consecutive", dict(index=2, value=lambda t: _set(t, 0, int(t[t >= 0][-1]))), ValueError,
     "block_expert: the blocks of each expert must be consecutive"),
    ("activation unknown", dict(activation="relu"), ValueError, "activation"),
    ("weight_layout unknown", dict(weight_layout="io"), ValueError, "weight_layout"),
    # nn.Linear-shaped weights (H=24 != I=16) declared in_out: both shapes name the layout
    ("w_gate_up in the other layout", dict(weight_layout="in_out"), ValueError, "w_gate_up.*in_out"),
    ("w_down in the other layout", dict(index=4, value=lambda t: t.transpose(1, 2), weight_layout="in_out"),
     ValueError, "w_down.*in_out"),
]


@pytest.mark.parametrize("change,error,name", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_inputs_name_the_argument(change, error, name):
    s = sample(t=9, k=2, e=4, block=4)        # 18 assignments; the last block is idle
    assert int(s.args[2][-1]) == -1
    args, kwargs = _replace(s, **change)
    with pytest.raises(error, match=name):
        torch.ops.nki.moe_experts(*args, **kwargs)


# --------------------------------------------------------------------------- SBUF budget

@pytest.mark.parametrize("weight_layout", moe_experts_reference.WEIGHT_LAYOUTS)
@pytest.mark.parametrize("shape", [(20, 200, 136, 4, 2, 130, torch.bfloat16),
                                   (16, 260, 100, 2, 2, 64, torch.float32),
                                   (40, 64, 64, 4, 3, 512, torch.float16)], ids=["bf16", "fp32", "fp16-B512"])
def test_sbuf_estimates_bound_the_measured_peak(shape, weight_layout):
    """The launchers' SBUF budgets (used to refuse oversize calls) are upper bounds of the simulator's peak."""
    from nki_lib.moe.kernels import moe_experts_bwd, moe_experts_fwd_launch
    t, h, inter, e, k, block, dtype = shape
    s = moe_experts_op.make_sample(t, h, inter, e, k, block, dtype, True, weight_layout=weight_layout)
    with collect_runs() as runs:
        run_with_grads(s)
    (_, fwd), (_, bwd) = runs
    counts = dict(top_k=k, n_blocks=s.args[2].numel())
    itemsize = s.args[0].element_size()
    in_out = dict(in_out=weight_layout == "in_out", save=True)     # a training call: g/u saved
    blocks = moe_experts_fwd_launch.group_blocks(h, inter, block, itemsize, routed=(t * k, e), **counts, **in_out)
    group = block * blocks                                            # slots per group
    assert 0 < fwd.peak_sbuf_bytes <= moe_experts_fwd_launch.sbuf_bytes(h, inter, group, itemsize, **counts, **in_out)
    bwd_counts = dict(counts, in_out=in_out["in_out"])               # the backward takes either layout as given
    saved = moe_experts_bwd._saved_blocks((None, blocks), h, inter, block, itemsize, **bwd_counts) is not None
    bwd_group = group if saved else block * moe_experts_bwd.group_blocks(h, inter, block, itemsize, **bwd_counts)
    assert 0 < bwd.peak_sbuf_bytes <= moe_experts_bwd.sbuf_bytes(h, inter, bwd_group, itemsize, saved=saved,
                                                                 **bwd_counts)


@pytest.mark.parametrize("t,h,inter,e,k,save,blocks", [
    (1024, 7168, 2048, 256, 8, False, 1),    # deepseek-v3 prefill: 32 tokens per expert
    (2560, 7168, 2048, 16, 1, True, 4),      # deepseek-v3 expert parallel, 160: a training forward keeps 4
    (2560, 7168, 2048, 16, 1, "accumulate", 2),   # inference, the accumulate combine's buffers counted
    (2560, 7168, 2048, 16, 1, False, 4),      # without them 4 blocks stage whole (128-column chunks)
    (1024, 2048, 768, 128, 8, True, 4),      # qwen3-30b-a3b: rows staged whole at 4 blocks already
    (8192, 2048, 768, 128, 8, True, 4),
], ids=["deepseek-prefill", "deepseek-ep-train", "deepseek-ep", "deepseek-ep-sum", "qwen3-1k", "qwen3-8k"])
def test_forward_groups_shrink_to_stage_the_output_rows_whole(t, h, inter, e, k, save, blocks):
    """The forward takes fewer blocks per group than fit, down to an expert's blocks on balanced
    routing, only when those stage the output rows whole and the most that fit do not (one
    indirect write per live slot tile instead of one per column group), and only when it saves
    no g/u (the backward reads them in the forward's groups); otherwise the most that fit (a
    launch choice, plain arithmetic; no time is asserted)."""
    from nki_lib.moe.kernels import moe_experts_fwd_launch
    from nki_lib.moe.moe_plan_reference import num_blocks

    counts = dict(top_k=k, n_blocks=num_blocks(t * k, e, 128), save=save is True, accumulate=save == "accumulate")
    most = moe_experts_fwd_launch.group_blocks(h, inter, 128, 2, **counts)
    got = moe_experts_fwd_launch.group_blocks(h, inter, 128, 2, routed=moe_experts_fwd_launch._routed(t * k, e, counts), **counts)
    assert got == blocks <= most
    if got < most:
        assert got >= moe_experts_fwd_launch.filled_group_blocks(t * k, e, 128)
        assert moe_experts_fwd_launch._stages_whole(h, inter, 128, 2, got, e, counts)
        assert not moe_experts_fwd_launch._stages_whole(h, inter, 128, 2, most, e, counts)


def test_sbuf_estimate_with_the_prefetch_bounds_the_measured_peak():
    """An in_out training forward that loads each next group's gate/up weights during the current
    group (``prefetch_gu``, chosen only when ``sbuf_bytes_at(..., prefetch=True)`` fits): that
    estimate bounds the simulator's peak."""
    from nki_lib.moe.kernels import moe_experts_fwd_launch
    from nki_lib.moe.kernels.moe_experts_groups import group_count
    s = sample(t=48, h=1024, inter=256, e=3, k=2, block=32, weight_layout="in_out")
    with collect_runs() as runs:
        run_with_grads(s)
    (_, fwd), _ = runs
    h, inter, block, itemsize = 1024, 256, 32, s.args[0].element_size()
    flags = dict(in_out=True, save=True, accumulate=True, top_k=2)
    blocks = moe_experts_fwd_launch.group_blocks(h, inter, block, itemsize, n_blocks=s.args[2].numel(), **flags)
    counts = dict(flags, n_blocks=group_count(s.args[2].numel(), 3, blocks, 0))
    tiles = moe_experts_fwd_launch.tiling(h, inter, blocks * block, itemsize, **counts)
    assert moe_experts_fwd_launch._prefetch_fits((h, inter, blocks * block, itemsize), tiles, counts)
    h_chunk, y_cols, overlap, gu_cols, wd_cols = tiles
    assert 0 < fwd.peak_sbuf_bytes <= moe_experts_fwd_launch.sbuf_bytes_at(
        h, inter, blocks * block, itemsize, h_chunk, y_cols, overlap=overlap, gu_cols=gu_cols, wd_cols=wd_cols,
        prefetch=True, **counts)


# --------------------------------------------------------------------------- plan data checks

def _plan_ok(experts, slots, n, e):
    """Plain-Python statement of the plan contract (docs/contract.md §4.3)."""
    block = len(slots) // len(experts) if experts else 0
    if any(not -1 <= x < e for x in experts) or any(not -1 <= a < n for a in slots):
        return False
    if sorted(a for a in slots if a >= 0) != list(range(n)):
        return False
    runs = [x for i, x in enumerate(experts) if x >= 0 and (i == 0 or experts[i - 1] != x)]
    if len(runs) != len(set(runs)):
        return False
    return all(a < 0 for b, x in enumerate(experts) if x < 0 for a in slots[b * block:(b + 1) * block])


@given(n_blocks=st.integers(0, 6), block=st.integers(1, 4), e=st.integers(1, 4), n=st.integers(0, 12),
       dtype=st.sampled_from([torch.int32, torch.int64]), data=st.data())
def test_plan_value_checks_match_the_contract(n_blocks, block, e, n, dtype, data):
    """validate_plan_values raises exactly when a plan breaks the contract (random plans, mostly
    near-valid: a valid plan with a few entries changed)."""
    slots = [-1] * (n_blocks * block)
    positions = data.draw(st.permutations(range(len(slots))))[:n] if n <= len(slots) else []
    for a, pos in enumerate(positions):
        slots[pos] = a
    experts = sorted(data.draw(st.lists(st.integers(-1, e - 1), min_size=n_blocks, max_size=n_blocks)),
                     key=lambda x: (x < 0, x))
    for _ in range(data.draw(st.integers(0, 2))):
        if slots and data.draw(st.booleans()):
            slots[data.draw(st.integers(0, len(slots) - 1))] = data.draw(st.integers(-2, n))
        elif experts:
            experts[data.draw(st.integers(0, len(experts) - 1))] = data.draw(st.integers(-2, e))
    ok = _plan_ok(experts, slots, n, e)
    args = (torch.tensor(experts, dtype=dtype), torch.tensor(slots, dtype=dtype))
    if ok:
        moe_experts_op.validate_plan_values(*args, num_assignments=n, num_experts=e)
    else:
        with pytest.raises(ValueError):
            moe_experts_op.validate_plan_values(*args, num_assignments=n, num_experts=e)


# --------------------------------------------------------------------------- weight layouts

@pytest.mark.parametrize("shape", [dict(), dict(t=40, h=200, inter=136, e=3, block=64, activation="clamped_swiglu",
                                                biases=True, swiglu_limit=0.5),
                                   dict(t=48, h=1024, inter=256, e=3, k=2, block=32)],
                         ids=["small", "tiled-biases", "paired-h"])
def test_in_out_layout_is_bitwise_the_out_in_layout(shape):
    """The same weights given transposed (``weight_layout="in_out"``): the forward kernel loads W^T
    tiles instead of transposing weight rows on TensorE (a bit-exact transpose), so y is bitwise
    equal; every gradient is bitwise equal too, the weight gradients transposed: the backward
    kernel takes in_out natively (no host transposes), transposing on TensorE (bit-exact) the
    tiles each layout lacks, and contracts each weight gradient over the same slots in the same
    slot-tile order with its operands swapped (stationary and moving: the same products, summed
    in the same order), stored in the weight's own rows. "paired-h": H = 1024 takes its H tiles in pairs
    with two rows per partition (``H_INTERLEAVE``) in both layouts (``tiled-biases``: one natural
    tile), and the in_out forward loads each next group's gate/up weights during the current group
    (``prefetch_gu``)."""
    out_in = sample(**shape)
    in_out = sample(**shape, weight_layout="in_out")
    for i in (4, 5):
        assert torch.equal(in_out.args[i], out_in.args[i].transpose(1, 2))
    a, b = run_with_grads(out_in), run_with_grads(in_out)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
    assert torch.equal(a[3], b[3].transpose(1, 2)) and torch.equal(a[4], b[4].transpose(1, 2))


def test_in_out_backward_copies_no_weights_on_the_host():
    """The in_out backward takes the weights as given and writes its weight gradients in their
    layout: no host op of the backward moves a weight-sized tensor (the launcher's index metadata
    and the routing weights' casts only), where the host transposes used to copy both weights and
    both weight gradients."""
    from nki_lib.bench.whole_op import record_host_ops
    s = sample(t=16, h=256, inter=128, e=2, k=1, block=16, weight_layout="in_out")
    weight_bytes = min(s.args[i].numel() * s.args[i].element_size() for i in (4, 5))
    args = [a.detach().clone().requires_grad_(a.requires_grad) if a.is_floating_point() else a for a in s.args]
    with nki_lib.use_backend("simulator"), nki_lib.strict(True), record_host_ops() as ops:
        y = torch.ops.nki.moe_experts(*args, **s.kwargs)
        torch.autograd.grad(y.sum(), [args[i] for i in (0, 1, 4, 5)])
    backward = [o for o in ops if o.op == "moe_experts_backward"]
    assert backward and all(o.bytes_written < weight_bytes for o in backward), [o.name for o in backward]


def test_in_out_backward_transposes_its_weights_on_chip():
    """The in_out backward's extra TensorE transposes are the weight blocks each group's products
    lack in that layout: W_down^T (H on partitions) and W_gate/W_up^T (I on partitions, the dx
    phase), one block per (H tile, I tile) each, less the W_gate^T/W_up^T blocks the out_in
    recompute transposes (none: the backward reads the forward's saved g/u here)."""
    counts = {}
    for layout in moe_experts_reference.WEIGHT_LAYOUTS:
        s = sample(t=16, h=256, inter=128, e=2, k=1, block=16, weight_layout=layout)
        with collect_runs() as runs:
            run_with_grads(s)
        (_, _), (_, bwd) = runs
        counts[layout] = sum(1 for e in bwd.trace if e.opcode == "nc_transpose")
    h_tiles, i_tiles, experts = 2, 1, 2
    assert counts["in_out"] - counts["out_in"] == experts * 3 * h_tiles * i_tiles


def test_in_out_forward_transposes_no_weights():
    """The in_out forward's TensorE transposes are the x rows' and the slot ids' only: fewer than
    out_in's by the weight blocks (2 gate/up blocks per (H tile, I tile) plus one W_down block)."""
    counts = {}
    for layout in moe_experts_reference.WEIGHT_LAYOUTS:
        s = sample(t=16, h=256, inter=128, e=2, k=1, block=16, weight_layout=layout)
        with collect_runs() as runs, nki_lib.use_backend("simulator"), nki_lib.strict(True):
            torch.ops.nki.moe_experts(*s.args, **s.kwargs)
        (_, report), = runs
        counts[layout] = sum(1 for e in report.trace if e.opcode == "nc_transpose")
    h_tiles, i_tiles, experts = 2, 1, 2
    assert counts["out_in"] - counts["in_out"] == experts * 3 * h_tiles * i_tiles
