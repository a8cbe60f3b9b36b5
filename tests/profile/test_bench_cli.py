"""``nki-lib bench`` end to end on tiny shapes (the registered kernels, through the simulator)."""

import json
from dataclasses import replace

import pytest

from nki_lib.bench.cli import main
from nki_lib.bench.harness import CaseResult, run_case
from nki_lib.bench.output import SCHEMA, table
from nki_lib.bench.shapes import Case, sweep


def test_unregistered_op_is_reported_not_estimated(monkeypatch):
    from nki_lib import registry

    def missing(name):
        raise ValueError(f"unknown op {name!r}")

    monkeypatch.setattr(registry, "get", missing)
    res = run_case(Case("moe_router", "prefill", "tiny", dict(T=4, H=8, E=2, k=1)))
    assert res.status == "not registered" and res.estimates == {} and res.cpu_s == {}
    assert res.flops == 2 * 4 * 8 * 2  # the formula is still reported


def test_table_marks_extrapolated_and_missing_rows():
    rows = [CaseResult("a", "flash_attention", "prefill", "m", "attention", {}, "bfloat16", extrapolation="x2",
                       estimates={"trn2": {"time_us": 1.0, "tflops": 2.0, "mfu": 0.5, "roofline_fraction": 0.4,
                                           "engine_roofline_fraction": 0.6, "bound_engine": "tensor"}}),
            CaseResult("b", "moe_router", "prefill", "m", "moe", {}, "bfloat16", status="not registered")]
    text = table(rows)
    assert "* a" in text and "a: x2" in text and "b: not registered" in text
    assert "trn2 dep" in text.splitlines()[0]


def test_cli_smoke_writes_jsonl_table_and_plot(tmp_path):
    rc = main(["--sweep", "smoke", "--ops", "flash_attention", "--modes", "prefill", "--out", str(tmp_path)])
    assert rc == 0
    lines = (tmp_path / "bench.jsonl").read_text().splitlines()
    header, row = json.loads(lines[0]), json.loads(lines[1])
    assert header["schema"] == SCHEMA and "--sweep smoke" in header["command"]
    assert row["op"] == "flash_attention"
    assert row["status"] == "ok" or row["status"].startswith("fallback")
    if row["status"] == "ok":
        for target in ("trn2", "trn3"):
            est = row["estimates"][target]
            assert est["lower_bound_us"] <= est["dependency_bound_us"] <= est["time_us"] <= est["upper_bound_us"]
            assert est["dependency_bound"]["time_us"] == est["dependency_bound_us"]
            assert est["dependency_bound"]["mfu"] >= est["mfu"]
            assert 0 < est["mfu"] < 1 and 0 < est["engine_roofline_fraction"] <= 1
        assert row["instructions"] > 0 and row["cpu_s"]["simulator_first"] > 0
        assert (tmp_path / "roofline_attention.png").exists()
    assert (tmp_path / "bench.txt").read_text().startswith("case")


def test_lnc2_case_reports_each_cores_balance():
    case = next(c for c in sweep("smoke") if c.mode == "prefill" and c.op == "flash_attention")
    res = run_case(replace(case, lnc=2), ("trn2",), steady=False, cpu_paths=False)
    assert res.label.endswith(" LNC2")
    if res.status != "ok":
        assert res.status.startswith("fallback") and res.estimates == {}
        return
    est = res.estimates["trn2"]
    assert est["grid"] == 2
    assert 0.0 <= est["core_balance"] <= 1.0 and 0.0 <= est["dependency_bound"]["core_balance"] <= 1.0


def test_train_case_reports_forward_and_backward_apart():
    case = next(c for c in sweep("smoke") if c.mode == "train" and c.op == "flash_attention")
    res = run_case(case, ("trn2",), steady=False, cpu_paths=False)
    if res.status != "ok":  # no backward kernel on this checkout: reported, not estimated
        assert res.status.startswith("fallback") and res.estimates == {}
        return
    est = res.estimates["trn2"]
    parts = est["parts"]
    assert set(parts) == {"flash_attention", "flash_attention_backward"}
    assert sum(p["time_us"] for p in parts.values()) == pytest.approx(est["time_us"])
    for p in parts.values():
        assert 0 < p["engine_roofline_fraction"] <= 1 and p["hotspots"]
