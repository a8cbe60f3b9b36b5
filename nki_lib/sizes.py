"""Sizes shared by the kernels, their launchers, the references and the benchmarks.

* :func:`ceil_div` -- the one ceiling division (ints, or integer tensors elementwise);
* :func:`spans` -- ``((start, size), ...)`` tiles covering ``[0, length)``;
* :func:`floor_pow2` / :func:`ceil_pow2` -- the largest power of two not above a count, the
  smallest not below it (at least 1);
* :data:`DTYPE_BYTES` / :func:`dtype_bytes` -- element sizes of the NKI data types
  (``FP32_BYTES``, ``HALF_BYTES`` for the float32 and bfloat16/float16 widths kernels budget with).
"""

from __future__ import annotations

__all__ = ["ceil_div", "spans", "floor_pow2", "ceil_pow2", "DTYPE_BYTES", "dtype_bytes", "FP32_BYTES", "HALF_BYTES"]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
FP32_BYTES = DTYPE_BYTES["float32"]
HALF_BYTES = DTYPE_BYTES["bfloat16"]     # bfloat16 / float16


def ceil_div(a, b):
    """``ceil(a / b)`` for integers ``b > 0`` (``a`` an int or an integer tensor)."""
    return -(-a // b)


def spans(length: int, width: int) -> tuple:
    """``((start, size), ...)`` covering ``[0, length)`` with sizes ``width`` (the last may be
    shorter): partial tiles at the end are handled in the kernel, never padded in HBM."""
    return tuple((start, min(width, length - start)) for start in range(0, length, width))


def floor_pow2(x) -> int:
    """The largest power of two ``<= max(1, x)`` (``x`` a count: tiles, slots, heads)."""
    return 1 << (max(1, int(x)).bit_length() - 1)


def ceil_pow2(x) -> int:
    """The smallest power of two ``>= max(1, x)`` (``x`` a count)."""
    return 1 << (max(1, int(x)) - 1).bit_length()


def dtype_bytes(dtype) -> int:
    """Element size of an NKI data type given as a torch dtype or its name; ValueError otherwise."""
    name = str(dtype).replace("torch.", "")
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype: no NKI element size for {dtype!r}")
    return DTYPE_BYTES[name]
