"""Kernel entry: ``jit``, ``simulate``, LNC1/LNC2 launch, argument/result conversion, ``last_run``.

A simulate call wraps NumPy (or CPU torch) arguments as HBM tensors without copying when they are
contiguous (so in-place writes reach the caller's arrays; non-contiguous ones are copied back),
runs the kernel body once (LNC1, in the calling thread) or as two threads with ``program_id`` 0/1
(LNC2), and converts returned tensors back to NumPy (or torch when any input was torch).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import threading
import types

import ml_dtypes
import numpy as np

from .blas import single_threaded
from .dtypes import as_dtype, from_numpy
from .errors import NKIRuleError, kernel_source
from .memory import Storage
from .state import BarrierBroken, Program, Run, current_or_none, set_current
from .target import TARGETS, get_target, set_running_target
from .tensor import NkiTensor, _compact
from .trace import RunReport

__all__ = ["jit", "simulate", "Kernel", "last_run", "recording", "install_as_nki", "uninstall_nki"]

_caller = threading.local()


class Kernel:
    """A ``@jit`` kernel; ``kernel[2]`` selects LNC2. Calling it outside a kernel simulates it."""

    def __init__(self, fn, grid=None, options=None):
        self.fn = fn
        self.grid = grid
        self.options = dict(options or {})
        self.__name__ = getattr(fn, "__name__", "kernel")
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)
        self.__doc__ = getattr(fn, "__doc__", None)
        self.__wrapped__ = fn

    def __getitem__(self, lnc):
        return Kernel(self.fn, _grid(lnc), self.options)

    def __call__(self, *args, **kwargs):
        if current_or_none() is not None:     # nested @jit helper: inline
            return self.fn(*args, **kwargs)
        return simulate(self)(*args, **kwargs)

    def with_schedule(self, edges):
        return self

    def __repr__(self):
        return f"Kernel({self.__qualname__}, grid={self.grid})"


def _grid(lnc):
    if isinstance(lnc, tuple) or not isinstance(lnc, (int, np.integer)) or lnc not in (1, 2):
        raise ValueError(f"LNC degree must be 1 or 2 (kernel[1] / kernel[2]), got {lnc!r}")
    return int(lnc)


def jit(fn=None, *, mode=None, compile_config=None, specialization_config=None, **kwargs):
    """``@jit`` / ``@jit(...)``: wrap a kernel function (``mode`` and compiler options are ignored)."""
    if "platform_target" in kwargs:
        raise TypeError("jit(platform_target=...) was removed in NKI 0.3; use NEURON_PLATFORM_TARGET_OVERRIDE "
                        "or nki_lib.simulator.set_target")
    if fn is None:
        return lambda f: jit(f, mode=mode, compile_config=compile_config, specialization_config=specialization_config,
                             **kwargs)
    if isinstance(fn, Kernel):
        return fn
    return Kernel(fn, None, kwargs)


class _Simulated:
    def __init__(self, kernel: Kernel, grid):
        self.kernel = kernel
        self.grid = grid

    def __getitem__(self, lnc):
        return _Simulated(self.kernel, _grid(lnc))

    def __call__(self, *args, **kwargs):
        return _run(self.kernel, self.grid, args, kwargs)


def simulate(kernel):
    """``simulate(kernel)(*args)``, ``simulate(kernel[2])(...)`` or ``simulate(kernel)[2](...)``."""
    if not isinstance(kernel, Kernel):
        if not callable(kernel):
            raise TypeError(f"simulate: expected a kernel function, got {type(kernel).__name__}")
        kernel = Kernel(kernel)
    return _Simulated(kernel, kernel.grid)


@contextlib.contextmanager
def recording(enabled: bool = True):
    """``with recording(False):`` turns trace recording off for simulate calls in this thread."""
    previous = getattr(_caller, "recording", True)
    _caller.recording = bool(enabled)
    try:
        yield
    finally:
        _caller.recording = previous


def last_run() -> RunReport | None:
    """Statistics of the most recent simulate call made by this thread."""
    return getattr(_caller, "report", None)


# ---------------------------------------------------------------- argument conversion
def _from_torch(t, name):
    from nki_lib.torch_bridge import numpy_view  # torch only when torch tensors are passed

    if t.device.type != "cpu":
        raise TypeError(f"argument {name!r}: only CPU torch tensors can be simulated")
    t = t.detach()
    as_dtype(t.dtype, name)
    base = t.contiguous()
    return numpy_view(base), (t if base is not t else None)


def _to_torch(arr):
    from nki_lib.torch_bridge import to_torch

    dt = from_numpy(arr.dtype)
    if dt.np.type in (ml_dtypes.float8_e4m3, ml_dtypes.float8_e8m0fnu):
        raise TypeError(f"result dtype {dt} has no torch equivalent; pass NumPy inputs to get NumPy results")
    return to_torch(arr)


class _Args:
    """Converts kernel arguments to HBM tensors and remembers what to write back."""

    def __init__(self, run: Run):
        self.run = run
        self.torch = False
        self.writeback = []      # (original, contiguous copy)

    def convert(self, value, name):
        if isinstance(value, np.ndarray):
            return self._wrap(value, name, None)
        if type(value).__module__.startswith("torch") and hasattr(value, "detach"):
            self.torch = True
            arr, original = _from_torch(value, name)
            return self._wrap(arr, name, original)
        if isinstance(value, list):
            raise TypeError(f"argument {name!r}: lists are not allowed as kernel arguments (use a tuple)")
        if isinstance(value, tuple):
            return tuple(self.convert(v, f"{name}[{i}]") for i, v in enumerate(value))
        return value

    def _wrap(self, arr, name, torch_original):
        try:
            dt = from_numpy(arr.dtype)
        except TypeError as exc:
            raise NKIRuleError("simulate", name, f"{exc}; cast to float32/bfloat16 first", kernel_source(4)) from None
        contiguous = np.ascontiguousarray(arr)
        if torch_original is not None:
            self.writeback.append((torch_original, contiguous))
        elif contiguous is not arr and not np.shares_memory(contiguous, arr):
            self.writeback.append((arr, contiguous))
        shape = contiguous.shape if contiguous.ndim else (1,)
        kind = "shared_hbm" if self.run.grid == 2 else "hbm"
        flat = contiguous.reshape(-1).view(np.uint8)
        storage = Storage(self.run.next_id(), kind, dt, shape, name, buf=flat)
        self.run.arg_storages.add(storage.id)
        return NkiTensor(storage, dt, 0, shape, _compact(shape), name=name)

    def finish(self):
        for original, contiguous in self.writeback:
            if isinstance(original, np.ndarray):
                original[...] = contiguous.reshape(original.shape)
            else:

                original.copy_(_to_torch(contiguous).reshape(original.shape))


def _convert_result(value, run: Run, torch_mode: bool):
    if value is None:
        return None
    if isinstance(value, (tuple, list)):
        return type(value)(_convert_result(v, run, torch_mode) for v in value)
    if isinstance(value, NkiTensor):
        kind = value._st.kind
        if kind != "shared_hbm" and value._st.id not in run.arg_storages:
            raise NKIRuleError("return", value.name or "result",
                               f"returned tensors must be allocated with buffer=nl.shared_hbm (got {kind})",
                               "<kernel return>")
        values, _ = value._gather()
        arr = np.array(values)
        return _to_torch(arr) if torch_mode else arr
    return value


# ---------------------------------------------------------------- running
def _run(kernel: Kernel, grid, args, kwargs):
    spec = TARGETS[get_target()]
    run = Run(kernel.__qualname__, spec, grid or 1, grid is not None, getattr(_caller, "recording", True))
    conv = _Args(run)
    _check_signature(kernel.fn)
    try:
        bound = inspect.signature(kernel.fn).bind(*args, **kwargs)
        names = list(bound.arguments)
    except (TypeError, ValueError):
        names = None
    if names is not None:
        for key in names:
            bound.arguments[key] = conv.convert(bound.arguments[key], key)
        call_args, call_kwargs = bound.args, bound.kwargs
    else:
        call_args = tuple(conv.convert(a, f"arg{i}") for i, a in enumerate(args))
        call_kwargs = {k: conv.convert(v, k) for k, v in kwargs.items()}

    programs = [Program(run, pid) for pid in range(run.grid)]
    results = [None] * run.grid
    errors = [None] * run.grid

    def body(pid):
        prog = programs[pid]
        outer = current_or_none()
        set_current(prog)
        set_running_target(spec.name)
        try:
            with np.errstate(all="ignore"):
                results[pid] = kernel.fn(*call_args, **call_kwargs)
            prog.check_capacity()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            errors[pid] = exc
            run.barrier.abort()
            prog.tracker.finish()           # peaks of what ran
        finally:
            run.barrier.finish(pid)
            set_current(outer)
            set_running_target(None if outer is None else outer.spec.name)

    with single_threaded():
        if run.grid == 1:
            body(0)
        else:
            threads = [threading.Thread(target=body, args=(pid,), name=f"nki-program-{pid}")
                       for pid in range(run.grid)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    primary = [e for e in errors if e is not None and not isinstance(e, BarrierBroken)]
    failure = primary[0] if primary else next((e for e in errors if e is not None), None)
    _caller.report = _report(run, programs)
    if failure is not None:
        raise failure.with_traceback(failure.__traceback__)
    conv.finish()
    return _convert_result(results[0], run, conv.torch)


def _check_signature(fn):
    """NKI 0.3+ rejects keyword-only parameters (a ``*`` separator) in a kernel signature."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return
    for param in params:
        if param.kind == inspect.Parameter.KEYWORD_ONLY:
            code = getattr(fn, "__code__", None)
            where = f"{os.path.basename(code.co_filename)}:{code.co_firstlineno}" if code else "<kernel>"
            raise NKIRuleError("jit", param.name, "keyword-only kernel parameters (a '*' separator) are not "
                                                  "allowed since NKI 0.3", where)


def _report(run: Run, programs) -> RunReport:
    trace = None
    if run.recording:
        trace = [entry for prog in programs for entry in prog.trace]
    return RunReport(
        kernel=run.kernel_name, target=run.spec.name, grid=run.grid,
        instructions=sum(p.n_instr for p in programs),
        peak_sbuf_bytes=max(p.tracker.peak_sbuf for p in programs),
        peak_psum_bytes=max(p.tracker.peak_psum_bytes for p in programs),
        peak_psum_banks=max(p.tracker.peak_psum_banks for p in programs),
        trace=trace)


# ---------------------------------------------------------------- sys.modules aliasing
_ALIASES = ("nki", "nki.language", "nki.isa", "nki.isa.constants", "nki.typing", "nki.tensor")


def _typing_module():
    mod = types.ModuleType("nki.typing")

    class _TensorAnnotation:
        def __class_getitem__(cls, item):
            return NkiTensor

    mod.tensor = _TensorAnnotation
    mod.mutable_tensor = _TensorAnnotation
    return mod


def install_as_nki() -> None:
    """Make ``import nki`` / ``nki.language`` / ``nki.isa`` / ``nki.isa.constants`` resolve to the simulator."""
    from . import isa, language, tensor

    package = sys.modules[__package__]
    typing_mod = _typing_module()
    package.typing = typing_mod
    # `import nki.tensor as ntensor` binds the package attribute `tensor`, i.e. tensor.py, which
    # re-exports the trace-time constant constructors of trace_tensor.py
    sys.modules.update({"nki": package, "nki.language": language, "nki.isa": isa,
                        "nki.isa.constants": isa.constants, "nki.typing": typing_mod, "nki.tensor": tensor})


def uninstall_nki() -> None:
    """Remove the aliases installed by ``install_as_nki`` (only those pointing at the simulator)."""
    package = sys.modules[__package__]
    from . import isa, language, tensor

    ours = {"nki": package, "nki.language": language, "nki.isa": isa, "nki.isa.constants": isa.constants,
            "nki.tensor": tensor}
    for name in _ALIASES:
        module = sys.modules.get(name)
        if module is not None and (ours.get(name) is module or name == "nki.typing"
                                   and getattr(package, "typing", None) is module):
            del sys.modules[name]
