"""nki-lib on TorchNeuron's ``neuron`` device, real or emulated.

* On a Trainium host (``torch_neuronx`` renamed PrivateUse1 to ``neuron``), ``import nki_lib``
  registers a ``neuron`` kernel for every ``torch.ops.nki`` op: it runs the op's NKI kernels on
  the ``device`` path (eligibility checks, recorded fallback), and under
  ``torch.compile(backend="neuron")`` the op body is traced for neuron inputs so the kernel
  launch is a graph node (:mod:`nki_lib.neuron.ops`). Nothing here imports the Neuron stack.
* :func:`emulate_neuron` gives any machine that device: PrivateUse1 renamed to ``neuron`` with
  PyTorch's Python-backend support, aten ops on the CPU underneath (counted in the coverage
  ledger), the same op registration, with ``nki_lib.simulator`` standing in for the real ``nki``
  and a stand-in ``neuron`` compile backend (:mod:`nki_lib.neuron.compile_backend`).
"""

from __future__ import annotations

import sys

import torch

from nki_lib.neuron import emulation
from nki_lib.neuron.emulation import EmulationError

__all__ = ["EmulationError", "emulate_neuron", "is_emulated", "launch_on_device", "real_neuron_loaded"]


def real_neuron_loaded() -> bool:
    """True when TorchNeuron owns PrivateUse1 (``torch_neuronx`` loaded, backend named neuron)."""
    return "torch_neuronx" in sys.modules and torch._C._get_privateuse1_backend_name() == "neuron"


def is_emulated() -> bool:
    """True once :func:`emulate_neuron` has run in this process."""
    return emulation.active()


def emulate_neuron() -> None:
    """Make ``neuron`` a device of this process, emulated on the CPU (once per process; calling it
    again is a no-op). Raises :class:`EmulationError` when torch_neuronx is loaded or PrivateUse1
    is already taken."""
    from nki_lib.neuron import compile_backend, ops

    emulation.setup()
    ops.register_neuron_kernels()
    compile_backend.register()


def launch_on_device(kernel, grid: int, args: tuple, kwargs: dict, op: str | None = None):
    """Launch ``kernel[grid](*args, **kwargs)`` for nki op ``op`` on neuron tensors (the ``device``
    path).

    Emulated: through ``nki_kernel_call`` (simulator underneath, a graph node under compile).
    Real: through TorchNeuron's ``wrap_nki`` caller with the grid set on the caller (a grid set on
    the kernel before ``wrap_nki`` is lost, docs/neuron.md §1), else the real kernel's own
    call, which routes neuron tensors to TorchNeuron's kernel HOP.
    """
    if emulation.active():
        from nki_lib.neuron.kernel_call import launch

        return launch(kernel, grid, args, kwargs, op=op)
    wrap_nki = getattr(sys.modules.get("torch_neuronx"), "wrap_nki", None)
    if wrap_nki is not None:
        caller = wrap_nki(kernel)
        return (caller[grid] if grid != 1 else caller)(*args, **kwargs)
    return (kernel[grid] if grid != 1 else kernel)(*args, **kwargs)
