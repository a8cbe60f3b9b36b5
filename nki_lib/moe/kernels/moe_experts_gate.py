"""Elementwise pieces of gpt-oss's clamped swiglu gate and of the expert biases, shared by the
expert-MLP forward and backward kernels.

Gate (moe_experts_reference.gate): with g, u the gate/up projections (fp32, PSUM or SBUF),
  gc = min(g, limit),  s = sigmoid(alpha gc),  a = gc s,  v = clamp(u, -limit, limit) + 1,
  h = a v;  dh/dg = v da with da = s (1 + alpha gc (1 - s)) [g <= limit],  dh/du = a [|u| <= limit]
(the clamps pass gradient where the bound holds with equality, as torch.clamp does). Engines:
ScalarE for the sigmoid (scale = alpha folded into the activation), VectorE for the clamps,
comparisons (1.0 / 0.0 results) and products. Every temporary is fp32, shaped like g.

Biases: a bias row (1, n) of expert e is one DMA at the expert register; it enters a PSUM
accumulator as a contraction of size 1 against a row of ones (TensorE), so no broadcast on the
vector engines is needed: ``acc (M, N) = row_a(1, M)^T row_b(1, N)`` with one side the ones.

Shapes: g, u (P, n) with P <= 128 partitions; bias rows (1, n) in the weights' dtype.
"""

from __future__ import annotations

from nki_lib._nki import nisa, nl


def _fp32(shape):
    return nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)


def clamped_swiglu_parts(g, u, alpha, limit):
    """(gc, s, a, v) fp32 tiles (see the module docstring)."""
    shape = g.shape
    gc_sb = _fp32(shape)
    nisa.tensor_scalar(dst=gc_sb, data=g, op0=nl.minimum, operand0=limit)
    s_sb = _fp32(shape)
    nisa.activation(dst=s_sb, op=nl.sigmoid, data=gc_sb, scale=alpha)
    a_sb = _fp32(shape)
    nisa.tensor_tensor(dst=a_sb, data1=gc_sb, data2=s_sb, op=nl.multiply)
    v_sb = _fp32(shape)
    nisa.tensor_scalar(dst=v_sb, data=u, op0=nl.maximum, operand0=-limit, op1=nl.minimum, operand1=limit)
    nisa.tensor_scalar(dst=v_sb, data=v_sb, op0=nl.add, operand0=1.0)
    return gc_sb, s_sb, a_sb, v_sb


def clamped_swiglu(h_dst, g, u, alpha, limit):
    """h_dst = (clamp(u) + 1) * gc * sigmoid(alpha gc) (cast to h_dst's dtype)."""
    _, _, a_sb, v_sb = clamped_swiglu_parts(g, u, alpha, limit)
    nisa.tensor_tensor(dst=h_dst, data1=a_sb, data2=v_sb, op=nl.multiply)


def clamped_swiglu_terms(g, u, alpha, limit):
    """(a, v, da, du_mask) fp32 tiles: h = a v, dh/dg = v da, dh/du = a du_mask."""
    shape = g.shape
    gc_sb, s_sb, a_sb, v_sb = clamped_swiglu_parts(g, u, alpha, limit)
    da_sb = _fp32(shape)
    nisa.tensor_scalar(dst=da_sb, data=s_sb, op0=nl.multiply, operand0=-1.0, op1=nl.add, operand1=1.0)
    nisa.tensor_tensor(dst=da_sb, data1=da_sb, data2=gc_sb, op=nl.multiply)            # gc (1 - s)
    nisa.tensor_scalar(dst=da_sb, data=da_sb, op0=nl.multiply, operand0=alpha, op1=nl.add, operand1=1.0)
    nisa.tensor_tensor(dst=da_sb, data1=da_sb, data2=s_sb, op=nl.multiply)              # s (1 + alpha gc (1 - s))
    mask_sb = gc_sb                                                                      # gc is dead: reuse
    nisa.tensor_scalar(dst=mask_sb, data=g, op0=nl.less_equal, operand0=limit)
    nisa.tensor_tensor(dst=da_sb, data1=da_sb, data2=mask_sb, op=nl.multiply)
    du_mask_sb = s_sb                                                                    # s is dead: reuse
    nisa.tensor_scalar(dst=mask_sb, data=u, op0=nl.greater_equal, operand0=-limit)
    nisa.scalar_tensor_tensor(dst=du_mask_sb, data=u, op0=nl.less_equal, operand0=limit, op1=nl.multiply,
                              operand1=mask_sb)
    return a_sb, v_sb, da_sb, du_mask_sb


def ones_row(n, dtype):
    """(1, n) tile of ones (the other side of a bias contraction)."""
    ones_sb = nl.ndarray((1, n), dtype=dtype, buffer=nl.sbuf)
    nisa.memset(dst=ones_sb, value=1.0)
    return ones_sb


def bias_row(bias, expert_reg, col0, n):
    """(1, n) tile of bias[e, col0 : col0 + n] (bias (E, C) in HBM, e in the register)."""
    cols = bias.shape[1]
    row_sb = nl.ndarray((1, n), dtype=bias.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=row_sb, src=bias.ap([[cols, 1], [1, n]], offset=col0, scalar_offset=expert_reg,
                                          indirect_dim=0))
    return row_sb


def add_outer(acc_psum, left_row, right_row):
    """acc (M, N) = left (1, M)^T right (1, N): starts the accumulation group (accumulate=False),
    so the caller's matmuls that follow must accumulate."""
    nisa.nc_matmul(dst=acc_psum, stationary=left_row, moving=right_row, accumulate=False)
