"""Rows whose running max is +inf (an inf score, issue 10 behaviour 8): lse is +inf there (the
logsumexp of the scores, as the reference defines it), for the flash-attention forward and the
decode kernels; the other rows are untouched.

A query row with +inf in one head-dim entry, against keys whose entry there is positive, scores
+inf on every key (no inf * 0, which would be NaN in both). The kernels' running max of that row
becomes +inf, where exp(s - m) is NaN; lse must still be +inf.
"""

from __future__ import annotations

import pytest
import torch

import nki_lib
from nki_lib.attention.decode_attention_op import make_sample


def _both_paths(op, args, kwargs):
    outs = {}
    for path in ("reference", "simulator"):
        with nki_lib.use_backend(path), nki_lib.strict():
            outs[path] = op(*args, **kwargs)
    return outs


def _assert_inf_lse_row(outs, row_index):
    """lse is +inf on the poisoned row (logsumexp of +inf scores) and finite, as the reference's,
    everywhere else. (The reference path itself is not asserted on the poisoned row: its fused
    CPU attention gives NaN there when it runs with an additive mask, e.g. decode's offset causal
    rows, and +inf otherwise.)"""
    ref, got = outs["reference"][1], outs["simulator"][1]
    assert torch.isposinf(got[row_index]), got[row_index]
    others = torch.ones_like(got, dtype=torch.bool)
    others[row_index] = False
    assert torch.isfinite(got[others]).all() and torch.isfinite(ref[others]).all()


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
