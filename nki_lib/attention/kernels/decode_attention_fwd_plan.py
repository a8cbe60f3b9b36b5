"""Launcher of the decode-attention kernel: what it can serve, the split plan, and its arguments.

The launcher passes the user's tensors; every piece of runtime metadata (each split's chunk
ranges, the key windows ``[first, L_b)``, the skipping of cache units that hold no needed key) is
derived by the kernel on chip from ``cache_seqlens`` (``kernels/decode_attention_fwd_meta.py``).
Host work here is views and static planning only:

* the cache viewed as rows of gatherable *units* (a reshape, no copy for contiguous caches):
  paged -> one block of all kv heads per row (unit = block, ``u = block_size``); contiguous ->
  ``u = gcd(Smax, C, 128)`` keys of one head per row;
* a token-major (num_blocks, block_size, Hkv, D) pool passed as ``pool.transpose(1, 2)`` (the
  layout of vLLM and of Hugging Face's continuous batching): read in place (``token_major``) on one
  core by the kernel's single-chunk path with one block per partition, or by its multi-chunk path
  with chunks of all kv heads at a depth M whose M*Hkv*D run fits a chunk buffer
  (``_token_major_depth``); otherwise, and for any other pool that is not contiguous head-major,
  the blocks its table names are gathered once into head-major copies, with the table renumbered
  to them (``_table_blocks``): a copy that grows with the table, never with the pool
  (docs/contract.md §3.2); a token-major contiguous-layout cache (B, Smax, Hkv, D) is that same
  memory as a token-major paged pool with an ``arange`` table (``_token_major_blocks``); any other
  contiguous-layout cache that is not contiguous is copied whole;
* ``block_table`` (paged) and ``cache_seqlens``, ``cache_start`` as given when int32, else one
  cast each (int64 index tensors: the op casts the first two already); a block table whose width
  is not a whole number of chunks (``C/u`` blocks) is padded once (the kernel reads the ids of a
  whole chunk at a time; the padding lies past the capacity, and the kernel skips it);
* the static plan: chunk depth ``M`` (``keys_per_partition``; a contiguous cache on the
  multi-chunk path at most its unit ``u``, on the single-chunk path whole, its last partition then
  partly filled), splits ``S`` (``plan_splits``), the padded unit columns;
* ``sink_rows`` float32: the sinks as (Hkv, G) (a view) when the R rows fit one tile, else the sink
  logit of each query row (Hkv, R) (an expand of ``sinks``, one copy).

Dimension legend as in ``kernels/decode_attention_fwd.py``.
"""

from __future__ import annotations

import math

import torch

from nki_lib._nki import nl
from nki_lib.attention.attention_args import resolve_scale
from nki_lib.attention.kernels.decode_attention_fwd import (
    SINGLE_CHUNK_KEYS,
    decode_attention_fwd_kernel,
    single_chunk_path,
    stream_budget,
    stream_head_groups,
)
from nki_lib.attention.kernels.decode_attention_fwd_gathers import shared_gathers
from nki_lib.attention.kernels.decode_attention_fwd_io import CHUNK_BUFFER_BYTES
from nki_lib.attention.kernels.tiles import MAX_INDEX
from nki_lib.backend import lnc_degree
from nki_lib.dispatch import KernelLaunch, Unsupported
from nki_lib.sizes import ceil_div, ceil_pow2, floor_pow2

__all__ = ["launch_decode_attention_fwd", "plan_splits", "KERNEL_DTYPES"]

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
STREAMS_PER_CORE = 16       # independent (sequence, kv head, split) streams wanted: one per DMA engine
LOCKSTEP_STREAM_HEADS = 4   # kv heads of one multi-chunk stream from which it takes no splits (measured,
                            # docs/perf-log.md §34.1 and §34.3: 2 heads still gain from 4 splits, 4 and 8 lose)
MAX_KEYS_PER_PARTITION = 128  # chunk <= 16384 keys: bounds the masked-away compute of a sequence's
                            # last chunk (work follows L_b, not the chunk)
CONTIGUOUS_UNIT_KEYS = 128   # gather granularity of a contiguous cache: reads stop within 127 keys
                            # of L_b; one unit = one 32 KiB descriptor run at D=128 bf16


def keys_per_partition(capacity: int, d: int, itemsize: int) -> int:
    """Chunk depth M (keys per partition; a chunk holds 128*M keys), a power of two <= the deepest
    whose K (or V) chunk fits ``CHUNK_BUFFER_BYTES`` per partition and <= MAX_KEYS_PER_PARTITION:
    the smallest whose one chunk holds the whole capacity when that chunk fits the single-chunk path
    (<= ``SINGLE_CHUNK_KEYS``; 3072 keys -> M = 32, not two chunks of 2048 on the multi-chunk path,
    docs/perf-log.md §38.1), else the largest whose chunk is no longer than the capacity (a chunk is
    computed whole; the splits of several chunks spread a long cache over streams)."""
    pmax = nl.tile_size.pmax
    deepest = floor_pow2(min(CHUNK_BUFFER_BYTES // (d * itemsize), MAX_KEYS_PER_PARTITION))
    whole = ceil_pow2(ceil_div(capacity, pmax))
    if whole <= deepest and whole * pmax <= SINGLE_CHUNK_KEYS:
        return whole
    return min(deepest, floor_pow2(capacity // pmax))


def plan_splits(batch: int, n_kv_heads: int, max_chunks: int, grid: int = 1, stream_heads: int = 1) -> int:
    """Number of splits of each sequence: enough streams to occupy the cores, at least one chunk each;
    a multiple of ``grid`` when the cores share the splits of each (b, hk) (B*Hkv not a multiple).
    One split when each multi-chunk stream holds ``stream_heads`` >= ``LOCKSTEP_STREAM_HEADS`` kv heads
    (``decode_attention_fwd.stream_head_groups``): their lockstep chains already overlap, each of their
    gathers spans every DMA engine, and a split would add its merge and a wait on its runtime bounds
    before its first ids load (docs/perf-log.md §34.1; token-major streams since §34.3, whose one stream
    then alternates two buffer pairs)."""
    if stream_heads >= LOCKSTEP_STREAM_HEADS:
        return 1
    wanted = ceil_div(STREAMS_PER_CORE * grid, batch * n_kv_heads)
    return _cores_share(max(1, min(wanted, max_chunks)), batch * n_kv_heads, grid)


def _cores_share(n_split: int, units: int, grid: int) -> int:
    return ceil_div(n_split, grid) * grid if units % grid else n_split


def _table_blocks(k_cache, v_cache, block_table):
    """(k, v, table) of a paged pool the kernel cannot read in place (either cache not contiguous
    head-major): the blocks of every table entry, in table order, gathered into head-major
    (B*max_blocks, Hkv, block_size, D) copies (one ``index_select`` each; entries of unused
    columns may hold any value and are clamped into the pool), and the table that numbers them
    ``0 .. B*max_blocks - 1``. Cost: the table's blocks, read and written once per call."""
    ids = block_table.reshape(-1).clamp(0, k_cache.shape[0] - 1)
    table = torch.arange(ids.numel(), dtype=torch.int32, device=block_table.device).reshape(block_table.shape)
    return k_cache.index_select(0, ids), v_cache.index_select(0, ids), table


def _chunking(b, hkv, cap, m, unit_keys, n_cols, grid, num_splits, stream_heads=1):
    """(chunk keys, unit columns a chunk, padded table width (paged) or None, splits) at depth ``m``."""
    chunk = m * nl.tile_size.pmax
    units_per_chunk = chunk // unit_keys
    n_cols_pad = None if n_cols is None else ceil_div(n_cols, units_per_chunk) * units_per_chunk
    n_split = (_cores_share(num_splits, b * hkv, grid) if num_splits
               else plan_splits(b, hkv, ceil_div(cap, chunk), grid, stream_heads))
    return chunk, units_per_chunk, n_cols_pad, n_split


def _token_major_views(k_cache, v_cache) -> bool:
    """Whether both caches are ``transpose(1, 2)`` views of contiguous token-major tensors (and not
    contiguous themselves: with Hkv = 1 or one key per block the two layouts are the same memory)."""
    return all(c.transpose(1, 2).is_contiguous() and not c.is_contiguous() for c in (k_cache, v_cache))


def _token_major_depth(k_cache, v_cache, plan_args, m, unit_keys, itemsize):
    """The chunk depth M at which the kernel reads a token-major pool in place, or None: both caches
    are ``transpose(1, 2)`` views of contiguous (num_blocks, block_size, Hkv, D) pools, on one core
    (two cores each take every other kv head: no whole rows), and either the single-chunk path with
    one block per partition (``shared_gathers``: its gathers move whole blocks of all kv heads) or
    the multi-chunk path with chunks of all kv heads (``decode_attention_fwd._stream_heads``), whose
    M keys per partition of every kv head fit one chunk buffer; not the single-chunk path with
    several partitions per block."""
    b, hkv, cap, n_cols, grid, num_splits = plan_args
    if not _token_major_views(k_cache, v_cache) or grid != 1:
        return None

    def single(depth):
        chunk, _, n_cols_pad, n_split = _chunking(b, hkv, cap, depth, unit_keys, n_cols, grid, num_splits)
        return single_chunk_path(n_split, b * hkv, grid, n_cols_pad * unit_keys, chunk)

    if single(m):
        return m if shared_gathers(None, unit_keys, m) else None
    d = k_cache.shape[3]
    depth = floor_pow2(min(m, CHUNK_BUFFER_BYTES // (hkv * d * itemsize)))
    if depth * nl.tile_size.pmax < unit_keys or hkv * depth * d * itemsize > CHUNK_BUFFER_BYTES:
        return None                         # more than 128 blocks a chunk, or a partition's run too long
    return None if single(depth) else depth


def _token_major_blocks(k_cache, v_cache):
    """A contiguous-layout token-major cache (``transpose(1, 2)`` views of contiguous (B, Smax, Hkv, D)
    tensors, flash-attn's layout) as a token-major paged pool of the same memory: blocks of the
    largest power of two dividing Smax and at most Smax / 128 keys (so that a cache of 128 such
    blocks is one chunk of one block per partition), (B*Smax/bs, bs, Hkv, D) viewed as
    ``transpose(1, 2)`` again, and the table ``arange`` that maps sequence b to its own blocks. Or
    None for any other cache."""
    if not _token_major_views(k_cache, v_cache):
        return None
    b, hkv, smax, d = k_cache.shape
    bs = floor_pow2(smax // nl.tile_size.pmax)
    while smax % bs:
        bs //= 2
    pools = [c.transpose(1, 2).reshape(b * smax // bs, bs, hkv, d).transpose(1, 2) for c in (k_cache, v_cache)]
    table = torch.arange(b * smax // bs, dtype=torch.int32, device=k_cache.device).reshape(b, smax // bs)
    return pools[0], pools[1], table


def _unit_rows(cache, paged, unit_keys):
    """(cache rows of units, head offset in elements, #rows): a reshape, no copy."""
    cache = cache.contiguous()         # a no-op but for a non-contiguous contiguous-layout cache
    if paged:
        nb, hkv, bs, d = cache.shape
        return cache.reshape(nb, hkv * bs * d), bs * d, nb
    b, hkv, smax, d = cache.shape
    per_head = smax // unit_keys
    return cache.reshape(b * hkv * per_head, unit_keys * d), per_head * unit_keys * d, b * hkv * per_head


def _as_int32(t):
    """``t`` itself when int32 (no op), else one cast (int64 index tensors)."""
    return t if t.dtype == torch.int32 else t.to(torch.int32)


def _sink_rows(sinks, hkv, sq):
    """float32 sinks for the kernel: (Hkv, G) per query head (a view; the kernel broadcasts them over
    the Sq tokens) when the R = G * Sq rows fit one tile, else (Hkv, R) per query row (a copy)."""
    if sinks is None:
        return None
    group = sinks.shape[0] // hkv
    heads = sinks.to(torch.float32).reshape(hkv, group)
    if group * sq <= nl.tile_size.pmax:
        return heads
    return heads.reshape(hkv, group, 1).expand(hkv, group, sq).reshape(hkv, group * sq).contiguous()


def launch_decode_attention_fwd(q, k_cache, v_cache, cache_seqlens, block_table, sinks, *, scale, window_left,
               softcap, num_splits=None, grid=None, cache_start=None):
    """The launch of ``decode_attention_fwd_kernel`` (it returns ``(out, lse)``); raises
    ``Unsupported`` for what the kernel cannot serve. No host ops for int32 index tensors whose
    block table is a whole number of chunks wide (see the module docstring)."""
    if q.dtype not in KERNEL_DTYPES:
        raise Unsupported(f"dtype {q.dtype}")
    if block_table is None and (pool := _token_major_blocks(k_cache, v_cache)) is not None:
        k_cache, v_cache, block_table = pool        # read in place as a paged pool, not copied whole
    b, hq, sq, d = q.shape
    hkv = k_cache.shape[1]
    pmax = nl.tile_size.pmax
    paged = block_table is not None
    cap = block_table.shape[1] * k_cache.shape[2] if paged else k_cache.shape[2]
    m = keys_per_partition(cap, d, q.element_size())
    if paged:
        unit_keys = k_cache.shape[2]
        if unit_keys & (unit_keys - 1):
            raise Unsupported(f"block_size {unit_keys}: the kernel gathers whole blocks of a power-of-two size")
        m = max(1, min(m, unit_keys), unit_keys // pmax)     # 128*M/bs units per chunk, <= 128
        if m * d * q.element_size() > CHUNK_BUFFER_BYTES:
            raise Unsupported(f"block_size {unit_keys} with D={d}: a whole block per chunk exceeds the "
                              f"{CHUNK_BUFFER_BYTES} B chunk buffer")
    grid = grid or lnc_degree()
    if not paged:
        unit_keys = math.gcd(k_cache.shape[2], m * pmax, CONTIGUOUS_UNIT_KEYS)
        n_split = _chunking(b, hkv, cap, m, unit_keys, None, grid, num_splits)[3]
        if not single_chunk_path(n_split, b * hkv, grid, cap, m * pmax):
            m = min(m, unit_keys)       # the multi-chunk path gathers whole units; the single-chunk
                                        # path loads partitions of M keys, a last one partly filled
    plan_args = (b, hkv, cap, block_table.shape[1] if paged else None, grid, num_splits)
    depth = _token_major_depth(k_cache, v_cache, plan_args, m, unit_keys, q.element_size()) if paged else None
    token_major = depth is not None
    m = depth or m
    kv_itemsize = max(k_cache.element_size(), v_cache.element_size())
    heads = stream_head_groups(hkv, token_major, paged, unit_keys, m, d, kv_itemsize, grid,
                               stream_budget(hq // hkv * sq))[0]
    chunk, units_per_chunk, n_cols_pad, n_split = _chunking(b, hkv, cap, m, unit_keys, plan_args[3], grid, num_splits,
                                                            heads)
    if cap + chunk >= MAX_INDEX:
        raise Unsupported(f"cache capacity {cap}: key positions must stay below {MAX_INDEX} (float32 bounds)")

    if token_major:
        k_units, v_units = (c.transpose(1, 2).reshape(c.shape[0], -1) for c in (k_cache, v_cache))
        head_offset, n_rows = unit_keys * d, k_cache.shape[0]
    else:
        if paged and not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            k_cache, v_cache, block_table = _table_blocks(k_cache, v_cache, block_table)
        k_units, head_offset, n_rows = _unit_rows(k_cache, paged, unit_keys)
        v_units, _, _ = _unit_rows(v_cache, paged, unit_keys)
    if n_rows >= MAX_INDEX:
        raise Unsupported(f"{n_rows} cache units: unit ids must stay below {MAX_INDEX} (float32 arithmetic)")
    n_cols = block_table.shape[1] if paged else n_rows // (b * hkv)
    if not paged:
        n_cols_pad = ceil_div(n_cols, units_per_chunk) * units_per_chunk
    table = None
    if paged:
        table = _as_int32(block_table)
        if n_cols_pad > n_cols:             # whole chunks of columns: the kernel reads C/u ids at a time
            table = torch.nn.functional.pad(table, (0, n_cols_pad - n_cols))
    return KernelLaunch(decode_attention_fwd_kernel,
                        (q.contiguous(), k_units, v_units, table, _as_int32(cache_seqlens),
                         None if cache_start is None else _as_int32(cache_start), _sink_rows(sinks, hkv, sq),
                         hkv, head_offset, None if paged else n_rows // b, unit_keys, m, n_split, n_cols_pad,
                         resolve_scale(scale, d), float(softcap), int(window_left), token_major),
                        grid=grid)
