"""Autocast for the nki ops: ``scaled_dot_product_attention``'s policy, in eager and compiled code.

SDPA sits on autocast's lower-precision list: inside an enabled ``torch.autocast`` region its
floating inputs are cast to the region's dtype and it computes and returns in that dtype. Each op
here names the arguments that follow that rule; :func:`register_autocast` installs an Autocast
kernel (one per device type with autocast) that casts those arguments to
``torch.get_autocast_dtype(device_type)`` (differentiably: gradients flow back to the original
dtype) and calls the op below the Autocast key, so the op itself never sees autocast (and
``nki_lib.dispatch`` disables it around the paths). Because it is a dispatcher kernel, the same
rule applies when torch.compile traces the op (AOTAutograd traces through the Autocast key).
Arguments not named (routing weights, integer metadata, selection biases) keep their dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_DEVICE_TYPES = ("cpu", "cuda", "xpu", "xla")
_LIB = torch.library.Library("nki", "FRAGMENT")   # noqa: TOR901  (kernels for ops defined elsewhere)


def _available(device_type: str) -> bool:
    try:
        return bool(torch._C._is_autocast_available(device_type))
    except RuntimeError:
        return False


def _cast(value, dtype):
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64:
        return value.to(dtype)
    return value


def register_autocast(qualname: str, cast_args: Sequence[str]) -> None:
    """Cast the arguments ``cast_args`` (schema names) of ``qualname`` (``"nki::<op>"``) to the
    autocast dtype inside enabled autocast regions. float64 arguments are left alone (autocast
    leaves float64 untouched for SDPA too)."""
    namespace, name = qualname.split("::")
    op = getattr(getattr(torch.ops, namespace), name).default
    positions = {a.name: i for i, a in enumerate(op._schema.arguments)}
    unknown = [a for a in cast_args if a not in positions]
    if unknown:
        raise ValueError(f"{qualname} has no arguments {unknown}")
    cast_positions = {positions[a] for a in cast_args}
    for device_type in filter(_available, _DEVICE_TYPES):
        key = "Autocast" + torch._C._dispatch_key_for_device(device_type)
        if not hasattr(torch._C.DispatchKey, key):
            continue
        _LIB.impl(name, _kernel(op, device_type, key, cast_positions, set(cast_args)), key, with_keyset=True)


def _kernel(op, device_type, key, cast_positions, cast_names):
    exclude = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))

    def kernel(keyset, *args, **kwargs):
        dtype = torch.get_autocast_dtype(device_type)
        args = tuple(_cast(a, dtype) if i in cast_positions else a for i, a in enumerate(args))
        kwargs = {k: _cast(v, dtype) if k in cast_names else v for k, v in kwargs.items()}
        with torch._C._ExcludeDispatchKeyGuard(exclude):
            return op(*args, **kwargs)

    return kernel
