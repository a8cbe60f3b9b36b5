"""Issue 13's targets table (nki_lib.bench.targets): the limits the issue names, and the PASS /
SHORT decision on every limited estimate and at every sensitivity corner. Synthetic results only:
no test here asserts the time of a real kernel."""

import os

import pytest

from nki_lib.bench.harness import CaseResult, core_balance, extrapolate_estimate, lnc_degree, plan
from nki_lib.bench.output import targets_report
from nki_lib.bench.shapes import Case, sweep
from nki_lib.bench.targets import TUNING_TARGETS, TuningTarget, judge, target_cases

TIME_CASE = Case("decode_attention", "decode", "unit", dict(B=1, Hq=1, Hkv=1, Sq=1, L=128, D=64), lnc=1)
TIME_TARGET = TuningTarget("unit time", TIME_CASE, "decode_attention", "time_us",
                           {"in order": 10.0, "dependency bound": 10.0, "lower bound": 5.0}, at_most=True)
FRACTION_TARGET = TuningTarget("unit fraction", TIME_CASE, "decode_attention", "hbm_roofline_fraction",
                               {"in order": 0.7, "dependency bound": 0.7})


def _figures(in_order=9.0, dep=8.0, lower=4.0, fraction=0.8, dep_fraction=0.9) -> dict:
    return {"time_us": in_order, "dependency_bound_us": dep, "lower_bound_us": lower,
            "hbm_roofline_fraction": fraction,
            "dependency_bound": {"time_us": dep, "hbm_roofline_fraction": dep_fraction},
            "bound_engine": "dma", "hotspots": [{"source": "k.py:7", "opcode": "dma_copy", "waited_on": "data"}],
            "host": {"time_us": 20.0}, "whole_op_us": in_order + 20.0, "whole_op_dependency_bound_us": dep + 20.0}


def _row(figures: dict, sensitivity: dict | None = None, case: Case = TIME_CASE) -> CaseResult:
    est = dict(figures)
    if sensitivity is not None:
        est["sensitivity"] = sensitivity
    return CaseResult(case.label, case.op, case.mode, case.model, case.family, dict(case.dims), "bfloat16",
                      estimates={"trn2": est})


def _by_name(fragment: str) -> TuningTarget:
    (target,) = [t for t in TUNING_TARGETS if fragment in t.name]
    return target


@pytest.mark.parametrize("fragment, in_order, lower", [
    ("decode B=4 Hq=8 Hkv=1 Sq=1 cache 2048", 24.0, 15.7),
    ("decode B=8 Hq=4 Hkv=1 Sq=4 cache 128", 28.7, 13.0),
    ("decode B=8 Hq=8 Hkv=1 Sq=4 cache 1024", 34.8, 16.8),
    ("router softmax", 106.8, 64.2),
    ("experts forward T=1024", 438.0, 294.2),
])
def test_aws_limits_are_the_issues_figures(fragment, in_order, lower):
    t = _by_name(fragment)
    assert t.at_most and t.metric == "time_us"
    assert t.limits == {"in order": in_order, "dependency bound": in_order, "lower bound": lower}
    assert not t.case.extrapolate  # simulated at full shape


@pytest.mark.parametrize("fragment, part, metric, threshold", [
    ("attention forward S=4096 D=128 causal: engine", "flash_attention", "engine_roofline_fraction", 0.85),
    ("attention backward S=4096 D=128 causal: engine", "flash_attention_backward", "engine_roofline_fraction", 0.75),
    ("expert MLP forward", "moe_experts", "mfu", 0.80),
    ("expert MLP backward", "moe_experts_backward", "mfu", 0.50),
    ("decode 8k cache (llama3-8b", "decode_attention", "hbm_roofline_fraction", 0.70),
    ("decode 8k cache (gpt-oss-120b", "decode_attention", "hbm_roofline_fraction", 0.70),
    ("decode 32k cache (llama3-8b", "decode_attention", "hbm_roofline_fraction", 0.70),
    ("decode 32k cache (gpt-oss-120b", "decode_attention", "hbm_roofline_fraction", 0.70),
    ("decode 8k paged cache, block 64 (llama3-8b", "decode_attention", "hbm_roofline_fraction", 0.70),
    ("decode 8k paged cache, block 64 (gpt-oss-120b", "decode_attention", "hbm_roofline_fraction", 0.70),
    ("no core idles", "flash_attention_backward", "core_balance", 0.9),
])
def test_fraction_targets_hold_on_both_estimates(fragment, part, metric, threshold):
    t = _by_name(fragment)
    assert (t.part, t.metric, t.at_most) == (part, metric, False)
    assert t.limits == {"in order": threshold, "dependency bound": threshold}


def test_two_core_targets_launch_with_lnc2_and_the_sweep_runs_each_case_once():
    assert _by_name("experts forward T=1024").case.lnc == 2
    lnc2_bwd = _by_name("no core idles").case
    assert lnc2_bwd.lnc == 2 and lnc2_bwd.dims["B"] == 2 and lnc2_bwd.dims["Hkv"] == 1
    labels = [c.label for c in sweep("targets")]
    assert len(labels) == len(set(labels)) == len(target_cases())
    assert {t.case.label for t in TUNING_TARGETS} == set(labels)
    # only the 128-expert MFU case is extrapolated (two simulations, the marginal cost of an expert)
    assert [c.op for c in sweep("targets") if c.extrapolate] == ["moe_experts"]
    assert all(not c.extrapolate for c in sweep("aws"))


def test_time_target_passes_only_when_every_estimate_is_under_its_limit():
    assert judge(TIME_TARGET, _row(_figures())).status == "PASS"
    for short in (dict(in_order=11.0), dict(dep=10.5), dict(lower=5.5)):
        verdict = judge(TIME_TARGET, _row(_figures(**short)))
        assert verdict.status == "SHORT"
        assert [c.ok for c in verdict.checks].count(False) == 1


def test_fraction_target_passes_only_on_both_estimates():
    assert judge(FRACTION_TARGET, _row(_figures())).status == "PASS"
    assert judge(FRACTION_TARGET, _row(_figures(fraction=0.6))).status == "SHORT"
    assert judge(FRACTION_TARGET, _row(_figures(dep_fraction=0.6))).status == "SHORT"


def test_sensitivity_judges_the_unfavourable_end_of_each_range():
    corner_slow = {"time_us": 10.5, "dependency_bound_us": 8.0, "lower_bound_us": 4.0,
                   "hbm_roofline_fraction": 0.75, "dependency_bound": {"hbm_roofline_fraction": 0.9}}
    corner_fast = {"time_us": 8.0, "dependency_bound_us": 7.0, "lower_bound_us": 3.0,
                   "hbm_roofline_fraction": 0.65, "dependency_bound": {"hbm_roofline_fraction": 0.95}}
    row = _row(_figures(), {"c=1": corner_slow, "c=2": corner_fast})
    time_verdict = judge(TIME_TARGET, row)
    assert time_verdict.status == "SHORT"  # nominal passes; c=1 pushes in-order time over 10
    in_order = time_verdict.checks[0]
    assert in_order.low == (8.0, "c=2") and in_order.high == (10.5, "c=1") and in_order.worst == 10.5
    fraction_verdict = judge(FRACTION_TARGET, row)
    assert fraction_verdict.status == "SHORT"  # c=2 drops the in-order fraction to 65%
    assert fraction_verdict.checks[0].worst == 0.65
    assert judge(TIME_TARGET, _row(_figures(), {"c=2": corner_fast})).status == "PASS"


def test_missing_figure_is_not_available_not_judged():
    verdict = judge(TIME_TARGET, CaseResult(TIME_CASE.label, TIME_CASE.op, "decode", "unit", "attention", {},
                                            "bfloat16", status="fallback: no kernel"))
    assert verdict.status == "n/a" and "fallback" in verdict.reason


def test_judged_part_of_a_train_call():
    case = _by_name("expert MLP backward").case
    fwd, bwd = _figures(fraction=0.1), _figures()
    for fig, mfu in ((fwd, 0.85), (bwd, 0.55)):
        fig["mfu"], fig["dependency_bound"]["mfu"] = mfu, mfu
    row = CaseResult(case.label, case.op, case.mode, case.model, case.family, {}, "bfloat16",
                     estimates={"trn2": {"parts": {"moe_experts": fwd, "moe_experts_backward": bwd}}})
    assert judge(_by_name("expert MLP forward"), row).status == "PASS"
    assert judge(_by_name("expert MLP backward"), row).status == "PASS"
    bwd["dependency_bound"]["mfu"] = 0.45
    assert judge(_by_name("expert MLP backward"), row).status == "SHORT"


def test_report_prints_verdicts_estimates_ranges_and_whole_op(monkeypatch):
    import nki_lib.bench.targets as targets

    monkeypatch.setattr(targets, "TUNING_TARGETS", (TIME_TARGET, FRACTION_TARGET))
    corner = {"time_us": 9.5, "dependency_bound_us": 8.5, "lower_bound_us": 4.5, "hbm_roofline_fraction": 0.6,
              "dependency_bound": {"hbm_roofline_fraction": 0.9}}
    text = targets_report([_row(_figures(), {"c=3": corner})])
    assert "1 PASS, 1 SHORT" in text
    assert "PASS  unit time" in text and "SHORT unit fraction" in text
    assert "in order 9.0 us (target <= 10.0 us" in text and "lower bound 4.0 us (target <= 5.0 us" in text
    assert "9.0 us at nominal .. 9.5 us at c=3" in text
    assert "in order 80.0% (target >= 70.0%; over the documented ranges 60.0% at c=3" in text
    assert "whole op 29.0 us in order, 28.0 us dependency bound" in text and "k.py:7" in text
    assert targets_report([]) == ""


def test_core_balance_over_launches():
    assert core_balance([(100.0,)]) == 1.0
    assert core_balance([(100.0, 100.0)]) == 1.0
    assert core_balance([(100.0, 0.0)]) == 0.0
    assert core_balance([(100.0, 50.0), (0.0, 50.0)]) == 1.0
    assert core_balance([]) == 1.0


def test_full_shape_cases_are_not_extrapolated_and_lnc_is_scoped(monkeypatch):
    dims = dict(B=4, Hq=8, Hkv=1, Sq=1, L=2048, D=128)
    assert plan(Case("decode_attention", "decode", "m", dims)).scale == 4.0
    # a paged block holds every kv head: never simulated one kv head at a time
    assert plan(Case("decode_attention", "decode", "m", {**dims, "Hkv": 2, "block_size": 64})).scale == 1.0
    full = plan(Case("decode_attention", "decode", "m", dims, extrapolate=False))
    assert full.scale == 1.0 and full.extrapolation is None and full.dims == dims
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    with lnc_degree(2):
        assert os.environ["NEURON_LOGICAL_NC_CONFIG"] == "2"
    assert "NEURON_LOGICAL_NC_CONFIG" not in os.environ
    with lnc_degree(None):
        assert "NEURON_LOGICAL_NC_CONFIG" not in os.environ


def _estimate(span: float, busy: float, cores: tuple, path_ns: float):
    from nki_lib.simulator.profile import Estimate

    launch = 10.0
    return Estimate("k", "trn2", len(cores), launch + span, span, launch, launch + 0.8 * span, 0.8 * span,
                    launch + busy, launch + 2 * span, {"tensor": busy, "dma": busy / 2}, {"tensor": 3}, 0, 0.0,
                    core_makespans_ns=cores, core_dependency_makespans_ns=cores,
                    critical_path=[(None, "tensor", path_ns, "data")])


def test_two_point_extrapolation_is_linear_in_every_time_figure_and_keeps_the_launch_once():
    small, large = _estimate(100.0, 60.0, (100.0, 90.0), 50.0), _estimate(160.0, 110.0, (160.0, 150.0), 80.0)
    e = extrapolate_estimate(small, large, 3.0)   # f = f(small) + 3 (f(large) - f(small))
    assert e.makespan_ns == 100.0 + 3 * 60.0 and e.dependency_makespan_ns == 0.8 * 280.0
    assert e.launch_ns == 10.0 and e.time_ns == 10.0 + 280.0   # the launch is not multiplied
    assert e.busy_ns == {"tensor": 60.0 + 3 * 50.0, "dma": 30.0 + 3 * 25.0}
    assert e.lower_bound_ns == 10.0 + 210.0 and e.core_makespans_ns == (280.0, 270.0)
    # the critical path keeps the larger simulation's share of the makespan (80 / 160)
    assert e.hotspots(1)[0][4] == 0.5 and e.instructions == {"tensor": 3}
    # a constant prologue is charged once: two points that differ by a per-expert cost c extrapolate
    # to prologue + (n + s n) c, not (1 + s) x (prologue + n c)
    prologue, c, n = 40.0, 30.0, 2
    pair = [_estimate(prologue + e_sim * c, 0.0, (prologue + e_sim * c,), 0.0) for e_sim in (n, 2 * n)]
    assert extrapolate_estimate(*pair, (128 - n) / n).makespan_ns == prologue + 128 * c


def _launch_choices(dims: dict, tiling_plan=None) -> tuple:
    """The launchers' static choices for a moe_experts train call of ``dims``: the forward saving
    g/u, the backward reading them and the backward recomputing them (every non-tensor argument,
    and the slots per group), with meta-device activations and weights: only their shapes matter
    to the choices, the plan is real."""
    import torch

    from nki_lib.bench.harness import tiling_context
    from nki_lib.bench.inputs import _plan
    from nki_lib.moe.kernels.moe_experts_bwd import launch_moe_experts_bwd
    from nki_lib.moe.kernels.moe_experts_fwd_launch import launch_moe_experts_fwd, saved_grouping

    t, h, i, e, k, bs = (dims[x] for x in ("T", "H", "I", "E", "k", "block_size"))
    layout = dims.get("weight_layout", "out_in")
    meta = dict(dtype=torch.bfloat16, device="meta")
    x = torch.empty(t, h, **meta)
    block_expert, slots, _ = _plan((torch.arange(t * k, dtype=torch.int32) % e).reshape(t, k), e, bs)
    weights = torch.full((t, k), 1.0 / k)
    flags = dict(activation="silu", swiglu_alpha=1.702, swiglu_limit=7.0)
    w_gate_up, w_down = torch.empty(e, 2 * i, h, **meta), torch.empty(e, h, i, **meta)   # out_in
    # the weights in the call's layout (both kernels take either as given)
    fwd_weights = (w_gate_up.transpose(1, 2), w_down.transpose(1, 2)) if layout == "in_out" else (w_gate_up, w_down)
    plan_args = (x, weights, block_expert, slots)
    with tiling_context(tiling_plan):
        blocks, saved_shape = saved_grouping(*plan_args, *fwd_weights, activation="silu", weight_layout=layout)
        fwd = launch_moe_experts_fwd(*plan_args, *fwd_weights, weight_layout=layout, save_activations=True, **flags)
        saved = (torch.empty(saved_shape, **meta), blocks)
        bwd = launch_moe_experts_bwd(x, *plan_args, *fwd_weights, saved=saved, weight_layout=layout, **flags)
        recompute = launch_moe_experts_bwd(x, *plan_args, *fwd_weights, weight_layout=layout, **flags)

    def choices(launch, groups, group_slots):   # statics, tensor arguments (saved g/u or not), slots per group
        static = [a for a in launch.args if not isinstance(a, torch.Tensor) and a is not None]
        tensors = sum(isinstance(a, torch.Tensor) for a in launch.args)
        return static + [tensors, launch.args[group_slots].shape[0] // launch.args[groups].shape[0]]

    return choices(fwd, 2, 4), choices(bwd, 3, 5), choices(recompute, 3, 5)


def test_two_point_simulations_take_the_real_shapes_top_k_and_tiling():
    """The MFU case's two simulated points run the kernels the real shape runs: k' = k, and every
    launch choice (group size, the forward's chunk, staging and spans, the backward's I chunk and
    dx span) equal to the real shape's (at 255 groups the backward's dx span is 1024 columns; the
    points' own plans, 15 and 31 groups, would take 2048)."""
    case = _by_name("expert MLP forward").case
    p = plan(case)
    assert p.dims["k"] == p.marginal_dims["k"] == case.dims["k"] and p.tiling_plan is not None
    real = _launch_choices(case.dims)
    assert real[1][-2] == real[2][-2] + 1   # the train call's backward reads the forward's saved g/u
    for point in (p.dims, p.marginal_dims):
        assert _launch_choices(point, p.tiling_plan) == real
    # Without the context the points took dx span 2048 here until the backward's SBUF estimate
    # went per phase (60cdfd5): now they take the real shape's choices either way. That the context
    # does change the choices is test_kernels_tiled_for_a_larger_plan_keep_parity's first assert.


def test_kernels_tiled_for_a_larger_plan_keep_parity():
    """Under the two-point rule's tiling context the kernels launch the plan they are given with the
    larger plan's tiling (here half the groups' slots, forward and backward): the simulator path
    ran, and the output and every gradient pass the fp64-oracle parity check."""
    import torch

    import nki_lib
    from nki_lib.bench.harness import tiling_context
    from nki_lib.moe import moe_experts_op
    from nki_lib.numerics.oppar import op_parity

    dims = dict(T=128, H=512, I=512, E=2, k=2, block_size=128)
    larger = (3000, 1000)
    (fwd, bwd, _), (fwd_big, bwd_big, _) = _launch_choices(dims), _launch_choices(dims, larger)
    assert fwd_big[-1] < fwd[-1] and bwd_big[-1] < bwd[-1]   # fewer slots per group
    sample = moe_experts_op.make_sample(128, 512, 512, 2, 2, 128, torch.bfloat16, True)
    nki_lib.reset_coverage()
    with tiling_context(larger):
        result = op_parity(moe_experts_op.SPEC, sample)
    assert result.ok, str(result)
    assert len(result.checks) == 5   # y and the gradients of x, topk_weights, w_gate_up, w_down
    cov = nki_lib.coverage()
    for op in ("moe_experts", "moe_experts_backward"):
        assert cov[op]["simulator"].calls >= 1 and not cov[op]["simulator"].fallbacks


def test_two_point_case_is_the_linear_combination_of_its_two_simulations():
    """run_case of an extrapolated moe_experts case equals f(n) + s (f(2n) - f(n)) of the two
    shapes simulated on their own (a relation between estimates; no time is asserted)."""
    from dataclasses import replace

    from nki_lib.bench.harness import run_case

    case = Case("moe_experts", "prefill", "tiny", dict(T=128, H=256, I=128, E=8, k=2, block_size=128), lnc=1)
    p = plan(case)
    kw = dict(targets=("trn2",), steady=False, cpu_paths=False)
    got = run_case(case, **kw)
    assert got.status == "ok" and got.extrapolation == p.extrapolation
    small, large = (run_case(replace(case, dims=d, extrapolate=False), **kw).estimates["trn2"]
                    for d in (p.dims, p.marginal_dims))
    est = got.estimates["trn2"]
    for key in ("time_us", "dependency_bound_us", "lower_bound_us"):
        assert est[key] == pytest.approx(small[key] + p.marginal_scale * (large[key] - small[key]))
    assert est["host"]["hbm_bytes"] == pytest.approx(
        small["host"]["hbm_bytes"] + p.marginal_scale * (large["host"]["hbm_bytes"] - small["host"]["hbm_bytes"]))
    # host launches are the larger call's, not extrapolated (the op count does not grow with E)
    assert est["host"]["launches"] == large["host"]["launches"]
