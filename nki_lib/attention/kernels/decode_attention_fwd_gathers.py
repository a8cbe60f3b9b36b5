"""Decode-attention kernel: the software-DGE gathers of K/V units, and the paged single-chunk path's
shared gathers (several kv heads per DMA).

Algorithm: one indirect DMA (``vector_offset`` = unit ids, ``oob_mode.skip``) moves the units of a
chunk into the chunk buffer, each partition one contiguous run (one descriptor); for a paged cache
whose partitions hold one whole block each (``shared_gathers``), the consecutive kv heads of one
sequence (``head_runs``) are one run of a block's cache row, so one gather serves them all
(``gather_heads``), and when V loads over K its gathers go in the parts of ``v_gather_parts``. A
token-major pool (block rows [token][kv head][D]) gathers per run of heads too
(``gather_runs_token_major``), landing [token][run head][D], each unit's chunk a (128, M, D) view
(``unit_views``); on the multi-chunk path a chunk of such a pool moves all kv heads of M keys per
partition (``gather_chunk_token_major``).
No loops beyond one gather per run of heads (the V cleaning of edge units is the caller's).

Shapes: cache units (rows, u*D) (paged: (NB, Hkv*bs*D), head-major or token-major rows); unit ids
(C/u, 1) int32 in SBUF; chunk buffers (128, M*D), shared tiles (128, units*M*D). Dimension legend as
in ``decode_attention_fwd``.

Limits: those of ``decode_attention_fwd`` (power-of-two units, C/u <= 128).
"""

from __future__ import annotations

from nki_lib._nki import nisa, nl
from nki_lib.attention.kernels.decode_attention_fwd_meta import skip_unneeded_units

__all__ = ["gather_chunk", "head_runs", "shared_gathers", "load_unit_ids", "gather_heads", "v_gather_parts",
           "unit_views", "gather_runs_token_major", "gather_chunk_token_major"]


def gather_chunk(cache_units, idx_sb, head_offset, unit_keys, chunk_sb, slots=None, heads=1):
    """One indirect DMA: units ``idx_sb`` of the cache (this kv head) -> chunk_sb (128, M*D), or
    only the slots ``(c0, n)`` of every partition -> chunk_sb[:, c0*D : (c0+n)*D] (each unit covers
    u/M whole partitions; M <= u). ``heads`` > 1 (paged, one block per partition: M = u): the
    chunks of that many consecutive kv heads -> chunk_sb (units, heads*M*D), head j at j*M*D, for
    the units (partitions) of ``idx_sb`` -- a block's kv heads are one contiguous run of its cache
    row, so each partition is still one descriptor (``heads`` x the bytes)."""
    n_units = idx_sb.shape[0]
    row_stride = cache_units.shape[1]
    m = unit_keys if heads > 1 else unit_keys * n_units // nl.tile_size.pmax
    d = chunk_sb.shape[1] // (m * heads)
    c0, n = slots or (0, m)
    if heads > 1:
        src = cache_units.ap([[row_stride, n_units], [1, heads * m * d]], offset=head_offset,
                             vector_offset=idx_sb, indirect_dim=0)
    else:
        src = cache_units.ap([[row_stride, n_units], [m * d, unit_keys // m], [1, n * d]],
                             offset=head_offset + c0 * d, vector_offset=idx_sb, indirect_dim=0)
    nisa.dma_copy(dst=chunk_sb[:, c0 * d:(c0 + n * heads) * d], src=src, oob_mode=nisa.oob_mode.skip,
                  dge_mode=nisa.dge_mode.swdge)


def gather_chunk_token_major(cache_units, idx_sb, unit_keys, chunk_sb, slots=None):
    """One indirect DMA of a token-major pool (rows of [token][kv head][D] per block): units
    ``idx_sb`` -> chunk_sb (128, M*Hkv*D) as [slot][kv head][D], all kv heads, or only the slots
    ``(c0, n)`` of every partition (each unit covers u/M whole partitions; partition j of a unit
    holds its keys j*M .. j*M + M - 1, one contiguous run of its row)."""
    n_units = idx_sb.shape[0]
    row_stride = cache_units.shape[1]
    m = unit_keys * n_units // nl.tile_size.pmax
    run = chunk_sb.shape[1] // m                    # Hkv*D elements per key
    c0, n = slots or (0, m)
    src = cache_units.ap([[row_stride, n_units], [m * run, unit_keys // m], [1, n * run]], offset=c0 * run,
                         vector_offset=idx_sb, indirect_dim=0)
    nisa.dma_copy(dst=chunk_sb[:, c0 * run:(c0 + n) * run], src=src, oob_mode=nisa.oob_mode.skip,
                  dge_mode=nisa.dge_mode.swdge)


def head_runs(group_units):
    """(first index, length) of each run of consecutive entries of ``group_units`` ((b, hk) each)
    that are consecutive kv heads of one sequence: their paged blocks' rows hold them contiguously."""
    runs = []
    for i, (b, hk) in enumerate(group_units):
        if runs and group_units[i - 1] == (b, hk - 1):
            runs[-1][1] += 1
        else:
            runs.append([i, 1])
    return [tuple(run) for run in runs]


def shared_gathers(seq_units, unit_keys, m):
    """Whether the single-chunk path of a paged cache gathers several kv heads per DMA
    (``gather_heads``): one block per partition (M = block size), so the consecutive kv
    heads of a block are one contiguous run of its cache row and of the partition's row of a
    shared (128, heads*M*D) buffer. Each swdge descriptor (one per partition) then moves all of
    them: the GpSimd descriptor generation, 1 us + 50 ns per descriptor per gather, falls by the
    number of heads per gather (docs/perf-log.md §22.1)."""
    return seq_units is None and unit_keys == m


def load_unit_ids(block_table, seqs, gate, unit_keys, sentinel, first=True):
    """Single-chunk path of a paged cache: the unit ids (C/u, 1) int32 of each sequence in ``seqs``
    (its only chunk's row of ``block_table``), one DMA each, all issued before the first gather (a
    later group's ids would otherwise queue behind the out stores of the group before it), then the
    ids of blocks holding no key of [first, L_b) replaced by ``sentinel`` (``gate`` (128, B*2):
    each sequence's [first, L_b), ``decode_attention_fwd_meta``; ``first`` False: first = 0)."""
    n_cols = block_table.shape[1]
    ids = {}
    for b in seqs:
        if b not in ids:
            ids[b] = nl.ndarray((n_cols, 1), dtype=nl.int32, buffer=nl.sbuf)
            nisa.dma_copy(dst=ids[b], src=block_table.ap([[1, n_cols], [1, 1]], offset=b * n_cols))
    for b, ids_sb in ids.items():
        skip_unneeded_units(ids_sb, unit_keys, gate[:, 2 * b:2 * b + 2], sentinel, first)
    return ids


def gather_heads(cache, cache_units, group_units, ids, tile, units):
    """One gather per run of consecutive kv heads of one sequence (``head_runs``) among the entries
    ``units`` of ``group_units`` (a paged cache, one block per partition: ``shared_gathers``), into
    their (128, M*D) views of ``tile`` (entry i at column i*M*D; ``ids``: each sequence's unit ids,
    ``load_unit_ids``)."""
    unit_keys, head_offset = cache[4], cache[5]
    width = tile.shape[1] // len(group_units)
    for r0, n in head_runs([group_units[i] for i in units]):
        i0 = units[r0]
        b, hk = group_units[i0]
        gather_chunk(cache_units, ids[b], hk * head_offset, unit_keys, tile[:, i0 * width:(i0 + n) * width], heads=n)


def v_gather_parts(waves, w):
    """The V gathers of wave ``w`` (lists of group entries) when V loads over K (``overlay``): the
    first wave's in two halves (the first half's V waits only for that half's K^T transposes, so it
    moves while the rest are made), and the last wave's last unit apart (the other units' P @ V runs
    while its V lands). Each gather costs GpSimd ~1 us + 128 descriptors: measured at B=1 Hq=32
    Hkv=8 L=8192 D=128 (docs/perf-log.md §22.1), a finer split costs more issue than it hides."""
    parts = [waves[w]]
    if w == 0 and len(waves[w]) > 1:
        half = len(waves[w]) // 2
        parts = [waves[w][:half], waves[w][half:]]
    if w == len(waves) - 1 and len(parts[-1]) > 1:
        parts = parts[:-1] + [parts[-1][:-1], parts[-1][-1:]]
    return parts


def unit_views(tile, group_units, m, d, token_major):
    """Each entry's (128, M*D) view of ``tile`` (entry i at column i*M*D), or for a token-major pool
    (``gather_runs_token_major``) its (128, M, D) view of its run's [token][run head][D] rows."""
    pmax = nl.tile_size.pmax
    if not token_major:
        return [tile[:, i * m * d:(i + 1) * m * d] for i in range(len(group_units))]
    views = []
    for r0, n in head_runs(group_units):
        run = tile[:, r0 * m * d:(r0 + n) * m * d].reshape((pmax, m, n, d))
        views += [run[:, :, j, :] for j in range(n)]
    return views


def gather_runs_token_major(cache_units, group_units, ids, tile, n_kv_heads, m, d):
    """A token-major pool (rows of [token][kv head][D] per block, one block per partition): one
    gather per run of consecutive kv heads of one sequence (``head_runs``) into its columns of
    ``tile`` as [token][run head][D]. A run of all ``n_kv_heads`` heads is the block's whole row:
    one descriptor per partition, as for a head-major pool. A shorter run reads M pieces of
    n*D elements per partition (M descriptors each, M times the GpSimd descriptor work)."""
    row_stride = cache_units.shape[1]
    for r0, n in head_runs(group_units):
        b, hk = group_units[r0]
        idx_sb, dst = ids[b], tile[:, r0 * m * d:(r0 + n) * m * d]
        if n == n_kv_heads:                 # a whole block row: the multi-chunk gather at M = block size
            gather_chunk_token_major(cache_units, idx_sb, m, dst)
            continue
        src = cache_units.ap([[row_stride, idx_sb.shape[0]], [n_kv_heads * d, m], [1, n * d]], offset=hk * d,
                             vector_offset=idx_sb, indirect_dim=0)
        nisa.dma_copy(dst=dst, src=src, oob_mode=nisa.oob_mode.skip, dge_mode=nisa.dge_mode.swdge)
