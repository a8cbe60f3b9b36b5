"""The gate activations of the expert MLPs, shared by the reference and the NKI kernels.

``ACTIVATIONS`` names them (PyTorch's definitions: ``silu``, ``gelu`` = the erf form, ``gelu_tanh``
= ``F.gelu(approximate="tanh")``); ``GELU_TANH_C`` and ``GELU_TANH_A`` are the two constants of
the tanh approximation ``0.5 g (1 + tanh(C (g + A g^3)))``.
"""

from __future__ import annotations

import math

__all__ = ["ACTIVATIONS", "GELU_TANH_C", "GELU_TANH_A"]

ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
GELU_TANH_C = (2.0 / math.pi) ** 0.5   # sqrt(2 / pi) of the tanh approximation
GELU_TANH_A = 0.044715                 # cubic coefficient of the tanh approximation
