"""Per-row key bounds (``nki_lib.attention.key_bounds``): the flash kernels serve padded batches
(``attn_mask`` key padding, left or right, B > 1) and packed documents with their own key offsets
(``cu_seqlens_k``). Host planning is checked against the dense mask of the contract; the kernels
(forward and backward, simulator, strict) against the fp64 oracle by ``op_parity``, with the
coverage ledger showing the kernel path; inexpressible masks stay recorded fallbacks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import nki_lib
from nki_lib import registry
from nki_lib.attention import key_bounds, masks
from nki_lib.dispatch import collect_runs
from nki_lib.numerics.oppar import op_parity
from nki_lib.registry import Sample

SPEC = registry.get("flash_attention")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Case:
    """``rows``: per batch row the valid key range ``(start, end)`` of a key padding mask, or None;
    ``cu``/``cu_k``: document offsets of queries / keys (B = 1); ``mask_kind``: how the padding is
    given (``bool`` (B, 1, 1, Sk), ``additive`` 0/-inf, ``per_query`` (B, 1, Sq, Sk) bool)."""
    b: int = 1
    hq: int = 2
    hkv: int = 1
    sq: int = 20
    sk: int = 20
    d: int = 16
    dtype: str = "fp32"
    causal: bool = False
    window: tuple = (-1, -1)
    sinks: bool = False
    softcap: float = 0.0
    rows: tuple | None = None
    cu: tuple | None = None
    cu_k: tuple | None = None
    mask_kind: str = "bool"
    seed: int = 0

    def mask(self):
        if self.rows is None:
            return None
        keys = torch.arange(self.sk)
        allow = torch.stack([(keys >= lo) & (keys < hi) for lo, hi in self.rows])[:, None, None]
        if self.mask_kind == "per_query":
            return allow.expand(self.b, 1, self.sq, self.sk).clone()
        if self.mask_kind == "additive":
            return torch.zeros(allow.shape).masked_fill(~allow, -math.inf).to(DTYPES[self.dtype])
        return allow

    def sample(self) -> Sample:
        dtype = DTYPES[self.dtype]
        gen = torch.Generator().manual_seed(self.seed)
        rand = lambda *s: torch.randn(*s, generator=gen).to(dtype).requires_grad_(True)  # noqa: E731
        sinks = torch.randn(self.hq, generator=gen).requires_grad_(True) if self.sinks else None
        cu, cu_k = (None if c is None else torch.tensor(c, dtype=torch.int64) for c in (self.cu, self.cu_k))
        kwargs = dict(causal=self.causal, window_left=self.window[0], window_right=self.window[1],
                      softcap=self.softcap)
        args = (rand(self.b, self.hq, self.sq, self.d), rand(self.b, self.hkv, self.sk, self.d),
                rand(self.b, self.hkv, self.sk, self.d), sinks, cu, cu_k, self.mask())
        return Sample(args, kwargs, repr(self))


def _padding_rows(draw, b, sk):
    kinds = st.sampled_from(("full", "left", "right", "both", "empty"))
    rows = []
    for _ in range(b):
        kind = draw(kinds)
        cut = draw(st.integers(0, sk))
        rows.append({"full": (0, sk), "left": (cut, sk), "right": (0, cut), "empty": (0, 0),
                     "both": (min(cut, sk - cut), max(cut, sk - cut))}[kind])
    return tuple(rows)


def _offsets(draw, total, n_docs):
    return tuple([0, *sorted(draw(st.lists(st.integers(0, total), min_size=n_docs - 1,
                                           max_size=n_docs - 1))), total])


@st.composite
def cases(draw) -> Case:
    hkv = draw(st.integers(1, 2))
    packed = draw(st.booleans())
    b = 1 if packed else draw(st.integers(1, 3))
    sq = draw(st.integers(1, 200))
    sk = draw(st.one_of(st.integers(1, 200), st.integers(513, 700)))
    cu = cu_k = rows = None
    if packed:
        n_docs = draw(st.integers(1, 4))
        cu, cu_k = _offsets(draw, sq, n_docs), _offsets(draw, sk, n_docs)
    if not packed or draw(st.booleans()):
        rows = _padding_rows(draw, b, sk)
    return Case(b=b, hq=hkv * draw(st.integers(1, 2)), hkv=hkv, sq=sq, sk=sk,
                d=draw(st.sampled_from((8, 32, 64, 128))), dtype=draw(st.sampled_from(sorted(DTYPES))),
                causal=draw(st.booleans()),
                window=draw(st.sampled_from(((-1, -1), (-1, -1), (16, -1), (7, 5), (0, 0)))),
                sinks=draw(st.booleans()), softcap=draw(st.sampled_from((0.0, 0.0, 5.0))), rows=rows,
                cu=cu, cu_k=cu_k, mask_kind=draw(st.sampled_from(("bool", "additive", "per_query"))),
                seed=draw(st.integers(0, 2 ** 16)))


# --------------------------------------------------------------------------- host planning

def _dense(case: Case):
    """(B, Sq, Sk) bool: the contract's visibility (masks.full_mask) AND the padding mask."""
    cu, cu_k = (None if c is None else torch.tensor(c) for c in (case.cu, case.cu_k))
    rule = masks.full_mask(case.sq, case.sk, causal=case.causal, window_left=case.window[0],
                           window_right=case.window[1], cu_seqlens=cu, device="cpu", cu_seqlens_k=cu_k)
    mask = case.mask()
    if mask is None:
        return rule[None].expand(case.b, -1, -1)
    allow = mask if mask.dtype == torch.bool else mask == 0
    return rule[None] & allow[:, 0].expand(case.b, case.sq, case.sk)


def _plan(case: Case):
    sample = case.sample()
    q, k, _, _, cu, cu_k, mask = sample.args
    if mask is not None:
        mask = mask.expand(-1, -1, -1, case.sk)
    return key_bounds.plan(q, k, cu, cu_k, mask, causal=case.causal, window_left=case.window[0],
                           window_right=case.window[1])


@given(case=cases())
@example(case=Case(b=3, sq=9, sk=9, causal=True, rows=((0, 9), (4, 9), (0, 0))))
@example(case=Case(sq=7, sk=11, causal=True, window=(2, -1), cu=(0, 3, 3, 7), cu_k=(0, 1, 8, 11)))
def test_bounds_are_the_dense_mask(case):
    """Inside [lo, hi] of every row is exactly what the contract's dense mask allows."""
    found = _plan(case)
    bounds = found.bounds.to(torch.int64)
    keys = torch.arange(case.sk)
    inside = (keys >= bounds[:, 0, :, None]) & (keys <= bounds[:, 1, :, None])
    if case.cu_k is None:   # the kernels also apply their static flags: intersect them
        inside &= masks.full_mask(case.sq, case.sk, cu_seqlens=None, device="cpu", **found.flags)
    else:
        assert found.flags == dict(causal=False, window_left=-1, window_right=-1)
    assert torch.equal(inside, _dense(case))


@pytest.mark.parametrize("mask, reason", [
    (torch.tensor([True, False, True, True]).reshape(1, 1, 1, 4), "holes"),
    (torch.tensor([0.0, -1.0, 0.0, 0.0]).reshape(1, 1, 1, 4), "values other than 0 and -inf"),
    (torch.tensor([0.0, float("nan"), 0.0, 0.0]).reshape(1, 1, 1, 4), "values other than 0 and -inf"),
    (torch.tensor([[True, True, True, False], [True, True, False, False]]).reshape(1, 2, 1, 4),
     "varies over heads"),
])
def test_inexpressible_masks_are_named(mask, reason):
    q = torch.zeros(1, 2, 3, 8)
    k = torch.zeros(1, 2, 4, 8)
    found = key_bounds.plan(q, k, None, None, mask.expand(-1, -1, 3, -1), causal=False,
                            window_left=-1, window_right=-1)
    assert isinstance(found, str) and reason in found


def test_expanded_head_dim_counts_as_one_head():
    """A mask broadcast over heads by expand (stride 0) is one interval per row."""
    q = torch.zeros(2, 4, 3, 8)
    k = torch.zeros(2, 4, 5, 8)
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]], dtype=torch.bool)[:, None, None]
    found = key_bounds.plan(q, k, None, None, mask.expand(2, 4, 3, 5), causal=False,
                            window_left=-1, window_right=-1)
    assert found.bounds[:, :, 0].tolist() == [[0, 4], [2, 4]]


# --------------------------------------------------------------------------- kernels

def _kernel_calls():
    stats = nki_lib.coverage()
    return {op: (stats[op]["simulator"].calls, dict(stats[op]["simulator"].fallbacks))
            for op in ("flash_attention", "flash_attention_backward") if "simulator" in stats.get(op, {})}


def _check_kernels(case: Case):
    nki_lib.reset_coverage()
    result = op_parity(SPEC, case.sample())
    assert result.ok, str(result)
    calls = _kernel_calls()
    assert calls["flash_attention"][0] >= 1 and not calls["flash_attention"][1], calls
    assert calls["flash_attention_backward"][0] >= 1 and not calls["flash_attention_backward"][1], calls


@settings(max_examples=20)   # each example is a forward and a backward simulator launch
@given(case=cases())
@example(case=Case(b=3, sq=14, sk=14, causal=True, rows=((0, 14), (5, 14), (9, 14))))        # left pad
@example(case=Case(b=3, sq=14, sk=14, causal=True, rows=((0, 14), (0, 9), (0, 3)),
                   dtype="bf16"))                                                               # right pad
@example(case=Case(b=2, sq=10, sk=30, rows=((0, 0), (4, 30)), sinks=True))                   # all padded
@example(case=Case(b=2, sq=10, sk=30, rows=((0, 0), (4, 30)), dtype="fp16"))                 # row, no sink
@example(case=Case(b=2, hq=4, hkv=1, sq=130, sk=600, d=64, rows=((0, 600), (70, 600)),
                   causal=True, window=(100, -1), dtype="bf16", mask_kind="additive"))       # GQA, causal+win
@example(case=Case(b=2, hq=2, hkv=2, sq=150, sk=150, rows=((0, 150), (0, 37)), window=(7, 5),
                   softcap=5.0, mask_kind="per_query"))                                          # window, softcap
@example(case=Case(sq=12, sk=25, causal=True, window=(4, -1), cu=(0, 3, 3, 12),
                   cu_k=(0, 9, 14, 25)))                                                        # docs Sk > Sq
@example(case=Case(sq=40, sk=16, causal=True, cu=(0, 30, 40), cu_k=(0, 4, 16), sinks=True,
                   dtype="bf16"))                                                              # docs Sk < Sq
@example(case=Case(sq=140, sk=600, d=32, cu=(0, 70, 140), cu_k=(0, 550, 600),
                   rows=((10, 590),)))                                                          # docs + padding
def test_kernels_serve_padding_and_documents(case):
    _check_kernels(case)


def test_inexpressible_mask_is_a_recorded_fallback():
    case = Case(b=2, sq=6, sk=8)
    sample = case.sample()
    q, k, v = (t.detach() for t in sample.args[:3])
    holes = torch.tensor([1, 1, 0, 1, 1, 1, 1, 1], dtype=torch.bool).reshape(1, 1, 1, 8)
    nki_lib.reset_coverage()
    with nki_lib.use_backend("simulator"):
        out, _ = SPEC.op(q, k, v, None, None, None, holes)
    want, _ = SPEC.op(q, k, v, None, None, None, holes)
    torch.testing.assert_close(out, want)
    fallbacks = nki_lib.coverage()["flash_attention"]["simulator"].fallbacks
    assert any("holes" in reason for reason in fallbacks), fallbacks


def test_padding_patterns_share_one_kernel_specialization():
    """The bounds are data of a static shape: other padding of the same batch shape compiles
    nothing new (one specialization per kernel), and an all-valid mask still runs masked."""
    nki_lib.reset_coverage()
    with nki_lib.use_backend("simulator"), nki_lib.strict():
        for rows in (((0, 9), (3, 9)), ((0, 0), (0, 5)), ((0, 9), (0, 9))):
            sample = Case(b=2, sq=7, sk=9, causal=True, rows=rows).sample()
            args = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in sample.args)
            SPEC.op(*args, **sample.kwargs)
    assert nki_lib.coverage().specializations["flash_attention"] == 1


@pytest.mark.parametrize("case", [
    Case(b=2, hq=4, hkv=2, sq=200, sk=300, causal=True, rows=((0, 300), (50, 300)), dtype="bf16"),
    Case(hq=2, hkv=2, sq=140, sk=600, d=32, cu=(0, 70, 140), cu_k=(0, 550, 600), rows=((10, 590),)),
], ids=["padded-gqa", "docs-padding"])
def test_kernels_serve_bounds_with_lnc2(monkeypatch, case):
    """NEURON_LOGICAL_NC_CONFIG=2: both programs read the bounds of the rows they own."""
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    with collect_runs() as runs:
        _check_kernels(case)
    assert {report.grid for _, report in runs if report is not None} == {2}
