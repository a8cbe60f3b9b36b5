"""moe_experts forward combine (nki_lib/moe/kernels/moe_experts_fwd_combine.py): on one core the
weighted rows are added into the token-ordered accumulator by DMA read-modify-writes
(``dma_compute``) inside the group loop; a token holding two slots of one expert (one DMA would
name its row twice), and LNC2, take the "sum" combine (assignment-ordered scratch + k-sum). Each
path is asserted from the kernel trace and judged by the parity rule."""

from __future__ import annotations

import pytest
import torch

import nki_lib
import nki_lib.moe  # noqa: F401  (registers the ops)
from nki_lib.dispatch import collect_runs
from nki_lib.moe import moe_experts_op
from nki_lib.moe.kernels import moe_experts_fwd_combine
from nki_lib.numerics.oppar import op_parity


def _sample(dtype=torch.bfloat16, **kw):
    return moe_experts_op.make_sample(40, 48, 24, 4, 2, 8, dtype, False, **kw)


def _forward_opcodes(sample):
    with nki_lib.use_backend("simulator"), nki_lib.strict(True), collect_runs() as runs:
        torch.ops.nki.moe_experts(*sample.args, **sample.kwargs)
    (_, report), = runs
    return [e.opcode for e in report.trace]


def _parity(sample):
    result = op_parity(moe_experts_op.SPEC, sample)
    assert result.ok, str(result)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_lnc1_accumulates_in_the_group_loop(dtype):
    s = _sample(dtype)
    opcodes = _forward_opcodes(s)
    assert "dma_compute" in opcodes
    assert "scalar_tensor_tensor" not in opcodes          # no k-sum after the loop
    _parity(s)


def test_fp32_accumulator_converts_after_the_loop(monkeypatch):
    monkeypatch.setattr(moe_experts_fwd_combine, "FP32_ACCUMULATOR", True)
    s = _sample(torch.bfloat16, seed=3)
    opcodes = _forward_opcodes(s)
    assert "dma_compute" in opcodes
    assert "scalar_tensor_tensor" not in opcodes
    _parity(s)


def test_token_routed_twice_to_one_expert_takes_the_sum_combine():
    ids = torch.tensor([[0, 0], [1, 0], [1, 1], [2, 0]])
    s = moe_experts_op.make_sample(4, 16, 8, 3, 2, 4, torch.bfloat16, False, topk_ids=ids)
    opcodes = _forward_opcodes(s)
    assert "dma_compute" not in opcodes and "scalar_tensor_tensor" in opcodes
    _parity(s)


def test_zero_fill_in_column_spans(monkeypatch):
    """The accumulator's zero fill stores its tile per column span when H exceeds it."""
    monkeypatch.setattr(moe_experts_fwd_combine, "WEIGHT_SPAN", 128)
    s = moe_experts_op.make_sample(20, 200, 24, 3, 2, 8, torch.bfloat16, False, seed=5)
    opcodes = _forward_opcodes(s)
    assert opcodes.count("memset") >= 1 and "dma_compute" in opcodes
    _parity(s)


def test_rows_staged_in_parts_take_the_sum_combine(monkeypatch):
    """Output rows staged in column groups (y_cols < H) keep the "sum" combine."""
    from nki_lib._nki import nl
    from nki_lib.moe.kernels import moe_experts_fwd_launch
    pmax = nl.tile_size.pmax
    monkeypatch.setattr(moe_experts_fwd_launch, "tiling", lambda *a, **k: (pmax, pmax, True, 0, 0))
    s = moe_experts_op.make_sample(12, 300, 40, 3, 2, 8, torch.bfloat16, False, seed=6)
    opcodes = _forward_opcodes(s)
    assert "dma_compute" not in opcodes and "scalar_tensor_tensor" in opcodes
    _parity(s)
