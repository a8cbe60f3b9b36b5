"""nki_lib.sdpa against torch's scaled_dot_product_attention (parity rule of nki_lib.numerics:
torch's SDPA in float64 is the oracle, in the test dtype the baseline)."""

import math

import pytest
import torch

import nki_lib
from nki_lib.numerics import assert_parity

F = torch.nn.functional.scaled_dot_product_attention


def _inputs(shape_q, shape_kv, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mk = lambda s: torch.randn(s, generator=gen).to(dtype).requires_grad_(True)  # noqa: E731
    return mk(shape_q), mk(shape_kv), mk(shape_kv)


def _masks(shape, kind):
    gen = torch.Generator().manual_seed(1)
    if kind == "bool":
        m = torch.rand(shape, generator=gen) > 0.3
        m[..., 0] = True                      # (torch's math path gives NaN for empty rows)
        return m
    if kind == "float":
        m = torch.randn(shape, generator=gen)
        m = m.masked_fill(torch.rand(shape, generator=gen) < 0.2, -math.inf)
        m[..., 0] = 0.0
        return m
    return None


CASES = [
    dict(q=(2, 4, 9, 8), kv=(2, 4, 9, 8), is_causal=True),
    dict(q=(1, 2, 5, 8), kv=(1, 2, 11, 8), is_causal=True),
    dict(q=(1, 2, 11, 8), kv=(1, 2, 5, 8), is_causal=True),
    dict(q=(2, 4, 7, 8), kv=(2, 2, 10, 8), enable_gqa=True),
    dict(q=(2, 4, 7, 8), kv=(2, 1, 10, 8)),
    dict(q=(2, 2, 7, 8), kv=(2, 2, 10, 8), mask=("bool", (2, 1, 1, 10))),
    dict(q=(2, 2, 7, 8), kv=(2, 2, 10, 8), mask=("bool", (7, 10))),
    dict(q=(2, 2, 7, 8), kv=(2, 2, 10, 8), mask=("float", (2, 2, 7, 10)), scale=0.2),
    dict(q=(3, 7, 8), kv=(3, 10, 8), is_causal=True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: " ".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sdpa_matches_torch(case, dtype):
    kw = dict(is_causal=case.get("is_causal", False), scale=case.get("scale"),
              enable_gqa=case.get("enable_gqa", False))
    mask = None if "mask" not in case else _masks(case["mask"][1], case["mask"][0])
    q, k, v = _inputs(case["q"], case["kv"], dtype)
    results = {}
    for name, fn, cast in (("ours", nki_lib.sdpa, dtype), ("baseline", F, dtype), ("oracle", F, torch.float64)):
        args = [t.detach().to(cast).requires_grad_(True) for t in (q, k, v)]
        m = mask if mask is None or mask.dtype == torch.bool else mask.to(cast)
        out = fn(*args, attn_mask=m, **kw)
        out.sum().backward()
        results[name] = (out.detach(), *(a.grad for a in args))
    kinds = ["output", "grad", "grad", "grad"]
    for i, kind in enumerate(kinds):
        assert_parity(results["ours"][i], results["oracle"][i], results["baseline"][i], kind=kind,
                      dtype=dtype, name=f"sdpa[{i}]")


def test_dropout_is_a_recorded_fallback():
    q, k, v = _inputs((1, 2, 6, 8), (1, 2, 6, 8), torch.float32)
    nki_lib.reset_coverage()
    out = nki_lib.sdpa(q, k, v, dropout_p=0.5)
    assert out.shape == q.shape
    assert nki_lib.coverage()["flash_attention"]["sdpa"].fallbacks["sdpa: dropout_p > 0"] == 1


def test_mask_and_causal_together_raise():
    q, k, v = _inputs((1, 2, 6, 8), (1, 2, 6, 8), torch.float32)
    with pytest.raises(ValueError, match="attn_mask and is_causal"):
        nki_lib.sdpa(q, k, v, attn_mask=torch.ones(6, 6, dtype=torch.bool), is_causal=True)


def test_head_mismatch_without_gqa_raises():
    q, k, v = _inputs((1, 4, 6, 8), (1, 2, 6, 8), torch.float32)
    with pytest.raises(ValueError, match="enable_gqa"):
        nki_lib.sdpa(q, k, v)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_key_padding_runs_on_the_kernels(kind):
    """Left- and right-padded keys (B, 1, 1, S), bool or additive 0/-inf, on the simulator path
    (strict): the flash kernels serve forward and backward, within the parity rule."""
    q, k, v = _inputs((3, 2, 7, 8), (3, 2, 10, 8), torch.bfloat16)
    keys = torch.arange(10)
    allow = torch.stack([keys < 10, keys >= 3, keys < 6])[:, None, None]
    mask = allow if kind == "bool" else torch.zeros(allow.shape).masked_fill(~allow, -math.inf)
    nki_lib.reset_coverage()
    results = {}
    for name, cast in (("ours", torch.bfloat16), ("baseline", torch.bfloat16), ("oracle", torch.float64)):
        args = [t.detach().to(cast).requires_grad_(True) for t in (q, k, v)]
        m = mask if kind == "bool" else mask.to(cast)
        with nki_lib.use_backend("simulator"), nki_lib.strict():
            out = nki_lib.sdpa(*args, attn_mask=m) if name == "ours" else F(*args, attn_mask=m)
            out.sum().backward()
        results[name] = (out.detach(), *(a.grad for a in args))
    for i, kind_i in enumerate(["output", "grad", "grad", "grad"]):
        assert_parity(results["ours"][i], results["oracle"][i], results["baseline"][i], kind=kind_i,
                      dtype=torch.bfloat16, name=f"sdpa[{i}]")
    stats = nki_lib.coverage()
    for op in ("flash_attention", "flash_attention_backward"):
        assert stats[op]["simulator"].calls == 1 and not stats[op]["simulator"].fallbacks
