"""Constants of the gate activations shared by the expert MLP reference and the NKI kernels.

``GELU_TANH_C`` and ``GELU_TANH_A`` are the two constants of the tanh approximation of GELU,
``0.5 g (1 + tanh(C (g + A g^3)))`` (PyTorch's ``F.gelu(approximate="tanh")``).
"""

from __future__ import annotations

import math

__all__ = ["GELU_TANH_C", "GELU_TANH_A"]

GELU_TANH_C = (2.0 / math.pi) ** 0.5   # sqrt(2 / pi) of the tanh approximation
GELU_TANH_A = 0.044715                 # cubic coefficient of the tanh approximation
