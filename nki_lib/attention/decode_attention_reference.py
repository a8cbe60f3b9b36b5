"""PyTorch reference and dense oracle for ``nki::decode_attention`` (docs/contract.md §3.2).

Shapes: B batch, Hq query heads, Hkv kv heads, Sq new tokens per sequence, D head dim,
Smax contiguous-cache capacity, NB physical blocks, bs block size, MB block-table columns,
L_b = ``cache_seqlens[b]`` valid positions of sequence b.

* ``dense_kv(k_cache, v_cache, block_table, b, length, first)``: cached positions
  ``[first, length)`` of sequence b as dense ``[Hkv, n, D]`` tensors, gathered through the block
  table (logical position p lives in block ``block_table[b, p // bs]`` at row ``p % bs``).
* ``decode_attention``: the reference path. For each sequence it gathers the keys any new token
  can see, ``[first, L_b)`` with ``first = max(0, L_b - Sq - window_left)`` (0 without a window),
  raised to ``cache_start[b]`` when given (left-padded caches: earlier positions are padding),
  and runs ``flash_attention_reference.flash_attention(causal=True, window_left=...)`` on that dense problem: with
  ``Sk = L_b - first`` the bottom-right alignment puts query t at position ``L_b - Sq + t`` (shifted
  by ``first``), which is exactly the decode rule, so decode *is* flash attention on the
  equivalent dense problem (dropping keys that no query sees changes nothing).
* ``naive``: the same decomposition with ``flash_attention_reference.naive`` (dense softmax in the inputs' dtype),
  the fp64 oracle and low-precision baseline of the parity tests.

Only positions in ``[first, L_b)`` are read, so garbage (even NaN) in unused cache slots, in
slots outside every query's window, or in unused block-table entries never reaches the result
(the kernel reads the same positions, up to its gather granularity).
"""

from __future__ import annotations

import torch

from nki_lib.attention import flash_attention_reference
from nki_lib.attention.attention_args import lse_dtype
from nki_lib.sizes import ceil_div


def dense_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor | None,
             b: int, length: int, first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of positions ``[first, length)`` of sequence ``b``: two ``[Hkv, n, D]``."""
    if block_table is None:
        return k_cache[b, :, first:length], v_cache[b, :, first:length]
    block_size = k_cache.shape[2]
    n_blocks = ceil_div(length, block_size)
    blocks = block_table[b, :n_blocks].to(torch.long)

    def gather(cache):
        hkv, d = cache.shape[1], cache.shape[3]
        # [n_blocks, Hkv, bs, D] -> [Hkv, n_blocks * bs, D] -> first `length` positions
        return cache[blocks].permute(1, 0, 2, 3).reshape(hkv, n_blocks * block_size, d)[:, first:length]

    return gather(k_cache), gather(v_cache)


def _per_sequence(attention, q, k_cache, v_cache, cache_seqlens, block_table, sinks, cache_start,
                  *, scale, window_left, softcap):
    lengths = [int(x) for x in cache_seqlens.tolist()]
    starts = [0] * len(lengths) if cache_start is None else [int(x) for x in cache_start.tolist()]
    outs, lses = [], []
    sq = q.shape[2]
    for b, length in enumerate(lengths):
        first = max(0, length - sq - window_left) if window_left >= 0 else 0
        first = max(first, starts[b])          # left-padded cache: positions < start are padding
        k_b, v_b = dense_kv(k_cache, v_cache, block_table, b, length, first)
        # contiguous copies: the result must not depend on the strides of the inputs
        out_b, lse_b = attention(q[b:b + 1].contiguous(), k_b[None].contiguous(), v_b[None].contiguous(),
                                 None if sinks is None else sinks.contiguous(), None, causal=True,
                                 scale=scale, window_left=window_left, window_right=-1,
                                 softcap=softcap)
        outs.append(out_b)
        lses.append(lse_b)
    if not outs:
        return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=lse_dtype(q.dtype))
    return torch.cat(outs), torch.cat(lses)


def decode_attention(q, k_cache, v_cache, cache_seqlens, block_table=None, sinks=None,
                     cache_start=None, *, scale=None, window_left=-1, softcap=0.0):
    """Returns ``(out [B,Hq,Sq,D] in q's dtype, lse [B,Hq,Sq] float32)`` (float64 for float64)."""
    return _per_sequence(flash_attention_reference.flash_attention, q, k_cache, v_cache, cache_seqlens, block_table,
                         sinks, cache_start, scale=scale, window_left=window_left, softcap=softcap)


def naive(q, k_cache, v_cache, cache_seqlens, block_table=None, sinks=None, cache_start=None, *,
          scale=None, window_left=-1, softcap=0.0):
    """Dense decode attention in the inputs' dtype (fp64 oracle / low-precision baseline)."""
    return _per_sequence(flash_attention_reference.naive, q, k_cache, v_cache, cache_seqlens, block_table, sinks,
                         cache_start, scale=scale, window_left=window_left, softcap=softcap)
