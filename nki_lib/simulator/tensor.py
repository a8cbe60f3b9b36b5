"""``NkiTensor``: a view (dtype, element offset, [stride, count] pattern) onto one ``Storage``.

Element ``(i0, ..., ik)`` of a view is flat storage element ``offset + sum(strides[d] * i_d)`` in
units of the view's dtype. On-chip views: dim 0 is the partition dim and its stride equals the
storage's elements per partition; the free dims must stay inside one partition. A view's shape
and partition stride are validated when it is built; whether it stays inside its allocation is
checked when an instruction first touches it (a kernel may build ``.ap()`` views for tiles it then
skips), for dynamic ``scalar_offset`` / ``vector_offset`` views at every execution. A stride-0
(broadcast) destination dim is written in order, so the last element along it wins. Indexing follows docs/nki-semantics.md §4.2, ``.ap()`` §4.4 (not composable; explicit
``offset`` is absolute from the storage start, ``None`` inherits the view's offset).
"""

from __future__ import annotations

import math

import numpy as np

from .dtypes import NkiDType, as_dtype, is_int
from .errors import NKIRuleError
from .errors import fail as _fail
from .hw import MAX_FREE_DIMS
from .memory import KIND_TO_REGION, ONCHIP, MemoryRegion, Storage
from .registers import VirtualRegister
from .state import current_or_none
from .trace import Access
from .trace_tensor import identity, zeros  # noqa: F401 - `nki.tensor` trace-time constants
from .views import ViewMethods, compact_strides

__all__ = ["NkiTensor", "MemoryRegion", "VirtualRegister", "dynamic_value"]


_MAX_AP_DIMS = MAX_FREE_DIMS + 1    # partition + free dims of one access pattern
_compact = compact_strides


def dynamic_value(src, op="ap", operand="scalar_offset") -> int:
    """Runtime integer of a register or a one-element integer tensor."""
    if isinstance(src, VirtualRegister):
        if src.value is None:
            _fail(op, operand, "register read before it was written")
        return src.value
    if isinstance(src, NkiTensor):
        vals, _ = src._gather()
        return int(vals.reshape(-1)[0])
    return int(src)


class NkiTensor(ViewMethods):
    """A tensor view. Shape, strides, offset and dtype are compile-time metadata."""

    __slots__ = ("_st", "_dtype", "_offset", "_shape", "_strides", "_dyn", "_npv", "_acc", "_name", "_size",
                 "_unchecked")

    def __init__(self, storage: Storage, dtype: NkiDType, offset: int, shape, strides, dyn=None,
                 name=None, op="view", defer_bounds=False):
        self._st = storage
        self._dtype = dtype
        self._offset = int(offset)
        self._shape = tuple(int(c) for c in shape)
        self._strides = tuple(int(s) for s in strides)
        self._dyn = dyn
        self._npv = None
        self._acc = None
        self._name = (storage.name if name is None else name) or f"{storage.kind}_tensor"
        self._size = math.prod(self._shape)
        for c in self._shape:
            if c < 1:
                _fail(op, self._name, f"view dims must be positive, got shape {self._shape}")
        if storage.kind in ONCHIP:
            if len(self._shape) < 2:
                _fail(op, self._name, "on-chip tensors need a partition dim and at least one free dim")
            fd = storage.partition_elems(dtype)
            if self._shape[0] > 1 and self._strides[0] != fd:
                _fail(op, self._name, f"partition stride must equal the elements per partition ({fd}), "
                                      f"got {self._strides[0]}")
        self._unchecked = dyn is None and defer_bounds
        if dyn is None and not defer_bounds:
            self._check_bounds(self._offset, op)

    # ----------------------------------------------------------------- metadata
    @property
    def shape(self):
        return self._shape

    @property
    def strides(self):
        return self._strides

    @property
    def offset(self):
        return self._offset

    @property
    def dtype(self):
        return self._dtype

    @property
    def buffer(self):
        return KIND_TO_REGION[self._st.kind]

    @property
    def name(self):
        return self._name

    @property
    def ndim(self):
        return len(self._shape)

    @property
    def size(self):
        return self._size

    @property
    def itemsize(self):
        return self._dtype.itemsize

    def __len__(self):
        return self._shape[0]

    def __repr__(self):
        return f"NkiTensor(name={self._name!r}, shape={self._shape}, dtype={self._dtype}, buffer={self._st.kind})"

    # tensor values are not available to Python on hardware (docs/nki-semantics.md §2.5); the tile object itself
    # is a trace-time value and is truthy (`if tile:`), as in NKI's front end
    def _no_value(self, *_):
        raise TypeError(f"tensor {self._name!r}: tensor contents are not available to Python code in a "
                        "kernel (runtime values only exist on the device)")

    __int__ = __float__ = __index__ = __array__ = __iter__ = _no_value

    def __bool__(self):
        return True

    # ----------------------------------------------------------------- geometry helpers
    @property
    def _onchip(self):
        return self._st.kind in ONCHIP

    def _extent(self, offset):
        lo = hi = 0
        start = 1 if self._onchip else 0
        for s, c in zip(self._strides[start:], self._shape[start:]):
            span = s * (c - 1)
            if span < 0:
                lo += span
            else:
                hi += span
        return lo, hi

    def _check_bounds(self, offset, op, operand=None):
        st = self._st
        lo, hi = self._extent(offset)
        if self._onchip:
            fd = st.partition_elems(self._dtype)
            p0, f0 = divmod(offset, fd) if offset >= 0 else (-1, 0)
            if p0 < 0 or f0 + lo < 0 or f0 + hi >= fd:
                _fail(op, operand or self._name, f"access pattern leaves the partition "
                                                 f"(free range [{f0 + lo}, {f0 + hi}] of {fd} elements)")
            if p0 + self._shape[0] > st.nparts:
                _fail(op, operand or self._name, f"partitions [{p0}, {p0 + self._shape[0]}) exceed the "
                                                 f"allocation's {st.nparts}")
        else:
            n = st.elements(self._dtype)
            if offset + lo < 0 or offset + hi >= n:
                _fail(op, operand or self._name, f"access pattern out of bounds (elements "
                                                 f"[{offset + lo}, {offset + hi}] of {n})")

    def _layout(self, offset):
        """(byte offset, byte strides) of this view in its storage's buffer."""
        st = self._st
        isz = self._dtype.itemsize
        if st.base == 0 and st.row_bytes == st.bpp:
            return offset * isz, tuple(s * isz for s in self._strides)
        p0, f0 = divmod(offset, st.bpp // isz)         # physical window: rows are row_bytes apart
        return (st.base + p0 * st.row_bytes + f0 * isz,
                (st.row_bytes,) + tuple(s * isz for s in self._strides[1:]))

    def _touch(self, op=None, operand=None):
        """Check a deferred view's bounds once, when an instruction first touches it."""
        if self._unchecked:
            if op is None:
                prog = current_or_none()
                op = prog.opcode if prog is not None else "view"
            self._check_bounds(self._offset, op, operand)
            self._unchecked = False

    def _strided(self, offset):
        byte_off, byte_strides = self._layout(offset)
        return np.ndarray(self._shape, dtype=self._dtype.np, buffer=self._st.buf, offset=byte_off,
                          strides=byte_strides)

    def _np(self):
        """Static NumPy view of this tensor (cached)."""
        view = self._npv
        if view is None:
            self._touch()
            view = self._npv = self._strided(self._offset)
        return view

    def _resolve(self, op, operand, skip):
        """(kind, payload, row_mask): 'view' -> ndarray view; 'index' -> flat element index array."""
        kind = self._dyn[0]
        if kind == "scalar":
            _, src, mult, limit = self._dyn
            value = dynamic_value(src, op, operand)
            off = self._offset + value * mult
            ok = 0 <= value < limit
            if ok:
                try:
                    self._check_bounds(off, op, operand)
                except NKIRuleError:
                    ok = False
            if not ok:
                if skip:
                    return "skip", None, None
                _fail(op, operand, f"dynamic offset {value} out of bounds (oob_mode.error)")
            return "view", self._strided(off), None
        _, idx_t, mult, limit = self._dyn
        idx_vals, _ = idx_t._gather()
        idx = np.asarray(idx_vals).T.reshape(-1)[: self._shape[0]].astype(np.int64)
        rows = self._shape[0]
        grids = np.ix_(*[np.arange(c, dtype=np.int64) * s for s, c in zip(self._strides[1:], self._shape[1:])]) \
            if len(self._shape) > 1 else ()
        flat = (self._offset + idx * mult).reshape((rows,) + (1,) * (len(self._shape) - 1))
        for g in grids:
            flat = flat + g[np.newaxis]
        n = self._st.elements(self._dtype)
        axes = tuple(range(1, flat.ndim))
        bad = (idx < 0) | (idx >= limit)
        if axes:
            bad |= ((flat < 0) | (flat >= n)).any(axis=axes)
        else:
            bad |= (flat < 0) | (flat >= n)
        if bad.any():
            if not skip:
                _fail(op, operand, f"vector_offset index out of bounds (rows {np.nonzero(bad)[0][:8].tolist()}, "
                                   "oob_mode.error)")
            flat = np.where(bad.reshape((rows,) + (1,) * (flat.ndim - 1)), 0, flat)
            return "index", flat, ~bad
        return "index", flat, None

    def _gather(self, op="read", operand="src", skip=False):
        """(values with the view's shape, valid-row mask or None). Values may alias storage."""
        life = self._st.life
        if life is not None:
            life.touch()
        if self._dyn is None:
            self._touch(op, operand)
            return self._np(), None
        kind, payload, mask = self._resolve(op, operand, skip)
        if kind == "skip":
            return None, np.zeros(self._shape[0], dtype=bool)
        if kind == "view":
            return payload, None
        return self._st.typed(self._dtype)[payload], mask

    def _scatter(self, values, op="write", operand="dst", mask=None, matmul=False, skip=False):
        """Write ``values`` (already of this view's dtype, reshapeable to its shape)."""
        values = np.asarray(values).reshape(self._shape)
        last = self._last_writes()
        life = self._st.life
        if life is not None:
            life.touch()
        if self._dyn is None:
            self._touch(op, operand)
            target = self._np()
            target[last] = values[last]
            if self._st.mm_mask is not None:
                self._mask_view(self._offset)[last] = 1 if matmul else 0
            return
        kind, payload, dmask = self._resolve(op, operand, skip)
        if kind == "skip":
            return
        if kind == "view":
            payload[last] = values[last]
            return
        rows = np.ones(self._shape[0], dtype=bool) if dmask is None else dmask
        if mask is not None:
            rows &= mask
        flat, vals = payload[last], values[last]
        keep = rows[last[0]]
        self._st.typed(self._dtype)[flat[keep]] = vals[keep]

    def _last_writes(self):
        """Index selecting, along every stride-0 (broadcast) dim, the element written last."""
        return tuple(slice(c - 1, c) if s == 0 and c > 1 else slice(None)
                     for s, c in zip(self._strides, self._shape))

    def _mask_view(self, offset):
        """This view of its allocation's matmul-written mask (laid out like an own buffer)."""
        self._touch()
        isz = self._dtype.itemsize
        byte_off, byte_strides = offset * isz, tuple(s * isz for s in self._strides)
        return np.ndarray(self._shape, dtype=np.uint8, buffer=self._st.mm_mask, offset=byte_off,
                          strides=byte_strides)

    def _access(self) -> Access:
        acc = self._acc
        if acc is not None:
            return acc
        self._touch()
        st = self._st
        isz = self._dtype.itemsize
        lo, hi = self._extent(self._offset)
        if self._onchip:
            fd = st.partition_elems(self._dtype)
            p0, f0 = divmod(self._offset, fd)
            parts = (st.pstart + p0, st.pstart + p0 + self._shape[0])
            brange = (st.bstart + (f0 + lo) * isz, st.bstart + (f0 + hi + 1) * isz)
        else:
            parts = (0, 1)
            brange = ((self._offset + lo) * isz, (self._offset + hi + 1) * isz)
        acc = Access(st.id, st.kind, parts, brange, self._shape, str(self._dtype), st.manual)
        if self._dyn is None:
            self._acc = acc
        return acc

    def _contig_bytes(self) -> int:
        """Bytes of the smallest contiguous run of this view (innermost compact dims)."""
        run = 1
        expected = 1
        start = 1 if self._onchip else 0
        for s, c in zip(reversed(self._strides[start:]), reversed(self._shape[start:])):
            if c == 1:
                continue
            if s != expected:
                break
            run *= c
            expected *= c
        return run * self._dtype.itemsize

    def _derive(self, offset, shape, strides, op, dtype=None, dyn=None):
        return NkiTensor(self._st, dtype or self._dtype, offset, shape, strides, dyn, self._name, op,
                         defer_bounds=self._unchecked)

    def _static(self, op):
        if self._dyn is not None:
            _fail(op, self._name, "indirect (dynamic) views cannot be re-viewed")

    # ----------------------------------------------------------------- indexing
    def __getitem__(self, key):
        self._static("getitem")
        if not isinstance(key, tuple):
            key = (key,)
        if any(k is Ellipsis for k in key):
            i = next(i for i, k in enumerate(key) if k is Ellipsis)
            fill = len(self._shape) - (len(key) - 1)
            key = key[:i] + (slice(None),) * fill + key[i + 1:]
        if len(key) > len(self._shape):
            _fail("getitem", self._name, f"too many indices ({len(key)}) for a {len(self._shape)}-d tensor")
        key = key + (slice(None),) * (len(self._shape) - len(key))
        offset = self._offset
        shape, strides = [], []
        onchip = self._onchip
        for dim, (k, c, s) in enumerate(zip(key, self._shape, self._strides)):
            if isinstance(k, (bool, np.bool_)):
                _fail("getitem", self._name, "boolean indices are not supported")
            if isinstance(k, (int, np.integer)):
                k = int(k)
                if k < 0:
                    k += c
                if not 0 <= k < c:
                    _fail("getitem", self._name, f"index {k} out of range for dim {dim} of size {c}")
                offset += k * s
                if onchip and dim == 0:
                    shape.append(1)
                    strides.append(s)
                continue
            if isinstance(k, slice):
                start, stop, step = k.start, k.stop, k.step
                step = 1 if step is None else int(step)
                if step < 1:
                    _fail("getitem", self._name, f"slice step must be >= 1, got {step}")
                start = 0 if start is None else int(start)
                stop = c if stop is None else int(stop)
                if start < 0:
                    start += c
                if stop < 0:
                    stop += c
                if not (0 <= start < stop <= c):
                    _fail("getitem", self._name, f"slice [{start}:{stop}] out of range for dim {dim} of size {c}")
                offset += start * s
                shape.append(len(range(start, stop, step)))
                strides.append(s * step)
                continue
            if isinstance(k, (NkiTensor, VirtualRegister)):
                _fail("getitem", self._name, "runtime values cannot index a tensor; use .ap(scalar_offset=...)")
            _fail("getitem", self._name, f"unsupported index {k!r}")
        if onchip and len(shape) < 2:
            shape.append(1)
            strides.append(1)
        if not shape:
            shape, strides = [1], [1]
        return self._derive(offset, shape, strides, "getitem")

    def __setitem__(self, key, value):
        from . import isa  # local: isa imports this module

        dst = self[key]
        if not isinstance(value, NkiTensor):
            isa.memset(dst, value)
        elif dst._onchip and value._onchip:
            isa.tensor_copy(dst, value)
        else:
            isa.dma_copy(dst, value)

    # ----------------------------------------------------------------- view methods
    def get_pattern(self):
        return [[s, c] for s, c in zip(self._strides, self._shape)]

    def is_indirect(self) -> bool:
        return self._dyn is not None

    def is_contiguous(self) -> bool:
        start = 1 if self._onchip else 0
        expected = 1
        for s, c in zip(reversed(self._strides[start:]), reversed(self._shape[start:])):
            if c != 1 and s != expected:
                return False
            expected *= c
        return True

    def ap(self, pattern, offset=None, scalar_offset=None, vector_offset=None, indirect_dim=0, dtype=None):
        op = "ap"
        new_dt = self._dtype if dtype is None else as_dtype(dtype, "dtype")
        if self._dyn is not None:
            _fail(op, self._name, "indirect views cannot be re-indirected")
        if not isinstance(pattern, (list, tuple)) or not pattern:
            _fail(op, "pattern", "pattern must be a non-empty list of [stride, count] pairs")
        strides, shape = [], []
        for pair in pattern:
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                _fail(op, "pattern", f"each pattern entry must be [stride, count], got {pair!r}")
            s, c = pair
            if not isinstance(s, (int, np.integer)) or not isinstance(c, (int, np.integer)):
                _fail(op, "pattern", f"strides and counts must be compile-time ints, got {pair!r}")
            strides.append(int(s))
            shape.append(int(c))
        if len(shape) > _MAX_AP_DIMS:  # hardware access patterns: partition + at most 4 free dims (§3.5)
            _fail(op, "pattern", f"{len(shape)} dims exceed the hardware limit of {_MAX_AP_DIMS} "
                                 "(partition + 4 free dims)")
        if offset is None:
            byte_off = self._offset * self._dtype.itemsize
            if byte_off % new_dt.itemsize:
                _fail(op, "offset", "inherited offset is not a whole number of the new dtype's elements")
            off = byte_off // new_dt.itemsize
        elif isinstance(offset, (int, np.integer)):
            off = int(offset)
        else:
            _fail(op, "offset", "offset must be a compile-time int; use scalar_offset for runtime values")
        if scalar_offset is not None and vector_offset is not None:
            _fail(op, "vector_offset", "at most one of scalar_offset and vector_offset")
        dyn = None
        if scalar_offset is not None or vector_offset is not None:
            if not 0 <= indirect_dim < len(self._shape):
                _fail(op, "indirect_dim", f"indirect_dim {indirect_dim} out of range")
            mult_bytes = self._strides[indirect_dim] * self._dtype.itemsize
            if mult_bytes % new_dt.itemsize:
                _fail(op, "indirect_dim", "indirect stride is not a whole number of the new dtype's elements")
            mult = mult_bytes // new_dt.itemsize
            limit = self._shape[indirect_dim]
            if scalar_offset is not None:
                if isinstance(scalar_offset, NkiTensor):
                    if scalar_offset.size != 1 or not is_int(scalar_offset.dtype):
                        _fail(op, "scalar_offset", "scalar_offset tensor must hold one integer element")
                elif not isinstance(scalar_offset, VirtualRegister):
                    _fail(op, "scalar_offset", "scalar_offset must be a (1, 1) SBUF int tensor or a VirtualRegister")
                dyn = ("scalar", scalar_offset, mult, limit)
            else:
                if indirect_dim != 0:
                    _fail(op, "indirect_dim", "vector_offset requires indirect_dim=0")
                if self._onchip:
                    _fail(op, "vector_offset", "vector_offset indirection is only allowed on HBM tensors")
                if not isinstance(vector_offset, NkiTensor) or vector_offset.buffer != MemoryRegion.sbuf:
                    _fail(op, "vector_offset", "vector_offset must be an SBUF tensor")
                if vector_offset.dtype not in ("int32", "uint32"):
                    _fail(op, "vector_offset", f"vector_offset must be int32/uint32, got {vector_offset.dtype}")
                if vector_offset.size < shape[0]:
                    _fail(op, "vector_offset", f"vector_offset holds {vector_offset.size} indices, pattern "
                                               f"needs {shape[0]}")
                dyn = ("vector", vector_offset, mult, limit)
        return NkiTensor(self._st, new_dt, off, shape, strides, dyn, self._name, op, defer_bounds=True)
