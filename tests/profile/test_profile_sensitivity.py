"""Sensitivity to the low-confidence constants (issue 10, cost model 5; docs/cost-model.md §7.9).

Every numeric ``L`` constant has documented bounds with a cited source; ``nki-lib bench --set``
replaces a constant for a run; ``--sensitivity`` estimates trn2 at each bound of each such
constant and a target PASSes only if it holds at every one.
"""

import json

import pytest

from nki_lib.bench.cli import main
from nki_lib.bench.harness import run_case
from nki_lib.bench.shapes import Case
from nki_lib.simulator.profile import corners, low_confidence, params

ROUTER = Case("moe_router", "prefill", "tiny", dict(T=128, H=256, E=8, k=2))


@pytest.mark.parametrize("target", ["trn2", "trn3"])
def test_every_numeric_low_confidence_constant_has_cited_bounds(target):
    hw = params(target)
    for name, p in hw.items():
        if p.confidence != "L" or not isinstance(p.value, (int, float)):
            continue
        assert p.bounds is not None, name
        low, high = p.bounds
        assert low <= p.value <= high, name
        assert "docs/cost-model.md §7.9" in p.bounds_source and "low:" in p.bounds_source \
            and "high:" in p.bounds_source, name


def test_named_constants_of_the_issue_are_bounded():
    bounded = low_confidence(params("trn2"))
    assert {"dma_chunk_floor_ns", "dma_issue_swdge_per_descriptor_ns", "dma_issue_swdge_ns"} <= set(bounded)


def test_corners_change_one_constant_each():
    hw = params("trn2")
    cs = corners("trn2")
    assert len(cs) == 2 * len(low_confidence(hw))
    for c in cs:
        assert getattr(c.hw, c.name) == c.value == low_confidence(hw)[c.name][c.side == "high"]
        changed = [n for n, p in c.hw.items() if p.value != hw.param(n).value]
        assert changed in ([c.name], [])  # [] when the bound equals the nominal value


def test_set_replaces_a_constant_for_the_run():
    slow = params("trn2").with_values("test", dma_chunk_floor_ns=400.0)
    nominal = run_case(ROUTER, ("trn2",), steady=False, cpu_paths=False)
    changed = run_case(ROUTER, ("trn2",), steady=False, cpu_paths=False, hw={"trn2": slow})
    assert nominal.status == changed.status == "ok"
    assert changed.estimates["trn2"]["busy_us"]["dma"] > nominal.estimates["trn2"]["busy_us"]["dma"]


def test_cli_set_and_sensitivity(tmp_path, capsys):
    rc = main(["--sweep", "smoke", "--ops", "moe_router", "--targets", "trn2", "--no-cpu", "--no-plot",
               "--no-steady", "--set", "dma_chunk_floor_ns=150", "--sensitivity", "--out", str(tmp_path)])
    assert rc == 0
    header, row = (json.loads(line) for line in (tmp_path / "bench.jsonl").read_text().splitlines()[:2])
    assert header["set"] == {"dma_chunk_floor_ns": 150.0} and header["sensitivity"] is True
    labels = set(row["estimates"]["trn2"]["sensitivity"])
    set_hw = params("trn2").with_values("cli", dma_chunk_floor_ns=150.0)
    assert labels == {c.label for c in corners(set_hw)}  # the constant set on the command line stays fixed
    assert not any(label.startswith("dma_chunk_floor_ns=") for label in labels)
    assert "trn2 sensitivity" in capsys.readouterr().out


def test_cli_set_rejects_unknown_constants():
    with pytest.raises(SystemExit, match="no cost-model constant"):
        main(["--sweep", "smoke", "--ops", "moe_router", "--set", "warp_speed=9"])
    with pytest.raises(SystemExit, match="NAME=VALUE"):
        main(["--sweep", "smoke", "--ops", "moe_router", "--set", "dma_chunk_floor_ns"])
