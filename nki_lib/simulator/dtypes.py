"""NKI dtypes: names, NumPy/ml_dtypes storage types, and the engine casting rules.

NKI dtypes are strings (``nl.bfloat16 == "bfloat16"``); ``NkiDType`` also compares equal to the
matching NumPy / ml_dtypes dtype. Engines compute in fp32 and cast on write: floats round to
nearest even (ml_dtypes), floats -> ints round half to even and saturate (NaN -> 0), ints -> ints
wrap (two's complement), anything -> bool is ``!= 0``. Packed MX x4 types are raw containers.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

__all__ = ["NkiDType", "as_dtype", "np_dtype", "cast_to", "to_f32", "is_float", "is_int",
           "ALL_DTYPES", "from_numpy"]


class NkiDType(str):
    """An NKI dtype: a ``str`` that also equals the matching NumPy dtype."""

    __slots__ = ()

    def __eq__(self, other):
        if isinstance(other, str):
            return str.__eq__(self, other)
        try:
            return str.__eq__(self, from_numpy(np.dtype(other)))
        except Exception:
            return NotImplemented

    def __ne__(self, other):
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    __hash__ = str.__hash__

    def __repr__(self) -> str:
        return f"nl.{str(self)}"

    @property
    def itemsize(self) -> int:
        return _INFO[self][1]

    @property
    def np(self) -> np.dtype:
        return _INFO[self][0]


_PACKED = {"float8_e5m2_x4", "float8_e4m3fn_x4", "float4_e2m1fn_x4"}
_INFO: dict[str, tuple[np.dtype, int]] = {
    "bool": (np.dtype(np.bool_), 1),
    "int8": (np.dtype(np.int8), 1),
    "int16": (np.dtype(np.int16), 2),
    "int32": (np.dtype(np.int32), 4),
    "uint8": (np.dtype(np.uint8), 1),
    "uint16": (np.dtype(np.uint16), 2),
    "uint32": (np.dtype(np.uint32), 4),
    "float16": (np.dtype(np.float16), 2),
    "bfloat16": (np.dtype(ml_dtypes.bfloat16), 2),
    "tfloat32": (np.dtype(np.float32), 4),
    "float32": (np.dtype(np.float32), 4),
    "float8_e4m3": (np.dtype(ml_dtypes.float8_e4m3), 1),
    "float8_e4m3fn": (np.dtype(ml_dtypes.float8_e4m3fn), 1),
    "float8_e5m2": (np.dtype(ml_dtypes.float8_e5m2), 1),
    "float8_e8m0fnu": (np.dtype(ml_dtypes.float8_e8m0fnu), 1),
    "float8_e5m2_x4": (np.dtype(np.uint32), 4),
    "float8_e4m3fn_x4": (np.dtype(np.uint32), 4),
    "float4_e2m1fn_x4": (np.dtype(np.uint16), 2),
}
ALL_DTYPES = {name: NkiDType(name) for name in _INFO}
_INFO = {ALL_DTYPES[k]: v for k, v in _INFO.items()}
_FROM_NP = {}
for _name, (_np, _) in _INFO.items():
    if _name not in _PACKED and _name != "tfloat32":
        _FROM_NP[_np] = ALL_DTYPES[_name]
_FLOATS = {ALL_DTYPES[n] for n in ("float16", "bfloat16", "tfloat32", "float32", "float8_e4m3",
                                   "float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu")}
_INTS = {ALL_DTYPES[n] for n in ("int8", "int16", "int32", "uint8", "uint16", "uint32")}
_TORCH_NAMES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16", "int8": "int8",
                "int16": "int16", "int32": "int32", "uint8": "uint8", "uint16": "uint16",
                "uint32": "uint32", "bool": "bool", "float8_e4m3fn": "float8_e4m3fn",
                "float8_e5m2": "float8_e5m2"}
_REJECTED = ("float64", "int64", "uint64", "complex64", "complex128", "longdouble")


def from_numpy(dt: np.dtype) -> NkiDType:
    """The NKI dtype stored as NumPy dtype ``dt``; TypeError for float64/int64 and friends."""
    if dt in _FROM_NP:
        return _FROM_NP[dt]
    raise TypeError(f"dtype {dt} is not an NKI dtype (NKI has no 64-bit or complex types)")


def as_dtype(dtype, argname: str = "dtype") -> NkiDType:
    """Normalise an NKI dtype given as NkiDType, name string, NumPy/ml_dtypes dtype or torch dtype."""
    if isinstance(dtype, NkiDType):
        return dtype
    if isinstance(dtype, str):
        name = dtype[3:] if dtype.startswith("nl.") else dtype
        if name == "bool_":
            name = "bool"
        if name in ALL_DTYPES:
            return ALL_DTYPES[name]
        raise TypeError(f"{argname}: unknown NKI dtype {dtype!r}")
    mod = type(dtype).__module__
    if mod.startswith("torch"):
        name = str(dtype).removeprefix("torch.")
        if name in _TORCH_NAMES:
            return ALL_DTYPES[_TORCH_NAMES[name]]
        raise TypeError(f"{argname}: torch dtype {dtype} is not an NKI dtype")
    try:
        dt = np.dtype(dtype)
    except Exception as exc:
        raise TypeError(f"{argname}: {dtype!r} is not a dtype") from exc
    try:
        return from_numpy(dt)
    except TypeError as exc:
        raise TypeError(f"{argname}: {exc}") from None


def np_dtype(dtype: NkiDType) -> np.dtype:
    return _INFO[dtype][0]


def is_float(dtype: NkiDType) -> bool:
    return dtype in _FLOATS


def is_int(dtype: NkiDType) -> bool:
    return dtype in _INTS


def is_packed(dtype: NkiDType) -> bool:
    return dtype in _PACKED


_INT_RANGE = {d: (np.iinfo(_INFO[d][0]).min, np.iinfo(_INFO[d][0]).max) for d in _INTS}


def to_f32(values: np.ndarray, dtype: NkiDType) -> np.ndarray:
    """Engine input conversion: any stored dtype -> fp32 (a fresh array)."""
    if dtype in _PACKED:
        raise TypeError(f"packed dtype {dtype} cannot be used in arithmetic")
    return values.astype(np.float32)


def _round_tf32(values: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).copy()
    finite = np.isfinite(values)
    bits[finite] = (bits[finite] + np.uint32(0x0FFF) + ((bits[finite] >> np.uint32(13)) & np.uint32(1))) \
        & np.uint32(0xFFFFE000)
    return bits.view(np.float32)


def cast_to(values, dtype: NkiDType) -> np.ndarray:
    """Engine output conversion of fp32 (or exact integer) ``values`` to ``dtype`` storage."""
    values = np.asarray(values)
    if dtype in _FLOATS:
        if dtype == "tfloat32":
            return _round_tf32(values.astype(np.float32))
        if values.dtype.kind in "iub":
            values = values.astype(np.float32)
        return values.astype(_INFO[dtype][0])
    if dtype in _INTS:
        if values.dtype.kind in "iub":
            return values.astype(_INFO[dtype][0])
        lo, hi = _INT_RANGE[dtype]
        rounded = np.nan_to_num(np.rint(values.astype(np.float64)), nan=0.0, posinf=hi, neginf=lo)
        return np.clip(rounded, lo, hi).astype(_INFO[dtype][0])
    if dtype == "bool":
        return values != 0
    raise TypeError(f"cannot convert values to packed dtype {dtype}")
