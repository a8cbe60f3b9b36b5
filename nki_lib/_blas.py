"""Single-threaded NumPy BLAS while the simulator runs a kernel.

The simulator multiplies tile-sized operands (at most 128 x 512); OpenBLAS threads only add
overhead there, and on a busy 2-core machine they thrash (a 128x128x512 product measured 18 ms
threaded vs 1.5 ms single-threaded). NumPy's bundled OpenBLAS reads OPENBLAS_NUM_THREADS only at
load time, so this finds the loaded library and sets its thread count through its C API for the
duration of a block, then restores it. Where no OpenBLAS is found it does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
from collections.abc import Iterator

_LOCK = threading.Lock()
_depth = 0
_saved = 0


@functools.lru_cache(maxsize=1)
def _openblas():
    """(get, set) thread-count functions of the OpenBLAS loaded in this process, or None."""
    try:
        import numpy  # noqa: F401  (make sure NumPy's BLAS is loaded)

        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "openblas" in line.lower() and "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix, suffix in (("scipy_openblas", "64_"), ("openblas", "64_"), ("openblas", "")):
            get = getattr(lib, f"{prefix}_get_num_threads{suffix}", None)
            set_ = getattr(lib, f"{prefix}_set_num_threads{suffix}", None)
            if get is not None and set_ is not None:
                return get, set_
    return None


@contextlib.contextmanager
def single_threaded_blas() -> Iterator[None]:
    global _depth, _saved
    funcs = _openblas()
    if funcs is None:
        yield
        return
    get, set_ = funcs
    with _LOCK:
        if _depth == 0:
            _saved = get()
            set_(1)
        _depth += 1
    try:
        yield
    finally:
        with _LOCK:
            _depth -= 1
            if _depth == 0:
                set_(_saved)
