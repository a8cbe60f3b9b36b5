"""``nki.tensor``: trace-time (compile-time) constant tensors for ``nl.shared_constant``.

The AWS docs of ``nki.language.shared_constant`` (SDK 2.33) take "a trace-time tensor ... created
using functions from nki.tensor such as nki.tensor.zeros(), nki.tensor.identity()" (example:
``nl.shared_constant(ntensor.identity(128, dtype=nl.int8), dtype=nl.float16)``), and NKI Library
kernels do ``import nki.tensor as ntensor`` (core/embeddings/rope.py). Such a tensor is host data
known while tracing, so here it is a NumPy array in the NKI dtype's storage type; no instruction
runs. ``install_as_nki`` aliases ``nki.tensor`` to ``tensor.py``, which re-exports these.
Not provided: ``arange`` (also named by the docs; its signature is not documented there).
"""

from __future__ import annotations

import numpy as np

from .dtypes import as_dtype, np_dtype

__all__ = ["identity", "zeros"]


def identity(n, dtype):
    """An ``n`` x ``n`` identity matrix as trace-time data of NKI dtype ``dtype``."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n <= 0:
        raise ValueError(f"identity: n must be a positive int, got {n!r}")
    return np.eye(int(n), dtype=np.float32).astype(np_dtype(as_dtype(dtype)))


def zeros(shape, dtype):
    """Zeros of ``shape`` (an int or a tuple of positive ints) as trace-time data of NKI dtype ``dtype``."""
    dims = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    if not dims or any(isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d <= 0 for d in dims):
        raise ValueError(f"zeros: shape must be positive ints, got {shape!r}")
    return np.zeros(tuple(int(d) for d in dims), dtype=np_dtype(as_dtype(dtype)))
