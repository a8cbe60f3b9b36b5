"""``torch.ops.nki.decode_attention``: attention of a few new tokens over a KV cache (inference).

    decode_attention(q, k_cache, v_cache, cache_seqlens, block_table=None, sinks=None,
                     cache_start=None, *,
                     scale=None, window_left=-1, softcap=0.0) -> (out, lse)

Semantics: docs/contract.md §3.2. Shapes (legend: B batch, Hq/Hkv query/kv heads, Sq new tokens,
D head dim, Smax contiguous capacity, NB physical blocks, bs block size, MB block-table columns):

* q (B, Hq, Sq, D); contiguous cache k_cache/v_cache (B, Hkv, Smax, D) with ``block_table=None``,
  or paged cache (NB, Hkv, bs, D) with block_table int32 (B, MB); capacity = Smax or MB * bs.
* cache_seqlens int32 or int64 (B,), ``Sq <= L_b <= capacity``; query t sits at position
  ``L_b - Sq + t``. cache_start int32 or int64 (B,) (optional, left-padded caches): the first
  valid position of each sequence, ``0 <= start_b <= L_b - Sq``; keys before it are not seen.
* sinks (Hq,) in any floating dtype (math in fp32).
* out (B, Hq, Sq, D) in q's dtype, lse (B, Hq, Sq) float32 (float64 for float64 inputs).

Inference only: with grad mode on, a call where any input requires grad raises a RuntimeError.
"""

from __future__ import annotations

import math

import torch

from nki_lib import registry
from nki_lib.attention import decode_attention_reference
from nki_lib.attention.attention_args import MAX_HEAD_DIM, lse_dtype
from nki_lib.autograd.autocast import follow_sdpa_autocast
from nki_lib.dispatch import dispatch
from nki_lib.registry import OpSpec, Sample
from nki_lib.sizes import ceil_div
from nki_lib.validation import INDEX_DTYPES, check_same_device, check_same_dtype, has_values, on_host
from nki_lib.validation import check_tensor as _check_tensor

INDEX_DTYPE = torch.int32


# --------------------------------------------------------------------------- validation

def _lse_dtype(q):
    return lse_dtype(q.dtype)


def capacity(k_cache: torch.Tensor, block_table: torch.Tensor | None) -> int:
    """Cached positions a sequence can hold: Smax (contiguous) or MB * bs (paged)."""
    if block_table is None:
        return k_cache.shape[2]
    return block_table.shape[1] * k_cache.shape[2]


def validate(q, k_cache, v_cache, cache_seqlens, block_table, sinks, cache_start=None, *, scale,
             window_left, softcap):
    """Shape/dtype/argument checks (no data access: safe under fake tensors)."""
    _check_tensor("q", q, rank=4)
    _check_tensor("k_cache", k_cache, rank=4)
    _check_tensor("v_cache", v_cache, rank=4)
    check_same_dtype("k_cache", k_cache, "q", q)
    check_same_dtype("v_cache", v_cache, "q", q)
    check_same_device("q", q, k_cache=k_cache, v_cache=v_cache)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape, got k_cache "
                         f"{tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)}")
    b, hq, sq, d = q.shape
    layout = "(B, Hkv, Smax, D)" if block_table is None else "(num_blocks, Hkv, block_size, D)"
    if block_table is None and k_cache.shape[0] != b:
        raise ValueError(f"k_cache must have the contiguous layout {layout} with batch size {b} "
                         f"(from q), got shape {tuple(k_cache.shape)}")
    if k_cache.shape[3] != d:
        raise ValueError(f"k_cache must have the layout {layout} with head dim {d} (from q), "
                         f"got shape {tuple(k_cache.shape)}")
    hkv = k_cache.shape[1]
    if hkv < 1 or hq % hkv != 0:
        raise ValueError(f"the number of q heads ({hq}) must be a multiple of the number of "
                         f"k_cache/v_cache heads ({hkv}) (k_cache layout {layout})")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"q head dim D must be in [1, {MAX_HEAD_DIM}], got {d}")
    if sq < 1:
        raise ValueError(f"q must hold Sq >= 1 new tokens, got Sq={sq}")
    if k_cache.shape[2] < 1:
        raise ValueError(f"k_cache must have a non-empty sequence/block dim, got shape {tuple(k_cache.shape)}")
    _check_tensor("cache_seqlens", cache_seqlens, rank=1, dtypes=INDEX_DTYPES)
    if cache_start is not None:
        _check_tensor("cache_start", cache_start, rank=1, dtypes=INDEX_DTYPES)
        if cache_start.shape[0] != b:
            raise ValueError(f"cache_start must have shape ({b},) (one first position per sequence), "
                             f"got {tuple(cache_start.shape)}")
        check_same_device("q", q, cache_start=cache_start)
    if cache_seqlens.shape[0] != b:
        raise ValueError(f"cache_seqlens must have shape ({b},) (one length per sequence), "
                         f"got {tuple(cache_seqlens.shape)}")
    if block_table is not None:
        _check_tensor("block_table", block_table, rank=2, dtypes=INDEX_DTYPES)
        if block_table.shape[0] != b:
            raise ValueError(f"block_table must have shape ({b}, max_blocks), got {tuple(block_table.shape)}")
        if block_table.shape[1] < 1:
            raise ValueError(f"block_table must have at least one column, got {tuple(block_table.shape)}")
    check_same_device("q", q, cache_seqlens=cache_seqlens, block_table=block_table)
    if not isinstance(window_left, (int, torch.SymInt)) or isinstance(window_left, bool):
        raise TypeError(f"window_left must be an int, got {type(window_left).__name__}")
    if window_left < -1:
        raise ValueError(f"window_left must be -1 (unbounded) or >= 0, got {window_left}")
    if scale is not None and (not isinstance(scale, (int, float)) or isinstance(scale, bool)
                              or not math.isfinite(scale)):
        raise ValueError(f"scale must be None or a finite float, got {scale!r}")
    if (not isinstance(softcap, (int, float)) or isinstance(softcap, bool) or not math.isfinite(softcap)
            or softcap < 0):
        raise ValueError(f"softcap must be a finite float >= 0, got {softcap!r}")
    if sinks is not None:
        _check_tensor("sinks", sinks, rank=1)
        if sinks.shape[0] != hq:
            raise ValueError(f"sinks must have shape ({hq},) (one logit per q head), got {tuple(sinks.shape)}")
        check_same_device("q", q, sinks=sinks)


def validate_starts(q, cache_seqlens, cache_start):
    """Data check of cache_start (real tensors only, on host copies: ``nki_lib.validation.on_host``):
    ``0 <= start_b <= L_b - Sq``; returns whether any start is > 0 (from the same host copy, no
    device op)."""
    with on_host(cache_start, cache_seqlens) as (starts, lengths):
        starts, last = starts.to(torch.int64), lengths.to(torch.int64) - q.shape[2]
        bad = (starts < 0) | (starts > last)
        if bool(bad.any()):
            b = int(bad.nonzero()[0, 0])
            raise ValueError(f"cache_start must lie in [0, cache_seqlens - Sq] (the new tokens are valid "
                             f"cache positions), got cache_start[{b}] = {int(starts[b])} with "
                             f"cache_seqlens[{b}] = {int(lengths[b])}, Sq = {q.shape[2]}")
        return bool(starts.any())


def validate_values(q, k_cache, cache_seqlens, block_table):
    """Data checks (real tensors only, on host copies: ``nki_lib.validation.on_host``): lengths within
    [Sq, capacity], used block ids in range."""
    with on_host(cache_seqlens, block_table) as (lengths, table):
        _check_lengths_and_table(q, k_cache, lengths, table)


def _check_lengths_and_table(q, k_cache, lengths, table):
    """:func:`validate_values` on the host copies of cache_seqlens and block_table (or None)."""
    sq = q.shape[2]
    cap = capacity(k_cache, table)
    if lengths.numel() == 0:
        return
    low, high = (int(x) for x in torch.aminmax(lengths))
    if low < sq:
        raise ValueError(f"cache_seqlens must be >= Sq={sq} (the cache already holds the new tokens), "
                         f"got a length of {low}")
    if high > cap:
        raise ValueError(f"cache_seqlens must be <= the cache capacity {cap}, got a length of {high}")
    if table is None:
        return
    block_size, num_blocks = k_cache.shape[2], k_cache.shape[0]
    block_key0 = torch.arange(0, table.shape[1] * block_size, block_size)   # first key of each column
    bad = (block_key0[None, :] < lengths[:, None]) & (table.clamp(0, num_blocks - 1) != table)
    if bool(bad.any()):
        b, col = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"block_table entries of used blocks must lie in [0, {num_blocks}) "
                         f"(num_blocks of k_cache), got block_table[{b}, {col}] = {int(table[b, col])}")


# --------------------------------------------------------------------------- op

@torch.library.custom_op("nki::decode_attention", mutates_args=())
def decode_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        cache_seqlens: torch.Tensor, block_table: torch.Tensor | None = None,
                        sinks: torch.Tensor | None = None, cache_start: torch.Tensor | None = None,
                        *, scale: float | None = None, window_left: int = -1, softcap: float = 0.0
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    flags = dict(scale=scale, window_left=window_left, softcap=softcap)
    validate(q, k_cache, v_cache, cache_seqlens, block_table, sinks, cache_start, **flags)
    if has_values(cache_seqlens, block_table, cache_start):
        validate_values(q, k_cache, cache_seqlens, block_table)
        if cache_start is not None:
            if not validate_starts(q, cache_seqlens, cache_start):
                cache_start = None             # every sequence starts at 0: the plain call
    if sinks is not None:
        sinks = sinks.to(_lse_dtype(q))
    if q.shape[0] == 0:
        return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=_lse_dtype(q))

    def launch():
        from nki_lib.attention.kernels import decode_attention_fwd_plan
        return decode_attention_fwd_plan.launch_decode_attention_fwd(
            q, k_cache, v_cache, cache_seqlens.to(INDEX_DTYPE),
            None if block_table is None else block_table.to(INDEX_DTYPE), sinks,
            cache_start=cache_start, **flags)

    out, lse = dispatch("decode_attention", (q, k_cache, v_cache, sinks), launch=launch,
                        reference=lambda: decode_attention_reference.decode_attention(
                            q, k_cache, v_cache, cache_seqlens, block_table, sinks, cache_start,
                            **flags))
    return out.contiguous(), lse.contiguous()


@decode_attention_op.register_fake
def _(q, k_cache, v_cache, cache_seqlens, block_table=None, sinks=None, cache_start=None, *,
      scale=None, window_left=-1, softcap=0.0):
    validate(q, k_cache, v_cache, cache_seqlens, block_table, sinks, cache_start, scale=scale,
             window_left=window_left, softcap=softcap)
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=_lse_dtype(q))


def _inference_only(ctx, inputs, keyword_only_inputs, output):
    names = ("q", "k_cache", "v_cache", "cache_seqlens", "block_table", "sinks", "cache_start")
    wanting = [n for n, t in zip(names, inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    raise RuntimeError(f"nki::decode_attention is inference-only (no backward): {', '.join(wanting)} "
                       f"require(s) grad; detach the inputs or call it under torch.no_grad()")


def _no_backward(ctx, *grads):
    raise RuntimeError("nki::decode_attention has no backward")


decode_attention_op.register_autograd(_no_backward, setup_context=_inference_only)
follow_sdpa_autocast("decode_attention")


# --------------------------------------------------------------------------- registry entry

def make_sample(b, hq, hkv, sq, d, lengths, dtype, *, block_size=None, num_blocks=None,
                capacity_=None, sinks=False, shuffle=True, seed=0, starts=None,
                index_dtype=INDEX_DTYPE, **kwargs) -> Sample:
    """A decode call: contiguous cache of capacity ``capacity_`` (default max(lengths)), or a paged
    cache with ``block_size`` (block ids drawn as a random permutation of ``num_blocks`` unless
    ``shuffle=False``; unused table entries are -1)."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float32).to(dtype)  # noqa: E731
    cap = capacity_ or max(lengths)
    q = rand(b, hq, sq, d)
    seqlens = torch.tensor(lengths, dtype=index_dtype)
    table = None
    if block_size is None:
        k, v = rand(b, hkv, cap, d), rand(b, hkv, cap, d)
        layout = f"contiguous Smax={cap}"
    else:
        max_blocks = ceil_div(cap, block_size)
        needed = [ceil_div(n, block_size) for n in lengths]
        num_blocks = num_blocks or max(1, sum(needed))
        order = torch.randperm(num_blocks, generator=gen) if shuffle else torch.arange(num_blocks)
        table = torch.full((b, max_blocks), -1, dtype=INDEX_DTYPE)
        nxt = 0
        for i, n in enumerate(needed):
            table[i, :n] = order[nxt:nxt + n].to(INDEX_DTYPE)
            nxt += n
        k, v = rand(num_blocks, hkv, block_size, d), rand(num_blocks, hkv, block_size, d)
        layout = f"paged bs={block_size} blocks={num_blocks}"
    sinks_t = None
    if sinks:
        sinks_t = torch.randn(hq, generator=gen).to(torch.float64 if dtype == torch.float64 else torch.float32)
    label = (f"q({b},{hq},{sq},{d}) hkv={hkv} {layout} L={list(lengths)[:4]}"
             f"{'...' if len(lengths) > 4 else ''} {str(dtype).replace('torch.', '')}")
    label += "".join(f" {k}={v}" for k, v in kwargs.items()) + (" sinks" if sinks else "")
    start_t = None if starts is None else torch.tensor(starts, dtype=index_dtype)
    label += f" cache_start={list(starts)}" if starts is not None else ""
    return Sample((q, k, v, seqlens, table, sinks_t, start_t), kwargs, label)


def _samples(dtype, requires_grad):
    del requires_grad  # inference-only op: samples never require grad
    return [
        make_sample(2, 4, 2, 1, 16, [5, 130], dtype),
        make_sample(2, 4, 1, 3, 8, [3, 40], dtype, block_size=16, sinks=True, softcap=4.0, scale=0.4),
        make_sample(1, 2, 2, 4, 8, [37], dtype, block_size=8, window_left=6),
        make_sample(3, 2, 1, 2, 16, [2, 64, 33], dtype, capacity_=70, window_left=0, sinks=True),
        make_sample(3, 4, 2, 2, 8, [9, 20, 14], dtype, capacity_=24, starts=[3, 0, 12],
                    index_dtype=torch.int64, window_left=7),
    ]


def _report_samples():
    """Token generation (Sq=1) and speculative verification (Sq=8), GQA 8:1, D=128, bf16: batch 1
    with a 2k and a 32k paged cache, batch 64 with a 2k contiguous cache of differing lengths.
    (Batch 64 with a 32k cache is left out: its 1 GiB cache is too slow to simulate.)"""
    bf16 = torch.bfloat16
    lengths_64 = [2048 - 29 * i for i in range(64)]
    return [
        make_sample(1, 8, 1, sq, 128, [cache], bf16, block_size=block)
        for cache, block in ((2048, 64), (32768, 256)) for sq in (1, 8)
    ] + [make_sample(64, 8, 1, sq, 128, lengths_64, bf16, capacity_=2048) for sq in (1, 8)]


SPEC = registry.register(OpSpec(
    name="decode_attention",
    naive=decode_attention_reference.naive,
    samples=_samples,
    report_samples=_report_samples,
    differentiable=False,
    family="attention",
    launchers=(
        "nki_lib.attention.kernels.decode_attention_fwd_plan.launch_decode_attention_fwd",
    ),
    kernels=(
        "nki_lib.attention.kernels.decode_attention_fwd.decode_attention_fwd_kernel",
    ),
))
