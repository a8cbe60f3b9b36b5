"""Launcher of the decode-attention kernel: what it can serve, the split plan, and the metadata.

Host work here is layout glue and small index metadata only (no attention math):

* the cache viewed as rows of gatherable *units* (a reshape, no copy for contiguous caches):
  paged -> one block of all kv heads per row (unit = block, ``u = block_size``); contiguous ->
  ``u = gcd(Smax, C, 128)`` keys of one head per row;
* ``unit_table`` (B, n_cols) int32: unit ids of kv head 0 per logical unit column (the block table
  itself when paged), padded to whole chunks, with every unit that holds no key of the needed
  range ``[first, L_b)``, ``first = max(0, L_b - Sq - window_left, cache_start_b)``, replaced by an out-of-range sentinel (the
  kernel's indirect DMA skips it);
* ``split_bounds`` (B, S, 4) int32: each split's chunk range in unit columns, cut at start <= lo
  <= hi <= stop into three ranges in key order -- edge chunks, interior chunks (every key inside
  ``[first, L_b)``: no cleaning, and for a contiguous cache one hardware-DGE DMA per K/V), edge
  chunks;
* ``key_window`` (B, S, 2) float32: ``[first, L_b)`` relative to the split's first key (edge
  chunks zero the V rows of keys outside it; the kernel derives each query row's visible key
  interval from it, its position ``L_b - Sq + t`` and ``window_left``);
* ``sink_rows`` float32: the sinks as (Hkv, G) (a view) when the R rows fit one tile, else the sink
  logit of each query row (Hkv, R) (an expand of ``sinks``).

All of it is computed with tensor ops from ``cache_seqlens`` (no host synchronisation). On the
single-chunk path of a contiguous cache without a window or cache start (``reads_lengths``) none of
it is built: the kernel takes ``cache_seqlens`` itself (int32) and derives the rest on chip.
Dimension legend as in ``kernels/decode_attention_fwd.py``.
"""

from __future__ import annotations

import math

import torch

from nki_lib._nki import nl
from nki_lib.attention.attention_args import resolve_scale
from nki_lib.attention.kernels.decode_attention_fwd import (
    decode_attention_fwd_kernel,
    reads_lengths,
    single_chunk_path,
)
from nki_lib.attention.kernels.tiles import MAX_INDEX
from nki_lib.backend import lnc_degree
from nki_lib.dispatch import KernelLaunch, Unsupported
from nki_lib.sizes import ceil_div

__all__ = ["launch_decode_attention_fwd", "plan_splits", "KERNEL_DTYPES"]

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
STREAMS_PER_CORE = 16       # independent (sequence, kv head, split) streams wanted: one per DMA engine
CHUNK_BUFFER_BYTES = 32768  # per partition for one K or V chunk buffer: each gather descriptor moves
                            # one partition's row, and GpSimd pays ~50 ns per descriptor (cost model
                            # §7.3), so 32 KiB rows keep descriptor generation below the DMA time
MAX_KEYS_PER_PARTITION = 128  # chunk <= 16384 keys: bounds the masked-away compute of a sequence's
                            # last chunk (work follows L_b, not the chunk)
CONTIGUOUS_UNIT_KEYS = 128   # gather granularity of a contiguous cache: reads stop within 127 keys
                            # of L_b; one unit = one 32 KiB descriptor run at D=128 bf16


def keys_per_partition(capacity: int, d: int, itemsize: int) -> int:
    """Chunk depth M (keys per partition; a chunk holds 128*M keys): the largest power of two
    <= MAX_KEYS_PER_PARTITION whose K (or V) chunk fits ``CHUNK_BUFFER_BYTES`` per partition and
    whose chunk is no longer than the capacity (a chunk is computed whole)."""
    by_bytes = CHUNK_BUFFER_BYTES // (d * itemsize)
    by_capacity = capacity // nl.tile_size.pmax
    return _floor_pow2(max(1, min(by_bytes, by_capacity, MAX_KEYS_PER_PARTITION)))


def _floor_pow2(x: int) -> int:
    return 1 << (int(x).bit_length() - 1)


def plan_splits(batch: int, n_kv_heads: int, max_chunks: int, grid: int = 1) -> int:
    """Number of splits of each sequence: enough streams to occupy the cores, at least one chunk each;
    a multiple of ``grid`` when the cores share the splits of each (b, hk) (B*Hkv not a multiple)."""
    wanted = ceil_div(STREAMS_PER_CORE * grid, batch * n_kv_heads)
    return _cores_share(max(1, min(wanted, max_chunks)), batch * n_kv_heads, grid)


def _cores_share(n_split: int, units: int, grid: int) -> int:
    return ceil_div(n_split, grid) * grid if units % grid else n_split


def _unit_rows(cache, paged, unit_keys):
    """(cache rows of units, head offset in elements, #rows): a reshape, no copy."""
    cache = cache.contiguous()
    if paged:
        nb, hkv, bs, d = cache.shape
        return cache.reshape(nb, hkv * bs * d), bs * d, nb
    b, hkv, smax, d = cache.shape
    per_head = smax // unit_keys
    return cache.reshape(b * hkv * per_head, unit_keys * d), per_head * unit_keys * d, b * hkv * per_head


def _unit_ids(block_table, batch, seq_rows, n_cols_pad, device):
    """(B, n_cols_pad) unit ids of kv head 0 per column (entries past the table's columns are never
    read: ``_unit_table`` replaces them). Contiguous: row ``b * seq_rows + col`` -- one arange seen
    through a strided view (no copy)."""
    if block_table is not None:
        n_cols = block_table.shape[1]
        return torch.nn.functional.pad(block_table, (0, n_cols_pad - n_cols)) if n_cols_pad > n_cols else block_table
    ids = torch.arange((batch - 1) * seq_rows + n_cols_pad, dtype=torch.int32, device=device)
    return ids.as_strided((batch, n_cols_pad), (seq_rows, 1))


def _unit_table(ids, lengths, first, unit_keys, n_rows):
    """Unit ids with every unit holding no key of ``[first, L_b)`` replaced by the out-of-range
    sentinel ``n_rows`` (units past the capacity start at or after L_b: no separate check)."""
    col_key0 = torch.arange(0, ids.shape[1] * unit_keys, unit_keys, dtype=torch.int32, device=ids.device)
    needed = col_key0[None, :] < lengths[:, None]
    if not isinstance(first, int):
        needed = needed & (col_key0[None, :] > (first - unit_keys)[:, None])
    return torch.where(needed, ids, n_rows)


def _interior_chunks(first, lengths, end, chunk):
    """Chunks [lo, hi) of each sequence whose keys are all visible to some new token (inside
    [first, L_b)): no slot needs cleaning, and for a contiguous cache one hardware-DGE DMA loads
    them whole. Empty (lo = hi = ``end``, the end of the last chunk) when there is none."""
    hi = lengths // chunk
    if isinstance(first, int):          # first = 0: none only when hi = 0, and then end = 1 (L_b >= 1)
        hi_or_end = hi.clamp(min=1)
        return hi_or_end - hi, hi_or_end
    lo = (first + chunk - 1) // chunk
    none = hi <= lo
    return torch.where(none, end, lo), torch.where(none, end, hi)


def _split_ranges(edges, direct_lo, direct_hi):
    """(B, S, 4) chunk bounds start <= lo <= hi <= stop of each split: in key order the ranges edge
    [start, lo), interior [lo, hi), edge [hi, stop) (start <= stop, so each clamp is a min of a max)."""
    start, stop = edges[:, :-1], edges[:, 1:]
    lo = torch.clamp(direct_lo[:, None], min=start, max=stop)
    hi = torch.clamp(direct_hi[:, None], min=lo, max=stop)
    return torch.stack([start, lo, hi, stop], dim=-1)


def _first_keys(lengths, sq, window_left, cache_start):
    """``first = max(0, L_b - Sq - window_left, cache_start_b)`` per sequence, int32; the Python
    int 0 when no window or start applies (the tables then skip every op on it)."""
    first = 0
    if window_left >= 0:
        first = (lengths - (sq + window_left)).clamp(min=0)
    if cache_start is not None:                       # left-padded cache: keys before start unseen
        start = cache_start.to(torch.int32)
        first = start if isinstance(first, int) else torch.maximum(first, start)
    return first


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
    ``Unsupported`` for what the kernel cannot serve."""
    if q.dtype not in KERNEL_DTYPES:
        raise Unsupported(f"dtype {q.dtype}")
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
    else:
        unit_keys = math.gcd(k_cache.shape[2], m * pmax, CONTIGUOUS_UNIT_KEYS)
        m = min(m, unit_keys)
    chunk = m * pmax
    units_per_chunk = chunk // unit_keys
    if cap + chunk >= MAX_INDEX:
        raise Unsupported(f"cache capacity {cap}: key positions must stay below {MAX_INDEX} (float32 bounds)")

    k_units, head_offset, n_rows = _unit_rows(k_cache, paged, unit_keys)
    v_units, _, _ = _unit_rows(v_cache, paged, unit_keys)
    lengths = cache_seqlens.to(torch.int32)         # all table math in int32 (< MAX_INDEX)
    first = _first_keys(lengths, sq, window_left, cache_start)
    n_cols = block_table.shape[1] if paged else n_rows // (b * hkv)
    n_cols_pad = ceil_div(n_cols, units_per_chunk) * units_per_chunk
    grid = grid or lnc_degree()
    n_split = (_cores_share(num_splits, b * hkv, grid) if num_splits
               else plan_splits(b, hkv, ceil_div(cap, chunk), grid))
    single = not paged and single_chunk_path(n_split, b * hkv, grid, n_cols_pad * unit_keys, chunk, head_offset // d)
    sink_rows = _sink_rows(sinks, hkv, sq)
    if reads_lengths(single, paged, isinstance(first, int), b):   # the kernel takes L_b: no tables
        unit_table = torch.empty((b, n_cols_pad), dtype=torch.int32, device=q.device)   # never read
        return KernelLaunch(decode_attention_fwd_kernel,
                            (q.contiguous(), k_units, v_units, unit_table, None, lengths, sink_rows,
                             hkv, head_offset, n_rows // b, unit_keys, m,
                             resolve_scale(scale, d), float(softcap), int(window_left)),
                            grid=grid)
    if single:
        unit_table = torch.empty((b, n_cols_pad), dtype=torch.int32, device=q.device)   # never read
    else:
        ids = _unit_ids(block_table, b, n_rows // b, n_cols_pad, q.device)
        unit_table = _unit_table(ids.to(torch.int32), lengths, first, unit_keys, n_rows)
    end = (lengths + (chunk - 1)) // chunk
    s_idx = torch.arange(n_split + 1, dtype=torch.int32, device=q.device)
    if isinstance(first, int):
        edges = (s_idx[None, :] * end[:, None]) // n_split                            # (B, S+1) chunks
    else:
        c0 = first // chunk
        edges = c0[:, None] + (s_idx[None, :] * (end - c0)[:, None]) // n_split
    split_bounds = _split_ranges(edges, *_interior_chunks(first, lengths, end, chunk))
    if units_per_chunk > 1:
        split_bounds = split_bounds * units_per_chunk
    window = (torch.nn.functional.pad(lengths[:, None], (1, 0)) if isinstance(first, int)
              else torch.stack([first, lengths], dim=-1))                          # (B, 2) [first, L_b)
    key_window = torch.empty((b, n_split, 2), dtype=torch.float32, device=q.device)
    torch.add(window[:, None, :], edges[:, :-1, None], alpha=-chunk, out=key_window)  # minus the split's key 0

    return KernelLaunch(decode_attention_fwd_kernel,
                        (q.contiguous(), k_units, v_units, unit_table, split_bounds, key_window, sink_rows,
                         hkv, head_offset, None if paged else n_rows // b, unit_keys, m,
                         resolve_scale(scale, d), float(softcap), int(window_left)),
                        grid=grid)
