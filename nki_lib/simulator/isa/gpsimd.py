"""GpSimd-engine (POOL) instructions (docs/nki-semantics.md §8.13, 8.20, 8.25, 8.26, 8.28). SBUF operands only.

``iota``/``affine_select`` evaluate ``offset + c * channel_multiplier + sum(idx_i * step_i)`` in
int32 for partition ``c`` (relative to the operand's first partition) and free multi-index ``idx``
row-major over ``pattern = [[step, num], ...]``.
"""

from __future__ import annotations

import numpy as np

from ..dtypes import cast_to
from ..hw import GPSIMD_CORE_PARTITIONS, LOCAL_GATHER_ELEMS
from ..ops import OPS
from ..tensor import NkiTensor
from ._common import INSTRUCTION, as_op, begin, onchip, read_f32, read_raw, same_pf, write

__all__ = ["iota", "affine_select", "tensor_partition_reduce", "nonzero_with_count", "local_gather"]

_WHY = " (GpSimd cannot access PSUM)"


def _affine(c, pattern, offset, channel_multiplier, p, f):
    c.check(isinstance(pattern, (list, tuple)) and 1 <= len(pattern) <= 4, "pattern",
            "pattern must be 1..4 [step, num] pairs")
    steps, nums = [], []
    for pair in pattern:
        c.check(isinstance(pair, (list, tuple)) and len(pair) == 2, "pattern", f"bad pattern entry {pair!r}")
        steps.append(int(pair[0]))
        nums.append(int(pair[1]))
    covered = int(np.prod(nums))
    c.check(covered == f, "pattern", f"pattern covers {covered} elements, dst has {f} per partition")
    vals = np.full((p,) + tuple(nums), int(offset), dtype=np.int64)
    vals += (np.arange(p, dtype=np.int64) * int(channel_multiplier)).reshape((p,) + (1,) * len(nums))
    for d, (s, n) in enumerate(zip(steps, nums)):
        shape = [1] * (len(nums) + 1)
        shape[d + 1] = n
        vals += (np.arange(n, dtype=np.int64) * s).reshape(shape)
    return vals.reshape(p, f).astype(np.int32)


def iota(dst, pattern, offset=0, channel_multiplier=0, name=None):
    """``dst[c, idx] = offset + c * channel_multiplier + sum(idx_i * step_i)`` (int32, cast to dst)."""
    c = begin("iota")
    p, f = onchip(c, dst, "dst", psum=False, why=_WHY)
    write(c, dst, _affine(c, pattern, offset, channel_multiplier, p, f))
    c.record("gpsimd", (), (dst,), dst._shape, dst._dtype, dst.size, dst.size * dst.itemsize)
    return INSTRUCTION


def affine_select(dst, pattern, channel_multiplier, on_true_tile, on_false_value, cmp_op=None, offset=0, name=None):
    """``dst = on_true_tile where cmp_op(affine value, 0) else on_false_value``."""
    c = begin("affine_select")
    pf = onchip(c, dst, "dst", psum=False, why=_WHY)
    same_pf(c, pf, on_true_tile, "on_true_tile", psum=False, why=_WHY)
    cmp = as_op(c, cmp_op if cmp_op is not None else OPS["equal"], "cmp_op")
    c.check(cmp.alu is not None and not cmp.bitvec, "cmp_op", f"{cmp!r} is not a comparison operator")
    c.check(not isinstance(on_false_value, NkiTensor), "on_false_value", "on_false_value must be a scalar")
    v = _affine(c, pattern, offset, channel_multiplier, *pf).astype(np.float32)
    keep = cmp.alu(v, np.float32(0)) != 0
    if on_true_tile._dtype == dst._dtype:
        x = np.array(read_raw(c, on_true_tile, "on_true_tile")).reshape(pf)
        out = np.where(keep, x, cast_to(np.float32(on_false_value), dst._dtype))
        dst._scatter(out, c.opcode, "dst")
    else:
        x = read_f32(c, on_true_tile, "on_true_tile", pf)
        write(c, dst, np.where(keep, x, np.float32(on_false_value)))
    c.record("gpsimd", (on_true_tile,), (dst,), dst._shape, dst._dtype, dst.size, dst.size * dst.itemsize,
             {"cmp_op": cmp.name})
    return INSTRUCTION


_PREDUCE = ("add", "average", "maximum", "minimum", "bitwise_or", "bitwise_and")


def tensor_partition_reduce(dst, op, data, name=None):
    """Reduce across partitions: ``dst[0, ...] = op over p of data[p, ...]``."""
    c = begin("tensor_partition_reduce")
    red = as_op(c, op, "op")
    c.check(red.name in _PREDUCE, "op", f"op must be one of {', '.join(_PREDUCE)}")
    p, f = onchip(c, data, "data", psum=False, why=_WHY)
    dpf = onchip(c, dst, "dst", psum=False, why=_WHY)
    c.check(dpf == (1, f), "dst", f"dst must have 1 partition and {f} elements")
    if red.bitvec:
        x = np.asarray(read_raw(c, data, "data")).reshape(p, f).astype(np.int64)
        out = red.alu.reduce(x, axis=0, keepdims=True)
    else:
        x = read_f32(c, data, "data", (p, f))
        out = x.mean(axis=0, keepdims=True, dtype=np.float32) if red.name == "average" \
            else red.alu.reduce(x, axis=0, keepdims=True)
    write(c, dst, out)
    c.record("gpsimd", (data,), (dst,), dst._shape, dst._dtype, dst.size, dst.size * dst.itemsize, {"op": red.name})
    return INSTRUCTION


def nonzero_with_count(dst, src, index_offset=0, padding_val=-1, name=None):
    """On partitions 0, 16, ..., 112: indices of nonzero elements (+offset), padding, then the count."""
    c = begin("nonzero_with_count")
    c.check(c.spec.gen >= 3, "dst", "nonzero_with_count needs NC-v3+")
    p, t = onchip(c, src, "src", psum=False, why=_WHY)
    dpf = onchip(c, dst, "dst", psum=False, why=_WHY)
    c.check(src._dtype in ("float32", "int32"), "src", "src must be float32 or int32")
    c.check(dst._dtype == "int32", "dst", "dst must be int32")
    c.check(dpf == (p, t + 1), "dst", f"dst must be ({p}, {t + 1})")
    x = np.asarray(read_raw(c, src, "src")).reshape(p, t)
    out = np.array(read_raw(c, dst, "dst")).reshape(dpf)
    for row in range(0, p, GPSIMD_CORE_PARTITIONS):
        nz = np.nonzero(x[row])[0]
        out[row, :] = int(padding_val)
        out[row, :len(nz)] = nz + int(index_offset)
        out[row, t] = len(nz)
    dst._scatter(out, c.opcode, "dst")
    c.record("gpsimd", (src,), (dst,), dst._shape, dst._dtype, dst.size, dst.size * dst.itemsize)
    return INSTRUCTION


def local_gather(dst, src_buffer, index, num_elem_per_idx=1, num_valid_indices=None, name=None):
    """Per 16-partition group: gather ``num_elem_per_idx`` elements at each shared index (docs/nki-semantics.md §8.28)."""
    c = begin("local_gather")
    p, f = onchip(c, src_buffer, "src_buffer", psum=False, why=_WHY)
    ip, _ = onchip(c, index, "index", psum=False, why=_WHY)
    dp, df = onchip(c, dst, "dst", psum=False, why=_WHY)
    c.check(index._dtype == "uint16", "index", "index must be uint16")
    c.check(ip == p and p % GPSIMD_CORE_PARTITIONS == 0, "index",
            f"src_buffer and index need the same partition count, a multiple of {GPSIMD_CORE_PARTITIONS}")
    c.check(dp == p, "dst", f"dst must have {p} partitions")
    c.check(dst._dtype == src_buffer._dtype, "dst", "local_gather does not change dtype")
    e = int(num_elem_per_idx)
    c.check(e in LOCAL_GATHER_ELEMS, "num_elem_per_idx", f"must be one of {LOCAL_GATHER_ELEMS}")
    x = np.asarray(read_raw(c, src_buffer, "src_buffer")).reshape(p, f)
    idx_all = np.asarray(read_raw(c, index, "index")).reshape(p, -1)
    out = np.array(read_raw(c, dst, "dst")).reshape(dp, df)
    group = GPSIMD_CORE_PARTITIONS
    for g in range(p // group):
        rows = slice(g * group, (g + 1) * group)
        idx = idx_all[rows].reshape(-1, order="F").astype(np.int64)
        v = len(idx) if num_valid_indices is None else int(num_valid_indices)
        idx = idx[:v]
        c.check(v * e <= df, "dst", f"dst holds {df} elements per partition, gather writes {v * e}")
        cols = (idx[:, None] + np.arange(e)[None, :]).reshape(-1)
        c.check(cols.size == 0 or (cols.min() >= 0 and cols.max() < f), "index", "gather index out of range")
        out[rows, :v * e] = x[rows][:, cols]
    dst._scatter(out, c.opcode, "dst")
    c.record("gpsimd", (src_buffer, index), (dst,), dst._shape, dst._dtype, dst.size, dst.size * dst.itemsize)
    return INSTRUCTION
