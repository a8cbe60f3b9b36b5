"""PyTorch reference for ``nki::moe_experts`` and its backward (docs/contract.md §4.3).

Same argument names as the op. A plain per-expert loop over the plan: for expert e, the slots of
the blocks with ``block_expert == e`` that hold an assignment ``a = t * k + j`` (not -1) select
token ``t = a // k`` and routing weight ``topk_weights[t, j]``; the gated MLP runs on those rows and
``topk_weights[t, j] * mlp_e(x_t)`` is added to ``y_t``. Experts are visited in ascending id, rows
in slot order, so the result is deterministic.

Shapes: T tokens, H hidden, I intermediate, E experts, k top-k, NB blocks, B block size,
N = T * k assignments. x (T, H), topk_weights float32 (T, k), block_expert int32 (NB,),
slot_assignment int32 (NB * B,), w_gate_up (E, 2I, H) (rows [0, I) gate, [I, 2I) up),
w_down (E, H, I).

* :func:`moe_experts` / :func:`moe_experts_backward`: what the ``reference`` path runs. bf16/fp16
  inputs are computed in float32 (accumulation in float32, as the contract asks) and the results
  cast back; float32/float64 stay in their dtype. The backward uses explicit formulas.
* :func:`naive`: the same loop in the inputs' own dtype, differentiable by autograd: the fp64
  oracle and the low-precision baseline of the parity tests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nki_lib.moe.activations import ACTIVATIONS, GELU_TANH_A, GELU_TANH_C


def act(g: torch.Tensor, activation: str) -> torch.Tensor:
    """The gate activation exactly as PyTorch defines it (gelu = erf form)."""
    if activation == "silu":
        return F.silu(g)
    if activation == "gelu":
        return F.gelu(g)
    if activation == "gelu_tanh":
        return F.gelu(g, approximate="tanh")
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def act_grad(g: torch.Tensor, activation: str) -> torch.Tensor:
    """d act(g) / d g."""
    if activation == "silu":
        s = torch.sigmoid(g)
        return s * (1 + g * (1 - s))
    if activation == "gelu":
        cdf = 0.5 * (1 + torch.erf(g * 0.5 ** 0.5))
        pdf = torch.exp(-0.5 * g * g) / (2 * torch.pi) ** 0.5
        return cdf + g * pdf
    if activation == "gelu_tanh":
        t = torch.tanh(GELU_TANH_C * (g + GELU_TANH_A * g ** 3))
        return 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * GELU_TANH_C * (1 + 3 * GELU_TANH_A * g * g)
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def _expert_rows(topk_weights, block_expert, slot_assignment):
    """Per expert e (ascending): (e, token ids (n,), assignment ids (n,)) of its slots in order."""
    nb = block_expert.shape[0]
    k = topk_weights.shape[1]
    block_size = slot_assignment.shape[0] // nb if nb else 0
    slot_expert = block_expert.to(torch.long).repeat_interleave(block_size)
    assignment = slot_assignment.to(torch.long)
    for e in torch.unique(slot_expert[(slot_expert >= 0) & (assignment >= 0)]).tolist():
        a = assignment[(slot_expert == e) & (assignment >= 0)]
        yield e, a // k, a


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def _forward(x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down, activation, dtype):
    inter = w_down.shape[2]
    y = torch.zeros(x.shape, dtype=dtype, device=x.device)
    w_flat = topk_weights.reshape(-1)
    for e, t, a in _expert_rows(topk_weights, block_expert, slot_assignment):
        x_e = x[t].to(dtype)
        gu = x_e @ w_gate_up[e].to(dtype).T
        h = act(gu[:, :inter], activation) * gu[:, inter:]
        y_e = (h @ w_down[e].to(dtype).T) * w_flat[a].to(dtype)[:, None]
        y = y.index_add(0, t, y_e)
    return y


def moe_experts(x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down, *,
                activation="silu"):
    """y (T, H) in x's dtype; float32 accumulation for bf16/fp16."""
    y = _forward(x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down, activation,
                 _compute_dtype(x.dtype))
    return y.to(x.dtype)


def naive(x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down, *, activation="silu"):
    """The same loop in the inputs' dtype (fp64 oracle / low-precision baseline)."""
    return _forward(x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down, activation,
                    x.dtype)


def moe_experts_backward(dy, x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down, *,
                         activation="silu"):
    """(dx, d topk_weights, d w_gate_up, d w_down), explicit formulas, float32 accumulation.

    Per assignment a = (t, j) on expert e with g/u the gate/up projections of x_t, h = act(g) * u,
    o = h @ W_down[e].T and dy_t the output gradient:
    d topk_weights[t, j] = <dy_t, o>; dh = topk_weights[t, j] * (dy_t @ W_down[e]);
    dg = dh * u * act'(g); du = dh * act(g); dx_t += dg @ W_gate[e] + du @ W_up[e];
    dW_gate[e] += dg^T x_t; dW_up[e] += du^T x_t; dW_down[e] += (topk_weights[t, j] dy_t)^T h.
    """
    dtype = _compute_dtype(x.dtype)
    inter = w_down.shape[2]
    dx = torch.zeros(x.shape, dtype=dtype, device=x.device)
    dw_flat = torch.zeros(topk_weights.numel(), dtype=_compute_dtype(topk_weights.dtype),
                          device=x.device)
    dw_gate_up = torch.zeros(w_gate_up.shape, dtype=dtype, device=x.device)
    dw_down = torch.zeros(w_down.shape, dtype=dtype, device=x.device)
    w_flat = topk_weights.reshape(-1)
    for e, t, a in _expert_rows(topk_weights, block_expert, slot_assignment):
        x_e, dy_e, wgt = x[t].to(dtype), dy[t].to(dtype), w_flat[a].to(dtype)[:, None]
        wgu, wd = w_gate_up[e].to(dtype), w_down[e].to(dtype)
        gu = x_e @ wgu.T
        g, u = gu[:, :inter], gu[:, inter:]
        a_g = act(g, activation)
        h = a_g * u
        dhy = dy_e @ wd
        dw_flat[a] = (dhy * h).sum(1).to(dw_flat.dtype)
        dh = dhy * wgt
        dgu = torch.cat([dh * u * act_grad(g, activation), dh * a_g], dim=1)
        dx = dx.index_add(0, t, dgu @ wgu)
        dw_gate_up[e] += dgu.T @ x_e
        dw_down[e] += (dy_e * wgt).T @ h
    return (dx.to(x.dtype), dw_flat.reshape(topk_weights.shape),
            dw_gate_up.to(w_gate_up.dtype), dw_down.to(w_down.dtype))
