"""``nki.language`` for the simulator: dtypes, buffers, allocation, indexing, loops, SPMD, op constants.

Creation functions allocate a fresh storage per call (docs/nki-semantics.md §9.1); the 0.3+ tile-returning
convenience functions (``nl.load``, ``nl.matmul``, ``nl.exp(x)``, ...) live in ``wrappers.py`` and
issue ordinary ``nisa`` instructions.
"""

from __future__ import annotations

import builtins
import contextlib

import numpy as np

from .dtypes import ALL_DTYPES, NkiDType, as_dtype, is_float
from .errors import NKIRuleError, kernel_source
from .memory import ONCHIP, Storage
from .nkiobject import NKIObject
from .ops import OPS, Op
from .state import current
from .target import tile_size
from .tensor import MemoryRegion, NkiTensor, VirtualRegister, _compact

# ---------------------------------------------------------------- dtypes (§6.1)
dtype = NkiDType
bool_ = ALL_DTYPES["bool"]
globals().update({name: dt for name, dt in ALL_DTYPES.items() if name != "bool"})
globals()["bool"] = bool_

# ---------------------------------------------------------------- buffers (§3.1)
sbuf = MemoryRegion.sbuf
psum = MemoryRegion.psum
private_hbm = MemoryRegion.private_hbm
hbm = MemoryRegion.hbm
shared_hbm = MemoryRegion.shared_hbm
tensor = NkiTensor
__all_ops__ = tuple(OPS)
globals().update(OPS)


def is_hbm(b) -> bool:
    return b in (MemoryRegion.private_hbm, MemoryRegion.shared_hbm)


def is_on_chip(b) -> bool:
    return b in (MemoryRegion.sbuf, MemoryRegion.psum)


def is_psum(b) -> bool:
    return b == MemoryRegion.psum


def is_sbuf(b) -> bool:
    return b == MemoryRegion.sbuf


# ---------------------------------------------------------------- allocation (§3.6, §9.1)
_KIND = {MemoryRegion.sbuf: "sbuf", MemoryRegion.psum: "psum", MemoryRegion.private_hbm: "private_hbm",
         MemoryRegion.shared_hbm: "shared_hbm"}


def _fail(operand, rule):
    raise NKIRuleError("ndarray", operand, rule, kernel_source(3))


def _shape(shape):
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    if not isinstance(shape, (tuple, list)) or not shape:
        raise TypeError(f"shape must be a non-empty tuple of ints, got {shape!r}")
    for c in shape:
        if not isinstance(c, (int, np.integer)) or isinstance(c, builtins.bool) or c < 1:
            raise ValueError(f"shape must hold positive ints, got {shape!r}")
    return tuple(int(c) for c in shape)


def ndarray(shape, dtype, buffer=None, name="", address=None):
    """Allocate an uninitialised tensor (floats read as NaN, ints as 4 until written)."""
    prog = current()
    shape = _shape(shape)
    dt = as_dtype(dtype)
    buffer = sbuf if buffer is None else buffer
    if not isinstance(buffer, MemoryRegion):
        raise TypeError(f"buffer must be nl.sbuf / nl.psum / nl.hbm / nl.private_hbm / nl.shared_hbm, got {buffer!r}")
    kind = _KIND[buffer]
    label = name or "ndarray"
    spec = prog.spec
    if kind in ONCHIP:
        if len(shape) < 2:
            _fail(label, f"on-chip tensors need a partition dim and a free dim, got shape {shape}")
        if shape[0] > spec.pmax:
            _fail(label, f"partition dimension {shape[0]} exceeds maximum {spec.pmax}")
        bpp = int(np.prod(shape[1:], dtype=np.int64)) * dt.itemsize
        cap = spec.sbuf_usable_bytes if kind == "sbuf" else spec.psum_partition_bytes
        if bpp > cap:
            _fail(label, f"{bpp} bytes per partition exceed the {kind.upper()} partition size {cap}")
        if address is not None:
            address = _placement(address, shape, bpp, kind, spec, label, dt)
    elif address is not None:
        _fail(label, "address= placement applies to SBUF/PSUM only")
    if kind == "shared_hbm":
        storage = _shared(prog, shape, dt, name)
    else:
        physical = prog.physical(kind) if address is not None else None
        storage = Storage(prog.run.next_id(), kind, dt, shape, name, address=address, physical=physical)
        if kind in ONCHIP:
            prog.tracker.request(storage, prog, kernel_source(2))
    return NkiTensor(storage, dt, 0, shape, _compact(shape), name=name)


def _placement(address, shape, bpp, kind, spec, label, dt):
    if not (isinstance(address, (tuple, list)) and len(address) == 2
            and builtins.all(isinstance(a, (int, np.integer)) for a in address)):
        _fail(label, "address must be (partition_offset, byte_offset) ints")
    p_off, b_off = int(address[0]), int(address[1])
    if p_off < 0 or p_off + shape[0] > spec.pmax:
        _fail(label, f"partitions [{p_off}, {p_off + shape[0]}) leave the {spec.pmax} partitions")
    cap = spec.sbuf_usable_bytes if kind == "sbuf" else spec.psum_partition_bytes
    if b_off < 0 or b_off + bpp > cap:
        _fail(label, f"bytes [{b_off}, {b_off + bpp}) leave the {kind.upper()} partition size {cap}")
    align = builtins.min(dt.itemsize, 4)  # nl.min (wrappers) shadows the builtin in this module
    if b_off % align:
        _fail(label, f"byte offset {b_off} is not aligned to {align}")
    if kind == "psum" and b_off % spec.psum_bank_bytes:
        _fail(label, f"PSUM placements must start at a 2 KiB bank boundary, got byte {b_off}")
    return p_off, b_off


def _shared(prog, shape, dt, name):
    """k-th shared_hbm allocation of every program refers to the same storage (docs/nki-semantics.md §2.4)."""
    run = prog.run
    with run.lock:
        seq = prog.shared_seq
        prog.shared_seq += 1
        if seq < len(run.shared_allocs):
            storage = run.shared_allocs[seq]
            if storage.alloc_shape != shape or storage.alloc_dtype != dt:
                _fail(name or "ndarray", f"shared_hbm allocation #{seq} differs between LNC programs "
                                         f"({storage.alloc_shape} {storage.alloc_dtype} vs {shape} {dt})")
            return storage
        storage = Storage(next(run.ids), "shared_hbm", dt, shape, name)
        run.shared_allocs.append(storage)
        return storage


def _filled(shape, dtype, value, buffer, name):
    from . import isa

    t = ndarray(shape, dtype, buffer=buffer, name=name)
    if t.buffer in (sbuf, psum):
        dt = as_dtype(dtype)
        isa.memset(t, value if is_float(dt) or dt == "bool" else int(value))
    else:
        t._st.typed(t.dtype)[...] = np.asarray(value).astype(t.dtype.np)
    return t


def zeros(shape, dtype, buffer=None, name=""):
    return _filled(shape, dtype, 0, buffer, name)


def ones(shape, dtype, buffer=None, name=""):
    return _filled(shape, dtype, 1, buffer, name)


def full(shape, fill_value, dtype, buffer=None, name=""):
    return _filled(shape, dtype, fill_value, buffer, name)


def zeros_like(x, dtype=None, buffer=None, name=""):
    return zeros(x.shape, dtype or x.dtype, buffer=buffer, name=name)


def empty_like(x, dtype=None, buffer=None, name=""):
    return ndarray(x.shape, dtype or x.dtype, buffer=buffer or x.buffer, name=name)


def ndarray_like(x, dtype=None, buffer=None, name=""):
    return empty_like(x, dtype, buffer, name)


def rand(shape, dtype, buffer=None, name=""):
    """Uniform [0, 1) values (seedable NumPy generator; not the device's RNG stream)."""
    t = ndarray(shape, dtype, buffer=buffer, name=name)
    prog = current()
    prog.begin("rand")
    values = _rng(prog).random(t.shape, dtype=np.float32)
    t._scatter(values.astype(t.dtype.np), "rand", "dst")
    prog.record("gpsimd", (), (t,), t.shape, t.dtype, t.size, t.size * t.itemsize)
    return t


def _rng(prog):
    gen = getattr(prog, "rng", None)
    if gen is None:
        gen = prog.rng = np.random.default_rng(prog.pid)
    return gen


def random_seed(seed):
    prog = current()
    value = seed if isinstance(seed, (int, np.integer)) else int(np.asarray(seed._gather()[0]).reshape(-1)[0])
    prog.rng = np.random.default_rng(int(value))


def shared_constant(constant, dtype=None):
    """A shared_hbm tensor holding ``constant`` (a NumPy array or a .npy path)."""
    arr = np.load(constant) if isinstance(constant, str) else np.asarray(constant)
    dt = as_dtype(dtype or arr.dtype)
    t = ndarray(arr.shape if arr.ndim else (1,), dt, buffer=shared_hbm, name="shared_constant")
    t._st.typed(dt)[...] = arr.astype(dt.np).reshape(-1)
    return t


def shared_identity_matrix(n, dtype=None, dst=None):
    """An n x n identity in SBUF (a compile-time constant; no instruction is recorded)."""
    dt = as_dtype(dtype or "uint8")
    t = dst if dst is not None else ndarray((n, n), dt, buffer=sbuf, name="identity")
    t._scatter(np.eye(n, dtype=np.float32).astype(t.dtype.np), "shared_identity_matrix", "dst")
    return t


# ---------------------------------------------------------------- indexing, loops, SPMD (§5, §9.5)
def ds(start, size):
    """``nl.ds(start, size)`` == ``slice(start, start + size)`` (compile-time ints)."""
    if isinstance(start, (NkiTensor, VirtualRegister)) or isinstance(size, (NkiTensor, VirtualRegister)):
        raise TypeError("nl.ds takes compile-time ints; use .ap(scalar_offset=...) for runtime offsets")
    return slice(int(start), int(start) + int(size))


def static_range(start, stop=None, step=1):
    return range(start, stop, step) if stop is not None else range(start)


affine_range = sequential_range = static_range


def _reg_value(x):
    if isinstance(x, VirtualRegister):
        if x.value is None:
            raise ValueError("dynamic loop bound register read before it was written")
        return x.value
    return int(x)


def dynamic_range(start, stop=None, step=1):
    """Device loop: bounds (ints or registers) read once at entry; yields frozen registers."""
    if stop is None:
        start, stop = 0, start
    if not isinstance(step, (int, np.integer)) or step < 1:
        raise ValueError(f"dynamic_range step must be a positive compile-time int, got {step!r}")
    for i in range(_reg_value(start), _reg_value(stop), int(step)):
        yield VirtualRegister(i, frozen=True)


def fori_loop(lower, upper, body_fun, step=1):
    for reg in dynamic_range(lower, upper, step):
        body_fun(reg)


def while_loop(init, body_fun):
    reg = init
    while _reg_value(reg) != 0:
        reg = body_fun(reg)
    return reg


def program_id(axis=0):
    if axis != 0:
        raise ValueError(f"program_id: only axis 0 exists, got {axis}")
    return current().pid


def num_programs(axes=0):
    if axes not in (0, None):
        raise ValueError(f"num_programs: only axis 0 exists, got {axes}")
    return current().run.grid


def program_ndim():
    return 1 if current().run.grid_given else 0


def device_print(print_prefix, tensor):
    values, _ = tensor._gather()
    print(print_prefix, np.array(values))


@contextlib.contextmanager
def no_reorder():
    yield


from .wrappers import (  # noqa: E402
    all,
    broadcast_to,
    expand_dims,
    load,
    load_transpose2d,
    matmul,
    max,
    mean,
    min,
    prod,
    rms_norm,
    softmax,
    store,
    sum,
    transpose,
    var,
    where,
)

_INTERNAL = {"builtins", "contextlib", "np", "annotations", "ALL_DTYPES", "NkiDType", "as_dtype", "is_float",
             "NKIRuleError", "kernel_source", "ONCHIP", "Storage", "OPS", "Op", "current", "VirtualRegister"}
__all__ = [n for n in list(globals()) if not n.startswith("_") and n not in _INTERNAL]
del Op
