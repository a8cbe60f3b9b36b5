"""Flash-attention backward: the key tiles of one kv head's pass (K/V loads, dK/dV accumulators).

Used by ``flash_attention_bwd_pipeline.kv_pass`` (plain NKI helpers, inlined at trace time); the
kernel, its loop structure and budget are described in ``flash_attention_bwd``.

Per key tile ``[k0, k0 + kn)`` (kn <= 512 keys, ``nblocks`` 128-key blocks), a :class:`KeyTile`:

    load_kv          K^T, V^T (head dim on partitions) of the tile and, when adjacent and not
                     loaded yet, the next one (``kv_batch``): one DMA each per head-dim chunk
                     (DMA transposes of natural rows, or rows of the host transposes)
    transpose_k_rows K rows (keys on partitions), needed last (the dQ stage): TensorE transposes
                     of K^T behind the tile's first scores (D <= 128, ``k_rows_on_chip``)
    load_k_rows      else one DMA of the natural rows
    alloc_kv_grads   the dK, dV fp32 PSUM accumulators, when the first pair reaches its dV stage
    store_kv_grads   dK = scale * acc (ScalarE), dV = acc (VectorE) side by side in one SBUF tile,
                     one DMA into the row-group output after the last pair's dK stage; blocks no
                     query saw get zeros

Shapes: K rows (pmax, nblocks, D); K^T, V^T (pmax, nchunks, kn); dK/dV PSUM accumulators
(pmax, nblocks, stride) fp32 with stride the next power of two >= D; HBM k (B, Hkv, Sk, D)
natural and dkv (B, Hkv, NKT, pmax, 2, per, D) in row-group layout.
Dimension legend: B batch, Hkv kv heads, NKT key tiles, pmax partitions, per = nblocks of a full
key tile (4), nchunks head-dim chunks of <= 128, D head dim, kn keys of the tile.
Limits: D <= 256 (two chunks; a block's accumulator fits one 2 KiB PSUM bank); a partial last
block (fewer than pmax keys) moves with a DMA of its own.
"""

from __future__ import annotations

from nki_lib._nki import nisa, nl
from nki_lib.attention.kernels import tiles
from nki_lib.attention.kernels.flash_attention_bwd_rows import full_blocks, rows_from_transposed
from nki_lib.attention.kernels.flash_attention_transposed_loads import load_transposed_into


def _acc_stride(head_dim: int) -> int:
    """Free stride of one 128-key block in the dK/dV PSUM accumulators: the next power of two
    >= D, so no block straddles a 2 KiB bank (a matmul result must fit one bank)."""
    return 1 << (head_dim - 1).bit_length()


class KeyTile(nl.NKIObject):
    """One key tile ``[k0, k0 + kn)`` of a kv head: K ``(pmax, nblocks, D)`` (keys on partitions),
    K^T and V^T ``(pmax, nchunks, kn)`` (head dim on partitions), and the dK/dV fp32 PSUM
    accumulators (made when the first pair reaches its dV stage, stored after the last pair's dK
    stage), with per-block flags telling whether a matmul started them."""

    def __init__(self, kt: int, k0: int, kn: int):
        self.kt = kt
        self.k0 = k0
        self.kn = kn
        self.blocks = tiles.key_blocks(kn)
        self.k_sb = self.kT_sb = self.vT_sb = None
        self.dk_psum = self.dv_psum = None
        self.dk_started = [False] * len(self.blocks)
        self.dv_started = [False] * len(self.blocks)


def load_kv(kvs, k_src, v_src, natural, b, hk, head_dim):
    """K^T and V^T of adjacent key tiles ``kvs`` (one or two, :func:`kv_batch`) in one DMA each
    per head-dim chunk (DMA transposes of natural K/V rows, or rows of the launcher's transposes,
    ``flash_attention_transposed_loads``): each partition moves one run of up to 2 KiB, so two
    key tiles pay the per-chunk DMA floor once (docs/cost-model.md §2.6); each key tile gets its
    view. The K rows follow (:func:`transpose_k_rows` or :func:`load_k_rows`)."""
    pmax = nl.tile_size.pmax
    chunks = tiles.head_dim_chunks(head_dim)
    k0, kn = kvs[0].k0, sum(kv.kn for kv in kvs)
    kT_sb = nl.ndarray((pmax, len(chunks), kn), dtype=k_src.dtype, buffer=nl.sbuf)
    vT_sb = nl.ndarray((pmax, len(chunks), kn), dtype=v_src.dtype, buffer=nl.sbuf)
    for ch, (d0, dc) in enumerate(chunks):
        load_transposed_into(kT_sb[:dc, ch, :], k_src, natural, b, hk, k0, kn, d0, dc)
        load_transposed_into(vT_sb[:dc, ch, :], v_src, natural, b, hk, k0, kn, d0, dc)
    for kv in kvs:
        kv.kT_sb, kv.vT_sb = kT_sb[:, :, kv.k0 - k0:kv.k0 - k0 + kv.kn], vT_sb[:, :, kv.k0 - k0:kv.k0 - k0 + kv.kn]


def kv_batch(ktiles, m):
    """Key tiles whose K^T/V^T load with ``ktiles[m]``'s: it and the next one when that is adjacent
    (a full key tile followed by the next keys) and not loaded yet."""
    kv = ktiles[m]
    if m + 1 < len(ktiles):
        nxt = ktiles[m + 1]
        if nxt.kT_sb is None and kv.kn == tiles.key_tile_width() and nxt.k0 == kv.k0 + kv.kn:
            return [kv, nxt]
    return [kv]


def k_rows_on_chip(head_dim):
    """Whether a key tile's K rows are TensorE transposes of its K^T (:func:`transpose_k_rows`):
    at D <= pmax, where the transposes' PSUM tile (one bank) fits beside the pipeline's six; at
    D > pmax (eight banks in use) they are a DMA of the natural rows (:func:`load_k_rows`)."""
    return head_dim <= nl.tile_size.pmax


def transpose_k_rows(kv, head_dim):
    """K rows ``(pmax, nblocks, D)`` from the tile's K^T in SBUF (``rows_from_transposed``: one
    TensorE transpose per 128-key block, one VectorE copy); no HBM traffic."""
    kv.k_sb = nl.ndarray((nl.tile_size.pmax, len(kv.blocks), head_dim), dtype=kv.kT_sb.dtype, buffer=nl.sbuf)
    rows_from_transposed(kv.k_sb, kv.kT_sb[:, 0, :], kv.blocks, head_dim)


def load_k_rows(kv, k, b, hk, head_dim):
    """K rows ``(pmax, nblocks, D)`` (keys on partitions) from the natural ``(B, Hkv, Sk, D)`` K:
    one DMA for the full blocks (each partition moves one D-element run per block), one for a
    partial last block. Used at D > pmax (:func:`k_rows_on_chip`)."""
    pmax = nl.tile_size.pmax
    kv.k_sb = nl.ndarray((pmax, len(kv.blocks), head_dim), dtype=k.dtype, buffer=nl.sbuf)
    nfull = full_blocks(kv.blocks)
    if nfull:
        rows = k[b, hk, kv.k0:kv.k0 + nfull * pmax, :]
        nisa.dma_copy(dst=kv.k_sb[:, :nfull, :], src=rows.ap([[head_dim, pmax], [pmax * head_dim, nfull], [1, head_dim]]))
    if nfull < len(kv.blocks):
        s0, sn = kv.blocks[nfull]
        nisa.dma_copy(dst=kv.k_sb[:sn, nfull, :], src=k[b, hk, kv.k0 + s0:kv.k0 + s0 + sn, :])


def store_kv_grads(dkv, b, hk, kv, cfg):
    """dK = scale * acc (ScalarE), dV = acc (VectorE) side by side in one SBUF tile
    ``(pmax, 2, nblocks, D)``, stored with one DMA per key tile into the row-group output ``dkv``
    (``[.., p, 0, s, :]`` dK, ``[.., p, 1, s, :]`` dV: one 2 KiB run per partition at D = 128
    bf16); blocks no query saw get zeros."""
    pmax = nl.tile_size.pmax
    d = cfg.head_dim
    blocks = kv.blocks
    dkv_sb = nl.ndarray((pmax, 2, len(blocks), d), dtype=dkv.dtype, buffer=nl.sbuf)
    dk_sb, dv_sb = dkv_sb[:, 0, :, :], dkv_sb[:, 1, :, :]
    for c, (s0, sn) in enumerate(blocks):
        if kv.dk_started[c]:
            nisa.activation(dst=dk_sb[:sn, c, :], op=nl.copy, data=kv.dk_psum[:sn, c, :d], scale=cfg.scale)
        else:
            nisa.memset(dst=dk_sb[:sn, c, :], value=0.0)
        if kv.dv_started[c]:
            nisa.tensor_copy(dst=dv_sb[:sn, c, :], src=kv.dv_psum[:sn, c, :d], engine=nisa.engine.vector)
        else:
            nisa.memset(dst=dv_sb[:sn, c, :], value=0.0)
    nfull = full_blocks(blocks)
    hbm = dkv[b, hk, kv.kt]
    if nfull:
        nisa.dma_copy(dst=hbm[:, :, :nfull, :], src=dkv_sb[:, :, :nfull, :])
    if nfull < len(blocks):
        sn = blocks[nfull][1]
        nisa.dma_copy(dst=hbm[:sn, :, nfull, :], src=dkv_sb[:sn, :, nfull, :])


def alloc_kv_grads(kv, cfg):
    pmax = nl.tile_size.pmax
    acc_free = _acc_stride(cfg.head_dim)
    kv.dk_psum = nl.ndarray((pmax, len(kv.blocks), acc_free), dtype=nl.float32, buffer=nl.psum)
    kv.dv_psum = nl.ndarray((pmax, len(kv.blocks), acc_free), dtype=nl.float32, buffer=nl.psum)

