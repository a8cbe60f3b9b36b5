"""The emulated neuron device (``nki_lib.emulate_neuron()``): each scenario in its own process
(the emulation renames PrivateUse1 once per process), bounded in time."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TIMEOUT_S = 300


def run_scenario(name: str, *args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OPENBLAS_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(HERE / "emulated_scenarios.py"), name, *args], env=env, check=False,
                          capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT)
    assert proc.returncode == 0, f"scenario {name} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def ops_findings(tmp_path_factory):
    baseline = tmp_path_factory.mktemp("neuron") / "cpu_baseline.pt"
    run_scenario("cpu_baseline", str(baseline))
    return run_scenario("ops", str(baseline))["cases"]


def test_every_op_runs_on_neuron_equal_to_the_simulator_bitwise(ops_findings):
    from nki_lib import registry

    assert {c["op"] for c in ops_findings} == {s.name for s in registry.all_specs()}
    for case in ops_findings:
        where = f"{case['op']} [{case['label']}]"
        assert case["outputs_equal"], f"{where}: neuron outputs differ from the simulator on CPU"
        assert case["grads_equal"], f"{where}: neuron gradients differ from the simulator on CPU"
        assert case["on_neuron"], f"{where}: an output or gradient is not on the neuron device"


def test_differentiable_ops_produce_gradients_on_neuron(ops_findings):
    from nki_lib import registry

    for case in ops_findings:
        if registry.get(case["op"]).differentiable:
            assert case["n_grads"] > 0, case


def test_ledger_shows_the_device_path_and_emulated_aten_calls(ops_findings):
    from nki_lib import registry

    for case in ops_findings:
        spec = registry.get(case["op"])
        names = [spec.name] + ([spec.backward_name] if spec.differentiable and spec.backward_name else [])
        for name in names:
            assert case["paths"].get(name) == {"device": 1}, (name, case["paths"])
        assert case["fallbacks"] == {n: {} for n in case["paths"]}, case["fallbacks"]
        assert case["emulated_aten"] > 0   # host-side preparation and the copies ran as neuron aten ops


def test_cpu_behaviour_is_unchanged_by_the_emulation(ops_findings):
    for case in ops_findings:
        assert case["cpu_unchanged"], f"{case['op']} [{case['label']}]: CPU results changed under emulation"
        assert case["cpu_paths"] == ["reference"], case["cpu_paths"]
        assert case["cpu_emulated_aten"] == 0


def test_a_call_the_kernels_cannot_serve_falls_back_visibly():
    found = run_scenario("fallback")
    assert found["fallbacks"]["device"] == {"float64": 1}
    assert found["reference_calls"] == 1
    assert found["equal_reference"] and found["on_neuron"]
    assert found["strict_error"] == "nki::flash_attention: the device path cannot serve this call: float64"


def test_neuron_tensors_behave_like_a_device():
    found = run_scenario("tensors")
    assert found["device"] == "neuron:0" and found["roundtrip"] and found["module"]
    assert found["view_strides"] == [1, 4] and not found["view_contiguous"] and found["view_values"]
    assert found["shares_storage"]
    assert found["fill"] and found["out_shape"] == [3, 4] and found["out_values"]
    assert found["grad_device"] == "neuron:0" and found["grad_equal"]
    for name in ("aten::mm", "aten::sin", "aten::_copy_from", "aten::abs"):
        assert found["emulated_aten"].get(name, 0) >= 1, name


@pytest.mark.parametrize("scenario,words", [
    ("refuse_neuronx", "torch_neuronx is loaded"),
    ("refuse_taken", "already taken (renamed to 'other')"),
    ("refuse_after_backward", "before the first autograd backward"),
])
def test_emulation_refuses_when_privateuse1_is_not_free(scenario, words):
    found = run_scenario(scenario)
    assert found["error"] is not None and words in found["error"], found


def test_compiled_attention_moe_block_trains_like_eager_on_neuron():
    found = run_scenario("compile_block")
    assert found["losses_equal"] and found["params_equal"], found["losses"]
    for which in ("forward", "backward"):
        targets = found["graphs"][which]
        assert "nki_kernel_call" in targets, which          # the kernels are graph nodes
        assert not any(t.startswith("nki.") for t in targets), (which, targets)   # no opaque op
    # the compiled steps' kernel calls count at run time, once per step (3 steps)
    assert found["calls"] == {op: {"device": 3} for op in found["calls"]} and len(found["calls"]) == 7
    # CPU inputs: the ops stay opaque nodes (a training step's experts: moe_experts_train,
    # docs/contract.md §4.3)
    assert {"nki.flash_attention.default", "nki.moe_router.default", "nki.moe_plan.default",
            "nki.moe_experts_train.default"} <= set(found["cpu_graph"])
    assert "nki_kernel_call" not in found["cpu_graph"]
    assert "static shapes only" in found["dynamic_error"]
    assert "opaque op node nki.flash_attention.default with neuron inputs" in found["opaque_error"]
