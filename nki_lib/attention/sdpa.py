"""``nki_lib.sdpa``: a drop-in for ``torch.nn.functional.scaled_dot_product_attention``.

Same arguments and semantics as PyTorch's: (..., L, E) query, (..., S, E) key, (..., S, Ev)
value; ``is_causal`` is **top-left** aligned (query i sees keys j <= i); ``attn_mask`` is bool
(True = attend) or additive float, broadcastable to (N, H, L, S); ``enable_gqa`` lets Hq be a
multiple of Hkv. Calls go to ``torch.ops.nki.flash_attention``:

* top-left causal is rewritten exactly into the op's bottom-right rule: for L <= S the keys
  ``>= L`` are never visible (they are dropped); for L > S the first S queries are causal over
  all keys and the rest see every key (two calls);
* ``attn_mask`` goes to the op's ``attn_mask`` (4-D, broadcast dims kept at size 1); the NKI
  kernels serve it when each query row's allowed keys are one interval, the same for all heads
  (key padding; bool, or additive 0/-inf), otherwise the op's reference does and the coverage
  ledger records why (``nki_lib/attention/key_bounds.py``);
* what the op does not take -- ``dropout_p > 0``, a value head dim Ev != E, fewer than 3 or more
  than 4 dims -- runs PyTorch's SDPA and is recorded in ``nki_lib.coverage()`` (op
  ``flash_attention``, path ``sdpa``).

Rows that see no key give 0, as PyTorch's CPU kernels do.
"""

from __future__ import annotations

import torch

from nki_lib.coverage import LEDGER

__all__ = ["sdpa"]


def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
         enable_gqa=False):
    """``scaled_dot_product_attention`` semantics on nki-lib's attention op (see the module doc)."""
    if attn_mask is not None and is_causal:
        raise ValueError("sdpa: attn_mask and is_causal=True cannot both be set (as in PyTorch)")
    reason = _unsupported(query, key, value, dropout_p)
    if reason is not None:
        LEDGER.record_fallback("flash_attention", "sdpa", reason)
        LEDGER.record_call("flash_attention", "torch-sdpa")
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
            scale=scale, enable_gqa=enable_gqa)
    three_d = query.dim() == 3
    if three_d:
        query, key, value = query[None], key[None], value[None]
        attn_mask = None if attn_mask is None else attn_mask[None] if attn_mask.dim() == 3 else attn_mask
    _check_heads(query, key, enable_gqa)
    mask = None if attn_mask is None else _mask4d(attn_mask, query, key)
    out = _causal(query, key, value, scale) if is_causal else _call(query, key, value, mask, scale, False)
    return out[0] if three_d else out


def _unsupported(query, key, value, dropout_p):
    if dropout_p and dropout_p > 0:
        return "sdpa: dropout_p > 0"
    if not (query.dim() == key.dim() == value.dim() and query.dim() in (3, 4)):
        return "sdpa: inputs other than 3-D or 4-D"
    if value.shape[-1] != query.shape[-1]:
        return "sdpa: value head dim != query head dim"
    if query.shape[0] != key.shape[0] and query.dim() == 4:
        return "sdpa: broadcast batch dims"
    return None


def _check_heads(query, key, enable_gqa):
    hq, hkv = query.shape[1], key.shape[1]
    if hq == hkv or hkv == 1:
        return
    if not enable_gqa or hq % hkv != 0:
        raise ValueError(f"sdpa: query has {hq} heads and key {hkv}: they must match, key must "
                         f"have 1 head, or enable_gqa=True with {hq} a multiple of {hkv}")


def _mask4d(attn_mask, query, key):
    full = (query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    mask = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
    torch.broadcast_shapes(mask.shape, full)   # raises like PyTorch when not broadcastable
    return mask.expand(tuple(f if m != 1 else 1 for m, f in zip(mask.shape, full)))


def _call(query, key, value, mask, scale, causal):
    out, _ = torch.ops.nki.flash_attention(query, key, value, None, None, None, mask,
                                           causal=causal, scale=scale)
    return out


def _causal(query, key, value, scale):
    """Top-left causal as bottom-right calls of the op."""
    sq, sk = query.shape[2], key.shape[2]
    if sq <= sk:
        return _call(query, key[:, :, :sq], value[:, :, :sq], None, scale, True)
    head = _call(query[:, :, :sk], key, value, None, scale, True)
    tail = _call(query[:, :, sk:], key, value, None, scale, False)
    return torch.cat([head, tail], dim=2)
