"""SDPA's autocast policy for nki ops: ``follow_sdpa_autocast("<op>")``.

Inside ``torch.autocast(device_type, dtype)`` PyTorch casts the floating inputs of
``scaled_dot_product_attention`` to the region's lower-precision dtype (float64 inputs are left
alone) and the op runs with autocast off, so its outputs come out in that dtype. This registers
the same rule for a custom op on the Autocast dispatch keys (CPU and CUDA): the dtype is read
from the active region at call time, so it holds for bfloat16 and float16 regions alike, in eager
code, under ``torch.compile`` and in ``torch.export`` (the casts are traced into the graph).
Non-floating tensors (offsets, index tensors, bool masks) are never cast. ``cast_args`` (schema
argument names) limits the rule to those arguments (the MoE ops keep routing weights and
selection biases in their dtype).
"""

from __future__ import annotations

import torch

__all__ = ["follow_sdpa_autocast", "AUTOCAST_DEVICES"]

AUTOCAST_DEVICES = ("cpu", "cuda")

_LIB = torch.library.Library("nki", "FRAGMENT")  # noqa: TOR901  (holds the autocast kernels)


def _cast(value, dtype):
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64:
        return value.to(dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    return value


def follow_sdpa_autocast(op_name: str, cast_args=None) -> None:
    """Register SDPA's autocast rule for ``torch.ops.nki.<op_name>`` (idempotent per process), for
    every floating argument or only those named in ``cast_args``."""
    overload = getattr(torch.ops.nki, op_name).default
    names = [a.name for a in overload._schema.arguments]
    if cast_args is not None and set(cast_args) - set(names):
        raise ValueError(f"nki::{op_name} has no arguments {sorted(set(cast_args) - set(names))}")
    selected = set(names) if cast_args is None else set(cast_args)
    for device_type in AUTOCAST_DEVICES:
        key_name = "Autocast" + torch._C._dispatch_key_for_device(device_type)
        key_set = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key_name))

        def kernel(*args, _device_type=device_type, _key_set=key_set, **kwargs):
            dtype = torch.get_autocast_dtype(_device_type)
            args = tuple(_cast(a, dtype) if n in selected else a for n, a in zip(names, args))
            with torch._C._ExcludeDispatchKeyGuard(_key_set):
                return overload(*args, **{k: _cast(v, dtype) if k in selected else v for k, v in kwargs.items()})

        _LIB.impl(op_name, kernel, key_name)
