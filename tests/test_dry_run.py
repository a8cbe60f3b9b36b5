"""``nki_lib.dry_run`` and ``nki-lib dry-run``: the migration reading of a user's step."""

from __future__ import annotations

import json

import torch

import nki_lib
from nki_lib.coverage import PathStats
from nki_lib.migration.cli import main as cli_main

STEP_MODULE = '''
import torch, nki_lib

def step():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 32, 16, generator=gen, requires_grad=True)
    k = torch.randn(1, 1, 32, 16, generator=gen)
    v = torch.randn(1, 1, 32, 16, generator=gen)
    nki_lib.flash_attention(q, k, v, causal=True).sum().backward()
    nki_lib.flash_attention(q.detach(), k, v, causal=True)            # same specialization
    nki_lib.flash_attention(q.double(), k.double(), v.double())        # float64: falls back
'''


def _step():
    namespace: dict = {}
    exec(compile(STEP_MODULE, "step", "exec"), namespace)
    return namespace["step"]


def _simulator_calls(op):
    return nki_lib.coverage().get(op, {}).get("simulator", PathStats()).calls


def test_dry_run_reads_calls_paths_fallbacks_compilations_and_estimates():
    before = _simulator_calls("flash_attention")
    report = nki_lib.dry_run(_step())
    ops = {o.op: o for o in report.ops}
    assert set(ops) == {"flash_attention", "flash_attention_backward"}
    fwd, bwd = ops["flash_attention"], ops["flash_attention_backward"]
    assert fwd.calls == 3 and fwd.paths == {"simulator": 2, "reference": 1}
    assert fwd.fallbacks == {"simulator: float64": 1}
    assert fwd.kernel_launches == 2 and len(fwd.specializations) == 1
    spec = fwd.specializations[0]
    assert spec.kernel.endswith("flash_attention_fwd_kernel") and spec.tensors[0] == "float32[1, 2, 16, 32]"
    assert bwd.calls == 1 and bwd.paths == {"simulator": 1} and not bwd.fallbacks
    for op in (fwd, bwd):
        assert op.kernel_us > 0 and op.dependency_bound_us > 0 and op.host_us >= 0
    assert abs(sum(report.share(o) for o in report.ops) - 1.0) < 1e-9   # shares of one total
    assert report.total_calls == 4 and report.fallback_calls == 1 and report.compilations == 2
    # the process-wide ledger keeps the dry run's calls on top of what it held
    assert _simulator_calls("flash_attention") == before + 2


def test_dry_run_report_text_and_json_carry_the_same_data():
    report = nki_lib.dry_run(_step())
    text = str(report)
    assert text.splitlines()[1].split()[:3] == ["op", "calls", "path"]
    assert "simulator: float64 (x1)" in text and "kernel specializations" in text
    data = json.loads(report.to_json())
    assert data["totals"]["calls"] == report.total_calls
    assert data["totals"]["compilations"] == report.compilations
    row = next(r for r in data["ops"] if r["op"] == "flash_attention")
    fwd = next(o for o in report.ops if o.op == "flash_attention")
    assert row["fallbacks"] == {"simulator: float64": 1}
    assert row["calls"] == 3 and row["kernel_us_per_call"] == fwd.kernel_us / 3
    assert row["share"] == report.share(fwd)


def test_dry_run_cli_runs_module_callable(tmp_path, monkeypatch, capsys):
    (tmp_path / "user_step.py").write_text(STEP_MODULE)
    monkeypatch.chdir(tmp_path)
    out_json = tmp_path / "report.json"
    assert cli_main(["user_step:step", "--json", str(out_json)]) == 0
    printed = capsys.readouterr().out
    assert "flash_attention_backward" in printed
    assert json.loads(out_json.read_text())["totals"]["fallback_calls"] == 1


def test_dry_run_cli_rejects_a_bad_spec(capsys):
    assert cli_main(["no_colon_here"]) == 2
    assert "MODULE:CALLABLE" in capsys.readouterr().err


def test_dry_run_rejects_a_non_callable():
    try:
        nki_lib.dry_run(torch.zeros(1))
    except TypeError as exc:
        assert "fn must be callable" in str(exc)
    else:
        raise AssertionError("dry_run accepted a tensor as fn")
