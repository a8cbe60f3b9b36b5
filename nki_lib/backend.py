"""Execution-path selection and strict mode (docs/contract.md §2).

Every op call runs on exactly one path: ``device`` (the NKI kernel through the real ``nki``
package on a Trainium ``neuron`` tensor), ``simulator`` (the same kernel source on
``nki_lib.simulator``) or ``reference`` (the PyTorch reference). The backend setting picks the
path; ``auto`` means ``device`` for neuron tensors when the real ``nki`` is usable, else
``reference``.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterable, Iterator

import torch

BACKENDS = ("auto", "device", "simulator", "reference")
PATHS = ("device", "simulator", "reference")


def _check_backend(name: str) -> str:
    if not isinstance(name, str):
        raise TypeError(f"backend must be a str, got {type(name).__name__}")
    key = name.strip().lower()
    if key not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    return key


def _env_flag(name: str) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"environment variable {name} must be 0/1/true/false, got {value!r}")


_global_backend = _check_backend(os.environ.get("NKI_LIB_BACKEND", "auto") or "auto")
_global_strict = _env_flag("NKI_LIB_STRICT")
_backend_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("nki_lib_backend", default=None)
_strict_override: contextvars.ContextVar[bool | None] = contextvars.ContextVar("nki_lib_strict", default=None)


def set_backend(name: str) -> None:
    """Set the process-wide backend: ``auto``, ``device``, ``simulator`` or ``reference``."""
    global _global_backend
    _global_backend = _check_backend(name)


def get_backend() -> str:
    """The backend in force here (a ``use_backend`` block wins over ``set_backend``)."""
    override = _backend_override.get()
    return override if override is not None else _global_backend


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Run the block with another backend: ``with nki_lib.use_backend("simulator"): ...``."""
    token = _backend_override.set(_check_backend(name))
    try:
        yield
    finally:
        _backend_override.reset(token)


def set_strict(enabled: bool = True) -> None:
    """Strict mode: any fallback to the reference becomes an ``NKIFallbackError``."""
    global _global_strict
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    _global_strict = enabled


def is_strict() -> bool:
    override = _strict_override.get()
    return override if override is not None else _global_strict


@contextlib.contextmanager
def strict(enabled: bool = True) -> Iterator[None]:
    """Run the block in (or out of) strict mode."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    token = _strict_override.set(enabled)
    try:
        yield
    finally:
        _strict_override.reset(token)


def device_available() -> bool:
    """True when the device path can launch kernels: the real ``nki`` package is the one kernels
    are bound to, or ``nki_lib.emulate_neuron()`` stands the simulator in for it."""
    from nki_lib._nki import USING_REAL_NKI
    from nki_lib.neuron import emulation

    return USING_REAL_NKI or emulation.active()


def requested_path(tensors: Iterable[torch.Tensor | None]) -> str:
    """The path the backend setting asks for, given the call's tensors."""
    backend = get_backend()
    if backend != "auto":
        return backend
    on_neuron = any(t is not None and t.device.type == "neuron" for t in tensors)
    return "device" if on_neuron and device_available() else "reference"


def lnc_degree() -> int:
    """Logical NeuronCore degree for kernel launches: ``NEURON_LOGICAL_NC_CONFIG`` (1 or 2;
    default 1), the variable the Neuron runtime and compiler read (docs/nki-semantics.md §2.1)."""
    value = os.environ.get("NEURON_LOGICAL_NC_CONFIG", "1").strip()
    if value not in ("1", "2"):
        raise ValueError(f"NEURON_LOGICAL_NC_CONFIG must be 1 or 2, got {value!r}")
    return int(value)
