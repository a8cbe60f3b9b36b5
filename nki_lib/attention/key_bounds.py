"""Per-row key bounds: the host metadata that lets the flash kernels serve padded batches and
packed documents with their own key offsets (``attn_mask``, ``cu_seqlens``, ``cu_seqlens_k``).

Every mask the kernels take gives query row ``(b, i)`` one interval of visible keys
``[lo, hi]`` (inclusive, absolute key indices; empty when ``lo > hi``): the causal/window rules
of docs/contract.md §3.1 (``masks``), the document of the row (``cu_seqlens``, with
``cu_seqlens_k`` its own key range and bottom-right alignment), and an ``attn_mask`` whose
allowed keys form one contiguous run per row (key padding, left or right, as transformers and
``nki_lib.sdpa`` pass it). :func:`plan` intersects them into a ``(B, 2, Sq)`` float32 tensor
(``[:, 0]`` = lo, ``[:, 1]`` = hi) that the kernels load per query tile (``tiles.row_bounds``)
and apply with one ``range_select`` per partial score tile. Shapes are static (B, Sq): nothing
data-dependent reaches a graph, the op stays opaque to ``torch.compile`` / ``export``.

What stays static: the causal/window flags still drive the kernels' compile-time tile skipping
when they hold for every row, i.e. without ``cu_seqlens_k`` (each document of ``cu_seqlens_k``
has its own diagonal, which is data); then the kernels get the flags off and every key tile
is visited and masked by the bounds alone.

What is not expressible (:func:`plan` returns the reason, the op records it as a fallback):
an ``attn_mask`` that varies over heads, an additive mask with values other than 0 and -inf
(they change scores; a large finite negative also changes rows with no allowed key), NaN in a
mask, and a row whose allowed keys are not contiguous (holes).

Cost: O(B * Sq) for the bounds, plus one pass over the mask as given: O(B * Sk) for a key
padding mask (B, 1, 1, Sk), O(B * Sq * Sk) only for a per-query mask (B, 1, Sq, Sk).
Dimension legend: B batch, Hq query heads, Sq/Sk lengths, N documents.
"""

from __future__ import annotations

import torch

from nki_lib.attention import masks

__all__ = ["KernelMask", "plan", "static_bounds", "document_bounds", "mask_bounds"]


class KernelMask:
    """What the kernels receive for one call: ``bounds`` (B, 2, Sq) float32 or None, and the
    causal/window flags they apply statically (tile skipping, in-kernel diagonal masks)."""

    def __init__(self, bounds, causal, window_left, window_right):
        self.bounds = bounds
        self.flags = dict(causal=causal, window_left=window_left, window_right=window_right)


def plan(q, k, cu_seqlens, cu_seqlens_k, attn_mask, *, causal, window_left, window_right):
    """The kernels' form of a call's mask, or the reason (str) it has none. Arguments as the op
    takes them after ``flash_attention_op._prepare`` (offsets checked, ``cu_seqlens_k`` equal to
    ``cu_seqlens`` dropped, the mask's key dim expanded)."""
    b, sq, sk = q.shape[0], q.shape[2], k.shape[2]
    rules = dict(causal=causal, window_left=window_left, window_right=window_right)
    if cu_seqlens is None and attn_mask is None:
        return KernelMask(None, **rules)
    if cu_seqlens is not None:
        lo, hi = document_bounds(cu_seqlens, cu_seqlens_k, sq, sk, **rules)
    else:
        lo, hi = static_bounds(sq, sk, device=q.device, **rules)
    lo, hi = lo.expand(b, sq), hi.expand(b, sq)
    if attn_mask is not None:
        found = mask_bounds(attn_mask, b, sq)
        if isinstance(found, str):
            return found
        lo, hi = torch.maximum(lo, found[0]), torch.minimum(hi, found[1])
    bounds = torch.stack([lo, hi], dim=1).to(torch.float32).contiguous()
    if cu_seqlens_k is not None:     # per-document diagonals: the bounds carry the rules
        return KernelMask(bounds, False, -1, -1)
    return KernelMask(bounds, **rules)


def static_bounds(sq, sk, *, device, causal, window_left, window_right):
    """(lo, hi) int64 (1, Sq) of the causal/window rules, bottom-right aligned."""
    diag = torch.arange(sq, device=device, dtype=torch.int64) + (sk - sq)
    return _rule_bounds(diag, torch.zeros_like(diag), torch.full_like(diag, sk - 1), causal,
                        window_left, window_right)


def document_bounds(cu_seqlens, cu_seqlens_k, sq, sk, *, causal, window_left, window_right):
    """(lo, hi) int64 (1, Sq): each query sees its own document's keys (``cu_seqlens_k``, default
    the query offsets), under the causal/window rules aligned bottom-right within the document."""
    cu_q = cu_seqlens.to(torch.int64)
    cu_k = cu_q if cu_seqlens_k is None else cu_seqlens_k.to(torch.int64)
    seg = masks.segment_ids(cu_q, sq)
    first, end = cu_k[seg], cu_k[seg + 1]
    diag = torch.arange(sq, device=cu_q.device, dtype=torch.int64) - cu_q[seg + 1] + end
    return _rule_bounds(diag, first, end - 1, causal, window_left, window_right)


def _rule_bounds(diag, lo, hi, causal, window_left, window_right):
    """[lo, hi] narrowed by the rules around each row's aligned key ``diag``; (1, Sq) each."""
    if window_left >= 0:
        lo = torch.maximum(lo, diag - window_left)
    if causal:
        hi = torch.minimum(hi, diag)
    if window_right >= 0:
        hi = torch.minimum(hi, diag + window_right)
    return lo[None], hi[None]


def mask_bounds(attn_mask, b, sq):
    """(lo, hi) int64 (B, Sq) of the allowed keys of each row of ``attn_mask`` (4-D, key dim
    full), or the reason (str) they are not one interval per row. Empty rows get lo > hi."""
    mask = attn_mask
    if mask.shape[1] != 1:
        if mask.stride(1) != 0:
            return "attn_mask varies over heads (the kernels take one key interval per row)"
        mask = mask[:, :1]
    if mask.shape[2] != 1 and mask.stride(2) == 0:
        mask = mask[:, :, :1]
    keep = _allowed(mask[:, 0])
    if isinstance(keep, str):
        return keep
    sk = keep.shape[-1]
    count = keep.sum(-1)
    first = keep.to(torch.uint8).argmax(-1)
    last = sk - 1 - keep.flip(-1).to(torch.uint8).argmax(-1)
    if bool(((count > 0) & (count != last - first + 1)).any()):
        return "attn_mask rows with holes (allowed keys not contiguous)"
    lo = torch.where(count > 0, first, sk)
    hi = torch.where(count > 0, last, -1)
    return lo.expand(b, sq), hi.expand(b, sq)


def _allowed(mask):
    """Bool (B', Sq', Sk) of the keys a mask allows, or the reason it is not a pure allow mask."""
    if mask.dtype == torch.bool:
        return mask
    zero, blocked = mask == 0, mask == float("-inf")
    if not bool((zero | blocked).all()):
        return "additive attn_mask with values other than 0 and -inf"
    return zero
