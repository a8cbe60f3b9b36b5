"""View methods of ``NkiTensor`` that re-shape metadata only (docs/nki-semantics.md §4.1): dtype views, reshape,
slice/select, permute, broadcast, expand/squeeze, split/merge dims and einops-style rearrange.

All return a new view on the same storage; on-chip views keep the partition dim first.
"""

from __future__ import annotations

import math

import numpy as np

from .dtypes import as_dtype
from .errors import fail as _fail
from .registers import VirtualRegister

__all__ = ["ViewMethods", "compact_strides"]


class ViewMethods:
    """Mixin for ``NkiTensor`` (uses its ``_derive``, ``_static``, ``_shape``, ``_strides``, ``_offset``)."""

    __slots__ = ()

    def view(self, dtype):
        op = "view"
        self._static(op)
        new_dt = as_dtype(dtype, "dtype")
        old, new = self._dtype.itemsize, new_dt.itemsize
        if old == new:
            return self._derive(self._offset, self._shape, self._strides, op, new_dt)
        if self._strides[-1] != 1 and self._shape[-1] != 1:
            _fail(op, self._name, "view(dtype) needs a contiguous last dim")
        shape, strides = list(self._shape), list(self._strides)
        if new > old:
            r = new // old
            if new % old or shape[-1] % r or self._offset % r or any(s % r for s in strides[:-1]):
                _fail(op, self._name, f"cannot view {self._dtype} as {new_dt}: last dim, strides and offset "
                                      f"must be divisible by {r}")
            shape[-1] //= r
            strides = [s // r for s in strides[:-1]] + [1]
            offset = self._offset // r
        else:
            r = old // new
            shape[-1] *= r
            strides = [s * r for s in strides[:-1]] + [1]
            offset = self._offset * r
        return self._derive(offset, shape, strides, op, new_dt)

    reinterpret_cast = view

    def reshape(self, shape):
        op = "reshape"
        self._static(op)
        shape = list(shape) if isinstance(shape, (list, tuple)) else [shape]
        shape = [int(c) for c in shape]
        if shape.count(-1) > 1:
            _fail(op, self._name, "at most one -1 in a reshape")
        if -1 in shape:
            known = int(np.prod([c for c in shape if c != -1], dtype=np.int64))
            shape[shape.index(-1)] = self.size // max(known, 1)
        if int(np.prod(shape, dtype=np.int64)) != self.size:
            _fail(op, self._name, f"cannot reshape {self._shape} to {tuple(shape)}: element counts differ")
        if self._onchip:
            if shape[0] != self._shape[0]:
                _fail(op, self._name, "on-chip reshape must keep the partition dim")
            if not self.is_contiguous():
                _fail(op, self._name, "reshape needs contiguous free dims")
            strides = [self._strides[0]] + compact_strides(shape[1:])
        else:
            if not self.is_contiguous():
                _fail(op, self._name, "reshape needs a contiguous view")
            strides = compact_strides(shape)
        return self._derive(self._offset, shape, strides, op)

    def slice(self, dim, start, end, step=1):
        if not 0 <= start < end <= self._shape[dim]:
            _fail("slice", self._name, f"slice [{start}:{end}] out of range for dim {dim} of size {self._shape[dim]}")
        key = [slice(None)] * len(self._shape)
        key[dim] = slice(start, end, step)
        return self[tuple(key)]

    def select(self, dim, index):
        if isinstance(index, (type(self), VirtualRegister)):
            return self._select_dynamic(dim, index)
        pattern = self.get_pattern()
        shape = [c for i, (s, c) in enumerate(pattern) if i != dim]
        strides = [s for i, (s, c) in enumerate(pattern) if i != dim]
        if not 0 <= index < self._shape[dim]:
            _fail("select", self._name, f"index {index} out of range for dim {dim}")
        offset = self._offset + index * self._strides[dim]
        if self._onchip and dim == 0:
            _fail("select", self._name, "cannot select on the partition dim of an on-chip tensor")
        if self._onchip and len(shape) < 2:
            shape, strides = shape + [1], strides + [1]
        return self._derive(offset, shape, strides, "select")

    def _select_dynamic(self, dim, index):
        pattern = [p for i, p in enumerate(self.get_pattern()) if i != dim]
        if self._onchip and len(pattern) < 2:
            pattern.append([1, 1])
        mult = self._strides[dim]
        return type(self)(self._st, self._dtype, self._offset, [c for _, c in pattern], [s for s, _ in pattern],
                         ("scalar", index, mult, self._shape[dim]), self._name, "select")

    def permute(self, dims):
        dims = [int(d) for d in dims]
        if sorted(dims) != list(range(len(self._shape))):
            _fail("permute", self._name, f"dims {dims} is not a permutation")
        if self._onchip and dims[0] != 0:
            _fail("permute", self._name, "on-chip permute must keep the partition dim first")
        return self._derive(self._offset, [self._shape[d] for d in dims], [self._strides[d] for d in dims], "permute")

    def broadcast(self, dim, size):
        if self._shape[dim] != 1:
            _fail("broadcast", self._name, f"dim {dim} must have size 1 to broadcast")
        if self._onchip and dim == 0:
            _fail("broadcast", self._name, "cannot broadcast the partition dim of an on-chip tensor")
        shape, strides = list(self._shape), list(self._strides)
        shape[dim], strides[dim] = int(size), 0
        return self._derive(self._offset, shape, strides, "broadcast")

    def expand_dim(self, dim):
        if self._onchip and dim == 0:
            _fail("expand_dim", self._name, "cannot insert a dim before the partition dim")
        shape, strides = list(self._shape), list(self._strides)
        shape.insert(dim, 1)
        strides.insert(dim, 1)
        return self._derive(self._offset, shape, strides, "expand_dim")

    def squeeze_dim(self, dim):
        if self._shape[dim] != 1:
            _fail("squeeze_dim", self._name, f"dim {dim} has size {self._shape[dim]}, not 1")
        if self._onchip and (dim == 0 or len(self._shape) <= 2):
            _fail("squeeze_dim", self._name, "on-chip tensors keep the partition dim and one free dim")
        shape, strides = list(self._shape), list(self._strides)
        del shape[dim], strides[dim]
        return self._derive(self._offset, shape, strides, "squeeze_dim")

    def reshape_dim(self, dim, shape):
        shape = [int(c) for c in shape]
        if -1 in shape:
            known = int(np.prod([c for c in shape if c != -1]))
            shape[shape.index(-1)] = self._shape[dim] // known
        if int(np.prod(shape)) != self._shape[dim]:
            _fail("reshape_dim", self._name, f"cannot split dim {dim} of size {self._shape[dim]} into {shape}")
        if self._onchip and dim == 0 and len(shape) > 1:
            _fail("reshape_dim", self._name, "cannot split the partition dim of an on-chip tensor")
        s = self._strides[dim]
        new_strides = [s * int(np.prod(shape[i + 1:])) for i in range(len(shape))]
        return self._derive(self._offset, list(self._shape[:dim]) + shape + list(self._shape[dim + 1:]),
                            list(self._strides[:dim]) + new_strides + list(self._strides[dim + 1:]), "reshape_dim")

    def flatten_dims(self, start_dim, end_dim):
        if self._onchip and start_dim == 0:
            _fail("flatten_dims", self._name, "cannot merge the partition dim of an on-chip tensor")
        for d in range(start_dim, end_dim):
            if self._strides[d] != self._strides[d + 1] * self._shape[d + 1]:
                _fail("flatten_dims", self._name, f"dims {start_dim}..{end_dim} are not contiguous")
        count = int(np.prod(self._shape[start_dim:end_dim + 1]))
        return self._derive(self._offset, list(self._shape[:start_dim]) + [count] + list(self._shape[end_dim + 1:]),
                            list(self._strides[:start_dim]) + [self._strides[end_dim]]
                            + list(self._strides[end_dim + 1:]),
                            "flatten_dims")

    def rearrange(self, src_pattern, dst_pattern, fixed_sizes=None):
        """einops-style view: ``(('b', ('h', 'w')), ('b', 'w', 'h'), {'h': 4})`` splits, permutes, merges."""
        op = "rearrange"
        self._static(op)
        fixed = dict(fixed_sizes or {})
        if len(src_pattern) != len(self._shape):
            _fail(op, "src_pattern", f"{len(src_pattern)} entries for a {len(self._shape)}-d tensor")
        sizes, strides, order = {}, {}, []
        for dim, entry in enumerate(src_pattern):
            names = list(entry) if isinstance(entry, (tuple, list)) else [entry]
            unknown = [n for n in names if n not in fixed]
            known = math.prod(fixed[n] for n in names if n in fixed)
            if len(unknown) > 1 or self._shape[dim] % known:
                _fail(op, "fixed_sizes", f"cannot split dim {dim} of size {self._shape[dim]} into {names}")
            step = self._strides[dim]
            for name in reversed(names):
                size = fixed.get(name, self._shape[dim] // known)
                sizes[name], strides[name] = size, step
                step *= size
            order.extend(names)
        out_shape, out_strides = [], []
        for entry in dst_pattern:
            names = list(entry) if isinstance(entry, (tuple, list)) else [entry]
            for a, b in zip(names, names[1:]):
                if strides[a] != strides[b] * sizes[b]:
                    _fail(op, "dst_pattern", f"cannot merge non-contiguous dims {names}")
            out_shape.append(math.prod(sizes[n] for n in names))
            out_strides.append(strides[names[-1]])
        if sorted(n for e in dst_pattern for n in (e if isinstance(e, (tuple, list)) else [e])) != sorted(order):
            _fail(op, "dst_pattern", "dst_pattern must use every name of src_pattern exactly once")
        if self._onchip and out_strides[0] != self._strides[0]:
            _fail(op, "dst_pattern", "on-chip rearrange must keep the partition dim first")
        return self._derive(self._offset, out_shape, out_strides, op)


def compact_strides(shape):
    strides, acc = [], 1
    for c in reversed(shape):
        strides.append(acc)
        acc *= c
    return list(reversed(strides))
