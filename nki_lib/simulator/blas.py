"""Run NumPy's OpenBLAS single-threaded while a kernel is simulated.

The simulator's matmuls are small tiles (at most 128 x 128 x 512 per instruction), where BLAS threads
gain little; on a loaded machine OpenBLAS's spinning worker threads slow them down by an order of
magnitude. ``single_threaded()`` sets NumPy's OpenBLAS to one thread for the outermost simulate call
and restores the previous count afterwards. Where the library cannot be found (non-Linux, another
BLAS) it changes nothing: this only affects speed, never results.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading

__all__ = ["single_threaded"]

_SYMBOLS = (("scipy_openblas_set_num_threads64_", "scipy_openblas_get_num_threads64_"),
            ("scipy_openblas_set_num_threads", "scipy_openblas_get_num_threads"),
            ("openblas_set_num_threads64_", "openblas_get_num_threads64_"),
            ("openblas_set_num_threads", "openblas_get_num_threads"))
_lock = threading.Lock()
_state = {"api": None, "searched": False, "depth": 0, "saved": None}


def _find():
    import numpy  # noqa: F401  (make sure NumPy's BLAS is loaded)

    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "openblas" in line.lower() and "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for set_name, get_name in _SYMBOLS:
            if hasattr(lib, set_name) and hasattr(lib, get_name):
                setter, getter = getattr(lib, set_name), getattr(lib, get_name)
                setter.argtypes, getter.restype = [ctypes.c_int], ctypes.c_int
                return setter, getter
    return None


@contextlib.contextmanager
def single_threaded():
    with _lock:
        if not _state["searched"]:
            _state["api"], _state["searched"] = _find(), True
        api = _state["api"]
        if api is not None and _state["depth"] == 0:
            _state["saved"] = api[1]()
            api[0](1)
        _state["depth"] += 1
    try:
        yield
    finally:
        with _lock:
            _state["depth"] -= 1
            if api is not None and _state["depth"] == 0:
                api[0](_state["saved"])
