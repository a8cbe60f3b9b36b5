"""Attention: ``torch.ops.nki.flash_attention`` (training) and its functional wrapper."""

from __future__ import annotations

import torch

from nki_lib.attention import ops  # noqa: F401  (registers the ops)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    scale: float | None = None, window: tuple[int, int] = (-1, -1),
                    softcap: float = 0.0, sinks: torch.Tensor | None = None,
                    cu_seqlens: torch.Tensor | None = None, return_lse: bool = False):
    """Flash attention over q (B, Hq, Sq, D), k/v (B, Hkv, Sk, D); see api-contract §3.

    ``window = (left, right)``, -1 for unbounded; masks are bottom-right aligned. Returns ``out``
    (B, Hq, Sq, D), or ``(out, lse)`` with ``lse`` float32 (B, Hq, Sq) when ``return_lse``.
    """
    if not (isinstance(window, (tuple, list)) and len(window) == 2):
        raise ValueError(f"window must be a pair (left, right), got {window!r}")
    out, lse = torch.ops.nki.flash_attention(q, k, v, sinks, cu_seqlens, causal=causal, scale=scale,
                                             window_left=window[0], window_right=window[1],
                                             softcap=softcap)
    return (out, lse) if return_lse else out
