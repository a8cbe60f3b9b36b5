"""Rows whose running max is +inf (an inf score, issue 10 behaviour 8): lse is +inf there (the
logsumexp of the scores, as the naive oracle defines it), for the flash-attention forward and the
decode kernels; the other rows are untouched.

A query row with +inf in one head-dim entry, against keys whose entry there is positive, scores
+inf on every key (no inf * 0, which would be NaN in both). The kernels' running max of that row
becomes +inf, where exp(s - m) is NaN; lse must still be +inf.
"""

from __future__ import annotations

import pytest
import torch

import nki_lib
from nki_lib.attention import flash_attention_reference
from nki_lib.attention.decode_attention_op import make_sample


def _both_paths(op, args, kwargs):
    outs = {}
    for path in ("reference", "simulator"):
        with nki_lib.use_backend(path), nki_lib.strict():
            outs[path] = op(*args, **kwargs)
    return outs


def _assert_inf_lse_row(outs, row_index):
    """lse is +inf on the poisoned row (logsumexp of +inf scores) on both paths, and finite
    everywhere else."""
    for path in ("reference", "simulator"):
        lse = outs[path][1]
        assert torch.isposinf(lse[row_index]), (path, lse[row_index])
        others = torch.ones_like(lse, dtype=torch.bool)
        others[row_index] = False
        assert torch.isfinite(lse[others]).all(), path


def _positive_entry(t, dim_index):
    """``t`` with entry ``dim_index`` of the head dim made positive (away from 0)."""
    t = t.clone()
    t[..., dim_index] = t[..., dim_index].abs() + 0.25
    return t


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_flash_forward_inf_score_row_has_inf_lse(causal, dtype):
    gen = torch.Generator().manual_seed(0)
    b, hq, hkv, s, d = 1, 2, 1, 200, 64
    q = torch.randn(b, hq, s, d, generator=gen).to(dtype)
    k = _positive_entry(torch.randn(b, hkv, s, d, generator=gen), 3).to(dtype)
    v = torch.randn(b, hkv, s, d, generator=gen).to(dtype)
    row = (0, 1, 150)
    q[row + (3,)] = float("inf")
    outs = _both_paths(torch.ops.nki.flash_attention, (q, k, v, None, None),
                       dict(causal=causal, scale=None, window_left=-1, window_right=-1, softcap=0.0))
    _assert_inf_lse_row(outs, row)


def test_decode_inf_score_row_has_inf_lse():
    sample = make_sample(2, 4, 2, 2, 16, [40, 9], torch.float32, block_size=8, capacity_=48, sinks=True)
    q, k, *rest = sample.args
    q, k = q.clone(), _positive_entry(k, 5)
    row = (1, 2, 1)
    q[row + (5,)] = float("inf")
    outs = _both_paths(torch.ops.nki.decode_attention, (q, k, *rest), sample.kwargs)
    _assert_inf_lse_row(outs, row)


REFERENCE_MASKED_CALLS = {
    # the structure or mask makes the reference run its fused kernel with an additive mask, where
    # an +inf score meets the mask's -inf entries
    "window": (200, dict(causal=True, window_left=37), False),
    "offset causal": (120, dict(causal=True), False),
    "key padding": (200, dict(causal=True), True),
}


@pytest.mark.parametrize("name", sorted(REFERENCE_MASKED_CALLS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_reference_masked_inf_score_row_has_inf_lse(name, dtype):
    """The reference path's masked calls give lse = +inf on a row with an +inf score (not NaN),
    as the naive oracle does, and the oracle's finite lse everywhere else."""
    sq, flags, key_padding = REFERENCE_MASKED_CALLS[name]
    gen = torch.Generator().manual_seed(1)
    b, hq, hkv, sk, d = 2, 2, 1, 200, 32
    q = torch.randn(b, hq, sq, d, generator=gen).to(dtype)
    k = _positive_entry(torch.randn(b, hkv, sk, d, generator=gen), 3).to(dtype)
    v = torch.randn(b, hkv, sk, d, generator=gen).to(dtype)
    row = (1, 0, sq - 50)
    q[row + (3,)] = float("inf")
    mask = None
    if key_padding:
        keys = torch.arange(sk)
        mask = torch.stack([keys >= 0, keys >= 30]).reshape(b, 1, 1, sk)
    with nki_lib.use_backend("reference"):
        _, lse = torch.ops.nki.flash_attention(q, k, v, None, None, None, mask, **flags)
    _, want = flash_attention_reference.naive(q.double(), k.double(), v.double(), None, None, None,
                                              mask, **flags)
    assert torch.isposinf(lse[row]), lse[row]
    assert torch.equal(torch.isposinf(lse), torch.isposinf(want))
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want)) and not lse.isnan().any()
