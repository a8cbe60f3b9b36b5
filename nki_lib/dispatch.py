"""Running an op on its path: the one fallback mechanism for every op (docs/contract.md §2).

An op implementation calls::

    dispatch("flash_attention", tensors, kernel=lambda: fwd_kernels.run(...),
             reference=lambda: reference.flash_attention(...))

``kernel`` runs the NKI kernels of the op through :func:`call_kernel`, which launches them on the
path in force (simulator or device). Before launching anything, a kernel launcher that cannot
serve the call raises :class:`Unsupported` with a reason; ``dispatch`` then falls back to the
reference and records the reason in the coverage ledger, or raises :class:`NKIFallbackError` in
strict mode. float64 inputs always fall back on the NKI paths (reason ``"float64"``): NKI has no
float64, and nothing is computed in float32 and returned as float64.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import ml_dtypes
import numpy as np
import torch

from nki_lib import backend
from nki_lib.coverage import LEDGER

T = TypeVar("T")


class Unsupported(Exception):
    """Raised by a kernel launcher, before it launches anything, when it cannot serve a call."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class NKIFallbackError(RuntimeError):
    """Strict mode: the chosen path could not serve the call."""


@dataclass
class _Launch:
    op: str
    path: str
    runs: list = field(default_factory=list)


_launch: contextvars.ContextVar[_Launch | None] = contextvars.ContextVar("nki_lib_launch", default=None)
_collector: contextvars.ContextVar[list | None] = contextvars.ContextVar("nki_lib_runs", default=None)


@contextlib.contextmanager
def collect_runs() -> Iterator[list]:
    """Collect ``(op, RunReport)`` for every simulated kernel launched inside the block."""
    runs: list = []
    token = _collector.set(runs)
    try:
        yield runs
    finally:
        _collector.reset(token)


def current_path() -> str | None:
    """The path of the op call being served (``None`` outside an op)."""
    launch = _launch.get()
    return None if launch is None else launch.path


def dispatch(op: str, tensors: Iterable[torch.Tensor | None], *, kernel: Callable[[], T],
             reference: Callable[[], T]) -> T:
    """Serve one call of ``op`` on the requested path, falling back to ``reference`` visibly.

    Autocast is disabled inside: an op computes in the dtypes it was given (an autocast region
    around the call must not change the reference's internal math, nor differ between eager and
    compiled code).
    """
    tensors = [t for t in tensors if t is not None]
    device_type = tensors[0].device.type if tensors else "cpu"
    with torch.autocast(device_type=device_type, enabled=False):
        return _dispatch(op, tensors, kernel, reference)


def _tracing(tensors) -> bool:
    from nki_lib.validation import has_values

    return not has_values(*tensors)


def _dispatch(op, tensors, kernel, reference):
    path = backend.requested_path(tensors)
    if path != "reference":
        reason = None
        if any(t.dtype == torch.float64 for t in tensors):
            reason = "float64"
        elif path == "device" and not backend.device_available():
            reason = "device: the real nki package is not available"
        if reason is None:
            token = _launch.set(_Launch(op, path))
            try:
                result = kernel()
            except Unsupported as exc:
                reason = exc.reason
            else:
                if not _tracing(tensors):   # a traced body: its kernel-call nodes count at run time
                    LEDGER.record_call(op, path)
                return result
            finally:
                _launch.reset(token)
        if backend.is_strict():
            raise NKIFallbackError(f"nki::{op}: the {path} path cannot serve this call: {reason}")
        LEDGER.record_fallback(op, path, reason)
    LEDGER.record_call(op, "reference")
    return reference()


# --------------------------------------------------------------------------- kernel launches

_TORCH_TO_NUMPY = {
    torch.float32: np.dtype(np.float32),
    torch.float16: np.dtype(np.float16),
    torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
    torch.float8_e4m3fn: np.dtype(ml_dtypes.float8_e4m3fn),
    torch.float8_e5m2: np.dtype(ml_dtypes.float8_e5m2),
    torch.int8: np.dtype(np.int8),
    torch.int16: np.dtype(np.int16),
    torch.int32: np.dtype(np.int32),
    torch.uint8: np.dtype(np.uint8),
    torch.bool: np.dtype(np.bool_),
}
_NUMPY_TO_TORCH = {v: k for k, v in _TORCH_TO_NUMPY.items()}
_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The NumPy (ml_dtypes) dtype of a torch dtype the kernels take."""
    if dtype not in _TORCH_TO_NUMPY:
        raise TypeError(f"no NKI dtype for torch dtype {dtype}")
    return _TORCH_TO_NUMPY[dtype]


def torch_dtype(dtype) -> torch.dtype:
    """The torch dtype of a NumPy (ml_dtypes) dtype a kernel returned."""
    out = _NUMPY_TO_TORCH.get(np.dtype(dtype))
    if out is None:
        raise TypeError(f"no torch dtype for numpy dtype {dtype}")
    return out


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU NumPy copy of ``t`` with the matching (ml_dtypes) dtype, bit-exact."""
    if t.dtype not in _TORCH_TO_NUMPY:
        raise TypeError(f"no NKI dtype for torch dtype {t.dtype}")
    t = t.detach().to("cpu").contiguous()
    np_dtype = _TORCH_TO_NUMPY[t.dtype]
    if t.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
        return t.view(_SAME_WIDTH_INT[t.element_size()]).numpy().view(np_dtype).copy()
    return t.numpy().copy()


def to_torch(a: np.ndarray, device: torch.device | str = "cpu") -> torch.Tensor:
    """A torch tensor from a NumPy (ml_dtypes) array, bit-exact."""
    dtype = _NUMPY_TO_TORCH.get(np.dtype(a.dtype))
    if dtype is None:
        raise TypeError(f"no torch dtype for numpy dtype {a.dtype}")
    a = np.ascontiguousarray(a)
    if dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
        out = torch.from_numpy(a.view(np.dtype(f"int{8 * a.itemsize}") if a.itemsize > 1 else np.uint8).copy())
        out = out.view(dtype)
    else:
        out = torch.from_numpy(a.copy())
    return out.to(device)


def _spec_key(kernel: Any, args: tuple, kwargs: dict, grid: int) -> tuple:
    def describe(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return ("tensor", tuple(value.shape), str(value.dtype))
        return repr(value)

    name = getattr(kernel, "__qualname__", None) or getattr(getattr(kernel, "func", None), "__qualname__", repr(kernel))
    return (name, grid, tuple(describe(a) for a in args), tuple(sorted((k, describe(v)) for k, v in kwargs.items())))


def call_kernel(kernel: Any, *args: Any, grid: int = 1, **kwargs: Any) -> Any:
    """Launch an ``@nki.jit`` kernel on the current op's path and return torch outputs.

    Tensor arguments are torch tensors. On the simulator path they are converted to NumPy
    (ml_dtypes), the kernel runs under ``nki.simulate`` and its outputs come back as torch
    tensors on the device of the first tensor argument; the ``RunReport`` is kept for
    ``collect_runs``. On the device path the kernel is called on the neuron tensors directly.
    """
    launch = _launch.get()
    if launch is None:
        raise RuntimeError("call_kernel must run inside dispatch() (an op call)")

    LEDGER.record_specialization(launch.op, _spec_key(kernel, args, kwargs, grid))
    if launch.path == "device":
        from nki_lib import neuron

        return neuron.launch_on_device(kernel, grid, args, kwargs, op=launch.op)
    launchable = kernel[grid] if grid != 1 else kernel
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
    return run_on_simulator(launchable, args, kwargs, device)


def run_on_simulator(launchable: Any, args: tuple, kwargs: dict, device: torch.device) -> Any:
    """Run a kernel under ``nki.simulate`` on NumPy copies of the torch arguments; outputs come back
    as torch tensors on ``device``, the ``RunReport`` is kept for ``collect_runs``."""
    from nki_lib._nki import nki

    convert = lambda v: to_numpy(v) if isinstance(v, torch.Tensor) else v  # noqa: E731
    outputs = nki.simulate(launchable)(*(convert(a) for a in args), **{k: convert(v) for k, v in kwargs.items()})
    last_run = getattr(nki, "last_run", None)
    report = last_run() if last_run is not None else None
    launch = _launch.get()
    if launch is not None:
        launch.runs.append(report)
    collector = _collector.get()
    if collector is not None:
        collector.append((launch.op if launch is not None else None, report))
    if outputs is None:
        return None
    if isinstance(outputs, tuple):
        return tuple(to_torch(o, device) for o in outputs)
    return to_torch(outputs, device)
