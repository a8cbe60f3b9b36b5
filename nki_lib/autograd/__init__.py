"""Shared autograd glue for the ops' ``register_autograd`` formulas.

Per-op formulas stay in ``<family>/<op>_op.py``; this module holds only what every op repeats.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def forbid_double_backward(backward_op, forward_name: str) -> None:
    """Make differentiating through ``backward_op`` raise a clear error (double backward)."""

    def _backward(ctx, *grads):
        raise NotImplementedError(
            f"double backward through nki::{forward_name} is not supported (its backward op "
            f"is not differentiable); use the reference path with torch.func for higher-order grads"
        )

    def _setup_context(ctx, inputs, keyword_only_inputs, output):
        return None

    backward_op.register_autograd(_backward, setup_context=_setup_context)


def masked_grads(needs: Sequence[bool], grads: Sequence[torch.Tensor | None]) -> tuple:
    """``None`` for every input whose ``ctx.needs_input_grad`` is False.

    ``grads`` lists one entry per positional input of the schema. The dispatcher drops trailing
    arguments equal to their defaults before autograd sees them, so ``needs`` may be shorter:
    the result has one entry per input autograd actually received.
    """
    if len(needs) > len(grads):
        raise ValueError(f"{len(grads)} gradients for {len(needs)} inputs")
    return tuple(g if need else None for need, g in zip(needs, grads))


def zeros_if_none(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """Autograd hands ``None`` for outputs that did not reach the loss; kernels want tensors."""
    return torch.zeros_like(like) if grad is None else grad.contiguous()
