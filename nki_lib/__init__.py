"""nki-lib: NKI (Trainium) kernels for attention and Mixture-of-Experts as PyTorch custom ops.

``import nki_lib`` registers every op in the ``nki`` namespace (``torch.ops.nki.<name>``).
"""

import torch

from nki_lib import attention, moe  # noqa: E402  (register the ops in torch.ops.nki)
from nki_lib.attention import decode_attention, flash_attention
from nki_lib.attention.sdpa import sdpa
from nki_lib.backend import get_backend, is_strict, set_backend, set_strict, strict, use_backend
from nki_lib.coverage import coverage, reset_coverage
from nki_lib.dispatch import NKIFallbackError, Unsupported
from nki_lib.migration import dry_run
from nki_lib.neuron import emulate_neuron

if torch._C._get_privateuse1_backend_name() == "neuron":   # TorchNeuron loaded: neuron kernels now
    from nki_lib.neuron.ops import register_neuron_kernels

    register_neuron_kernels()

__version__ = "0.1.0"

__all__ = [
    "set_backend", "get_backend", "use_backend", "set_strict", "is_strict", "strict",
    "coverage", "reset_coverage", "NKIFallbackError", "Unsupported", "flash_attention",
    "decode_attention", "sdpa", "attention", "moe", "emulate_neuron", "dry_run",
]
