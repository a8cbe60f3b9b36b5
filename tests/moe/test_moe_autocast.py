"""SDPA's autocast policy for the MoE ops, eager and compiled: inside ``torch.autocast`` the
projection operands are cast to the autocast dtype (the routing weights keep theirs), the result
is what the op computes on those cast inputs (bit for bit), gradients reach the float32 leaves in
float32, and torch.compile(fullgraph=True) gives the eager results."""

from __future__ import annotations

import pytest
import torch

import nki_lib.moe  # noqa: F401  (registers the ops)
from nki_lib.moe import moe_experts_op, moe_router_op

AUTOCAST = torch.bfloat16


def experts_call(x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down, b_gate_up, b_down):
    return torch.ops.nki.moe_experts(x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down,
                                     b_gate_up, b_down, activation="clamped_swiglu", swiglu_limit=0.5)


def _experts_args():
    s = moe_experts_op.make_sample(11, 24, 16, 4, 2, 8, torch.float32, True, activation="clamped_swiglu",
                                biases=True, swiglu_limit=0.5)
    return list(s.args)


def _run(fn, args, autocast):
    args = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
    with torch.autocast("cpu", dtype=AUTOCAST, enabled=autocast):
        out = fn(*args)
    first = out[0] if isinstance(out, tuple) else out
    first.float().sum().backward()
    return out, [a.grad for a in args if a.requires_grad]


def _cast(args, names_at):
    return [a.detach().to(AUTOCAST).requires_grad_(a.requires_grad) if i in names_at else a
            for i, a in enumerate(args)]


@pytest.mark.parametrize("compiled", [False, True])
def test_experts_follow_sdpa_policy(compiled):
    args = _experts_args()
    fn = torch.compile(experts_call, fullgraph=True, backend="aot_eager") if compiled else experts_call
    y, grads = _run(fn, args, autocast=True)
    assert y.dtype == AUTOCAST
    assert [g.dtype for g in grads] == [torch.float32] * len(grads)
    expected, _ = _run(experts_call, _cast(args, {0, 4, 5, 6, 7}), autocast=False)
    assert torch.equal(y, expected)
    if compiled:
        eager, eager_grads = _run(experts_call, args, autocast=True)
        assert torch.equal(y, eager)
        assert all(torch.equal(a, b) for a, b in zip(grads, eager_grads))


def test_experts_routing_weights_keep_their_dtype():
    """bf16 routing weights (as Qwen3-MoE and gpt-oss hand them) are served, their gradient in bf16."""
    args = _experts_args()
    args[1] = args[1].detach().to(torch.bfloat16).requires_grad_()
    _, grads = _run(experts_call, args, autocast=False)
    assert grads[1].dtype == torch.bfloat16


@pytest.mark.parametrize("compiled", [False, True])
def test_router_follows_sdpa_policy(compiled):
    s = moe_router_op.make_sample(13, 32, 6, torch.float32, True, top_k=2)
    call = lambda x, w: torch.ops.nki.moe_router(x, w, **s.kwargs)  # noqa: E731
    fn = torch.compile(call, fullgraph=True, backend="aot_eager") if compiled else call
    args = list(s.args[:2])
    (logits, weights, ids), grads = _run(fn, args, autocast=True)
    assert logits.dtype == torch.float32 and ids.dtype == torch.int32
    (exp_logits, exp_weights, exp_ids), _ = _run(call, _cast(args, {0, 1}), autocast=False)
    assert torch.equal(logits, exp_logits) and torch.equal(ids, exp_ids)
    assert [g.dtype for g in grads] == [torch.float32, torch.float32]
