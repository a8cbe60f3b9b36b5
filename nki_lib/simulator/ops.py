"""Operator constants of ``nki.language`` (docs/nki-semantics.md §7): ALU ops, activation functions, specials.

Each constant is an ``Op``: the same object is passed as ``op=`` to ``nisa`` instructions and is
callable as the 0.3+ tile-returning convenience function (``nl.add(x, y)``, ``nl.exp(x)``). All
arithmetic is fp32; comparisons and logical ops give 1.0 / 0.0; bitvec ops act on raw integers.
"""

from __future__ import annotations

import numpy as np

__all__ = ["Op", "OPS", "lookup_op"]

_F32 = np.float32


class Op:
    """One ``nl`` operator constant.

    ``alu``: binary fp32 function ``(x, y)`` (or unary ``(x)`` when ``unary``) usable by the Vector /
    GpSimd ALU; ``act``: fp32 activation function usable by the Scalar engine; ``bitvec``: integer
    bit operation; ``reduce_identity``: identity when legal as a reduce op, else None.
    """

    __slots__ = ("name", "alu", "act", "unary", "bitvec", "reduce_identity", "int_alu")
    wrapper = None  # set by language: the tile-returning implementation

    def __init__(self, name, alu=None, act=None, unary=False, bitvec=False, reduce_identity=None, int_alu=None):
        self.name = name
        self.alu = alu
        self.act = act
        self.unary = unary
        self.bitvec = bitvec
        self.reduce_identity = reduce_identity
        self.int_alu = int_alu

    def __repr__(self):
        return f"nl.{self.name}"

    def __call__(self, *args, **kwargs):
        return Op.wrapper(self, *args, **kwargs)


def _cmp(fn):
    return lambda x, y: fn(x, y).astype(_F32)


def _logical(fn):
    return lambda x, y: fn(x != 0, y != 0).astype(_F32)


def _abs_max(x, y):
    return np.where(np.abs(x) > np.abs(y), x, y)


def _abs_min(x, y):
    return np.where(np.abs(x) < np.abs(y), x, y)


def _sigmoid(x):
    return (1.0 / (1.0 + np.exp(-x, dtype=_F32))).astype(_F32)


def _erf(x):
    import torch  # lazily: only gelu/erf need it

    return torch.special.erf(torch.from_numpy(np.ascontiguousarray(x, dtype=_F32))).numpy()


_SQRT_2_PI = np.float32(np.sqrt(2.0 / np.pi))
_INV_SQRT_2 = np.float32(1.0 / np.sqrt(2.0))
_INV_SQRT_2PI = np.float32(1.0 / np.sqrt(2.0 * np.pi))
_GELU_SIG = np.float32(1.702)


def _gelu(x):
    return 0.5 * x * (1.0 + _erf(x * _INV_SQRT_2))


def _gelu_dx(x):
    return 0.5 * (1.0 + _erf(x * _INV_SQRT_2)) + x * np.exp(-0.5 * x * x) * _INV_SQRT_2PI


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(_SQRT_2_PI * (x + np.float32(0.044715) * x * x * x)))


def _gelu_sig(x):
    return x * _sigmoid(_GELU_SIG * x)


def _gelu_sig_dx(x):
    s = _sigmoid(_GELU_SIG * x)
    return s + _GELU_SIG * x * s * (1.0 - s)


def _silu_dx(x):
    s = _sigmoid(x)
    return s * (1.0 + x * (1.0 - s))


def _softplus(x):
    return np.logaddexp(np.float32(0.0), x).astype(_F32)


def _rsqrt(x):
    return (1.0 / np.sqrt(x)).astype(_F32)


def _recip(x):
    return (1.0 / x).astype(_F32)


def _right_shift(x, y):
    unsigned = x.view(np.dtype(f"u{x.dtype.itemsize}")) if x.dtype.kind == "i" else x
    return np.right_shift(unsigned, y.astype(unsigned.dtype)).view(x.dtype)


def _left_shift(x, y):
    return np.left_shift(x, y.astype(x.dtype))


_INF = np.float32(np.inf)
OPS = {}


def _add(op: Op) -> Op:
    OPS[op.name] = op
    return op


# arithmetic binary (fp32), legal reduce ops carry their identity
for _name, _fn, _ident, _int in (("add", np.add, 0.0, np.add), ("subtract", np.subtract, 0.0, np.subtract),
                                 ("multiply", np.multiply, 1.0, np.multiply),
                                 ("maximum", np.maximum, -_INF, np.maximum), ("minimum", np.minimum, _INF, np.minimum)):
    _add(Op(_name, alu=_fn, reduce_identity=_ident, int_alu=_int))
_add(Op("power", alu=np.power))
_add(Op("abs_max", alu=_abs_max))
_add(Op("abs_min", alu=_abs_min))
_add(Op("divide", alu=None))
_add(Op("fmod", alu=None))
_add(Op("mod", alu=None))
for _name, _fn in (("equal", np.equal), ("not_equal", np.not_equal), ("greater_equal", np.greater_equal),
                   ("greater", np.greater), ("less_equal", np.less_equal), ("less", np.less)):
    _add(Op(_name, alu=_cmp(_fn), int_alu=_fn))
for _name, _fn in (("logical_and", np.logical_and), ("logical_or", np.logical_or), ("logical_xor", np.logical_xor)):
    _add(Op(_name, alu=_logical(_fn), reduce_identity=0.0 if _name != "logical_and" else 1.0))
# bitvec
_add(Op("bitwise_and", alu=np.bitwise_and, bitvec=True, reduce_identity=-1))
_add(Op("bitwise_or", alu=np.bitwise_or, bitvec=True, reduce_identity=0))
_add(Op("bitwise_xor", alu=np.bitwise_xor, bitvec=True, reduce_identity=0))
_add(Op("left_shift", alu=_left_shift, bitvec=True))
_add(Op("right_shift", alu=_right_shift, bitvec=True))
_add(Op("invert", alu=np.invert, bitvec=True, unary=True))
# unary ALU ops that are also activation functions
_add(Op("abs", alu=np.abs, act=np.abs, unary=True))
_add(Op("square", alu=np.square, act=np.square, unary=True))
_add(Op("relu", alu=lambda x: np.maximum(x, _F32(0)), act=lambda x: np.maximum(x, _F32(0)), unary=True))
_add(Op("rsqrt", alu=_rsqrt, act=_rsqrt, unary=True))
_add(Op("reciprocal", alu=_recip, act=_recip, unary=True))
# activation functions (Scalar engine)
for _name, _fn in (
        ("copy", lambda x: x), ("sigmoid", _sigmoid), ("gelu", _gelu), ("gelu_dx", _gelu_dx),
        ("gelu_apprx_tanh", _gelu_tanh), ("gelu_apprx_sigmoid", _gelu_sig), ("gelu_apprx_sigmoid_dx", _gelu_sig_dx),
        ("silu", lambda x: x * _sigmoid(x)), ("silu_dx", _silu_dx), ("tanh", np.tanh), ("softplus", _softplus),
        ("mish", lambda x: x * np.tanh(_softplus(x))), ("erf", _erf),
        ("erf_dx", lambda x: np.float32(2.0 / np.sqrt(np.pi)) * np.exp(-x * x)), ("exp", np.exp), ("log", np.log),
        ("sin", np.sin), ("arctan", np.arctan), ("sqrt", np.sqrt), ("sign", np.sign)):
    _add(Op(_name, act=_fn, unary=True))
_add(Op("prelu", act=lambda x: np.maximum(x, _F32(0)), unary=True))
# tile-function-only unary ops (no single ISA opcode)
for _name in ("negative", "cos", "tan", "ceil", "floor", "trunc", "logical_not"):
    _add(Op(_name, unary=True))
# specials
_add(Op("bypass"))
_add(Op("average", reduce_identity=0.0))

_NUMPY_ALIASES = {np.add: "add", np.subtract: "subtract", np.multiply: "multiply", np.maximum: "maximum",
                  np.minimum: "minimum", np.exp: "exp", np.square: "square", np.tanh: "tanh", np.abs: "abs",
                  np.equal: "equal", np.greater: "greater", np.greater_equal: "greater_equal", np.less: "less",
                  np.less_equal: "less_equal", np.not_equal: "not_equal", np.sqrt: "sqrt", np.log: "log",
                  np.sin: "sin", np.bitwise_and: "bitwise_and", np.bitwise_or: "bitwise_or",
                  np.bitwise_xor: "bitwise_xor", np.power: "power", np.reciprocal: "reciprocal"}


def lookup_op(op, argname: str = "op") -> Op:
    """The ``Op`` for an ``nl`` constant (NumPy ufunc aliases accepted, as the legacy API did)."""
    if isinstance(op, Op):
        return op
    if op in _NUMPY_ALIASES:
        return OPS[_NUMPY_ALIASES[op]]
    raise TypeError(f"{argname}: {op!r} is not an nki.language operator constant")
