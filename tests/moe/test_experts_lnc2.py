"""moe_experts forward under LNC2 (``NEURON_LOGICAL_NC_CONFIG=2``): the two programs take
alternate groups of blocks, scatter their rows into one shared assignment-ordered scratch, meet at
a core barrier and sum alternate token tiles (the "sum" combine). The result is bitwise that of LNC1
with the same combine (every row is computed by the same instructions on either core, and the
k-sum keeps its order; LNC1 normally takes the "accumulate" combine, tests/moe/test_experts_combine.py),
and within the parity bound of the fp64 oracle; the backward is unchanged (LNC1)."""

from __future__ import annotations

import pytest
import torch

import nki_lib
import nki_lib.moe  # noqa: F401  (registers the ops)
from nki_lib.dispatch import collect_runs
from nki_lib.moe import moe_experts_op
from nki_lib.numerics.oppar import op_parity

CASES = {
    "odd groups": dict(t=37, h=40, inter=24, e=3, k=2, block=8, dtype=torch.bfloat16),
    "one group": dict(t=5, h=24, inter=16, e=1, k=1, block=8, dtype=torch.float32),
    "token tiles": dict(t=300, h=136, inter=40, e=4, k=2, block=64, dtype=torch.bfloat16),
    # every expert fills exactly one block: the plan's spare groups come last (unused), after the
    # last used group (whose y rows are scattered late, in the following group's body)
    "full blocks": dict(t=32, h=40, inter=136, e=4, k=2, block=16, dtype=torch.bfloat16,
                        topk_ids=(torch.arange(64) % 4).reshape(32, 2)),
    "gpt-oss": dict(t=20, h=48, inter=24, e=4, k=2, block=8, dtype=torch.float16, activation="clamped_swiglu",
                    biases=True, swiglu_limit=0.5),
}


def _sample(case, requires_grad):
    c = dict(case)
    return moe_experts_op.make_sample(c.pop("t"), c.pop("h"), c.pop("inter"), c.pop("e"), c.pop("k"),
                                      c.pop("block"), c.pop("dtype"), requires_grad, **c)


def _forward(sample):
    with nki_lib.use_backend("simulator"), nki_lib.strict(True), collect_runs() as runs:
        y = torch.ops.nki.moe_experts(*sample.args, **sample.kwargs)
    return y, runs[-1][1].grid


@pytest.mark.parametrize("name", sorted(CASES))
def test_lnc2_matches_lnc1(monkeypatch, name):
    sample = _sample(CASES[name], False)
    from nki_lib.moe.kernels import moe_experts_fwd_launch

    monkeypatch.setattr(moe_experts_fwd_launch, "combine_mode", lambda *args: "sum")
    outs = []
    for lnc in ("1", "2"):
        monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", lnc)
        y, grid = _forward(sample)
        assert grid == int(lnc)
        outs.append(y)
    assert torch.equal(outs[0].view(torch.uint8), outs[1].view(torch.uint8))


@pytest.mark.parametrize("name", sorted(CASES))
def test_lnc2_parity(monkeypatch, name):
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    sample = _sample(CASES[name], True)
    result = op_parity(moe_experts_op.SPEC, sample)
    assert result.ok, str(result)
    leaves = sum(isinstance(a, torch.Tensor) and a.requires_grad for a in sample.args)
    assert len(result.checks) == 1 + leaves, str(result)
