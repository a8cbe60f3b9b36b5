"""Rarely used ``nki.isa`` instructions (docs/nki-semantics.md §8.27, §8.29), not used by the NKI Library.

* Vector engine: ``tensor_scalar_cumulative`` (per-partition scan of ``op0(x, imm0)`` with ``op1``),
  ``tensor_tensor_scan`` (two-input recurrence), ``select_reduce`` (where + max reduce),
  ``bn_stats`` / ``bn_aggr`` (mean and variance), ``nc_match_replace8`` (replace the first
  occurrences of 8 values), ``exponential`` (NC-v4 fast ``exp(x - max)`` with a running sum).
* Scalar engine: ``activate2`` (NC-v4 ``op((x op0 imm0) op1 imm1)`` with reduce).
* GpSimd: ``nc_n_gather`` (per-partition gather by flattened free index).
* NC-v4 MX (§8.16, §8.19): ``quantize_mx`` and ``nc_matmul_mx`` (``nisa`` gets them only from
  here: ``isa/__init__`` star-imports this module). Scale layout: the scale of group row g (partitions 8g..8g+7) lives at
  partition ``(g // 4) * 32 + g % 4`` of the scale view (4 rows per 32-partition quadrant; slice the
  scale tile's start partition for the 0/4/8/12 offsets). Scale exponent: the 0.6 API doc value
  ``floor(log2 amax) - (Emax - 1)`` (§14.13), stored biased by 127 (e8m0).

Operands are (P, F) streams as everywhere (§4.3): F = elements per partition in row-major order
of the view's free dims. Arithmetic is fp32 with cast on write; the Vector and Scalar engine
accumulator registers are the per-program ``vector_acc`` / ``scalar_acc`` arrays (§8.0.1).
Not implemented: ``sequence_bounds``, ``topk``, the RNG family (``rng``, ``rand2``, ``dropout``,
``set_rng_seed``, ``rand_set_state``, ``rand_get_state``): not used by any kernel here.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from ..dtypes import is_float, is_int
from ..ops import OPS
from ._accum import accumulate
from ._common import (
    INSTRUCTION,
    as_op,
    begin,
    onchip,
    read_f32,
    read_raw,
    same_pf,
    scalar_operand,
    tile_operands,
    write,
)
from .constants import reduce_cmd as _reduce_cmd
from .pe import _psum_dst, _psum_write

__all__ = ["tensor_scalar_cumulative", "tensor_tensor_scan", "select_reduce", "bn_stats", "bn_aggr",
           "nc_match_replace8", "exponential", "activate2", "nc_n_gather", "quantize_mx", "nc_matmul_mx"]

_SCAN_OPS = ("add", "subtract", "multiply", "maximum", "minimum")
_NO_32BIT_INT = ("int32", "uint32")
_PREDICATE_DTYPES = ("int8", "uint8", "int16", "uint16")
_INDEX_DTYPES = ("uint16", "uint32")
_ACTIVATE2_PAIRS = {("multiply", "add"), ("multiply", "subtract"), ("multiply", "bypass"), ("add", "bypass"),
                    ("subtract", "bypass"), ("bypass", "bypass")}
_ABS_REDUCE_IDENTITY = {"abs_max": 0.0, "abs_min": np.inf}
_MATCH_SLOTS = 8                       # values per nc_match_replace8 (as max8 / nc_find_index8)
_MATCH_DATA_RANGE = (8, 16384)         # elements per partition accepted by the 8-wide Vector ops


def _record(c, engine, reads, writes, attrs=None):
    dst = writes[0]
    c.record(engine, tuple(reads), tuple(writes), dst._shape, dst._dtype, dst.size, dst.size * dst.itemsize, attrs)


def _arith_op(c, op, operand, allow_bypass=False):
    alu = as_op(c, op, operand)
    if allow_bypass and alu.name == "bypass":
        return alu
    c.check(alu.alu is not None and not alu.bitvec and not alu.unary, operand,
            f"{alu!r} is not a binary arithmetic ALU operator")
    return alu


def _apply(alu, x, operand, reverse):
    return alu.alu(operand, x) if reverse else alu.alu(x, operand)


def _reduce_res_shape(c, reduce_res, p):
    if reduce_res is not None:
        c.check(onchip(c, reduce_res, "reduce_res") == (p, 1), "reduce_res", f"reduce_res must be ({p}, 1)")


def tensor_scalar_cumulative(dst, src, op0, op1, imm0, imm1=None, reduce_cmd=_reduce_cmd.reset_reduce,
                             reverse0=False, name=None):
    """Per partition ``reg = op1(op0(x_i, imm0), reg); dst_i = reg`` over the flattened free dims.

    The register starts at op1's identity (``reset``/``reset_reduce``), at ``imm1`` (``load_reduce``)
    or at the Vector accumulator (``reduce``); ``idle`` starts at the identity and leaves the
    accumulator untouched. Otherwise the accumulator keeps the last value of each partition.
    """
    c = begin("tensor_scalar_cumulative")
    a0 = _arith_op(c, op0, "op0")
    a1 = as_op(c, op1, "op1")
    c.check(a1.name in _SCAN_OPS, "op1", f"op1 must be one of {', '.join(_SCAN_OPS)}, got {a1!r}")
    c.check(isinstance(reduce_cmd, _reduce_cmd), "reduce_cmd", f"must be a nisa.reduce_cmd member, got {reduce_cmd!r}")
    pf = onchip(c, src, "src")
    same_pf(c, pf, dst, "dst")
    for t, operand in ((src, "src"), (dst, "dst")):
        c.check(t._dtype not in _NO_32BIT_INT, operand, f"32-bit integer {t._dtype} is not supported")
    p = pf[0]
    t = _apply(a0, read_f32(c, src, "src", pf), scalar_operand(c, imm0, p, "imm0"), reverse0)
    if reduce_cmd == _reduce_cmd.load_reduce:
        c.check(imm1 is not None, "imm1", "reduce_cmd.load_reduce needs imm1")
        reg = np.broadcast_to(scalar_operand(c, imm1, p, "imm1"), (p, 1)).astype(np.float32)
    elif reduce_cmd == _reduce_cmd.reduce:
        reg = c.vector_acc[:p].reshape(p, 1).copy()
    else:
        reg = np.full((p, 1), a1.reduce_identity, dtype=np.float32)
    if a1.name == "subtract":  # reg = x_i - reg is not associative: scan step by step
        out = np.empty_like(t)
        for i in range(pf[1]):
            reg = t[:, i:i + 1] - reg
            out[:, i:i + 1] = reg
    else:  # commutative: an fp32 ufunc accumulate in program order
        out = a1.alu.accumulate(np.concatenate([reg, t], axis=1), axis=1)[:, 1:]
    write(c, dst, out)
    if reduce_cmd != _reduce_cmd.idle and pf[1] > 0:
        c.vector_acc[:p] = out[:, -1]
    _record(c, "vector", (src,) + tile_operands(imm0, imm1), (dst,),
            {"op0": a0.name, "op1": a1.name, "reduce_cmd": reduce_cmd.name})
    return INSTRUCTION


def tensor_tensor_scan(dst, data0, data1, initial, op0, op1, reverse0=False, reverse1=False, name=None):
    """Per partition ``r_i = op1(op0(data0_i, r_{i-1}), data1_i)`` with ``r_{-1} = initial``."""
    c = begin("tensor_tensor_scan")
    a0 = _arith_op(c, op0, "op0")
    a1 = _arith_op(c, op1, "op1")
    pf = onchip(c, data0, "data0")
    same_pf(c, pf, data1, "data1")
    same_pf(c, pf, dst, "dst")
    c.check(not (data0._st.kind == "psum" and data1._st.kind == "psum"), "data1",
            "data0 and data1 may not both be in PSUM")
    x0 = read_f32(c, data0, "data0", pf)
    x1 = read_f32(c, data1, "data1", pf)
    r = np.broadcast_to(scalar_operand(c, initial, pf[0], "initial"), (pf[0], 1)).astype(np.float32)
    out = np.empty_like(x0)
    for i in range(pf[1]):
        r = _apply(a1, _apply(a0, x0[:, i:i + 1], r, reverse0), x1[:, i:i + 1], reverse1)
        out[:, i:i + 1] = r
    write(c, dst, out)
    reads = (data0, data1) + tile_operands(initial)
    _record(c, "vector", reads, (dst,), {"op0": a0.name, "op1": a1.name})
    return INSTRUCTION


def select_reduce(dst, predicate, on_true, on_false, reduce_res=None, reduce_cmd=_reduce_cmd.idle,
                  reduce_op=None, reverse_pred=False, name=None):
    """``dst = where(predicate != 0 (xor reverse_pred), on_true, on_false)``, max-reduced per partition."""
    c = begin("select_reduce")
    pf = onchip(c, on_true, "on_true")
    same_pf(c, pf, predicate, "predicate")
    same_pf(c, pf, dst, "dst")
    c.check(on_true._dtype not in ("tfloat32",) + _NO_32BIT_INT, "on_true",
            f"on_true may not be tfloat32, int32 or uint32, got {on_true._dtype}")
    c.check(predicate._dtype in _PREDICATE_DTYPES, "predicate",
            f"predicate must be one of {', '.join(_PREDICATE_DTYPES)}, got {predicate._dtype}")
    c.check(not (on_true._st.kind == "psum" and predicate._st.kind == "psum"), "predicate",
            "on_true and predicate may not both be in PSUM")
    red = as_op(c, reduce_op if reduce_op is not None else OPS["maximum"], "reduce_op")
    c.check(red.name == "maximum", "reduce_op", "select_reduce only reduces with nl.maximum")
    _reduce_res_shape(c, reduce_res, pf[0])
    if reduce_res is not None:
        c.check(is_float(reduce_res._dtype), "reduce_res", "reduce_res must have a float dtype")
    mask = read_raw(c, predicate, "predicate").reshape(pf) != 0
    if reverse_pred:
        mask = ~mask
    out = np.where(mask, read_f32(c, on_true, "on_true", pf), scalar_operand(c, on_false, pf[0], "on_false"))
    write(c, dst, out)
    accumulate(c, c.vector_acc, reduce_cmd, red, out.max(axis=1), pf[0], reduce_res)
    reads = (predicate, on_true) + tile_operands(on_false)
    _record(c, "vector", reads, (dst,) if reduce_res is None else (dst, reduce_res),
            {"reduce_cmd": reduce_cmd.name})
    return INSTRUCTION


def _moments(x):
    """(count, mean, variance * count) per row of the fp32 array ``x`` (an empty row gives zeros)."""
    count = np.float32(x.shape[1])
    if x.shape[1] == 0:
        zeros = np.zeros((x.shape[0], 1), np.float32)
        return zeros, zeros, zeros
    mean = x.mean(axis=1, keepdims=True, dtype=np.float32)
    m2 = np.square(x - mean).sum(axis=1, keepdims=True, dtype=np.float32)
    return np.full_like(mean, count), mean, m2


def bn_stats(dst, data, name=None):
    """Per partition ``(count, mean, var*count)`` of the even- and then of the odd-indexed elements."""
    c = begin("bn_stats")
    pf = onchip(c, data, "data")
    c.check(pf[1] <= c.spec.bn_stats_fmax, "data",
            f"{pf[1]} elements per partition exceed bn_stats_fmax {c.spec.bn_stats_fmax}")
    c.check(onchip(c, dst, "dst") == (pf[0], 6), "dst", f"dst must hold 6 elements on each of {pf[0]} partitions")
    x = read_f32(c, data, "data", pf)
    write(c, dst, np.concatenate(_moments(x[:, 0::2]) + _moments(x[:, 1::2]), axis=1))
    _record(c, "vector", (data,), (dst,))
    return INSTRUCTION


def bn_aggr(dst, data, name=None):
    """Combine the ``(count, mean, var*count)`` triples of ``data`` into ``(mean, variance)``."""
    c = begin("bn_aggr")
    pf = onchip(c, data, "data")
    c.check(pf[1] % 3 == 0 and pf[1] > 0, "data", f"elements per partition ({pf[1]}) must be a multiple of 3")
    c.check(onchip(c, dst, "dst") == (pf[0], 2), "dst", f"dst must hold 2 elements on each of {pf[0]} partitions")
    triples = read_f32(c, data, "data", pf).reshape(pf[0], -1, 3)
    count, mean, m2 = triples[..., 0], triples[..., 1], triples[..., 2]
    total = count.sum(axis=1, keepdims=True, dtype=np.float32)
    safe_total = np.where(total > 0, total, np.float32(1))
    grand_mean = (count * mean).sum(axis=1, keepdims=True, dtype=np.float32) / safe_total
    spread = (m2 + count * np.square(mean - grand_mean)).sum(axis=1, keepdims=True, dtype=np.float32)
    write(c, dst, np.concatenate([grand_mean, spread / safe_total], axis=1))
    _record(c, "vector", (data,), (dst,))
    return INSTRUCTION


def nc_match_replace8(dst, data, vals, imm, dst_idx=None, name=None):
    """Copy ``data`` to ``dst`` replacing the first occurrence of each of the 8 ``vals`` with ``imm``.

    Duplicated values are matched in reverse slot order (the highest slot gets the first match);
    ``dst_idx`` (uint32/uint16, (P, 8)) receives the matched positions, all-ones when not found.
    """
    c = begin("nc_match_replace8")
    pf = onchip(c, data, "data")
    lo, hi = _MATCH_DATA_RANGE
    c.check(lo <= pf[1] <= hi, "data", f"needs {lo}..{hi} elements per partition, has {pf[1]}")
    same_pf(c, pf, dst, "dst")
    slots = (pf[0], _MATCH_SLOTS)
    c.check(onchip(c, vals, "vals") == slots, "vals", f"vals must be {slots}")
    if dst_idx is not None:
        c.check(onchip(c, dst_idx, "dst_idx") == slots, "dst_idx", f"dst_idx must be {slots}")
        c.check(dst_idx._dtype in _INDEX_DTYPES, "dst_idx", f"dst_idx must be uint32 or uint16, got {dst_idx._dtype}")
    x = read_f32(c, data, "data", pf)
    v = read_f32(c, vals, "vals", slots)
    eq = x[:, None, :] == v[:, :, None]                           # (P, slots, F)
    later_equal = np.zeros(slots, dtype=np.int64)                 # equal vals in higher slots
    for k in range(_MATCH_SLOTS - 1):
        later_equal[:, k] = (v[:, k + 1:] == v[:, k:k + 1]).sum(axis=1)
    target = eq & (np.cumsum(eq, axis=2) == (later_equal + 1)[:, :, None])
    found = target.any(axis=2)
    out = x.copy()
    out[target.any(axis=1)] = np.float32(imm)
    write(c, dst, out)
    writes = (dst,)
    if dst_idx is not None:
        sentinel = np.iinfo(dst_idx._dtype.np).max
        write(c, dst_idx, np.where(found, np.argmax(target, axis=2), sentinel).astype(np.int64), "dst_idx")
        writes = (dst, dst_idx)
    _record(c, "vector", (data, vals), writes)
    return INSTRUCTION


def exponential(dst, src, max_value=0.0, reduce_res=None, reduce_cmd=_reduce_cmd.idle, reduce_init=0.0, name=None):
    """NC-v4 Vector engine ``dst = exp(src - max_value)`` with an optional running row sum."""
    c = begin("exponential")
    c.check(c.spec.gen >= 4, "dst", "exponential needs NC-v4 (trn3)")
    pf = onchip(c, src, "src")
    same_pf(c, pf, dst, "dst")
    _reduce_res_shape(c, reduce_res, pf[0])
    y = np.exp(read_f32(c, src, "src", pf) - scalar_operand(c, max_value, pf[0], "max_value"))
    write(c, dst, y)
    init = scalar_operand(c, reduce_init, pf[0], "reduce_init")
    accumulate(c, c.vector_acc, reduce_cmd, OPS["add"], y.sum(axis=1, dtype=np.float32), pf[0], reduce_res,
               init=None if reduce_cmd != _reduce_cmd.load_reduce else np.asarray(init).reshape(-1))
    reads = (src,) + tile_operands(max_value, reduce_init)
    _record(c, "vector", reads, (dst,) if reduce_res is None else (dst, reduce_res),
            {"func": "exp", "reduce_cmd": reduce_cmd.name})
    return INSTRUCTION


def activate2(dst, op, data, imm0=0.0, imm1=0.0, op0=None, op1=None, relu_param=0.0, reverse0=False,
              reverse1=False, reduce_op=None, reduce_res=None, reduce_cmd=_reduce_cmd.idle, name=None):
    """NC-v4 Scalar engine ``dst = op((x op0 imm0) op1 imm1)``, optionally reduced per partition.

    ``op0``/``op1`` default to ``nl.bypass``; legal pairs: (multiply, add), (multiply, subtract),
    (multiply, bypass), (add, bypass), (subtract, bypass), (bypass, bypass). ``nl.prelu`` uses
    ``relu_param`` as the negative slope. ``reduce_op``: add, maximum, minimum, abs_max, abs_min
    into the Scalar engine registers (reset to the reduce identity).
    """
    c = begin("activate2")
    c.check(c.spec.gen >= 4, "dst", "activate2 needs NC-v4 (trn3)")
    func = as_op(c, op, "op")
    c.check(func.act is not None, "op", f"{func!r} is not an activation function")
    stage0 = _arith_op(c, op0 if op0 is not None else OPS["bypass"], "op0", allow_bypass=True)
    stage1 = _arith_op(c, op1 if op1 is not None else OPS["bypass"], "op1", allow_bypass=True)
    c.check((stage0.name, stage1.name) in _ACTIVATE2_PAIRS, "op1",
            f"(op0, op1) = ({stage0.name}, {stage1.name}) is not a supported pair")
    pf = onchip(c, data, "data")
    same_pf(c, pf, dst, "dst")
    _reduce_res_shape(c, reduce_res, pf[0])
    v = read_f32(c, data, "data", pf)
    for stage, imm, reverse, operand in ((stage0, imm0, reverse0, "imm0"), (stage1, imm1, reverse1, "imm1")):
        if stage.name != "bypass":
            v = _apply(stage, v, scalar_operand(c, imm, pf[0], operand), reverse)
    if func.name == "prelu":
        y = np.where(v >= 0, v, np.float32(relu_param) * v).astype(np.float32)
    else:
        y = func.act(v).astype(np.float32)
    write(c, dst, y)
    if reduce_op is not None:
        red = as_op(c, reduce_op, "reduce_op")
        c.check(red.name in ("add", "maximum", "minimum") + tuple(_ABS_REDUCE_IDENTITY), "reduce_op",
                "reduce_op must be add, maximum, minimum, abs_max or abs_min")
        _reduce_abs_aware(c, red, reduce_cmd, y, pf[0], reduce_res)
    reads = (data,) + tile_operands(imm0, imm1)
    _record(c, "scalar", reads, (dst,) if reduce_res is None else (dst, reduce_res),
            {"func": func.name, "reduce": reduce_op is not None})
    return INSTRUCTION


def _reduce_abs_aware(c, red, cmd, y, p, reduce_res):
    """Scalar-engine register update for activate2 (abs_max/abs_min have no ALU reduce identity)."""
    if red.name not in _ABS_REDUCE_IDENTITY:
        accumulate(c, c.scalar_acc, cmd, red, red.alu.reduce(y, axis=1), p, reduce_res)
        return
    c.check(cmd in (_reduce_cmd.idle, _reduce_cmd.reset, _reduce_cmd.reduce, _reduce_cmd.reset_reduce), "reduce_cmd",
            f"reduce_cmd.{cmd.name} is not supported with {red!r}")
    row = y[:, 0]
    for j in range(1, y.shape[1]):
        row = red.alu(row, y[:, j])
    if cmd in (_reduce_cmd.reset, _reduce_cmd.reset_reduce):
        c.scalar_acc[:p] = _ABS_REDUCE_IDENTITY[red.name]
    if cmd in (_reduce_cmd.reduce, _reduce_cmd.reset_reduce):
        c.scalar_acc[:p] = red.alu(c.scalar_acc[:p], row)
    if reduce_res is not None:
        write(c, reduce_res, c.scalar_acc[:p].copy(), "reduce_res")


def nc_n_gather(dst, data, indices, name=None):
    """GpSimd per-partition gather: ``dst[p, j] = data[p, indices[p, j]]`` (flattened free index)."""
    c = begin("nc_n_gather")
    why = " (GpSimd cannot access PSUM)"
    pf = onchip(c, data, "data", psum=False, why=why)
    ipf = onchip(c, indices, "indices", psum=False, why=why)
    c.check(ipf[0] == pf[0], "indices", f"partition count {ipf[0]} differs from data's {pf[0]}")
    c.check(is_int(indices._dtype) and indices._dtype.startswith("uint"), "indices",
            f"indices must be an unsigned integer tile, got {indices._dtype}")
    same_pf(c, ipf, dst, "dst", psum=False, why=why)
    c.check(dst._dtype == data._dtype, "dst", f"dst dtype {dst._dtype} differs from data's {data._dtype}")
    idx = np.asarray(read_raw(c, indices, "indices")).reshape(ipf).astype(np.int64)
    c.check(bool((idx < pf[1]).all()), "indices", f"an index is out of range for {pf[1]} elements per partition")
    values = np.asarray(read_raw(c, data, "data")).reshape(pf)
    dst._scatter(np.take_along_axis(values, idx, axis=1), c.opcode, "dst")
    _record(c, "gpsimd", (data, indices), (dst,))
    return INSTRUCTION


# ---------------------------------------------------------------------------------------------
# MX (microscaling) formats, NC-v4 only

_MX_ELEMENT = {"float8_e5m2_x4": np.dtype(ml_dtypes.float8_e5m2), "float8_e4m3fn_x4": np.dtype(ml_dtypes.float8_e4m3fn),
               "float4_e2m1fn_x4": np.dtype(ml_dtypes.float4_e2m1fn)}
_MX_QUANT_EMAX = {"float8_e4m3fn_x4": 8, "float8_e5m2_x4": 15}   # largest normal exponent of the element type
_MX_PACK = 4                 # elements per packed x4 container (also the free extent of a scale group)
_MX_GROUP_PARTITIONS = 8     # partitions of a scale group
_QUADRANT = 32               # partitions per quadrant
_SCALE_ROWS_PER_QUADRANT = 4
_E8M0_BIAS = 127
_SCALE_DTYPES = ("float8_e8m0fnu", "uint8")
_FP4_BITS = 4


def _scale_rows(groups: int) -> np.ndarray:
    """Scale-view partition of each group row (4 rows at the start of every 32-partition quadrant)."""
    g = np.arange(groups)
    return (g // _SCALE_ROWS_PER_QUADRANT) * _QUADRANT + g % _SCALE_ROWS_PER_QUADRANT


def _check_scale(c, scale, operand, groups, per_partition):
    spf = onchip(c, scale, operand, psum=False, why=" (MX scales live in SBUF)")
    c.check(scale._dtype in _SCALE_DTYPES, operand, f"scales must be float8_e8m0fnu or uint8, got {scale._dtype}")
    need = int(_scale_rows(groups)[-1]) + 1
    c.check(spf[0] >= need, operand, f"{groups} scale rows need {need} partitions in the quadrant layout, have {spf[0]}")
    c.check(spf[1] == per_partition, operand, f"scales need {per_partition} elements per partition, have {spf[1]}")
    return spf


def _unpack(c, t, operand, pf) -> np.ndarray:
    """(P, F) packed container -> (P, F, 4) fp32 element values (little-endian lanes)."""
    raw = np.ascontiguousarray(read_raw(c, t, operand)).reshape(pf)
    element = _MX_ELEMENT[t._dtype]
    if t._dtype == "float4_e2m1fn_x4":
        shifts = np.arange(_MX_PACK, dtype=np.uint16) * _FP4_BITS
        nibbles = ((raw[..., None] >> shifts) & np.uint16(0xF)).astype(np.uint8)
        return nibbles.view(element).astype(np.float32)
    return raw.view(np.uint8).reshape(*pf, _MX_PACK).view(element).astype(np.float32)


def quantize_mx(dst, src, dst_scale, name=None):
    """Quantize bf16/fp16 ``src`` (P, F) to MX fp8 ``dst`` (P, F/4, x4 packed) with e8m0 ``dst_scale``.

    One scale per group of 8 partitions x 4 consecutive free elements: ``X = 2**(floor(log2 amax)
    - (Emax - 1))`` (an all-zero group gets 2**-127); data ``cast(v / X)`` saturated to the element
    type's largest finite value. Packed element ``dst[p, j]`` holds ``src[p, 4j .. 4j+3]``.
    """
    c = begin("quantize_mx")
    c.check(c.spec.gen >= 4, "dst", "quantize_mx needs NC-v4 (trn3)")
    pf = onchip(c, src, "src", psum=False, why=" (quantize_mx operands live in SBUF)")
    c.check(src._dtype in ("bfloat16", "float16"), "src", f"src must be bfloat16 or float16, got {src._dtype}")
    c.check(pf[0] % _QUADRANT == 0, "src", f"partition count {pf[0]} must be a multiple of {_QUADRANT}")
    c.check(pf[1] % _MX_PACK == 0, "src", f"elements per partition ({pf[1]}) must be a multiple of {_MX_PACK}")
    packed = (pf[0], pf[1] // _MX_PACK)
    c.check(onchip(c, dst, "dst", psum=False, why=" (quantize_mx operands live in SBUF)") == packed, "dst",
            f"dst must hold {packed[1]} packed elements on each of {packed[0]} partitions")
    c.check(dst._dtype in _MX_QUANT_EMAX, "dst", f"dst must be float8_e5m2_x4 or float8_e4m3fn_x4, got {dst._dtype}")
    groups = pf[0] // _MX_GROUP_PARTITIONS
    _check_scale(c, dst_scale, "dst_scale", groups, packed[1])
    x = read_f32(c, src, "src", pf).reshape(groups, _MX_GROUP_PARTITIONS, packed[1], _MX_PACK)
    amax = np.abs(x).max(axis=(1, 3))                                        # (G, F/4)
    with np.errstate(divide="ignore"):
        exponent = np.floor(np.log2(amax)) - (_MX_QUANT_EMAX[dst._dtype] - 1)
    exponent = np.where(amax > 0, exponent, -_E8M0_BIAS)
    exponent = np.clip(exponent, -_E8M0_BIAS, _E8M0_BIAS).astype(np.int64)
    element = _MX_ELEMENT[dst._dtype]
    limit = np.float32(ml_dtypes.finfo(element).max)
    scaled = x / np.exp2(exponent[:, None, :, None]).astype(np.float32)
    q = np.clip(scaled, -limit, limit).astype(element)                       # NaN stays NaN
    dst._scatter(q.view(np.uint8).reshape(*packed, _MX_PACK).view("<u4").reshape(packed), c.opcode, "dst")
    spf = onchip(c, dst_scale, "dst_scale")
    scales = np.array(read_raw(c, dst_scale, "dst_scale")).reshape(spf)
    scales[_scale_rows(groups)] = (exponent + _E8M0_BIAS).astype(np.uint8).view(scales.dtype)
    dst_scale._scatter(scales, c.opcode, "dst_scale")
    _record(c, "vector", (src,), (dst, dst_scale))
    return INSTRUCTION


def _dequantized(c, t, scale, operand):
    """(4K, free) fp32 values of a packed MX operand, scales applied, contraction-major."""
    pf = onchip(c, t, operand, psum=False, why=" (TensorE reads SBUF)")
    c.check(t._dtype in _MX_ELEMENT, operand, f"{operand} must be an x4 packed MX dtype, got {t._dtype}")
    groups = pf[0] // _MX_GROUP_PARTITIONS
    spf = _check_scale(c, scale, operand + "_scale", groups, pf[1])
    biased = np.array(read_raw(c, scale, operand + "_scale")).reshape(spf).view(np.uint8)[_scale_rows(groups)]
    factor = np.exp2(biased.astype(np.float32) - _E8M0_BIAS)                  # (K/8, free)
    values = _unpack(c, t, operand, pf) * np.repeat(factor, _MX_GROUP_PARTITIONS, axis=0)[..., None]
    return values.transpose(0, 2, 1).reshape(pf[0] * _MX_PACK, pf[1])


def nc_matmul_mx(dst, stationary, moving, stationary_scale, moving_scale, tile_position=None, tile_size=None,
                 accumulate=None, name=None):
    """MX matmul (NC-v4): ``dst (M, N) [+]= sum_{k, q} S[k, m, q] * V[k, n, q]`` of the dequantized
    x4 operands ``stationary (K, M)`` and ``moving (K, N)``; accumulate rules as ``nc_matmul`` (§8.8).
    """
    c = begin("nc_matmul_mx")
    c.check(c.spec.gen >= 4, "dst", "nc_matmul_mx needs NC-v4 (trn3)")
    c.check(accumulate in (None, True, False), "accumulate", "accumulate must be None, True or False")
    k, m = onchip(c, stationary, "stationary", psum=False, why=" (TensorE reads SBUF)")
    km, n = onchip(c, moving, "moving", psum=False, why=" (TensorE reads SBUF)")
    c.check(k == km, "moving", f"contraction (partition) sizes differ: stationary {k}, moving {km}")
    c.check(k % _QUADRANT == 0, "stationary", f"contraction {k} must be a multiple of {_QUADRANT}")
    c.check(m % 2 == 0 and m <= c.spec.gemm_stationary_fmax, "stationary",
            f"stationary free size {m} must be even and at most {c.spec.gemm_stationary_fmax}")
    if tile_size:
        c.check(tuple(tile_size)[1] == c.spec.pmax and k <= tuple(tile_size)[0], "tile_size",
                f"nc_matmul_mx supports row tiling only: column size {c.spec.pmax}, row size >= {k}")
    if tile_position:
        c.check(tuple(tile_position)[1] == 0, "tile_position", "nc_matmul_mx column tiles must start at 0")
    dpf = _psum_dst(c, dst, n, False)
    c.check(dpf == (m, n), "dst", f"dst must be ({m}, {n}) (M partitions x N elements), got {dst._shape}")
    s = _dequantized(c, stationary, stationary_scale, "stationary")
    v = _dequantized(c, moving, moving_scale, "moving")
    accumulated = _psum_write(c, dst, np.matmul(s.T, v), accumulate, dpf)
    c.record("tensor", (stationary, moving, stationary_scale, moving_scale), (dst,), (m, n), dst._dtype, m * n,
             m * n * dst.itemsize, {"K": _MX_PACK * k, "M": m, "N": n, "accumulate": accumulated,
                                    "is_transpose": False, "mx": True})
    return INSTRUCTION
