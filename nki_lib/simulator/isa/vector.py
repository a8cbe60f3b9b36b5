"""Vector-engine (DVE) instructions (docs/nki-semantics.md §8.2-8.5, 8.11, 8.12, 8.15, 8.17, 8.21-8.23, 8.27).

All arithmetic is fp32 with cast on write; bitvec ops act on raw integers; ``tensor_tensor`` on
int32/uint32 operands outside PSUM runs on GpSimd with exact integer math. Operands are (P, F)
streams: same partition count and elements per partition, free shapes may differ.
"""

from __future__ import annotations

import numpy as np

from ..dtypes import is_float, is_int
from ..hw import QUADRANT, SHUFFLE_KEEP, TOPK_MAX_FREE, TOPK_WIDTH
from ..tensor import NkiTensor
from ._accum import accumulate
from ._common import (
    INSTRUCTION,
    as_op,
    begin,
    engine_name,
    onchip,
    read_f32,
    read_raw,
    same_pf,
    scalar_operand,
    tile_operands,
    write,
)
from .constants import engine as _engine
from .constants import reduce_cmd as _reduce_cmd

__all__ = ["tensor_copy", "memset", "tensor_tensor", "tensor_scalar", "scalar_tensor_tensor", "tensor_reduce",
           "reciprocal", "tensor_scalar_reduce", "tensor_copy_predicated", "max8", "nc_find_index8",
           "nc_stream_shuffle", "range_select"]

_NO_PSUM_GPSIMD = " (GpSimd cannot access PSUM)"
_SCALAR_V3_PAIRS = {("multiply", "add"), ("multiply", None), ("add", None)}


def _rec(c, eng, reads, dst, attrs=None):
    c.record(eng, reads, (dst,), dst._shape, dst._dtype, dst.size, dst.size * dst.itemsize, attrs)


def tensor_copy(dst, src, engine=None, name=None):
    """Copy ``src`` to ``dst`` (bit-exact for equal dtypes, via fp32 otherwise)."""
    c = begin("tensor_copy")
    eng = engine_name(c, engine, "vector", ("vector", "scalar", "gpsimd"))
    gp = eng == "gpsimd"
    pf = onchip(c, src, "src", psum=not gp, why=_NO_PSUM_GPSIMD)
    same_pf(c, pf, dst, "dst", psum=not gp, why=_NO_PSUM_GPSIMD)
    if src._dtype == dst._dtype and not (eng == "scalar" and c.spec.gen < 3):
        vals = np.array(read_raw(c, src, "src"))
        dst._scatter(vals, c.opcode, "dst")
    else:
        write(c, dst, read_f32(c, src, "src", pf))
    _rec(c, eng, (src,), dst)
    return INSTRUCTION


def memset(dst, value, engine=None, name=None):
    """Fill every element of ``dst`` with the compile-time constant ``value``."""
    c = begin("memset")
    eng = engine_name(c, engine, "vector", ("vector", "gpsimd"))
    pf = onchip(c, dst, "dst", psum=eng != "gpsimd", why=_NO_PSUM_GPSIMD)
    c.check(isinstance(value, (int, float, bool, np.integer, np.floating)), "value",
            f"value must be a compile-time number, got {type(value).__name__}")
    dt = dst._dtype
    if is_int(dt):
        c.check(isinstance(value, (int, np.integer)), "value",
                f"integer tile {dt} needs an integer value, got {value!r}")
        fill = np.array(int(value), dtype=np.int64)
    elif dt.endswith("_x4"):
        c.check(value == 0, "value", "packed x4 tiles can only be memset to 0")
        fill = np.zeros((), dtype=dt.np)
        dst._scatter(np.broadcast_to(fill, dst._shape), c.opcode, "dst")
        _rec(c, eng, (), dst)
        return INSTRUCTION
    else:
        fill = np.float32(value)
    write(c, dst, np.broadcast_to(fill, pf))
    _rec(c, eng, (), dst, {"value": value})
    return INSTRUCTION


def _binary(c, op, x, y, int_path):
    if op.bitvec:
        return op.alu(x, y)
    if int_path and op.int_alu is not None:
        out = op.int_alu(x, y)
        return out.astype(np.int64) if out.dtype == bool else out
    return op.alu(x, y)


def tensor_tensor(dst, data1, data2, op, engine=None, name=None):
    """``dst = op(data1, data2)`` elementwise."""
    c = begin("tensor_tensor")
    alu = as_op(c, op, "op")
    c.check(alu.alu is not None and not alu.unary, "op", f"{alu!r} is not a binary ALU operator")
    eng = engine_name(c, engine, "vector", ("vector", "gpsimd"))
    engine_given = engine is not None and engine != _engine.unknown
    pf = onchip(c, data1, "data1")
    same_pf(c, pf, data2, "data2")
    same_pf(c, pf, dst, "dst")
    in_psum = [t._st.kind == "psum" for t in (data1, data2)]
    c.check(not all(in_psum), "data2", "at most one tensor_tensor input may be in PSUM")
    ints32 = all(t._dtype in ("int32", "uint32") for t in (data1, data2, dst))
    if alu.name == "power" or eng == "gpsimd":
        for t, nm in ((data1, "data1"), (data2, "data2"), (dst, "dst")):
            c.check(t._st.kind != "psum", nm, "operand may not be in PSUM" + _NO_PSUM_GPSIMD)
        eng = "gpsimd"
    # exact integer math on GpSimd: all int32/uint32, nothing in PSUM, engine GpSimd or left to the compiler
    exact_ints = ints32 and not any(in_psum) and dst._st.kind != "psum"
    int_path = exact_ints and (eng == "gpsimd" or not engine_given)
    if int_path:
        eng = "gpsimd"
    if alu.bitvec:
        for t, nm in ((data1, "data1"), (data2, "data2"), (dst, "dst")):
            c.check(is_int(t._dtype), nm, f"bitvec op {alu!r} needs integer dtypes, got {t._dtype}")
        x = read_raw(c, data1, "data1").reshape(pf).astype(np.int64)
        y = read_raw(c, data2, "data2").reshape(pf).astype(np.int64)
        if alu.name == "right_shift":
            x = read_raw(c, data1, "data1").reshape(pf)
            y = read_raw(c, data2, "data2").reshape(pf)
        out = alu.alu(x, y)
    elif int_path:
        x = read_raw(c, data1, "data1").reshape(pf).astype(np.int64)
        y = read_raw(c, data2, "data2").reshape(pf).astype(np.int64)
        out = _binary(c, alu, x, y, True)
    else:
        out = alu.alu(read_f32(c, data1, "data1", pf), read_f32(c, data2, "data2", pf))
    write(c, dst, out)
    _rec(c, eng, (data1, data2), dst, {"op": alu.name})
    return INSTRUCTION


def _apply_scalar(op, t, operand, reverse):
    if op.unary:
        return op.alu(t)
    return op.alu(operand, t) if reverse else op.alu(t, operand)


def _scalar_int(c, x, name):
    if isinstance(x, NkiTensor):
        c.check(is_int(x._dtype), name, "bitvec operands must be integer tiles")
        return read_raw(c, x, name).reshape(-1, 1).astype(np.int64)
    c.check(isinstance(x, (int, np.integer)), name, "bitvec operands must be integers")
    return np.int64(x)


def tensor_scalar(dst, data, op0, operand0, reverse0=False, op1=None, operand1=None, reverse1=False,
                  engine=None, name=None):
    """``dst = op1(op0(data, operand0), operand1)`` with per-partition or immediate scalar operands."""
    c = begin("tensor_scalar")
    eng = engine_name(c, engine, "vector", ("vector", "scalar", "gpsimd"))
    a0 = as_op(c, op0, "op0")
    a1 = as_op(c, op1, "op1", allow_none=True)
    for op, nm in ((a0, "op0"), (a1, "op1")):
        if op is not None:
            c.check(op.alu is not None, nm, f"{op!r} is not an ALU operator")
    if a1 is not None:
        c.check(a0.bitvec == a1.bitvec, "op1", "op0 and op1 must both be arithmetic or both bitvec")
    if eng == "scalar" and c.spec.gen < 4:
        pair = (a0.name, a1.name if a1 else None)
        c.check(pair in _SCALAR_V3_PAIRS, "op0", f"the {c.spec.name} Scalar engine supports only "
                                                 "(multiply, add), (multiply, None), (add, None)")
    pf = onchip(c, data, "data", psum=eng != "gpsimd", why=_NO_PSUM_GPSIMD)
    same_pf(c, pf, dst, "dst", psum=eng != "gpsimd", why=_NO_PSUM_GPSIMD)
    if a0.unary:
        c.check(operand0 is None or (not isinstance(operand0, NkiTensor) and operand0 == 0), "operand0",
                f"unary op0 {a0!r} takes operand0=None (or 0)")
    if a1 is not None and a1.unary:
        c.check(operand1 is None or (not isinstance(operand1, NkiTensor) and operand1 == 0), "operand1",
                f"unary op1 {a1!r} takes operand1=None (or 0)")
    reads = (data,) + tile_operands(operand0, operand1)
    if a0.bitvec:
        c.check(is_int(data._dtype) and is_int(dst._dtype), "data", "bitvec ops need integer tiles")
        t = read_raw(c, data, "data").reshape(pf).astype(np.int64)
        t = a0.alu(t, _scalar_int(c, operand0, "operand0")) if not a0.unary else a0.alu(t)
        if a1 is not None:
            t = a1.alu(t, _scalar_int(c, operand1, "operand1")) if not a1.unary else a1.alu(t)
    else:
        t = read_f32(c, data, "data", pf)
        s0 = None if a0.unary else scalar_operand(c, operand0, pf[0], "operand0")
        t = _apply_scalar(a0, t, s0, reverse0)
        if a1 is not None:
            s1 = None if a1.unary else scalar_operand(c, operand1, pf[0], "operand1")
            t = _apply_scalar(a1, t, s1, reverse1)
    write(c, dst, t)
    _rec(c, eng, tuple(reads), dst, {"op0": a0.name, "op1": a1.name if a1 else None})
    return INSTRUCTION


def scalar_tensor_tensor(dst, data, op0, operand0, op1, operand1, reverse0=False, reverse1=False, dtype=None,
                         name=None):
    """``dst = op1(op0(data, operand0), operand1)``; operand0 scalar / (P,1) tile, operand1 a full tile."""
    c = begin("scalar_tensor_tensor")
    a0 = as_op(c, op0, "op0")
    a1 = as_op(c, op1, "op1")
    for op, nm in ((a0, "op0"), (a1, "op1")):
        c.check(op.alu is not None and not op.bitvec and not op.unary, nm,
                f"{op!r} is not a binary arithmetic ALU operator")
    pf = onchip(c, data, "data")
    same_pf(c, pf, operand1, "operand1")
    same_pf(c, pf, dst, "dst")
    c.check(not (data._st.kind == "psum" and operand1._st.kind == "psum"), "operand1",
            "data and operand1 may not both be in PSUM")
    t = read_f32(c, data, "data", pf)
    s0 = scalar_operand(c, operand0, pf[0], "operand0")
    t = a0.alu(s0, t) if reverse0 else a0.alu(t, s0)
    o1 = read_f32(c, operand1, "operand1", pf)
    t = a1.alu(o1, t) if reverse1 else a1.alu(t, o1)
    write(c, dst, t)
    reads = (data, operand1) + tile_operands(operand0)
    _rec(c, "vector", reads, dst, {"op0": a0.name, "op1": a1.name})
    return INSTRUCTION


def tensor_reduce(dst, op, data, axis, negate=False, keepdims=False, name=None):
    """Reduce ``data`` over trailing free ``axis`` (int or tuple) with ``op`` into ``dst``."""
    c = begin("tensor_reduce")
    alu = as_op(c, op, "op")
    c.check(alu.reduce_identity is not None and alu.alu is not None, "op", f"{alu!r} is not a reduce operator")
    pf = onchip(c, data, "data")
    nd = len(data._shape)
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    axes = tuple(sorted(int(a) + nd if int(a) < 0 else int(a) for a in axes))
    c.check(len(axes) > 0 and 0 not in axes, "axis", "cannot reduce the partition dim (axis 0)")
    c.check(axes == tuple(range(nd - len(axes), nd)), "axis",
            f"axis {axes} must be the trailing free dims ending at the last dim ({nd - 1})")
    kept = int(np.prod(data._shape[1:nd - len(axes)], dtype=np.int64))
    dpf = onchip(c, dst, "dst")
    c.check(dpf == (pf[0], kept), "dst", f"dst must hold {kept} elements on each of {pf[0]} partitions, "
                                         f"has {dpf[1]} on {dpf[0]}")
    if alu.bitvec:
        c.check(is_int(data._dtype), "data", "bitvec reductions need integer data")
        x = read_raw(c, data, "data").reshape(pf[0], kept, -1).astype(np.int64)
        out = alu.alu.reduce(x, axis=2)
        c.check(not negate, "negate", "negate applies to arithmetic reductions only")
    else:
        x = read_f32(c, data, "data", pf).reshape(pf[0], kept, -1)
        out = alu.alu.reduce(x, axis=2) if isinstance(alu.alu, np.ufunc) else _fold(alu, x)
        if negate:
            out = -out
    write(c, dst, out)
    _rec(c, "vector", (data,), dst, {"op": alu.name, "axis": axes})
    return INSTRUCTION


def _fold(alu, x):
    out = x[..., 0]
    for j in range(1, x.shape[-1]):
        out = alu.alu(out, x[..., j])
    return out


def reciprocal(dst, data, name=None):
    """``dst = 1 / data`` in fp32 (Vector engine)."""
    c = begin("reciprocal")
    pf = onchip(c, data, "data")
    same_pf(c, pf, dst, "dst")
    write(c, dst, np.float32(1.0) / read_f32(c, data, "data", pf))
    _rec(c, "vector", (data,), dst)
    return INSTRUCTION


def tensor_scalar_reduce(dst, data, op0, operand0, reduce_op, reduce_res=None, reverse0=False,
                         reduce_cmd=_reduce_cmd.reset_reduce, reduce_init=None, reduce_res_negate=False, name=None):
    """``dst = op0(data, operand0)`` plus a per-partition reduction into the Vector accumulator."""
    c = begin("tensor_scalar_reduce")
    a0 = as_op(c, op0, "op0")
    c.check(a0.alu is not None and not a0.bitvec, "op0", f"{a0!r} is not an arithmetic ALU operator")
    red = as_op(c, reduce_op, "reduce_op")
    c.check(red.name in ("add", "multiply", "maximum", "minimum"), "reduce_op",
            "reduce_op must be add, multiply, maximum or minimum")
    pf = onchip(c, data, "data")
    same_pf(c, pf, dst, "dst")
    if reduce_res is not None:
        c.check(onchip(c, reduce_res, "reduce_res") == (pf[0], 1), "reduce_res", f"must be ({pf[0]}, 1)")
    t = read_f32(c, data, "data", pf)
    s0 = None if a0.unary else scalar_operand(c, operand0, pf[0], "operand0")
    t = _apply_scalar(a0, t, s0, reverse0)
    write(c, dst, t)
    accumulate(c, c.vector_acc, reduce_cmd, red, red.alu.reduce(t, axis=1), pf[0], reduce_res,
               reduce_init, reduce_res_negate)
    writes = (dst,) if reduce_res is None else (dst, reduce_res)
    reads = (data,) + tile_operands(operand0, reduce_init)
    c.record("vector", reads, writes, dst._shape, dst._dtype, dst.size, dst.size * dst.itemsize,
             {"op0": a0.name, "reduce_op": red.name, "reduce_cmd": reduce_cmd.name})
    return INSTRUCTION


def tensor_copy_predicated(dst, src, predicate, reverse_pred=False, name=None):
    """``dst = src`` where ``predicate != 0`` (xor ``reverse_pred``); elsewhere ``dst`` unchanged."""
    c = begin("tensor_copy_predicated")
    pf = onchip(c, dst, "dst")
    same_pf(c, pf, predicate, "predicate")
    c.check(predicate._dtype in ("uint8", "uint16", "uint32"), "predicate",
            f"predicate must be uint8/uint16/uint32, got {predicate._dtype}")
    mask = read_raw(c, predicate, "predicate").reshape(pf) != 0
    if reverse_pred:
        mask = ~mask
    current = np.array(read_raw(c, dst, "dst")).reshape(pf)
    if isinstance(src, NkiTensor):
        same_pf(c, pf, src, "src")
        c.check(src._dtype == dst._dtype, "src", f"dtype {src._dtype} differs from dst's {dst._dtype}")
        c.check(not (src._st.kind == "psum" and predicate._st.kind == "psum"), "predicate",
                "src and predicate may not both be in PSUM")
        new = read_raw(c, src, "src").reshape(pf)
        reads = (src, predicate, dst)
    else:
        new = np.broadcast_to(np.asarray(src).astype(dst._dtype.np), pf)
        reads = (predicate, dst)
    current[mask] = new[mask]
    dst._scatter(current, c.opcode, "dst")
    _rec(c, "vector", reads, dst)
    return INSTRUCTION


def max8(dst, src, name=None):
    """The 8 largest values of each partition of ``src``, descending."""
    c = begin("max8")
    pf = onchip(c, src, "src")
    c.check(len(src._shape) <= 3, "src", "src may have at most 3 dims")
    c.check(TOPK_WIDTH <= pf[1] <= TOPK_MAX_FREE, "src",
            f"needs {TOPK_WIDTH}..{TOPK_MAX_FREE} elements per partition, has {pf[1]}")
    dpf = onchip(c, dst, "dst")
    c.check(dpf == (pf[0], TOPK_WIDTH), "dst", f"dst must be ({pf[0]}, {TOPK_WIDTH})")
    x = read_f32(c, src, "src", pf)
    top = -np.sort(-x, axis=1, kind="stable")[:, :TOPK_WIDTH]
    write(c, dst, top)
    _rec(c, "vector", (src,), dst)
    return INSTRUCTION


def nc_find_index8(dst, data, vals, name=None):
    """Index of the first occurrence of each of 8 ``vals`` per partition (duplicates: successive matches)."""
    c = begin("nc_find_index8")
    pf = onchip(c, data, "data")
    c.check(TOPK_WIDTH <= pf[1] <= TOPK_MAX_FREE, "data",
            f"needs {TOPK_WIDTH}..{TOPK_MAX_FREE} elements per partition, has {pf[1]}")
    c.check(onchip(c, vals, "vals") == (pf[0], TOPK_WIDTH), "vals", f"vals must be ({pf[0]}, {TOPK_WIDTH})")
    c.check(onchip(c, dst, "dst") == (pf[0], TOPK_WIDTH), "dst", f"dst must be ({pf[0]}, {TOPK_WIDTH})")
    c.check(dst._dtype in ("uint32", "uint16"), "dst", f"dst must be uint32 or uint16, got {dst._dtype}")
    x = read_f32(c, data, "data", pf)
    v = read_f32(c, vals, "vals", (pf[0], TOPK_WIDTH))
    eq = x[:, None, :] == v[:, :, None]                          # (P, 8, F)
    rank = np.zeros((pf[0], TOPK_WIDTH), dtype=np.int64)         # how many earlier equal vals
    for k in range(1, TOPK_WIDTH):
        rank[:, k] = (v[:, :k] == v[:, k:k + 1]).sum(axis=1)
    hits = np.cumsum(eq, axis=2)
    target = eq & (hits == (rank + 1)[:, :, None])
    found = target.any(axis=2)
    idx = np.argmax(target, axis=2)
    sentinel = np.iinfo(dst._dtype.np).max
    out = np.where(found, idx, sentinel).astype(np.int64)
    write(c, dst, out)
    _rec(c, "vector", (data, vals), dst)
    return INSTRUCTION


def nc_stream_shuffle(dst, src, shuffle_mask, name=None):
    """Within each 32-partition quadrant: ``dst[q*32+i] = src[q*32+mask[i]]`` (255 keeps dst)."""
    c = begin("nc_stream_shuffle")
    spf = onchip(c, src, "src")
    dpf = onchip(c, dst, "dst")
    c.check(spf[1] == dpf[1], "dst", f"{dpf[1]} elements per partition, src has {spf[1]}")
    c.check(src._dtype == dst._dtype, "dst", "src and dst dtypes must match")
    mask = [int(m) for m in shuffle_mask]
    c.check(len(mask) == QUADRANT, "shuffle_mask", f"shuffle_mask needs {QUADRANT} entries, got {len(mask)}")
    x = np.array(read_raw(c, src, "src")).reshape(spf)
    out = np.array(read_raw(c, dst, "dst")).reshape(dpf)
    for p in range(dpf[0]):
        q, i = divmod(p, QUADRANT)
        m = mask[i]
        if m == SHUFFLE_KEEP:
            continue
        sp = q * QUADRANT + m
        if sp >= spf[0]:
            sp = m
        c.check(0 <= m < QUADRANT and sp < spf[0], "shuffle_mask", f"mask entry {m} references a missing src partition")
        out[p] = x[sp]
    dst._scatter(out, c.opcode, "dst")
    _rec(c, "vector", (src,), dst)
    return INSTRUCTION


_RANGE_CMPS = ("equal", "less", "less_equal", "greater", "greater_equal")
FP32_MIN = -3.4028235e38


def range_select(dst, on_true_tile, comp_op0, comp_op1, bound0, bound1, reduce_cmd=_reduce_cmd.reset_reduce,
                 reduce_res=None, reduce_op=None, range_start=0, on_false_value=FP32_MIN, name=None):
    """Keep ``on_true_tile[p, j]`` where both comparisons of ``range_start + j`` with the bounds hold."""
    c = begin("range_select")
    c.check(c.spec.gen >= 3, "dst", "range_select needs NC-v3+")
    pf = onchip(c, on_true_tile, "on_true_tile")
    same_pf(c, pf, dst, "dst")
    c.check(is_float(on_true_tile._dtype), "on_true_tile", "on_true_tile must be a float dtype")
    ops = []
    for op, nm in ((comp_op0, "comp_op0"), (comp_op1, "comp_op1")):
        o = as_op(c, op, nm)
        c.check(o.name in _RANGE_CMPS, nm, f"must be one of {', '.join(_RANGE_CMPS)}")
        ops.append(o)
    red = as_op(c, reduce_op if reduce_op is not None else _maximum(), "reduce_op")
    c.check(red.name == "maximum", "reduce_op", "range_select reduces with nl.maximum")
    c.check(float(on_false_value) == np.float32(FP32_MIN), "on_false_value", "on_false_value must be FP32_MIN")
    b0 = scalar_operand(c, bound0, pf[0], "bound0")
    b1 = scalar_operand(c, bound1, pf[0], "bound1")
    idx = np.float32(range_start) + np.arange(pf[1], dtype=np.float32)[None, :]
    keep = (ops[0].alu(idx, b0) != 0) & (ops[1].alu(idx, b1) != 0)
    x = read_f32(c, on_true_tile, "on_true_tile", pf)
    out = np.where(keep, x, np.float32(on_false_value))
    write(c, dst, out)
    accumulate(c, c.vector_acc, reduce_cmd, red, out.max(axis=1), pf[0], reduce_res)
    writes = (dst,) if reduce_res is None else (dst, reduce_res)
    reads = (on_true_tile,) + tile_operands(bound0, bound1)
    c.record("vector", reads, writes, dst._shape, dst._dtype, dst.size, dst.size * dst.itemsize)
    return INSTRUCTION


def _maximum():
    from ..ops import OPS
    return OPS["maximum"]
