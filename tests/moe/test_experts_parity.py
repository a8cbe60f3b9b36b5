"""moe_experts parity on the simulator path (strict) against the fp64 oracle: output and every
gradient (x, topk_weights, w_gate_up, w_down, and the expert biases when given), over T, H, I, E,
k, dtype, block size, activation (gpt-oss's clamped swiglu included), biases.

Plans come from ``torch.ops.nki.moe_plan`` (via ``moe_experts_op.make_sample``).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import nki_lib.moe  # noqa: F401  (registers the ops)
from nki_lib.moe import moe_experts_op
from nki_lib.moe.moe_experts_reference import ACTIVATIONS, WEIGHT_LAYOUTS
from nki_lib.numerics.oppar import op_parity

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def sample(t, h, inter, e, k, block, dtype, activation="silu", *, seed=0, topk_ids=None, **kwargs):
    return moe_experts_op.make_sample(t, h, inter, e, k, block, dtype, True, activation=activation,
                                   seed=seed, topk_ids=topk_ids, **kwargs)


def check(s):
    result = op_parity(moe_experts_op.SPEC, s)
    assert result.ok, str(result)
    leaves = sum(isinstance(a, torch.Tensor) and a.requires_grad for a in s.args)
    assert len(result.checks) == 1 + leaves, str(result)   # y and every gradient were all judged


@st.composite
def cases(draw):
    e = draw(st.integers(1, 6))
    return sample(draw(st.integers(1, 24)), draw(st.integers(1, 160)), draw(st.integers(1, 96)), e,
                  draw(st.integers(1, min(e, 3))), draw(st.integers(1, 40)), draw(st.sampled_from(_DTYPES)),
                  draw(st.sampled_from(ACTIVATIONS)), seed=draw(st.integers(0, 99)), biases=draw(st.booleans()),
                  swiglu_limit=draw(st.sampled_from([0.5, 7.0])), weight_layout=draw(st.sampled_from(WEIGHT_LAYOUTS)))


@given(cases())
@example(sample(1, 8, 4, 3, 2, 4, torch.float32))                                 # T = 1
@example(sample(30, 200, 136, 4, 2, 130, torch.bfloat16, "gelu"))                 # H, I > pmax; 2 slot tiles
@example(sample(12, 40, 24, 3, 3, 300, torch.float16, "gelu_tanh"))              # 3 slot tiles, T*k < B
@example(sample(30, 200, 136, 4, 2, 130, torch.bfloat16, "clamped_swiglu", biases=True,
                swiglu_limit=0.5))                                               # gpt-oss gate, tiled H, I
@example(sample(30, 200, 136, 4, 2, 130, torch.bfloat16, "clamped_swiglu", biases=True, swiglu_limit=0.5,
                weight_layout="in_out"))                                         # gpt-oss's own layout
def test_parity(s):
    check(s)


@pytest.mark.parametrize("dtype", _DTYPES)
def test_registered_samples(dtype):
    for s in moe_experts_op.SPEC.samples(dtype, True):
        check(s)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_every_token_to_one_expert(activation):
    check(sample(10, 24, 16, 4, 1, 8, torch.bfloat16, activation, topk_ids=torch.full((10, 1), 2)))
    check(sample(10, 24, 16, 4, 2, 8, torch.float32, activation, topk_ids=torch.tensor([[2, 3]] * 10)))


def test_experts_with_no_tokens():
    ids = torch.tensor([[1, 4]] * 5 + [[4, 1]] * 4)                   # experts 0, 2, 3, 5 idle
    check(sample(9, 32, 20, 6, 2, 4, torch.float32, topk_ids=ids))


def test_single_expert():
    check(sample(11, 16, 12, 1, 1, 4, torch.bfloat16, "gelu"))


def test_k_equals_e():
    check(sample(7, 24, 8, 4, 4, 8, torch.float16, "gelu_tanh"))


def test_fewer_assignments_than_one_block():
    check(sample(3, 16, 8, 3, 2, 64, torch.float32))


def test_repeated_expert_in_a_token():
    """A token routed twice to one expert: two assignments, two slots, no write conflict."""
    ids = torch.tensor([[0, 0], [1, 0], [1, 1], [2, 0]])
    check(sample(4, 16, 8, 3, 2, 4, torch.float32, topk_ids=ids))


def test_several_intermediate_chunks():
    """I > gemm_moving_fmax: the backward walks several I chunks (partial d topk_weights sums)."""
    check(sample(5, 8, 2 * 256 + 40, 2, 1, 8, torch.float32, "gelu"))


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("weight_layout", WEIGHT_LAYOUTS)
def test_narrow_tilings(monkeypatch, overlap, weight_layout):
    """Chunks narrow to pmax and outputs are scattered per chunk when SBUF is short (large H, I,
    B), with and without the overlap (forward: deferred last y scatters; backward: next-chunk
    weight prefetch), and (in_out) gate/up weight spans of one I tile: the same results through
    those code paths."""
    from nki_lib._nki import nl
    from nki_lib.moe.kernels import moe_experts_bwd, moe_experts_fwd_launch
    pmax = nl.tile_size.pmax
    narrow = (pmax, pmax, overlap)
    gu_cols = pmax if weight_layout == "in_out" else 0
    monkeypatch.setattr(moe_experts_fwd_launch, "tiling", lambda *a, **k: (*narrow, gu_cols, 0))
    monkeypatch.setattr(moe_experts_bwd, "tiling", lambda *a, **k: narrow)
    check(sample(6, 300, 2 * 128 + 44, 3, 2, 8, torch.bfloat16, "gelu_tanh", weight_layout=weight_layout))


def test_in_out_wide_down_rows_with_narrow_chunks(monkeypatch):
    """in_out, W_down rows loaded 2 pmax columns wide for all I tiles and shared by H chunks of
    pmax columns (a partial last block and chunk at H = 300), staged in groups of 2 pmax columns."""
    from nki_lib._nki import nl
    from nki_lib.moe.kernels import moe_experts_fwd_launch
    pmax = nl.tile_size.pmax
    monkeypatch.setattr(moe_experts_fwd_launch, "tiling", lambda *a, **k: (pmax, 2 * pmax, True, pmax, 2 * pmax))
    check(sample(6, 300, 2 * 128 + 44, 3, 2, 8, torch.bfloat16, "clamped_swiglu", biases=True, swiglu_limit=0.5,
                 weight_layout="in_out"))


@pytest.mark.parametrize("grouped", [True, False])
def test_expert_spanning_many_blocks(monkeypatch, grouped):
    """First, middle and last blocks of one expert: fp32 weight-gradient accumulation across
    blocks, with the backward's groups one block each (every mode) and as chosen (one group)."""
    from nki_lib.moe.kernels import moe_experts_bwd
    if not grouped:
        monkeypatch.setattr(moe_experts_bwd, "group_blocks", lambda *a, **k: 1)
    ids = torch.tensor([[1, 0]] * 13)                                 # expert 1: 13 slots -> 4 blocks
    check(sample(13, 24, 16, 3, 2, 4, torch.bfloat16, topk_ids=ids))


def test_grouped_blocks():
    """The forward merges up to 512 slots of an expert's consecutive blocks into one group sharing
    the weight tiles: several live slot tiles per group, skipped padding tiles, slot tiles that span
    two blocks (B = 48), and groups cut inside an expert's run (B = 8: 64 blocks per group)."""
    check(sample(300, 24, 16, 2, 2, 64, torch.bfloat16))
    check(sample(100, 24, 16, 2, 1, 48, torch.float32, "gelu"))
    check(sample(700, 16, 8, 1, 1, 8, torch.float16, "gelu_tanh"))


def test_padding_tile_inside_a_group():
    """A plan whose expert has a part-filled block followed by another of its blocks (valid: every
    assignment once, the expert's blocks consecutive): the backward's group then has a padding
    slot tile between live ones, which its guards skip while the later tiles stay aligned."""
    s = sample(20, 24, 16, 1, 1, 256, torch.float32, topk_ids=torch.zeros(20, 1, dtype=torch.int64))
    args = list(s.args)
    block_expert, slot_assignment = args[2], args[3]
    assert block_expert.numel() == 1
    slots = torch.full((2 * 256,), -1, dtype=slot_assignment.dtype)
    slots[:10], slots[256:266] = torch.arange(10), torch.arange(10, 20)   # tile 1 of block 0: padding
    args[2] = torch.zeros(2, dtype=block_expert.dtype)
    args[3] = slots
    check(type(s)(tuple(args), s.kwargs, s.label + " padding tile inside a group"))
