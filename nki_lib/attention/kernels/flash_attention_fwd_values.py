"""V of one key section of the flash-attention forward kernel (``flash_attention_fwd.py``), streamed
per section or cached per (batch, kv head), as the per-block pairs P @ V contracts.

A section's V is described block by block (``key_blocks(slen)``: full 128-key blocks, then the
remainder): ``((v_block (bn, D), (c0, c1, step)), ...)``, where ``v_block`` holds the block's
keys on its partitions and ``p_sb[:, c0:c1:step]`` (columns relative to the section start) are
the same keys in P, in the same order, for the block's TensorE transpose. Two layouts:

* **interleaved run** of ``c <= interleave_blocks`` full blocks starting at block g0: partition p
  of block g0 + i holds key ``128 * g0 + c * p + i``; every partition reads one contiguous HBM
  run of ``c * D`` elements (one DMA per run), and the transpose reads P with a column stride of
  c elements (at most ``MAX_READ_STRIDE_BYTES``);
* **natural block**: partition p of block J holds key ``128 * J + p`` (one run of D elements per
  partition per block; the transpose reads P's columns in order).

Streamed (no cache): each section loads its own V in interleaved runs from the section start.
Cached (``ValueCache``, V of the kv head within its SBUF budget): runs aligned to
``128 * interleave_blocks`` keys. A section that covers a whole aligned run uses the run
interleaved when it is loaded or when none of its natural blocks is (loading it); otherwise, and
for a section that covers part of a run (the causal diagonal, a window's edge), natural blocks,
loading the missing ones (one DMA per consecutive missing stretch). Each
key is loaded once per kv head in each form it is used in (causal: natural blocks, since every
run is first reached by its diagonal; full attention: interleaved runs).

Dimension legend: slen keys of a section, s0 its first key, D head dim, bn keys of a block
(<= 128), c blocks of an interleaved run, J global block index, r global run index.
Limits: those of ``flash_attention_fwd.py``.
"""

from __future__ import annotations

from nki_lib._nki import nisa, nl
from nki_lib.attention.kernels.tiles import key_blocks
from nki_lib.sizes import FP32_BYTES, HALF_BYTES

__all__ = ["PADDED_RUNS", "PADDED_RUN_MIN_RUNS", "MAX_READ_STRIDE_BYTES", "interleave_blocks", "load_v", "ValueCache",
           "cache_bytes", "cached_v", "padded_width"]

PADDED_RUNS = 2  # with one query head per pass and no softcap, the first run(s) of a kv head are
                 # used interleaved even by a section that covers them in part (its P zero-padded
                 # to the run end, ``padded_width``): in causal order those are the shortest rows,
                 # the DMA-bound start, where natural blocks cost one 256 B row per key per block.
                 # The zero blocks cost every head their transposes and evictions, so several
                 # heads per pass (GQA) or softcap (ScalarE-bound) keep natural blocks
                 # (docs/perf-log.md §14.4). 2: run 1 too (rows 8-14 padded), which frees the
                 # DMA of its natural blocks at dma_chunk_floor_ns=178 (4096 causal worst corner
                 # 117.1 -> 111.0 us in order, nominal 107.5 -> 108.4 with the P^T by DMA of
                 # flash_attention_fwd_plan.DMA_PT_FROM_PADDED, docs/perf-log.md §16.3)
PADDED_RUN_MIN_RUNS = 4  # ... and only when the kv head has at least this many runs: padding a
                         # run adds about (run / sk)^2 of a causal head's work (the rows under
                         # it padded to its end), <= 1/16 per run here; with fewer runs it costs more than it
                         # saves (S = 1024 D = 192 one head per pass +14 %, S = 2048 D = 64 +3 %,
                         # docs/perf-log.md §14.6)
MAX_READ_STRIDE_BYTES = 16  # innermost read stride above which an engine port runs at half
                            # bandwidth (docs/cost-model.md §2.5, NC-v2 arch guide)


def interleave_blocks(dtype):
    """Full 128-key blocks of V interleaved together: as many as keep the column stride of the P
    transposes at ``MAX_READ_STRIDE_BYTES`` (8 in bf16/fp16, 4 in fp32)."""
    p_bytes = FP32_BYTES if dtype == nl.float32 else HALF_BYTES
    return max(1, MAX_READ_STRIDE_BYTES // p_bytes)


def _load_run(v, b, hk, key0, c):
    """``c`` full blocks of V from key ``key0`` as (128, c, D), interleaved (one DMA)."""
    _, hkv, sk, d = v.shape
    pmax = nl.tile_size.pmax
    run_sb = nl.ndarray((pmax, c, d), dtype=v.dtype, buffer=nl.sbuf)
    first = ((b * hkv + hk) * sk + key0) * d
    nisa.dma_copy(dst=run_sb, src=v.ap(pattern=[[c * d, pmax], [d, c], [1, d]], offset=first))
    return run_sb


def _run_blocks(run_sb, c, col0):
    """The block descriptors of an interleaved run whose first key is P column ``col0``."""
    pmax = nl.tile_size.pmax
    return [(run_sb[:, i, :], (col0 + i, col0 + c * pmax, c)) for i in range(c)]


def load_v(v, b, hk, k0, kn):
    """Streamed V of the keys [k0, k0 + kn): interleaved runs of up to ``interleave_blocks`` full
    blocks from k0 (one DMA each), then the remainder block in order."""
    pmax = nl.tile_size.pmax
    blocks = key_blocks(kn)
    n_full = kn // pmax
    il = interleave_blocks(v.dtype)
    desc = []
    for g0 in range(0, n_full, il):
        c = min(il, n_full - g0)
        desc += _run_blocks(_load_run(v, b, hk, k0 + g0 * pmax, c), c, g0 * pmax)
    if n_full < len(blocks):
        j0, bn = blocks[n_full]
        tail_sb = nl.ndarray((pmax, v.shape[3]), dtype=v.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=tail_sb[0:bn, :], src=v[b, hk, k0 + j0:k0 + j0 + bn, :])
        desc.append((tail_sb[0:bn, :], (j0, j0 + bn, 1)))
    return tuple(desc)


def cache_bytes(sk, d, dtype):
    """SBUF bytes per partition of a whole kv head's V in both layouts (the cache's bound)."""
    p_bytes = FP32_BYTES if dtype == nl.float32 else HALF_BYTES
    return 2 * ((sk + nl.tile_size.pmax - 1) // nl.tile_size.pmax) * d * p_bytes


class ValueCache(nl.NKIObject):
    """V of one (batch, kv head) in SBUF: natural blocks by global block index and interleaved
    runs by global run index, filled on demand, dropped when the kv head changes."""
    owner: object          # (b, hk) or None
    padded_runs: int       # runs of a kv head used interleaved even when covered in part
    natural: dict          # J -> (128, D) block tile view
    runs: dict             # r -> (run tile (128, c, D), c)


def _natural(v, cache, b, hk, j_lo, j_hi):
    """Make natural blocks [j_lo, j_hi) present: one DMA per consecutive missing stretch of full
    blocks, one for the partial last block of the sequence."""
    pmax = nl.tile_size.pmax
    _, hkv, sk, d = v.shape
    n_full = sk // pmax
    j = j_lo
    while j < j_hi:
        if j in cache.natural:
            j += 1
            continue
        if j >= n_full:                                   # the partial last block
            bn = sk - j * pmax
            tail_sb = nl.ndarray((pmax, d), dtype=v.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=tail_sb[0:bn, :], src=v[b, hk, j * pmax:sk, :])
            cache.natural[j] = tail_sb
            j += 1
            continue
        stop = j
        while stop < min(j_hi, n_full) and stop not in cache.natural:
            stop += 1
        nb = stop - j
        blk_sb = nl.ndarray((pmax, nb, d), dtype=v.dtype, buffer=nl.sbuf)
        first = ((b * hkv + hk) * sk + j * pmax) * d
        nisa.dma_copy(dst=blk_sb, src=v.ap(pattern=[[d, pmax], [pmax * d, nb], [1, d]], offset=first))
        for i in range(nb):
            cache.natural[j + i] = blk_sb[:, i, :]
        j = stop


def cached_v(v, cache, b, hk, s0, slen):
    """The block descriptors of section [s0, s0 + slen) from the kv head's cache (see the module
    docstring), loading what is missing."""
    pmax = nl.tile_size.pmax
    sk = v.shape[2]
    if cache.owner != (b, hk):
        cache.owner, cache.natural, cache.runs = (b, hk), {}, {}
    il = interleave_blocks(v.dtype)
    n_full = sk // pmax
    j_first, j_end = s0 // pmax, (s0 + slen + pmax - 1) // pmax
    desc = []
    j = j_first
    while j < j_end:
        r = j // il
        g0 = r * il
        c = min(il, n_full - g0)
        covers = j == g0 and c > 0 and (j_end >= g0 + c or r < cache.padded_runs)
        if covers and (r in cache.runs or all(g not in cache.natural for g in range(g0, g0 + c))):
            if r not in cache.runs:
                cache.runs[r] = (_load_run(v, b, hk, g0 * pmax, c), c)
            desc += _run_blocks(cache.runs[r][0], c, g0 * pmax - s0)
            j = g0 + c
            continue
        stop = min(j_end, g0 + il) if c > 0 and j < g0 + c else j + 1
        _natural(v, cache, b, hk, j, stop)
        for g in range(j, stop):
            bn = min(pmax, sk - g * pmax)
            desc.append((cache.natural[g][0:bn, :], (g * pmax - s0, g * pmax - s0 + bn, 1)))
        j = stop
    return tuple(desc)


def padded_width(v_blocks, slen):
    """Columns P needs for a section's V blocks: ``slen``, or the end of a padded interleaved run
    (``ValueCache.padded_runs``) past it, whose columns past ``slen`` are zero."""
    return max([slen] + [cols[1] for _, cols in v_blocks])
