"""Scalar-engine (ACT) instructions: activation, activation_reduce (docs/nki-semantics.md §8.7).

``dst = op(data * scale + bias)`` in fp32; with a reduce command the per-partition sum of the fp32
results (before the dst cast) goes through the Scalar engine's accumulator registers.
"""

from __future__ import annotations

import numpy as np

from ..hw import ACTIVATION_RANGES
from ..tensor import NkiTensor
from ._accum import accumulate
from ._common import INSTRUCTION, as_op, begin, engine_name, onchip, read_f32, same_pf, scalar_operand, write
from .constants import reduce_cmd as _reduce_cmd

__all__ = ["activation", "activation_reduce"]


def activation(dst, op, data, bias=None, scale=1.0, reduce_op=None, reduce_res=None,
               reduce_cmd=_reduce_cmd.idle, engine=None, name=None):
    """``dst = op(data * scale + bias)``; optional add-reduce into the accumulator / ``reduce_res``.

    ``engine=nisa.gpsimd_engine`` (NC-v4+) runs it on GpSimd: SBUF only, no accumulator.
    """
    c = begin("activation")
    eng = engine_name(c, engine, "scalar", ("scalar", "gpsimd"))
    if eng == "gpsimd":
        c.check(c.spec.gen >= 4, "engine", "activation on GpSimd needs NC-v4+")
        c.check(reduce_res is None and reduce_op is None and reduce_cmd == _reduce_cmd.idle, "reduce_cmd",
                "the accumulator exists only on the Scalar engine")
        for t, nm in ((data, "data"), (dst, "dst")):
            c.check(not isinstance(t, NkiTensor) or t._st.kind != "psum", nm, "GpSimd cannot access PSUM")
    return _activation(c, dst, op, data, bias, scale, reduce_op, reduce_res, reduce_cmd, eng)


def activation_reduce(dst, op, data, reduce_op, reduce_res, bias=None, scale=1.0, name=None):
    """``activation`` with ``reduce_cmd=reset_reduce`` writing the row reduction to ``reduce_res``."""
    c = begin("activation_reduce")
    c.check(isinstance(reduce_res, NkiTensor), "reduce_res", "activation_reduce needs a reduce_res tile")
    return _activation(c, dst, op, data, bias, scale, reduce_op, reduce_res, _reduce_cmd.reset_reduce, "scalar")


def _activation(c, dst, op, data, bias, scale, reduce_op, reduce_res, reduce_cmd, eng):
    fn = as_op(c, op, "op")
    c.check(fn.act is not None, "op", f"{fn!r} is not an activation function")
    pf = onchip(c, data, "data")
    same_pf(c, pf, dst, "dst")
    x = read_f32(c, data, "data", pf)
    s = scalar_operand(c, scale, pf[0], "scale")
    reads = [data]
    if isinstance(scale, NkiTensor):
        reads.append(scale)
    if bias is not None:
        if isinstance(bias, NkiTensor):
            c.check(bias._dtype != "tfloat32", "bias", "bias may not be tfloat32")
            reads.append(bias)
        else:
            c.check(c.spec.gen >= 3, "bias", "immediate bias needs NC-v3+")
        x = x * s + scalar_operand(c, bias, pf[0], "bias")
    elif not (isinstance(s, np.float32) and s == 1.0):
        x = x * s
    if fn.name in ACTIVATION_RANGES:
        lo, hi = (np.float32(v) for v in ACTIVATION_RANGES[fn.name])   # fp32 limits, as the engine sees them
        bad = ~((x >= lo) & (x <= hi)) & ~np.isnan(x)
        if bad.any():
            c.fail("data", f"nl.{fn.name} input {float(x[bad].flat[0])!r} is outside its valid range "
                           f"[{lo:.6g}, {hi:.6g}] on the Scalar engine (the hardware result would be garbage; "
                           "reduce the argument first)")
    y = np.asarray(fn.act(x), dtype=np.float32)
    red = as_op(c, reduce_op, "reduce_op", allow_none=True)
    if red is not None:
        c.check(red.name == "add", "reduce_op", "activation reduces with nl.add only")
    if reduce_res is not None:
        c.check(onchip(c, reduce_res, "reduce_res") == (pf[0], 1), "reduce_res", f"reduce_res must be ({pf[0]}, 1)")
    write(c, dst, y)
    row = y.sum(axis=1, dtype=np.float32) if red is not None else None
    accumulate(c, c.scalar_acc, reduce_cmd, red, row, pf[0], reduce_res)
    writes = (dst,) if reduce_res is None else (dst, reduce_res)
    c.record(eng, tuple(reads), writes, dst._shape, dst._dtype, dst.size, dst.size * dst.itemsize,
             {"func": fn.name, "reduce": red is not None and reduce_cmd != _reduce_cmd.idle})
    return INSTRUCTION
