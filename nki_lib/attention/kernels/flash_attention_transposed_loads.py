"""Transposed tiles of attention inputs, loaded with the head dim on partitions, for the
flash-attention kernels (``flash_attention_fwd*.py``, ``flash_attention_bwd*.py``).

The kernels contract over the head dim (S = Q K^T, dP = dO V^T), so they need q^T, k^T, dO^T and
v^T tiles ``(dc, n)``. For 2-byte dtypes with D <= 128 they read the natural ``(B, H, S, D)``
tensors and transpose on the way in with a DMA transpose (``nisa.dma_transpose``: up to 90 % of
DMA throughput from HBM, docs/cost-model.md §2.6; each partition row of the tile is one
``n``-element run), so the launcher makes no transposed copy. Otherwise (fp32, whose DMA
transpose is not documented; D > 128, whose head-dim chunks would read 256 B pieces) the
launcher passes the ``(B, H, D, S)`` transposes and the tiles are contiguous rows of them.

Dimension legend: B batch, H heads, S sequence, D head dim, dc head-dim chunk (<= 128), n rows.
"""

from __future__ import annotations

import torch

from nki_lib._nki import nisa, nl

__all__ = ["on_chip", "as_kernel_layout", "load_transposed_into", "load_transposed"]


def on_chip(x: torch.Tensor) -> bool:
    """Whether the kernels transpose ``x`` (B, H, S, D) on chip (see the module docstring)."""
    return x.element_size() == 2 and x.shape[-1] <= nl.tile_size.pmax


def as_kernel_layout(x: torch.Tensor, natural: bool) -> torch.Tensor:
    """The launcher's tensor for :func:`load_transposed`: ``x`` itself (``natural``) or its
    ``(B, H, D, S)`` transpose (layout glue, one host copy)."""
    return x.contiguous() if natural else x.transpose(2, 3).contiguous()


def load_transposed_into(dst, x, natural, b, h, s0, n, c0, dc):
    """``dst`` ``(dc, n)`` = ``x[b, h, s0:s0 + n, c0:c0 + dc]^T`` (one DMA): a DMA transpose of
    the natural rows when ``natural``, else contiguous rows of ``x`` = the launcher's
    ``(B, H, D, S)`` transpose."""
    if natural:
        nisa.dma_transpose(dst=dst, src=x[b, h, s0:s0 + n, c0:c0 + dc])
    else:
        nisa.dma_copy(dst=dst, src=x[b, h, c0:c0 + dc, s0:s0 + n])


def load_transposed(x, natural, b, h, s0, n, chunks):
    """Fresh tiles ``(dc, n)`` per head-dim chunk ``(c0, dc)`` of ``x[b, h, s0:s0 + n, :]^T``
    (:func:`load_transposed_into`)."""
    out = []
    for c0, dc in chunks:
        t_sb = nl.ndarray((dc, n), dtype=x.dtype, buffer=nl.sbuf)
        load_transposed_into(t_sb, x, natural, b, h, s0, n, c0, dc)
        out.append(t_sb)
    return out
