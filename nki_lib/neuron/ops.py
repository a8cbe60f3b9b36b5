"""The ``neuron`` kernel of every ``torch.ops.nki`` op, eager and under ``torch.compile``.

Eager: the op's own body registered for PrivateUse1 (named ``neuron``), so neuron tensors take
the ``device`` path of :func:`nki_lib.dispatch.dispatch` (``auto`` picks it for neuron tensors)
with its eligibility checks and recorded fallback. Registering it explicitly, rather than
relying on the default kernel, keeps the op on it if a backend routes ops that only have a
default kernel to its CPU fallback (docs/neuron.md §2).

Compile: what TorchNeuron's ``nki_op`` does for its own ops (docs/neuron.md §1, §3): a FunctionalTensorMode
rule runs the op body under the mode when an input is a neuron tensor, so AOTAutograd records the
host-side preparation as aten ops and each launch as a kernel-call node; the forward and backward
ops both get it. For CPU/CUDA inputs the rule defers to the mode, and the op stays one opaque node.
"""

from __future__ import annotations

import threading

import torch
from torch._library.custom_ops import OPDEFS
from torch._subclasses.functional_tensor import FunctionalTensorMode
from torch.utils import _pytree as pytree

NAMESPACE = "nki"
_lock = threading.Lock()
_registered: set[str] = set()


def nki_opdefs() -> dict:
    """``{qualified name: CustomOpDef}`` of every op in the ``nki`` namespace."""
    return {name: opdef for name, opdef in list(OPDEFS.items()) if name.startswith(NAMESPACE + "::")}


def has_neuron_input(args, kwargs) -> bool:
    return any(isinstance(v, torch.Tensor) and v.device.type == "neuron"
               for v in pytree.tree_leaves((args, kwargs)))


def _decompose_for_neuron(body):
    def rule(mode, op, types, args, kwargs):
        if not has_neuron_input(args, kwargs):
            return mode.__torch_dispatch__(op, types, args, kwargs)
        with mode:
            return body(*args, **kwargs)

    return rule


def register_neuron_kernels() -> list[str]:
    """Register the neuron kernel and the compile rule of every nki op (idempotent). Requires
    PrivateUse1 to be named ``neuron``; returns the names registered now."""
    if torch._C._get_privateuse1_backend_name() != "neuron":
        raise RuntimeError("register_neuron_kernels: PrivateUse1 is not named 'neuron' in this process")
    done = []
    with _lock:
        for name, opdef in nki_opdefs().items():
            if name in _registered:
                continue
            opdef.register_kernel("neuron")(opdef._init_fn)
            opdef.register_torch_dispatch(FunctionalTensorMode, _decompose_for_neuron(opdef._init_fn))
            _registered.add(name)
            done.append(name)
    return done


def registered() -> set[str]:
    return set(_registered)
