"""PyTorch reference for ``nki::moe_experts`` and its backward (docs/contract.md §4.3).

Same argument names as the op. A plain per-expert loop over the plan: for expert e, the slots of
the blocks with ``block_expert == e`` that hold an assignment ``a = t * k + j`` (not -1) select
token ``t = a // k`` and routing weight ``topk_weights[t, j]``; the gated MLP runs on those rows and
``topk_weights[t, j] * mlp_e(x_t)`` is added to ``y_t``. Experts are visited in ascending id, rows
in slot order, so the result is deterministic.

Shapes: T tokens, H hidden, I intermediate, E experts, k top-k, NB blocks, B block size,
N = T * k assignments. x (T, H), topk_weights (T, k) any float dtype, block_expert int32 (NB,),
slot_assignment int32 (NB * B,), w_gate_up (E, 2I, H) (rows [0, I) gate, [I, 2I) up),
w_down (E, H, I), optional biases b_gate_up (E, 2I) and b_down (E, H) (then
``mlp_e(x) = W_down[e] gate(W_gate_up[e] x + b_gate_up[e]) + b_down[e]``).

``weight_layout``: ``"out_in"`` (default) is the nn.Linear layout above (output features first);
``"in_out"`` puts the contraction dim first, w_gate_up (E, H, 2I) (columns [0, I) gate, [I, 2I) up)
and w_down (E, I, H), the transposes of the same matrices (gpt-oss's native Hugging Face layout,
and the one the forward kernel multiplies without transposing weight blocks). The weight
gradients come back in the weights' layout.

Gates (``h`` from the gate projection g and the up projection u):

* ``silu`` / ``gelu`` / ``gelu_tanh``: ``h = act(g) * u`` (PyTorch's definitions);
* ``clamped_swiglu`` (gpt-oss): ``g = min(g, limit)``, ``u = clamp(u, -limit, limit)``,
  ``h = (u + 1) * g * sigmoid(alpha * g)`` (``swiglu_alpha``, ``swiglu_limit``); the clamps pass
  gradient where the bound holds with equality, as ``torch.clamp`` does.

* :func:`moe_experts` / :func:`moe_experts_backward`: what the ``reference`` path runs. bf16/fp16
  inputs are computed in float32 (accumulation in float32, as the contract asks) and the results
  cast back; float32/float64 stay in their dtype. The routing weights are read in that compute
  dtype and their gradient returned in their own dtype. The backward uses explicit formulas.
* :func:`naive`: the same loop in the inputs' own dtype, differentiable by autograd: the fp64
  oracle and the low-precision baseline of the parity tests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nki_lib.moe.activations import GELU_TANH_A, GELU_TANH_C

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "clamped_swiglu")
# gpt-oss's swiglu constants (transformers GptOssConfig defaults swiglu_alpha / swiglu_limit)
SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0
WEIGHT_LAYOUTS = ("out_in", "in_out")   # nn.Linear (E, 2I, H) / (E, H, I), or (E, H, 2I) / (E, I, H)


def check_weight_layout(weight_layout) -> None:
    """``ValueError`` naming ``weight_layout`` unless it is one of :data:`WEIGHT_LAYOUTS`."""
    if weight_layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"weight_layout must be one of {WEIGHT_LAYOUTS}, got {weight_layout!r}")


def as_out_in(w: torch.Tensor, weight_layout: str) -> torch.Tensor:
    """An expert weight (E, a, b) given in ``weight_layout`` as a view in the out_in layout (also
    maps an out_in gradient back to in_out: the transpose is its own inverse)."""
    check_weight_layout(weight_layout)
    return w if weight_layout == "out_in" else w.transpose(1, 2)


def _out_in(w_gate_up, w_down, weight_layout):
    """Both weights as contiguous out_in tensors (a copy for in_out), so that the reference's
    matmuls, and so its rounding, are the same in either layout."""
    return tuple(as_out_in(w, weight_layout).contiguous() for w in (w_gate_up, w_down))


def act(g: torch.Tensor, activation: str) -> torch.Tensor:
    """The gate activation of the plain gates exactly as PyTorch defines it (gelu = erf form)."""
    if activation == "silu":
        return F.silu(g)
    if activation == "gelu":
        return F.gelu(g)
    if activation == "gelu_tanh":
        return F.gelu(g, approximate="tanh")
    raise ValueError(f"activation must be one of {ACTIVATIONS[:3]}, got {activation!r}")


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
    raise ValueError(f"activation must be one of {ACTIVATIONS[:3]}, got {activation!r}")


def gate(g, u, activation, alpha=SWIGLU_ALPHA, limit=SWIGLU_LIMIT):
    """h from the gate and up projections (differentiable by autograd)."""
    if activation == "clamped_swiglu":
        g = g.clamp(max=limit)
        return (u.clamp(-limit, limit) + 1) * g * torch.sigmoid(alpha * g)
    return act(g, activation) * u


def gate_terms(g, u, activation, alpha=SWIGLU_ALPHA, limit=SWIGLU_LIMIT):
    """(a, v, da, du_mask) with h = a * v, dh/dg = v * da, dh/du = a * du_mask (None = 1)."""
    if activation == "clamped_swiglu":
        gc = g.clamp(max=limit)
        s = torch.sigmoid(alpha * gc)
        a = gc * s
        da = s * (1 + alpha * gc * (1 - s)) * (g <= limit).to(g.dtype)
        return a, u.clamp(-limit, limit) + 1, da, ((u >= -limit) & (u <= limit)).to(u.dtype)
    return act(g, activation), u, act_grad(g, activation), None


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


def _projections(x_e, e, w_gate_up, b_gate_up, dtype):
    """(g, u) of rows x_e on expert e (+ its gate/up bias)."""
    gu = x_e @ w_gate_up[e].to(dtype).T
    if b_gate_up is not None:
        gu = gu + b_gate_up[e].to(dtype)
    return gu.chunk(2, dim=1)


def _down(h, e, w_down, b_down, dtype):
    o = h @ w_down[e].to(dtype).T
    return o if b_down is None else o + b_down[e].to(dtype)


def _forward(x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down, b_gate_up, b_down, flags,
             dtype):
    y = torch.zeros(x.shape, dtype=dtype, device=x.device)
    w_flat = topk_weights.reshape(-1)
    for e, t, a in _expert_rows(topk_weights, block_expert, slot_assignment):
        g, u = _projections(x[t].to(dtype), e, w_gate_up, b_gate_up, dtype)
        y_e = _down(gate(g, u, **flags), e, w_down, b_down, dtype) * w_flat[a].to(dtype)[:, None]
        y.index_add_(0, t, y_e)
    return y


def _flags(activation, swiglu_alpha, swiglu_limit):
    return dict(activation=activation, alpha=swiglu_alpha, limit=swiglu_limit)


def moe_experts(x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down, b_gate_up=None,
                b_down=None, *, activation="silu", swiglu_alpha=SWIGLU_ALPHA, swiglu_limit=SWIGLU_LIMIT,
                weight_layout="out_in"):
    """y (T, H) in x's dtype; float32 accumulation for bf16/fp16."""
    w_gate_up, w_down = _out_in(w_gate_up, w_down, weight_layout)
    y = _forward(x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down, b_gate_up, b_down,
                 _flags(activation, swiglu_alpha, swiglu_limit), _compute_dtype(x.dtype))
    return y.to(x.dtype)


def naive(x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down, b_gate_up=None, b_down=None, *,
          activation="silu", swiglu_alpha=SWIGLU_ALPHA, swiglu_limit=SWIGLU_LIMIT, weight_layout="out_in"):
    """The same loop in the inputs' dtype (fp64 oracle / low-precision baseline)."""
    w_gate_up, w_down = _out_in(w_gate_up, w_down, weight_layout)
    return _forward(x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down, b_gate_up, b_down,
                    _flags(activation, swiglu_alpha, swiglu_limit), x.dtype)


def moe_experts_backward(dy, x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down, b_gate_up=None,
                         b_down=None, *, activation="silu", swiglu_alpha=SWIGLU_ALPHA,
                         swiglu_limit=SWIGLU_LIMIT, weight_layout="out_in"):
    """(dx, d topk_weights, d w_gate_up, d w_down, d b_gate_up, d b_down) with the weight
    gradients in ``weight_layout``: :func:`out_in_backward` on out_in copies of the weights."""
    grads = out_in_backward(dy, x, topk_weights, block_expert, slot_assignment,
                            *_out_in(w_gate_up, w_down, weight_layout), b_gate_up, b_down, activation=activation,
                            swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)
    dw_gate_up, dw_down = (as_out_in(g, weight_layout).contiguous() for g in grads[2:4])
    return grads[:2] + (dw_gate_up, dw_down) + grads[4:]


def out_in_backward(dy, x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down, b_gate_up=None,
                    b_down=None, *, activation="silu", swiglu_alpha=SWIGLU_ALPHA, swiglu_limit=SWIGLU_LIMIT):
    """(dx, d topk_weights, d w_gate_up, d w_down, d b_gate_up, d b_down), explicit formulas,
    float32 accumulation, weights in the out_in layout; the bias gradients are empty (0,) tensors
    when there is no bias.

    Per assignment a = (t, j) on expert e with g/u the gate/up projections of x_t (+ bias),
    h = a(g) v(u) (:func:`gate_terms`), o = h @ W_down[e].T + b_down[e] and dy_t the output gradient:
    d topk_weights[t, j] = <dy_t, o>; dh = topk_weights[t, j] * (dy_t @ W_down[e]);
    dg = dh * v * a'(g); du = dh * a * v'(u); dx_t += dg @ W_gate[e] + du @ W_up[e];
    dW_gate[e] += dg^T x_t; dW_up[e] += du^T x_t; dW_down[e] += (topk_weights[t, j] dy_t)^T h;
    db_gate_up[e] += sum_t (dg, du); db_down[e] += sum_t topk_weights[t, j] dy_t.
    """
    dtype = _compute_dtype(x.dtype)
    dx = torch.zeros(x.shape, dtype=dtype, device=x.device)
    dw_flat = torch.zeros(topk_weights.numel(), dtype=dtype, device=x.device)
    dw_gate_up = torch.zeros(w_gate_up.shape, dtype=dtype, device=x.device)
    dw_down = torch.zeros(w_down.shape, dtype=dtype, device=x.device)
    db_gate_up = None if b_gate_up is None else torch.zeros(b_gate_up.shape, dtype=dtype, device=x.device)
    db_down = None if b_down is None else torch.zeros(b_down.shape, dtype=dtype, device=x.device)
    w_flat = topk_weights.reshape(-1)
    flags = _flags(activation, swiglu_alpha, swiglu_limit)
    for e, t, a in _expert_rows(topk_weights, block_expert, slot_assignment):
        x_e, dy_e, wgt = x[t].to(dtype), dy[t].to(dtype), w_flat[a].to(dtype)[:, None]
        wgu, wd = w_gate_up[e].to(dtype), w_down[e].to(dtype)
        g, u = _projections(x_e, e, w_gate_up, b_gate_up, dtype)
        a_g, v, da, du_mask = gate_terms(g, u, **flags)
        h = a_g * v
        dhy = dy_e @ wd
        dw_flat[a] = (dhy * h).sum(1) + (0 if b_down is None else dy_e @ b_down[e].to(dtype))
        dh = dhy * wgt
        du = dh * a_g if du_mask is None else dh * a_g * du_mask
        dgu = torch.cat([dh * v * da, du], dim=1)
        dx.index_add_(0, t, dgu @ wgu)
        dw_gate_up[e] += dgu.T @ x_e
        dw_down[e] += (dy_e * wgt).T @ h
        if db_gate_up is not None:
            db_gate_up[e] += dgu.sum(0)
        if db_down is not None:
            db_down[e] += (dy_e * wgt).sum(0)
    return (dx.to(x.dtype), dw_flat.reshape(topk_weights.shape).to(topk_weights.dtype),
            dw_gate_up.to(w_gate_up.dtype), dw_down.to(w_down.dtype),
            x.new_zeros(0) if db_gate_up is None else db_gate_up.to(b_gate_up.dtype),
            x.new_zeros(0) if db_down is None else db_down.to(b_down.dtype))
