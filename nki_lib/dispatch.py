"""Running an op on its path: the one launch path and fallback mechanism for every op
(docs/contract.md §2).

An op implementation calls::

    dispatch("flash_attention", tensors,
             launch=lambda: flash_attention_fwd.launch_flash_attention_fwd(q, k, v, ...),
             reference=lambda: flash_attention_reference.flash_attention(q, k, v, ...))

``launch`` is the op's *launcher* (in ``<family>/kernels/<op>_fwd.py`` / ``_bwd.py``) applied to
the call's arguments. A launcher never launches anything itself: it checks that its kernel can
serve the call (raising :class:`Unsupported` with a reason when it cannot), prepares the kernel's
inputs on the host with plain torch ops (transposes, layout glue, index metadata), and returns a
:class:`KernelLaunch` value, or a sequence of them for an op that runs several kernels one after
the other. ``dispatch`` then runs that value on the path in force with :func:`run_launch`.

When a launcher raises :class:`Unsupported`, ``dispatch`` falls back to ``reference`` and records
the reason in the coverage ledger, or raises :class:`NKIFallbackError` in strict mode. float64
inputs always fall back on the NKI paths (reason ``"float64"``): NKI has no float64, and nothing is
computed in float32 and returned as float64.

The launch value
----------------

``KernelLaunch(kernel, args, kwargs, grid, unpack)`` describes one kernel call completely:

* ``kernel``: the ``@nki.jit`` function (from ``nki_lib._nki``);
* ``args`` / ``kwargs``: its arguments, exactly as the kernel receives them: torch tensors (already
  prepared by the launcher, on the device of the op's inputs) and Python scalars, strings, bools
  or ``None``;
* ``grid``: the launch grid (the LNC degree: ``kernel[grid]`` when it is not 1);
* ``unpack``: a function from the kernel's outputs (a torch tensor or a tuple of them, in the
  order the kernel returns them) to the op's outputs, made of plain torch ops (reshapes, slices),
  or ``None`` when the kernel already returns the op's outputs.

It holds no path and calls nothing back: running it means ``unpack(kernel[grid](*args, **kwargs))``.
:func:`run_launch` does that on the ``simulator`` path (:func:`run_on_simulator`: ``nki.simulate``
on NumPy copies of the tensors, the outputs brought back through ``nki_lib.torch_bridge``, the one
torch <-> NumPy bridge, which the simulator's own torch support uses too) and on the ``device``
path (``nki_lib.neuron.launch_on_device``: the kernel called on the neuron tensors as they are,
through TorchNeuron, or through the ``nki_kernel_call`` graph node under emulation). A runner for
another device or a tracer needs nothing else: it calls the kernel on ``args``/``kwargs`` and
applies ``unpack``; the host-side preparation already happened in the launcher as torch ops, so
``torch.compile`` sees it. Every run records the kernel specialization (kernel name, grid,
argument shapes and dtypes, scalar values) in the coverage ledger.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from nki_lib import backend
from nki_lib.coverage import LEDGER
from nki_lib.torch_bridge import to_numpy, to_torch

T = TypeVar("T")


class Unsupported(Exception):
    """Raised by a kernel launcher, before it returns a launch, when its kernel cannot serve a call."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class NKIFallbackError(RuntimeError):
    """Strict mode: the chosen path could not serve the call."""


@dataclass(frozen=True)
class KernelLaunch:
    """One kernel call: ``unpack(kernel[grid](*args, **kwargs))`` (see the module docstring)."""

    kernel: Any
    args: tuple = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    grid: int = 1
    unpack: Callable[[Any], Any] | None = None


Launch = KernelLaunch | Sequence[KernelLaunch]

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


def dispatch(op: str, tensors: Iterable[torch.Tensor | None], *, launch: Callable[[], Launch],
             reference: Callable[[], T]) -> T:
    """Serve one call of ``op`` on the requested path, falling back to ``reference`` visibly.

    Autocast is disabled inside: an op computes in the dtypes it was given (an autocast region
    around the call must not change the reference's internal math, nor differ between eager and
    compiled code).
    """
    tensors = [t for t in tensors if t is not None]
    device_type = tensors[0].device.type if tensors else "cpu"
    with torch.autocast(device_type=device_type, enabled=False):
        return _dispatch(op, tensors, launch, reference)


def _tracing(tensors) -> bool:
    from nki_lib.validation import has_values

    return not has_values(*tensors)


def _refusal(path: str, tensors) -> str | None:
    """Why the NKI ``path`` cannot take a call with these tensors before any launch is planned, or None."""
    if any(t.dtype == torch.float64 for t in tensors):
        return "float64"
    if path == "device" and not backend.device_available():
        return "device: the real nki package is not available"
    return None


def kernel_path(tensors: Iterable[torch.Tensor | None]) -> str | None:
    """The NKI path ("simulator" or "device") :func:`dispatch` would try for a call with these
    tensors, or None when it goes to the reference without planning a launch (asked for, float64
    inputs, no device). A launch may still raise :class:`Unsupported` on the path returned."""
    tensors = [t for t in tensors if t is not None]
    path = backend.requested_path(tensors)
    return None if path == "reference" or _refusal(path, tensors) else path


def _dispatch(op, tensors, launch, reference):
    path = backend.requested_path(tensors)
    if path != "reference":
        reason = _refusal(path, tensors)
        if reason is None:
            try:
                planned = launch()
            except Unsupported as exc:
                reason = exc.reason
            else:
                result = run_launch(op, planned, path)
                if not _tracing(tensors):   # a traced body: its kernel-call nodes count at run time
                    LEDGER.record_call(op, path)
                return result
        if backend.is_strict():
            raise NKIFallbackError(f"nki::{op}: the {path} path cannot serve this call: {reason}")
        LEDGER.record_fallback(op, path, reason)
    LEDGER.record_call(op, "reference")
    return reference()


# --------------------------------------------------------------------------- running a launch

def run_launch(op: str, launch: Launch, path: str) -> Any:
    """Run a launch value (or a sequence of them, in order) on ``path`` (``simulator``/``device``).

    Returns the unpacked outputs (a tuple of them, one per launch, for a sequence)."""
    if isinstance(launch, KernelLaunch):
        return _run_one(op, launch, path)
    return tuple(_run_one(op, one, path) for one in launch)


def _spec_key(kernel: Any, args: tuple, kwargs: Mapping, grid: int) -> tuple:
    def describe(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return ("tensor", tuple(value.shape), str(value.dtype))
        return repr(value)

    name = getattr(kernel, "__qualname__", None) or getattr(getattr(kernel, "func", None), "__qualname__", repr(kernel))
    return (name, grid, tuple(describe(a) for a in args), tuple(sorted((k, describe(v)) for k, v in kwargs.items())))


def _run_one(op: str, launch: KernelLaunch, path: str) -> Any:
    LEDGER.record_specialization(op, _spec_key(launch.kernel, launch.args, launch.kwargs, launch.grid))
    if path == "device":
        from nki_lib import neuron

        outputs = neuron.launch_on_device(launch.kernel, launch.grid, launch.args, dict(launch.kwargs), op=op)
    else:
        launchable = launch.kernel[launch.grid] if launch.grid != 1 else launch.kernel
        device = next((a.device for a in launch.args if isinstance(a, torch.Tensor)), torch.device("cpu"))
        outputs = run_on_simulator(launchable, launch.args, launch.kwargs, device, op=op)
    return outputs if launch.unpack is None else launch.unpack(outputs)


def run_on_simulator(launchable: Any, args: tuple, kwargs: Mapping, device: torch.device,
                     op: str | None = None) -> Any:
    """Run a kernel under ``nki.simulate`` on NumPy copies of the torch arguments; outputs come back
    as torch tensors on ``device``, the ``RunReport`` is kept for ``collect_runs`` (under ``op``)."""
    from nki_lib._nki import nki

    convert = lambda v: to_numpy(v) if isinstance(v, torch.Tensor) else v  # noqa: E731
    outputs = nki.simulate(launchable)(*(convert(a) for a in args), **{k: convert(v) for k, v in kwargs.items()})
    last_run = getattr(nki, "last_run", None)
    report = last_run() if last_run is not None else None
    collector = _collector.get()
    if collector is not None:
        collector.append((op, report))
    if outputs is None:
        return None
    if isinstance(outputs, tuple):
        return tuple(to_torch(o, device) for o in outputs)
    return to_torch(outputs, device)
