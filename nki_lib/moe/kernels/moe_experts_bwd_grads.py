"""Elementwise gradients of the expert-MLP backward (one slot tile of one I chunk).

Algorithm: from g, u, dhy in fp32 PSUM (slots on partitions, an I chunk free): act(g) (or the
clamped swiglu's terms, :mod:`.moe_experts_gate`), h = act(g) v(u), the partial d topk_weights
<dhy, h> (a VectorE reduction over the chunk, added into the tile's accumulator), dh = w_a dhy,
du = dh act(g) v'(u), dg = dh v(u) act'(g); act' on ScalarE (silu_dx / gelu_dx), the tanh-GELU
derivative composed from nl.tanh and VectorE ops. No loops: one call per (slot tile, I chunk).

Shapes (dimension legend): H hidden, I intermediate, E experts, S slots of the block (group), ps <= 128 slots of one slot tile, P = 128 partitions, cn <= 512 columns of one I chunk, dtype the activations' dtype. In: g, u, dhy (ps, cn) fp32 PSUM, w_col (ps, 1) fp32;
out: h, dg, du (ps, cn) in dtype.

Limits: at most FP32_TEMPS (FP32_TEMPS_CLAMPED with the clamped swiglu) fp32 (ps, cn) temporaries
live at once, the bound the launcher's SBUF estimate uses.
"""

from __future__ import annotations

from nki_lib._nki import nisa, nl
from nki_lib.moe.activations import GELU_TANH_A, GELU_TANH_C
from nki_lib.moe.kernels.moe_experts_gate import clamped_swiglu_terms
from nki_lib.moe.kernels.moe_experts_steps import (
    act_fn,
)

ACT_GRAD_FN = {"silu": "silu_dx", "gelu": "gelu_dx"}   # ScalarE derivative functions
FP32_TEMPS = 10    # fp32 (slots x I chunk) temporaries of mlp_grads / _gelu_tanh_grad, upper bound
FP32_TEMPS_CLAMPED = 12   # the same with clamped_swiglu_terms (gc, s, a, v, da, masks, h, dh, ...)


def _gelu_tanh_grad(dst, g_psum, shape):
    """dst = d/dg [0.5 g (1 + tanh(c (g + a g^3)))], composed from ScalarE tanh and VectorE ops:
    0.5 (1 + t) + 0.5 g (1 - t^2) c (1 + 3 a g^2), t = tanh(c (g + a g^3))."""
    g2_sb = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=g2_sb, op=nl.square, data=g_psum)
    inner_sb = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=inner_sb, data=g2_sb, op0=nl.multiply, operand0=GELU_TANH_A, op1=nl.add,
                       operand1=1.0)
    nisa.tensor_tensor(dst=inner_sb, data1=inner_sb, data2=g_psum, op=nl.multiply)
    t_sb = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=t_sb, op=nl.tanh, data=inner_sb, scale=GELU_TANH_C)
    sech2_sb = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)                # 1 - t^2
    nisa.tensor_tensor(dst=sech2_sb, data1=t_sb, data2=t_sb, op=nl.multiply)
    nisa.tensor_scalar(dst=sech2_sb, data=sech2_sb, op0=nl.multiply, operand0=-1.0, op1=nl.add,
                       operand1=1.0)
    nisa.tensor_scalar(dst=g2_sb, data=g2_sb, op0=nl.multiply, operand0=3.0 * GELU_TANH_A * 0.5 * GELU_TANH_C,
                       op1=nl.add, operand1=0.5 * GELU_TANH_C)                    # 0.5 c (1 + 3 a g^2)
    nisa.tensor_tensor(dst=g2_sb, data1=g2_sb, data2=sech2_sb, op=nl.multiply)
    nisa.tensor_tensor(dst=g2_sb, data1=g2_sb, data2=g_psum, op=nl.multiply)
    nisa.tensor_scalar(dst=t_sb, data=t_sb, op0=nl.multiply, operand0=0.5, op1=nl.add, operand1=0.5)
    nisa.tensor_tensor(dst=dst, data1=g2_sb, data2=t_sb, op=nl.add)


def _act_grad(dst, g_psum, activation, shape):
    if activation == "gelu_tanh":
        _gelu_tanh_grad(dst, g_psum, shape)
    else:
        nisa.activation(dst=dst, op=getattr(nl, ACT_GRAD_FN[activation]), data=g_psum)


def mlp_grads(g_psum, u_psum, dhy_psum, w_col, gate, dtype, dw_acc, first):
    """From g, u, dhy (ps, n) fp32: h and dg, du (in ``dtype``); adds <dhy, h> into dw_acc (ps, 1).
    With h = a(g) v(u): dg = dh v a'(g), du = dh a v'(u) (v = u, v' = 1 unless clamped swiglu)."""
    shape = g_psum.shape
    activation, alpha, limit = gate
    du_mask = None
    if activation == "clamped_swiglu":
        act_sb, v_tile, dact_sb, du_mask = clamped_swiglu_terms(g_psum, u_psum, alpha, limit)
    else:
        act_sb, v_tile = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf), u_psum
        nisa.activation(dst=act_sb, op=act_fn(activation), data=g_psum)
    h_sb = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=h_sb, data1=act_sb, data2=v_tile, op=nl.multiply)
    prod_sb = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=prod_sb, data1=h_sb, data2=dhy_psum, op=nl.multiply)
    part_sb = dw_acc if first else nl.ndarray((shape[0], 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=part_sb, op=nl.add, data=prod_sb, axis=1)
    if not first:
        nisa.tensor_tensor(dst=dw_acc, data1=dw_acc, data2=part_sb, op=nl.add)
    dh_sb = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=dh_sb, data=dhy_psum, op0=nl.multiply, operand0=w_col)
    du_sb = nl.ndarray(shape, dtype=dtype, buffer=nl.sbuf)
    if du_mask is None:
        nisa.tensor_tensor(dst=du_sb, data1=dh_sb, data2=act_sb, op=nl.multiply)
    else:
        nisa.tensor_tensor(dst=du_mask, data1=du_mask, data2=act_sb, op=nl.multiply)
        nisa.tensor_tensor(dst=du_sb, data1=dh_sb, data2=du_mask, op=nl.multiply)
    if activation != "clamped_swiglu":
        dact_sb = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)
        _act_grad(dact_sb, g_psum, activation, shape)
    nisa.tensor_tensor(dst=dh_sb, data1=dh_sb, data2=v_tile, op=nl.multiply)
    dg_sb = nl.ndarray(shape, dtype=dtype, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=dg_sb, data1=dh_sb, data2=dact_sb, op=nl.multiply)
    hx_sb = nl.ndarray(shape, dtype=dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=hx_sb, src=h_sb)
    return hx_sb, dg_sb, du_sb
