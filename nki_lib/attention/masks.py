"""Which keys a query sees (docs/contract.md §3), as small pure predicates on index tensors.

With ``off = Sk - Sq`` (bottom-right alignment), key j is visible to query i iff
``not causal or j <= i + off``, ``window_left < 0 or j >= i + off - window_left``,
``window_right < 0 or j <= i + off + window_right`` and, with ``cu_seqlens``, i and j lie in the
same document (each document aligned on its own: with ``cu_seqlens_k`` its ``off`` is its key
count minus its query count). The reference, the naive oracle and the kernels' host-side tile planning all use
these definitions.
"""

from __future__ import annotations

import torch


def visible(q_idx: torch.Tensor, k_idx: torch.Tensor, *, sq: int, sk: int, causal: bool,
            window_left: int, window_right: int) -> torch.Tensor:
    """Boolean mask ``[len(q_idx), len(k_idx)]`` of the causal/window rules."""
    return visible_at(q_idx, k_idx, offset=sk - sq, causal=causal, window_left=window_left,
                      window_right=window_right)


def visible_at(q_idx: torch.Tensor, k_idx: torch.Tensor, *, offset: int, causal: bool,
               window_left: int, window_right: int) -> torch.Tensor:
    """The causal/window rules with query i aligned to key ``i + offset``."""
    diag = q_idx[:, None] + offset               # the key aligned with each query
    k = k_idx[None, :]
    mask = torch.ones(q_idx.numel(), k_idx.numel(), dtype=torch.bool, device=q_idx.device)
    if causal:
        mask &= k <= diag
    if window_left >= 0:
        mask &= k >= diag - window_left
    if window_right >= 0:
        mask &= k <= diag + window_right
    return mask


def segment_ids(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """Document id of every position ``0 .. length-1`` for packed sequences."""
    pos = torch.arange(length, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens[1:].contiguous(), pos, right=True)


def full_mask(sq: int, sk: int, *, causal: bool, window_left: int, window_right: int,
              cu_seqlens: torch.Tensor | None, device,
              cu_seqlens_k: torch.Tensor | None = None) -> torch.Tensor:
    """The dense ``[Sq, Sk]`` mask (for the naive oracle and small problems only). With
    ``cu_seqlens`` (and ``cu_seqlens_k`` for keys, default the same offsets) each document is
    bottom-right aligned on its own and sees only its own keys."""
    if cu_seqlens is None:
        return visible(torch.arange(sq, device=device), torch.arange(sk, device=device), sq=sq,
                       sk=sk, causal=causal, window_left=window_left, window_right=window_right)
    cu_q = [int(x) for x in cu_seqlens.tolist()]
    cu_k = cu_q if cu_seqlens_k is None else [int(x) for x in cu_seqlens_k.tolist()]
    mask = torch.zeros(sq, sk, dtype=torch.bool, device=device)
    for q0, q1, k0, k1 in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]):
        mask[q0:q1, k0:k1] = visible(torch.arange(q1 - q0, device=device),
                                     torch.arange(k1 - k0, device=device), sq=q1 - q0,
                                     sk=k1 - k0, causal=causal, window_left=window_left,
                                     window_right=window_right)
    return mask


def tile_is_visible(q_start: int, q_stop: int, k_start: int, k_stop: int, *, sq: int, sk: int,
                    causal: bool, window_left: int, window_right: int) -> bool:
    """Static check: may any key of ``[k_start, k_stop)`` be visible to any query of
    ``[q_start, q_stop)`` under the causal/window rules? (Kernels skip tiles where it is False.)"""
    off = sk - sq
    lo_diag, hi_diag = q_start + off, q_stop - 1 + off
    if causal and k_start > hi_diag:
        return False
    if window_left >= 0 and k_stop - 1 < lo_diag - window_left:
        return False
    if window_right >= 0 and k_start > hi_diag + window_right:
        return False
    return True


def tile_is_full(q_start: int, q_stop: int, k_start: int, k_stop: int, *, sq: int, sk: int,
                 causal: bool, window_left: int, window_right: int) -> bool:
    """Static check: is every key of the tile visible to every query (no mask needed)?"""
    off = sk - sq
    lo_diag, hi_diag = q_start + off, q_stop - 1 + off
    if causal and k_stop - 1 > lo_diag:
        return False
    if window_left >= 0 and k_start < hi_diag - window_left:
        return False
    if window_right >= 0 and k_stop - 1 > lo_diag + window_right:
        return False
    return True
