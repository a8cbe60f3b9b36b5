"""Argument rules shared by the attention ops, their references and their kernels' launchers.

* ``MAX_HEAD_DIM``: the largest head dim D the attention ops accept (the kernels tile D by 128);
* :func:`resolve_scale`: the softmax scale of a call (``D ** -0.5`` when ``scale`` is None);
* :func:`lse_dtype`: the dtype of the returned lse (float32, float64 for float64 inputs).
"""

from __future__ import annotations

import torch

__all__ = ["MAX_HEAD_DIM", "resolve_scale", "lse_dtype"]

MAX_HEAD_DIM = 256


def resolve_scale(scale: float | None, head_dim: int) -> float:
    return head_dim ** -0.5 if scale is None else float(scale)


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32
