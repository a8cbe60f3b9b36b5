"""moe_router bad inputs (docs/contract.md §5): ValueError / TypeError naming the argument, raised
before any kernel runs; launcher limits raise ``Unsupported`` and fall back visibly."""

from __future__ import annotations

import pytest
import torch

import nki_lib
import nki_lib.moe  # noqa: F401  (registers the ops)
from nki_lib.dispatch import Unsupported
from nki_lib.moe.kernels import moe_router_bwd, moe_router_fwd

T, H, E = 6, 8, 4


def call(x=None, weight=None, expert_bias=None, **flags):
    x = torch.randn(T, H) if x is None else x
    weight = torch.randn(E, H) if weight is None else weight
    flags.setdefault("top_k", 2)
    return torch.ops.nki.moe_router(x, weight, expert_bias, **flags)


@pytest.mark.parametrize("kwargs, error, name", [
    (dict(x=torch.randn(T, H, 1)), ValueError, "x"),
    (dict(weight=torch.randn(E)), ValueError, "weight"),
    (dict(x=torch.randint(0, 3, (T, H))), TypeError, "x"),
    (dict(weight=torch.randn(E, H, dtype=torch.bfloat16)), TypeError, "weight"),
    (dict(weight=torch.randn(E, H + 1)), ValueError, "x must have hidden size"),
    (dict(expert_bias=torch.randn(E, dtype=torch.float64)), TypeError, "expert_bias"),
    (dict(expert_bias=torch.randn(E + 1)), ValueError, "expert_bias"),
    (dict(top_k=0), ValueError, "top_k"),
    (dict(top_k=E + 1), ValueError, "top_k"),
    (dict(score_func="relu"), ValueError, "score_func"),
    (dict(num_groups=3), ValueError, "num_groups"),
    (dict(num_groups=0), ValueError, "num_groups"),
    (dict(num_groups=2, topk_groups=3), ValueError, "topk_groups"),
    (dict(num_groups=4, topk_groups=1, top_k=2), ValueError, "topk_groups"),
])
def test_bad_inputs_name_the_argument(kwargs, error, name):
    with pytest.raises(error, match=name):
        call(**kwargs)


def test_bad_inputs_rejected_under_fake_tensors():
    """The fake runs the same checks (torch.compile / export see them)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        with pytest.raises(ValueError, match="top_k"):
            call(torch.empty(T, H), torch.empty(E, H), top_k=E + 1)


def test_launcher_limits_raise_unsupported_before_launch():
    """Sizes the kernels cannot hold in SBUF are refused up front (meta tensors: nothing runs)."""
    x = torch.empty(4, 65536, dtype=torch.bfloat16, device="meta")
    weight = torch.empty(2048, 65536, dtype=torch.bfloat16, device="meta")
    with pytest.raises(Unsupported, match="SBUF"):
        moe_router_fwd.check_supported(x, weight)
    with pytest.raises(Unsupported, match="SBUF"):
        moe_router_bwd.check_supported(x, weight)
    with pytest.raises(Unsupported, match="scan limit"):
        moe_router_fwd.check_supported(x, torch.empty(20000, 8, device="meta"))


def test_unsupported_falls_back_visibly(monkeypatch):
    def refuse(*args, **kwargs):
        raise Unsupported("test refusal")

    monkeypatch.setattr(moe_router_fwd, "check_supported", refuse)
    nki_lib.reset_coverage()
    with nki_lib.use_backend("simulator"):
        out = call()
    assert out[0].shape == (T, E)
    assert "test refusal" in str(nki_lib.coverage())
    with nki_lib.use_backend("simulator"), nki_lib.strict(True), pytest.raises(nki_lib.NKIFallbackError,
                                                                                match="test refusal"):
        call()
