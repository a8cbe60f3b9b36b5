"""The one torch <-> NumPy bridge: bit-exact conversions with the ml_dtypes dtypes NKI uses.

Used by ``nki_lib.dispatch`` (kernel arguments and outputs on the simulator path) and by
``nki_lib.simulator.launch`` (torch arguments of ``simulate``). bfloat16 and the float8 types have
no NumPy builtin: they travel as same-width integers and are viewed as the ml_dtypes type.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

__all__ = ["numpy_view", "to_numpy", "to_torch", "numpy_dtype", "torch_dtype"]

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
    torch.uint16: np.dtype(np.uint16),
    torch.uint32: np.dtype(np.uint32),
    torch.bool: np.dtype(np.bool_),
}
_NUMPY_TO_TORCH = {v: k for k, v in _TORCH_TO_NUMPY.items()}
# dtypes NumPy cannot hold natively: moved as the same-width integer, then viewed.
_CARRIER = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The NumPy (ml_dtypes) dtype holding torch ``dtype`` bit for bit; TypeError if none does."""
    if dtype not in _TORCH_TO_NUMPY:
        raise TypeError(f"no NKI dtype for torch dtype {dtype}")
    return _TORCH_TO_NUMPY[dtype]


def torch_dtype(dtype) -> torch.dtype:
    """The torch dtype of a NumPy (ml_dtypes) dtype a kernel returned; TypeError if none."""
    out = _NUMPY_TO_TORCH.get(np.dtype(dtype))
    if out is None:
        raise TypeError(f"no torch dtype for numpy dtype {dtype}")
    return out


def numpy_view(t: torch.Tensor) -> np.ndarray:
    """A NumPy array sharing memory with the contiguous CPU tensor ``t`` (no copy)."""
    np_dtype = numpy_dtype(t.dtype)
    carrier = _CARRIER.get(t.dtype)
    if carrier is not None:
        return t.view(carrier).numpy().view(np_dtype)
    return t.numpy()


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU NumPy copy of ``t`` with the matching (ml_dtypes) dtype, bit-exact."""
    numpy_dtype(t.dtype)
    return numpy_view(t.detach().to("cpu").contiguous()).copy()


def to_torch(a: np.ndarray, device: torch.device | str = "cpu") -> torch.Tensor:
    """A torch tensor (a copy) from a NumPy (ml_dtypes) array, bit-exact, on ``device``."""
    dtype = torch_dtype(a.dtype)
    a = np.ascontiguousarray(a)
    carrier = _CARRIER.get(dtype)
    if carrier is not None:
        out = torch.from_numpy(a.view(numpy_dtype(carrier)).copy()).view(dtype)
    else:
        out = torch.from_numpy(a.copy())
    return out.to(device)
