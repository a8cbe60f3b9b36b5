"""0.3+ convenience functions of ``nki.language`` (docs/nki-semantics.md §9.2-9.4), built from ``nisa`` instructions.

Each returns a fresh tile (SBUF unless noted; ``matmul``/``transpose`` return PSUM tiles) of the
input's shape; ``dtype=`` picks the result dtype (default: the input's). Functions with no single
ISA equivalent (tan, ceil, floor, trunc, fmod, mod) raise NotImplementedError; ``sin``/``cos`` reduce the
argument to [-pi, pi] first (the Scalar-engine ``sin`` activation has no range reduction).
"""

from __future__ import annotations

import builtins
import math

import numpy as np

from . import isa
from .ops import OPS, Op
from .tensor import MemoryRegion, NkiTensor

__all__ = ["load", "store", "load_transpose2d", "matmul", "transpose", "sum", "max", "min", "mean", "prod",
           "all", "var", "rms_norm", "softmax", "where", "broadcast_to", "expand_dims"]

_NO_ISA = ("tan", "ceil", "floor", "trunc", "fmod", "mod")
_TWO_PI = 2.0 * math.pi


def _new(shape, dtype, buffer=MemoryRegion.sbuf):
    from .language import ndarray

    return ndarray(tuple(shape), dtype, buffer=buffer)


def load(src, dtype=None):
    """HBM -> new SBUF tile of ``src``'s shape (``dst = dma_copy(src)``)."""
    dst = _new(src.shape, dtype or src.dtype)
    isa.dma_copy(dst=dst, src=src)
    return dst


def store(dst, value):
    """SBUF tile -> HBM view."""
    isa.dma_copy(dst=dst, src=value)


def load_transpose2d(src, dtype=None):
    """HBM (A, B) -> new SBUF tile (B, A)."""
    dst = _new((src.shape[1], src.shape[0]), dtype or src.dtype)
    isa.dma_transpose(dst=dst, src=src)
    return dst


def transpose(x, dtype=None):
    """(P, F) -> new PSUM tile (F, P) through the Tensor engine."""
    dst = _new((x.size // x.shape[0], x.shape[0]), dtype or x.dtype, MemoryRegion.psum)
    isa.nc_transpose(dst=dst, data=x)
    return dst


def matmul(x, y, transpose_x=False):
    """``x @ y`` (or ``x.T @ y`` with ``transpose_x``) into a new fp32 PSUM tile."""
    if transpose_x:
        stationary = x
    else:
        x_t = transpose(x)
        stationary = _new(x_t.shape, x.dtype)
        isa.tensor_copy(dst=stationary, src=x_t)
    dst = _new((stationary.size // stationary.shape[0], y.size // y.shape[0]), "float32", MemoryRegion.psum)
    isa.nc_matmul(dst=dst, stationary=stationary, moving=y)
    return dst


def _is_tile(v):
    return isinstance(v, NkiTensor)


def _column(t):
    return t.shape[0] > 0 and t.size == t.shape[0]


def _elementwise(op: Op, *args, dtype=None, **kwargs):
    if op.name in _NO_ISA:
        raise NotImplementedError(f"nl.{op.name} has no single NKI ISA equivalent in this simulator")
    if op.name in ("bypass", "average", "prelu"):
        raise TypeError(f"nl.{op.name} is an operator constant, not a tile function")
    if op.name == "copy":
        x = args[0]
        out = _new(x.shape, dtype or x.dtype)
        isa.tensor_copy(dst=out, src=x)
        return out
    if op.unary:
        (x,) = args
        out = _new(x.shape, dtype or x.dtype)
        if op.name in ("sin", "cos"):
            _sin_reduced(out, x, math.pi / 2 if op.name == "cos" else 0.0)
        elif op.name == "negative":
            isa.tensor_scalar(dst=out, data=x, op0=OPS["multiply"], operand0=-1.0)
        elif op.name == "logical_not":
            isa.tensor_scalar(dst=out, data=x, op0=OPS["equal"], operand0=0.0)
        elif op.act is not None:
            isa.activation(dst=out, op=op, data=x)
        else:
            isa.tensor_scalar(dst=out, data=x, op0=op, operand0=None)
        return out
    x, y = args
    if not _is_tile(x) and not _is_tile(y):
        raise TypeError(f"nl.{op.name}: at least one operand must be a tile")
    if op.name == "divide":
        if _is_tile(y):
            recip = _new(y.shape, "float32")
            isa.reciprocal(dst=recip, data=y)
            return _elementwise(OPS["multiply"], x, recip, dtype=dtype)
        return _elementwise(OPS["multiply"], x, 1.0 / float(y), dtype=dtype)
    big = x if _is_tile(x) and (not _is_tile(y) or x.size >= y.size) else y
    other = y if big is x else x
    out = _new(big.shape, dtype or big.dtype)
    if _is_tile(other) and other.size == big.size:
        isa.tensor_tensor(dst=out, data1=x, data2=y, op=op)
    elif not _is_tile(other) or _column(other):
        isa.tensor_scalar(dst=out, data=big, op0=op, operand0=other, reverse0=big is y)
    else:
        raise ValueError(f"nl.{op.name}: cannot broadcast {other.shape} against {big.shape}")
    return out


Op.wrapper = staticmethod(_elementwise)


def _split_constant(value, parts, bits):
    """``value`` as ``parts`` fp32 constants of ``bits`` significant bits each (Cody-Waite)."""
    out, rest = [], value
    for _ in range(parts - 1):
        exp = math.floor(math.log2(abs(rest)))
        step = 2.0 ** (exp - bits + 1)
        head = math.floor(rest / step) * step
        out.append(head)
        rest -= head
    return out + [rest]


_TWO_PI_PARTS = _split_constant(_TWO_PI, 3, 12)   # k * part is exact in fp32 for |k| < 2**12


def _sin_reduced(out, x, phase):
    """``out = sin(x + phase)`` with range reduction to [-pi, pi] (the ScalarE sin has none):
    k = rint((x + phase) / 2pi) through an int32 tile, r = x - 2pi k in three Cody-Waite steps
    (exact products), then r + phase, clamped to +-pi."""
    shape = x.shape
    turns = _new(shape, "int32")
    isa.tensor_scalar(dst=turns, data=x, op0=OPS["multiply"], operand0=1.0 / _TWO_PI, op1=OPS["add"],
                      operand1=phase / _TWO_PI)
    reduced = _new(shape, "float32")
    isa.tensor_copy(dst=reduced, src=x)
    for part in _TWO_PI_PARTS:
        isa.scalar_tensor_tensor(dst=reduced, data=turns, op0=OPS["multiply"], operand0=-part, op1=OPS["add"],
                                 operand1=reduced)
    isa.tensor_scalar(dst=reduced, data=reduced, op0=OPS["add"], operand0=phase, op1=OPS["minimum"],
                      operand1=math.pi)
    isa.tensor_scalar(dst=reduced, data=reduced, op0=OPS["maximum"], operand0=-math.pi)
    isa.activation(dst=out, op=OPS["sin"], data=reduced)


def _reduce(opname, x, axis, dtype, keepdims):
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    nd = len(x.shape)
    axes = tuple(sorted(a + nd if a < 0 else a for a in axes))
    kept = [c for d, c in enumerate(x.shape) if d not in axes]
    if keepdims:
        shape = [1 if d in axes else c for d, c in enumerate(x.shape)]
    else:
        shape = kept if len(kept) >= 2 else kept + [1]
    out = _new(shape, dtype or x.dtype)
    isa.tensor_reduce(dst=out, op=OPS[opname], data=x, axis=axes, keepdims=keepdims)
    return out


def sum(x, axis, dtype=None, keepdims=False):
    return _reduce("add", x, axis, dtype, keepdims)


def max(x, axis, dtype=None, keepdims=False):
    return _reduce("maximum", x, axis, dtype, keepdims)


def min(x, axis, dtype=None, keepdims=False):
    return _reduce("minimum", x, axis, dtype, keepdims)


def prod(x, axis, dtype=None, keepdims=False):
    return _reduce("multiply", x, axis, dtype, keepdims)


def mean(x, axis, dtype=None, keepdims=False):
    total = _reduce("add", x, axis, "float32", keepdims)
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    count = int(np.prod([x.shape[a] for a in axes]))
    out = _new(total.shape, dtype or x.dtype)
    isa.tensor_scalar(dst=out, data=total, op0=OPS["multiply"], operand0=1.0 / count)
    return out


def all(x, axis, dtype=None):
    nonzero = _new(x.shape, "float32")
    isa.tensor_scalar(dst=nonzero, data=x, op0=OPS["not_equal"], operand0=0.0)
    return _reduce("minimum", nonzero, axis, dtype or x.dtype, False)


def _all_free_axes(name, x, axis):
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    nd = len(x.shape)
    if sorted(a + nd if a < 0 else a for a in axes) != list(range(1, nd)):
        raise ValueError(f"nl.{name}: axis must cover all free dims {tuple(range(1, nd))}, got {axis!r}")
    return x.size // x.shape[0]


def var(x, axis, dtype=None, keepdims=False):
    """Per-partition variance over all free dims (keepdims is ignored: the result is (P, 1))."""
    count = _all_free_axes("var", x, axis)
    p = x.shape[0]
    neg_mean = _new((p, 1), "float32")
    isa.tensor_reduce(dst=neg_mean, op=OPS["add"], data=x, axis=tuple(range(1, len(x.shape))), negate=True)
    isa.tensor_scalar(dst=neg_mean, data=neg_mean, op0=OPS["multiply"], operand0=1.0 / count)
    squares = _new(x.shape, "float32")
    sum_sq = _new((p, 1), "float32")
    isa.activation(dst=squares, op=OPS["square"], data=x, bias=neg_mean, reduce_op=OPS["add"], reduce_res=sum_sq,
                   reduce_cmd=isa.reduce_cmd.reset_reduce)
    out = _new((p, 1), dtype or x.dtype)
    isa.tensor_scalar(dst=out, data=sum_sq, op0=OPS["multiply"], operand0=1.0 / count)
    return out


def rms_norm(x, w, axis, n, epsilon=1e-06, dtype=None, compute_dtype=None):
    """``x / sqrt(mean(x^2) + epsilon) * w`` over all free dims; ``w`` a tile of ``x``'s shape."""
    _all_free_axes("rms_norm", x, axis)
    p = x.shape[0]
    squares = _new(x.shape, compute_dtype or "float32")
    sum_sq = _new((p, 1), "float32")
    isa.activation(dst=squares, op=OPS["square"], data=x, reduce_op=OPS["add"], reduce_res=sum_sq,
                   reduce_cmd=isa.reduce_cmd.reset_reduce)
    inv_rms = _new((p, 1), "float32")
    isa.tensor_scalar(dst=inv_rms, data=sum_sq, op0=OPS["multiply"], operand0=1.0 / n, op1=OPS["add"],
                      operand1=float(epsilon))
    isa.activation(dst=inv_rms, op=OPS["rsqrt"], data=inv_rms)
    out = _new(x.shape, dtype or x.dtype)
    isa.scalar_tensor_tensor(dst=out, data=x, op0=OPS["multiply"], operand0=inv_rms, op1=OPS["multiply"],
                             operand1=w)
    return out


def softmax(x, axis=-1, dtype=None):
    """Row softmax over the last free dim: exp(x - max) / sum."""
    if axis not in (-1, len(x.shape) - 1):
        raise ValueError("nl.softmax supports the last axis only")
    p = x.shape[0]
    row_max = _new((p, 1), "float32")
    isa.tensor_reduce(dst=row_max, op=OPS["maximum"], data=x, axis=len(x.shape) - 1, negate=True)
    exps = _new(x.shape, "float32")
    row_sum = _new((p, 1), "float32")
    isa.activation(dst=exps, op=OPS["exp"], data=x, bias=row_max, reduce_op=OPS["add"], reduce_res=row_sum,
                   reduce_cmd=isa.reduce_cmd.reset_reduce)
    inv = _new((p, 1), "float32")
    isa.reciprocal(dst=inv, data=row_sum)
    out = _new(x.shape, dtype or x.dtype)
    isa.tensor_scalar(dst=out, data=exps, op0=OPS["multiply"], operand0=inv)
    return out


def where(condition, x, y, dtype=None):
    """``x`` where ``condition`` (1.0/0.0) is nonzero, else ``y`` (tiles of one shape)."""
    out = _new(x.shape, dtype or x.dtype)
    isa.tensor_copy(dst=out, src=y)
    pred = _new(condition.shape, "uint8")
    isa.tensor_scalar(dst=pred, data=condition, op0=OPS["not_equal"], operand0=0.0)
    src = x
    if x.dtype != out.dtype:
        src = _new(x.shape, out.dtype)
        isa.tensor_copy(dst=src, src=x)
    isa.tensor_copy_predicated(dst=out, src=src, predicate=pred)
    return out


def broadcast_to(x, shape, dtype=None):
    """Broadcast size-1 free dims of ``x`` to ``shape`` (same rank) into a new tile."""
    view = x
    for d, (have, want) in enumerate(zip(x.shape, shape)):
        if have != want:
            view = view.broadcast(d, want)
    out = _new(shape, dtype or x.dtype)
    isa.tensor_copy(dst=out, src=view)
    return out


def expand_dims(x, axis):
    return x.expand_dim(axis)


del builtins
