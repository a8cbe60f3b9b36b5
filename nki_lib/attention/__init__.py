"""Attention: ``torch.ops.nki.flash_attention`` (training) and its functional wrapper."""

from __future__ import annotations

import torch

from nki_lib.attention import flash_attention_op  # noqa: F401  (registers the ops)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    scale: float | None = None, window: tuple[int, int] = (-1, -1),
                    softcap: float = 0.0, sinks: torch.Tensor | None = None,
                    cu_seqlens: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
                    attn_mask: torch.Tensor | None = None, return_lse: bool = False):
    """Flash attention over q (B, Hq, Sq, D), k/v (B, Hkv, Sk, D); see docs/contract.md §3.1.

    ``window = (left, right)``, -1 for unbounded; masks are bottom-right aligned. Packed
    documents: ``cu_seqlens`` (query offsets) and optionally ``cu_seqlens_k`` (key offsets; each
    document bottom-right aligned on its own). Padded batches: ``attn_mask`` bool (B, 1, 1, Sk)
    key padding (or any 4-D bool / additive mask broadcastable to (B, Hq, Sq, Sk)). Returns
    ``out`` (B, Hq, Sq, D), or ``(out, lse)`` with ``lse`` float32 (B, Hq, Sq) when ``return_lse``.
    """
    if not (isinstance(window, (tuple, list)) and len(window) == 2):
        raise ValueError(f"window must be a pair (left, right), got {window!r}")
    if not all(isinstance(w, int) and not isinstance(w, bool) for w in window):
        raise TypeError(f"window must hold two ints (-1 for unbounded), got {window!r}")
    out, lse = torch.ops.nki.flash_attention(q, k, v, sinks, cu_seqlens, cu_seqlens_k, attn_mask,
                                             causal=causal, scale=scale,
                                             window_left=window[0], window_right=window[1],
                                             softcap=softcap)
    return (out, lse) if return_lse else out


from nki_lib.attention import decode_attention_op as _decode  # noqa: E402,F401  (registers torch.ops.nki.decode_attention)

KV_LAYOUTS = ("HND", "NHD")   # cache dims after the batch/block dim: (Hkv, tokens, D) or (tokens, Hkv, D)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     cache_seqlens: torch.Tensor, *, block_table: torch.Tensor | None = None,
                     sinks: torch.Tensor | None = None, cache_start: torch.Tensor | None = None,
                     scale: float | None = None, window_left: int = -1, softcap: float = 0.0,
                     return_lse: bool = False, kv_layout: str = "HND"):
    """Attention of new tokens q (B, Hq, Sq, D) over a KV cache that already holds them.

    Contiguous cache: k_cache/v_cache (B, Hkv, Smax, D). Paged cache: (num_blocks, Hkv,
    block_size, D) with ``block_table`` int32 (B, max_blocks). ``kv_layout="NHD"`` takes the
    token-major caches of flash-attn, vLLM and Hugging Face's continuous batching instead:
    (B, Smax, Hkv, D) and (num_blocks, block_size, Hkv, D), passed on as transposed views.
    ``cache_seqlens`` int32/int64 (B,) are the valid lengths, ``cache_start`` (B,) the first valid
    positions (left-padded caches); see docs/contract.md §3.2. Inference only. Returns ``out`` or
    ``(out, lse)``.
    """
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
    if kv_layout == "NHD" and all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (k_cache, v_cache)):
        k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)   # else the op names the bad one
    out, lse = torch.ops.nki.decode_attention(q, k_cache, v_cache, cache_seqlens, block_table, sinks,
                                              cache_start,
                                              scale=scale, window_left=window_left, softcap=softcap)
    return (out, lse) if return_lse else out


from nki_lib.attention.ring_attention import ring_attention  # noqa: E402, F401  (context parallelism)
