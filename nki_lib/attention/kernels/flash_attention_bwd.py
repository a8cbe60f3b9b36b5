"""Flash-attention backward: the NKI kernel and its launcher ``launch_flash_attention_bwd``.

Math (``reference.flash_attention_backward``), per query row i and key j, with s = scale * q.k
(then ``softcap * tanh(s / softcap)`` when softcap > 0) and masked pairs excluded:

    P = exp(s - lse)                 recomputed from the forward's lse (no softmax statistics pass)
    delta = rowsum(dO * O) - dlse    the gradient through lse shifts the row term
    dV += P^T dO,  dP = dO V^T,  dS = P * (dP - delta) [* (1 - tanh^2) under softcap]
    dQ = scale * dS K,  dK += scale * dS^T Q,  dsinks[h] = -sum_i exp(sink_h - lse_i) * delta_i

Files: this one (launcher, kernel, pipeline, query groups, K/V tiles), ``flash_attention_bwd_tile`` (the stages
of one query tile x key tile pair), ``flash_attention_bwd_prep`` (phase 0: per-row statistics, dsinks).

Loop structure (KV-outer, FlashAttention-2 backward; all loops unrolled at trace time):

    for (b, kv head hk) units (one pass each, LNC2: shared between the programs):
        issue the first key tile's loads; phase 0 (bwd_prep) of hk's query heads: -lse of all
        rows (and the per-row key bounds, when given, one DMA) now, -delta of a query group when
        the pass first loads it (its O/dO rows prefetched STATS_AHEAD groups earlier), all kept in
        SBUF; dsinks partials at the end of the pass
        pairs = [(key tile [k0, k0 + kn), kn <= 512, query head h, query group, query tile)
                 for every key tile, query head of the group, visiting query tile]
        one software pipeline over all pairs (STAGES; pair j's stage runs at step j + lag):
            scores   S = Q K^T, dP = dO V^T          TensorE -> PSUM fp32 (diagonal tiles: up to
                                                     the last visible 128-key block)
            probs    P = exp(scale * S - lse)        ScalarE (reads PSUM); masks of partial tiles:
                                                     GpSimd affine_select on P (causal/window),
                                                     key bounds: VectorE range_select before exp;
                     dP - delta                      ScalarE eviction (the bias of a copy), fp32
            dscores  dS = (dP - delta) * P           GpSimd, one product
            dv       dV += P^T dO                    TensorE, per visible 128-key block (queries
                                                     are the contraction dim: no transpose)
            dk       dK += dS^T Q, dS^T              TensorE, per visible block; interior pairs
                                                     (every row sees the whole key tile) go in
                                                     couples of neighbours whose dS^T is ONE
                                                     SBUF -> SBUF DMA transpose (``DsCouple``)
            evict    dS^T PSUM -> SBUF               VectorE (pairs outside couples)
            dq       dQ_part = dS K                  TensorE -> PSUM fp32
            acc      acc (+)= dQ_part                ScalarE (first visit) / VectorE
        loads run one unit ahead: a key tile's K^T, V^T (with the next key tile's: one DMA each
        for two) (then its K rows) when the previous key tile starts; a query group's Q^T, dO^T
        (one DMA each, with the next group's when cached) and its Q, dO, O rows (one DMA,
        shared with phase 0) when the previous group starts, kept for the kv head's later key
        tiles when they fit (``q_cached``, else reloaded per visit); after a group's last pair:
        dq = scale * acc in the output dtype for the tiles whose last key tile this is; after a
        key tile's last pair: dK = scale * acc (ScalarE), dV = acc (VectorE) -> HBM (one DMA for both).

dQ accumulates over key tiles in fp32, in key-tile order: in SBUF for the whole pass when the
GQA group's accumulators take at most half a partition (``dq_resident``; Sq <= 16384 at G = 1,
D = 128), else in an fp32 HBM scratch (loaded / stored per group visit, one DMA each). dK/dV of
a kv head accumulate over every query head of its GQA group in the same PSUM tiles.
Deterministic: one fixed accumulation order, no atomics. Whole-tile skipping and masks follow
``tiles.plan_row`` / ``tiles.row_bounds`` exactly like the forward; 128-key blocks no query of
the tile sees also skip the dV/dK/dQ matmuls.

LNC2 (``NEURON_LOGICAL_NC_CONFIG=2``): the two programs share the (batch, kv head) units
(``program_units``: every other unit of the batch-major order), each with its GQA group's query
heads, so every dq/dk/dv row has one writer and no barrier is needed; with one kv head and
B >= 2 the cores split the batch. dsinks is one row when each query head's units run on one
program, else one row of partial sums per program, added by the launcher (``dsinks_writers``).
With an odd number of (batch, kv head) units and a GQA group the programs divide (B = 1,
Hkv = 1, Hq = 8), the programs split every kv head's query heads instead (``head_split``) and
write fp32 partial dK/dV, added by the launcher; otherwise (one unit and one query head) the
second program idles.

Engine balance (cost model, D = 128, bf16, trn2): per 128 x 512 score tile TensorE does S, dP,
4 x (dV, dK, dQ) (2560 cycles, all useful) plus, outside couples, 4 dS^T transposes (512 more);
ScalarE the exp and the dP - delta eviction (854 ns); VectorE the dQ accumulation and, outside
couples, the dS^T evictions (133 + 267 ns); GpSimd dS (427 ns) and the causal/window masks of
diagonal tiles; DMA one 2 KiB-per-partition dS^T transpose per couple (1.42 us per two tiles).
Busy times at Sq = Sk = 4096 causal: TensorE 146 us, DMA 122, ScalarE 124, GpSimd 69, VectorE
34; estimated 169 us (81% of the engine-aware roofline; docs/perf-log.md §12.5).
Every streamed DMA moves one contiguous run of >= 1 KiB per partition (Q^T and dO^T 1 KiB
each per group, 2 KiB per two groups when cached; Q/dO/O rows 3 KiB per group; K^T and V^T
2 KiB per two key tiles; K rows 1 KiB and dK + dV 2 KiB per key tile; dS^T 2 KiB per couple).
Q^T, dO^T, K^T and V^T are DMA transposes of the natural (B, H, S, D) inputs for 2-byte dtypes
with D <= 128 (``flash_attention_transposed_loads``; no host transposes), else rows of host transposes.

Working set (per partition; D <= 128, 16-bit inputs): SBUF: thirteen pairs with their
couples' dS and dS^T tiles, three query groups and up to four key tiles' K^T/V^T in flight,
phase-0 rows of the next group (84 KiB peak in all, the cached groups and resident dQ included,
at Sq = Sk = 4096 causal, G = 1, bf16; simulator report) plus 24 B per query
tile and query head of the GQA group (statistics, lse/dlse columns), plus, when resident,
4 * D B of fp32 dQ accumulator per query tile and query head of the GQA group, plus, when
``q_cached``, a group's Q^T, dO^T and Q, dO, O rows (5 KiB at D = 128, bf16) per query group and
query head of the GQA group.
PSUM: dK, dV (one bank each, two each for D in (128, 256]) and one S, dP, dS^T and dQ tile each
(every PSUM tile is consumed one pipeline step after it is made): 6 banks at D <= 128, 8 at
D = 256.

Shapes (HBM; the row layouts are layout glue, one host op each): q_rows
(B, Hq, NG, pmax, 3, per, D) (Q, dO and O rows in row-group layout, ``query_rows``: [.., g, p, i, s, :] = row
(g * per + s) * pmax + p of input i, zero rows past Sq); q_src, do_src (B, Hq, Sq, D), k_src,
v_src (B, Hkv, Sk, D) natural (``natural``), else their (B, H, D, S) transposes;
k_rows (B, Hkv, NKT, pmax, per, D) (``row_groups``); lse, dlse (B, Hq, Sq) fp32; sinks (Hq,) fp32;
doc (B, pmax, NT, 2) fp32 per-row key bounds [lo, hi] (``nki_lib.attention.key_bounds``:
documents, key padding, the causal/window rules intersected; ``tiles.bounds_layout``) or None.
Outputs dq (B, Hq, NG, pmax, per, D) and
dkv (B, Hkv, NKT, pmax, 2, per, D) (dK then dV rows of each partition, one 2 KiB store per key
tile) in row-group layout (the launcher turns them back).
Scratch (non-resident dQ): dq_acc like dq, fp32.
Dimension legend: B batch, Hq/Hkv query/kv heads (G = Hq // Hkv), Sq/Sk lengths, D head dim,
pmax partitions, per = 128-row tiles per group (= 128-key blocks per key tile, 4), NG query
groups, NKT key tiles, qn/kn rows/keys of the current tile, NT query tiles.
Limits: D <= 256 (two contraction chunks); bf16/fp16/fp32; Sq + Sk < 2**24 (float32 key
indices); with per-row key bounds (cu_seqlens, attn_mask) and no softcap, scale > 0 (scores
outside the bounds are filled with the most negative float32 before exp), else ``Unsupported``.
"""

from __future__ import annotations

from functools import partial

import torch

from nki_lib._nki import nisa, nki, nl
from nki_lib.attention.attention_args import MAX_HEAD_DIM
from nki_lib.attention.kernels import flash_attention_bwd_prep, tiles
from nki_lib.attention.kernels.flash_attention_bwd_tile import (
    Config,
    DsCouple,
    Pair,
    acc_stage,
    dk_stage,
    dq_stage,
    dscores_stage,
    dv_stage,
    evict_stage,
    probs_stage,
    scores_stage,
    seen_blocks,
)
from nki_lib.attention.kernels.flash_attention_transposed_loads import as_kernel_layout, load_transposed_into, on_chip
from nki_lib.backend import lnc_degree
from nki_lib.dispatch import KernelLaunch, Unsupported
from nki_lib.sizes import ceil_div

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _acc_stride(head_dim: int) -> int:
    """Free stride of one 128-key block in the dK/dV PSUM accumulators: the next power of two
    >= D, so no block straddles a 2 KiB bank (a matmul result must fit one bank)."""
    return 1 << (head_dim - 1).bit_length()


# --------------------------------------------------------------------------- K/V tile

def _full_blocks(blocks):
    """Number of leading full (pmax-row) blocks; a partial last block moves on its own."""
    pmax = nl.tile_size.pmax
    return sum(1 for _, sn in blocks if sn == pmax)


def _move_rows(hbm_rows, sb, blocks, to_sbuf):
    """A key tile's rows in row-group layout ``(pmax, nblocks, D)`` between HBM and SBUF: one DMA for
    the full blocks (one contiguous run per partition), one for a partial last block."""
    nfull = _full_blocks(blocks)
    pairs = [(hbm_rows[:, :nfull, :], sb[:, :nfull, :])] if nfull else []
    if nfull < len(blocks):
        sn = blocks[nfull][1]
        pairs.append((hbm_rows[:sn, nfull, :], sb[:sn, nfull, :]))
    for hbm, tile in pairs:
        nisa.dma_copy(dst=tile if to_sbuf else hbm, src=hbm if to_sbuf else tile)


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


def _load_kv(kvs, k_src, v_src, natural, b, hk, head_dim):
    """K^T and V^T of adjacent key tiles ``kvs`` (one or two, :func:`_kv_batch`) in one DMA each
    per head-dim chunk (DMA transposes of natural K/V rows, or rows of the launcher's transposes,
    ``flash_attention_transposed_loads``): each partition moves one run of up to 2 KiB, so two
    key tiles pay the per-chunk DMA floor once (docs/cost-model.md §2.6); each key tile gets its
    view. The K rows follow (:func:`_load_k_rows`)."""
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


def _kv_batch(ktiles, m):
    """Key tiles whose K^T/V^T load with ``ktiles[m]``'s: it and the next one when that is adjacent
    (a full key tile followed by the next keys) and not loaded yet."""
    kv = ktiles[m]
    if m + 1 < len(ktiles):
        nxt = ktiles[m + 1]
        if nxt.kT_sb is None and kv.kn == tiles.key_tile_width() and nxt.k0 == kv.k0 + kv.kn:
            return [kv, nxt]
    return [kv]


def _load_k_rows(kv, k_rows, b, hk, head_dim):
    """K rows (one DMA, row-group layout): needed last (dQ stage), so issued after the first
    query group's loads."""
    kv.k_sb = nl.ndarray((nl.tile_size.pmax, len(kv.blocks), head_dim), dtype=k_rows.dtype, buffer=nl.sbuf)
    _move_rows(k_rows[b, hk, kv.kt], kv.k_sb, kv.blocks, True)


def _store_kv_grads(dkv, b, hk, kv, cfg):
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
    nfull = _full_blocks(blocks)
    hbm = dkv[b, hk, kv.kt]
    if nfull:
        nisa.dma_copy(dst=hbm[:, :, :nfull, :], src=dkv_sb[:, :, :nfull, :])
    if nfull < len(blocks):
        sn = blocks[nfull][1]
        nisa.dma_copy(dst=hbm[:sn, :, nfull, :], src=dkv_sb[:sn, :, nfull, :])


# --------------------------------------------------------------------------- query groups

def _q_groups(visits):
    """``((group id, visits of the group), ...)`` by aligned query group (``_group_tiles`` query
    tiles each): one DMA moves a group's Q^T, dO^T, Q, dO or dQ rows (>= 1 KiB per partition)."""
    per = _group_tiles()
    gids = []
    for t, _ in visits:
        if t // per not in gids:
            gids.append(t // per)
    return tuple((gid, tuple(v for v in visits if v[0] // per == gid)) for gid in gids)


def _group_tiles():
    """Query tiles per group: as many 128-row tiles as a key tile has 128-key blocks (queries and
    keys share the row-group HBM layout of :func:`row_groups`)."""
    return tiles.key_tile_width() // nl.tile_size.pmax


def _runs(slots, partial_slot):
    """Maximal runs ``(start, stop)`` of consecutive slots; the partial last tile is its own run."""
    runs = []
    for s in slots:
        if runs and runs[-1][1] == s and s != partial_slot and runs[-1][0] != partial_slot:
            runs[-1] = (runs[-1][0], s + 1)
        else:
            runs.append((s, s + 1))
    return runs


class Streams(nl.NKIObject):
    """The query-side HBM tensors of one launch: ``qdo_rows`` (Q and dO rows, row-group layout),
    ``q_src``, ``do_src`` (Q and dO, natural or transposed: ``flash_attention_transposed_loads``), ``q_cache``
    (``{(query head, group): (Q^T/dO^T, Q/dO rows)}`` of the current kv head, kept for its later
    key tiles when :func:`q_cached` allows, else None), ``q_visits`` (the (query head, group)
    pairs the current pass visits), ``qT_ahead`` (Q^T/dO^T views of groups loaded with the
    previous group, :func:`_load_qdoT`), ``dq``
    (output, row-group layout), ``dq_acc`` (fp32 scratch between key tiles; None when the
    accumulators stay in SBUF), ``dq_res`` (the SBUF accumulators of the current kv head's query
    heads, or None)."""

    def __init__(self, qdo_rows, q_src, do_src, natural, dq, dq_acc, seqlen_q):
        self.qdo_rows = qdo_rows
        self.q_src = q_src
        self.do_src = do_src
        self.natural = natural
        self.q_cache = None
        self.q_visits = set()
        self.qT_ahead = {}
        self.dq = dq
        self.dq_acc = dq_acc
        self.dq_res = None
        self.seqlen_q = seqlen_q


def _load_q_group(ins, b, h, gid, head_dim, phase0_rows):
    """Q^T and dO^T ``(pmax, nchunks, 2, group rows)`` (one DMA each per head-dim chunk; the
    columns past Sq of the last group are zeroed) and Q, dO rows-on-partitions
    ``(pmax, 2, group tiles, D)``: views of the phase-0 rows (``phase0_rows()``), else one DMA
    (2 KiB contiguous per partition)."""
    pmax = nl.tile_size.pmax
    per = _group_tiles()
    qdoT_sb = ins.qT_ahead.pop((h, gid), None)
    if qdoT_sb is None:
        ahead = ins.q_cache is not None and (h, gid + 1) in ins.q_visits and (h, gid + 1) not in ins.q_cache
        views = _load_qdoT(ins, b, h, gid, 2 if ahead else 1, head_dim)
        qdoT_sb = views[0]
        if ahead:
            ins.qT_ahead[(h, gid + 1)] = views[1]
    rows_sb = phase0_rows()
    if rows_sb is not None:
        return qdoT_sb, rows_sb[:, 0:2, :, :]
    qdo_sb = nl.ndarray((pmax, 2, per, head_dim), dtype=ins.qdo_rows.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=qdo_sb, src=ins.qdo_rows[b, h, gid])
    return qdoT_sb, qdo_sb


def _load_qdoT(ins, b, h, gid, n, head_dim):
    """Q^T and dO^T of ``n`` (1 or 2) consecutive query groups from ``gid``, one DMA each per
    head-dim chunk (each partition moves one run of up to 2 KiB: the per-chunk DMA floor is paid
    once for both groups, docs/cost-model.md §2.6; columns past Sq zeroed): one
    ``(pmax, nchunks, 2, group rows)`` view per group."""
    pmax = nl.tile_size.pmax
    width = _group_tiles() * pmax
    chunks = tiles.head_dim_chunks(head_dim)
    q0 = gid * width
    rows = min(n * width, ins.seqlen_q - q0)
    qdoT_sb = nl.ndarray((pmax, len(chunks), 2, n * width), dtype=ins.q_src.dtype, buffer=nl.sbuf)
    if rows < n * width:
        nisa.memset(dst=qdoT_sb[:, :, :, rows:], value=0.0)
    for ch, (d0, dc) in enumerate(chunks):
        for i, src in enumerate((ins.q_src, ins.do_src)):
            load_transposed_into(qdoT_sb[:dc, ch, i, :rows], src, ins.natural, b, h, q0, rows, d0, dc)
    return [qdoT_sb[:, :, :, i * width:(i + 1) * width] for i in range(n)]


def _move_dq(dq_grp, hbm_grp, runs, q_tiles, gid, to_sbuf):
    """Group rows ``(pmax, group tiles, D)`` <-> a row-group HBM tensor (the fp32 scratch or dq),
    one DMA per run of slots (each partition moves one contiguous run)."""
    per = _group_tiles()
    for s0, s1 in runs:
        rows = q_tiles[gid * per + s0][1]
        hbm = hbm_grp[:rows, s0:s1, :]
        sb = dq_grp[:rows, s0:s1, :]
        nisa.dma_copy(dst=sb if to_sbuf else hbm, src=hbm if to_sbuf else sb)


def _group_flags(group, gid, k0, plans, num_q_tiles, last_rows):
    """Slots of the group's visiting tiles, whether this is their first / last key tile, and the
    slot of the partial last query tile (-1 if none in this group)."""
    pmax = nl.tile_size.pmax
    per = _group_tiles()
    partial = num_q_tiles - 1 - gid * per if last_rows < pmax else -1
    slots = [t - gid * per for t, _ in group]
    first = [plans[t][0][0] == k0 for t, _ in group]
    last = [plans[t][-1][0] == k0 for t, _ in group]
    return slots, first, last, partial


def _load_group(ins, b, h, gid, flags, cfg, phase0_rows):
    """Q^T, dO^T, Q, dO and the dQ accumulator (tiles visited before) of one query group.
    ``phase0_rows()`` issues the group's phase-0 rows (Q, dO, O; once per pass) after the
    transposes and returns them, or None once its statistics are done: Q and dO rows are then
    views of that tile instead of a DMA of their own."""
    pmax = nl.tile_size.pmax
    per = _group_tiles()
    slots, first, _, partial = flags
    if ins.q_cache is not None and (h, gid) in ins.q_cache:
        qdoT_sb, qdo_sb = ins.q_cache[(h, gid)]
        phase0_rows()
    else:
        qdoT_sb, qdo_sb = _load_q_group(ins, b, h, gid, cfg.head_dim, phase0_rows)
        if ins.q_cache is not None:
            ins.q_cache[(h, gid)] = (qdoT_sb, qdo_sb)
    if ins.dq_res is not None:
        dq_grp = ins.dq_res[:, h % ins.dq_res.shape[1], gid * per:(gid + 1) * per, :]
    else:
        dq_grp = nl.ndarray((pmax, per, cfg.head_dim), dtype=nl.float32, buffer=nl.sbuf)
        loads = _runs([s for s, f in zip(slots, first) if not f], partial)
        _move_dq(dq_grp, ins.dq_acc[b, h, gid], loads, tiles.query_tiles(ins.seqlen_q), gid, True)
    return qdoT_sb, qdo_sb, dq_grp


def _finish_group(ins, loaded, b, h, gid, flags, q_tiles, cfg):
    """After the group's last pair on this key tile: dq (scale applied, output dtype) leaves for
    the tiles whose last key tile this is; without SBUF residency the other accumulators return
    to the fp32 scratch."""
    slots, _, last, partial = flags
    per = _group_tiles()
    dq_grp = loaded[2]
    done = [s for s, f in zip(slots, last) if f]
    if done:
        out_sb = nl.ndarray((nl.tile_size.pmax, per, cfg.head_dim), dtype=ins.dq.dtype, buffer=nl.sbuf)
        for s in done:
            qn = q_tiles[gid * per + s][1]
            nisa.activation(dst=out_sb[:qn, s, :], op=nl.copy, data=dq_grp[:qn, s, :], scale=cfg.scale)
        _move_dq(out_sb, ins.dq[b, h, gid], _runs(done, partial), q_tiles, gid, False)
    if ins.dq_res is None:
        stores = _runs([s for s, f in zip(slots, last) if not f], partial)
        _move_dq(dq_grp, ins.dq_acc[b, h, gid], stores, q_tiles, gid, False)


def dq_resident(group, seqlen_q, head_dim):
    """Whether the fp32 dQ accumulators of a GQA group's query heads stay in SBUF for a whole kv
    head (no HBM round trip per key tile): when they take at most half of a partition's SBUF."""
    per = _group_tiles()
    rows = ceil_div(seqlen_q, per * nl.tile_size.pmax) * per
    return group * rows * head_dim * 4 <= nl.tile_size.sbuf_fmax_bytes // 2


def q_cached(group, seqlen_q, head_dim, itemsize):
    """Whether a kv head's query groups stay in SBUF once loaded (Q^T, dO^T, Q and dO rows of every
    query head of the GQA group, reused by every later key tile instead of one reload per visit):
    when they and the resident dQ accumulators (:func:`dq_resident`) take at most half of a
    partition's SBUF (Sq <= 8192 at G = 1, D = 128, bf16)."""
    pmax, per = nl.tile_size.pmax, _group_tiles()
    num_groups = ceil_div(seqlen_q, per * pmax)
    chunks = len(tiles.head_dim_chunks(head_dim))
    group_bytes = (chunks * 2 * per * pmax + 2 * per * head_dim) * itemsize
    dq_bytes = per * head_dim * 4 if dq_resident(group, seqlen_q, head_dim) else 0
    return group * num_groups * (group_bytes + dq_bytes) <= nl.tile_size.sbuf_fmax_bytes // 2


# Software pipeline: the stage of pair j issued at step j + lag. Per step, the program order below
# puts each engine's work whose inputs were produced in earlier steps first, so no in-order engine
# queue waits behind a result of the same step. Each PSUM tile is consumed one step after it is made
# and consumers come first in a step: at most dK, dV, S, dP, dS^T and dQ tiles are live (6 banks at
# D <= 128, 8 at D = 256). Lags measured on trn2 at Sq = Sk = 4096 causal (cost model), also at the
# documented bounds of the low-confidence constants (``--sensitivity``).
STAGES = (  # (lag, stage)
    (12, "acc"),      # VectorE/ScalarE: dQ_part into the group accumulator (then a group may finish)
    (4, "evict"),     # VectorE: dS^T PSUM -> SBUF
    (1, "probs"),     # ScalarE: P = exp(...), dP - delta; GpSimd masks
    (2, "dscores"),   # GpSimd: dS
    (0, "scores"),    # TensorE: S, dP
    (3, "dv"),        # TensorE: dV += P^T dO
    (11, "dq"),       # TensorE: dQ_part = dS K (late: a couple's dS^T DMA transpose lands in time
                      # even at the slow end of the DMA chunk floor, docs/perf-log.md §12.5)
    (3, "dk"),        # TensorE: dK += dS^T Q, dS^T (a couple's last pair: its DMA transpose)
)
PIPELINE_LAG = max(lag for lag, _ in STAGES)
STATS_AHEAD = 1   # query groups whose phase-0 rows (O, dO) are in flight before their statistics are due


def _kv_pass(ins, kvs, prep, b, hk, group, gs, plans, cfg):
    """Everything of kv head hk for its query heads ``hk * group + g`` (g in ``gs``: the whole GQA
    group, or this program's share of it under an LNC2 head split): every (query head, key tile,
    query tile) pair in
    one software pipeline (:data:`STAGES`), key tile by key tile, so it never drains between key
    tiles or query heads. Loads run one unit ahead (the next key tile's K/V when a key tile's
    first pair is scored, the next query group's rows when a group's first pair is scored);
    a group finishes (dq out / accumulators back) after its last pair's accumulate stage, a key
    tile's dK/dV leave after its last pair's dK stage."""
    k_rows, k_src, v_src, dkv = kvs
    q_tiles = tiles.query_tiles(ins.seqlen_q)
    units = []   # (key tile, query head, group id, visits of the group, flags)
    order = []   # (unit, index in the unit)
    ktiles = []
    for kt, (k0, kn) in enumerate(tiles.key_tiles(cfg.mask.sk)):
        kv = KeyTile(kt, k0, kn)
        visits = _visits(plans, k0)
        if not visits:
            _store_kv_grads(dkv, b, hk, kv, cfg)
            continue
        ktiles.append(kv)
        for g in gs:
            for gid, grp in _q_groups(visits):
                flags = _group_flags(grp, gid, k0, plans, len(q_tiles), q_tiles[-1][1])
                units.append((kv, g, gid, grp, flags))
                order.extend((len(units) - 1, i) for i in range(len(grp)))
    ins.q_visits = {(hk * group + g, gid) for _, g, gid, _, _ in units}
    ins.qT_ahead = {}
    last_pair = [max(j for j, (n, _) in enumerate(order) if units[n][0] is kv) for kv in ktiles]
    loaded = [None] * len(units)
    pairs = [None] * len(order)

    def ensure(n):
        if n < len(units) and loaded[n] is None:
            kv, g, gid, _, flags = units[n]
            loaded[n] = _load_group(ins, b, hk * group + g, gid, flags, cfg,
                                    partial(flash_attention_bwd_prep.prefetch_group, prep, hstats[g], gid))
            for m in range(n + 1, min(n + STATS_AHEAD + 1, len(units))):   # O/dO rows a few groups ahead
                flash_attention_bwd_prep.prefetch_group(prep, hstats[units[m][1]], units[m][2])
            flash_attention_bwd_prep.group_stats(prep, hstats[g], gid)

    def ensure_kv(m):
        if m < len(ktiles) and ktiles[m].kT_sb is None:
            _load_kv(_kv_batch(ktiles, m), k_src, v_src, ins.natural, b, hk, cfg.head_dim)

    def ensure_rows(m):
        if m < len(ktiles) and ktiles[m].k_sb is None:
            _load_k_rows(ktiles[m], k_rows, b, hk, cfg.head_dim)

    def new_pair(j):
        n, i = order[j]
        _, _, _, grp, flags = units[n]
        t, tile_masked = grp[i]
        return Pair(loaded[n], flags[0][i], t, q_tiles[t][1], tile_masked, flags[1][i])

    ensure_kv(0)
    hstats = {g: flash_attention_bwd_prep.head_start(prep, b, hk * group + g) for g in gs}
    for step in range(len(order) + PIPELINE_LAG):
        for lag, stage in STAGES:
            j = step - lag
            if not 0 <= j < len(order):
                continue
            n, i = order[j]
            kv, g, gid, grp, flags = units[n]
            k0, kn = kv.k0, kv.kn
            if stage == "scores":
                m = ktiles.index(kv)
                ensure_kv(m)
                ensure(n)
                ensure_rows(m)
                ensure(n + 1)
                ensure_kv(m + 1)
                ensure_rows(m + 1)
                if pairs[j] is None:
                    pairs[j] = new_pair(j)
                if i in _couple_starts(ins, cfg) and i + 1 < len(grp):   # interior neighbours: one dS^T DMA
                    pairs[j + 1] = new_pair(j + 1)
                    if all(_interior(p, kv, cfg) for p in pairs[j:j + 2]):
                        DsCouple(pairs[j:j + 2], loaded[n][0].dtype)
                scores_stage(pairs[j], kv, k0, _seen_width(pairs[j], kv, cfg), cfg)
            elif stage == "probs":
                probs_stage(pairs[j], hstats[g].stats_sb, k0, _seen_width(pairs[j], kv, cfg), cfg)
            elif stage == "dscores":
                dscores_stage(pairs[j], _seen_width(pairs[j], kv, cfg))
            elif stage == "dv":
                if kv.dv_psum is None:
                    _alloc_kv_grads(kv, cfg)
                dv_stage(pairs[j], kv, k0, kn, cfg)
            elif stage == "dk":
                dk_stage(pairs[j], kv, k0, kn, cfg)
                if last_pair[ktiles.index(kv)] == j:
                    _store_kv_grads(dkv, b, hk, kv, cfg)
                    kv.dk_psum = kv.dv_psum = None
            elif stage == "evict":
                evict_stage(pairs[j], k0, kn, cfg)
            elif stage == "dq":
                dq_stage(pairs[j], kv, k0, kn, cfg)
                if last_pair[ktiles.index(kv)] == j:
                    kv.k_sb = kv.kT_sb = kv.vT_sb = None
            else:
                acc_stage(pairs[j])
                pairs[j] = None
                if i == len(grp) - 1:
                    _finish_group(ins, loaded[n], b, hk * group + g, gid, flags, q_tiles, cfg)
                    loaded[n] = None
    for hs in hstats.values():
        flash_attention_bwd_prep.head_finish(prep, hs)


def _couple_starts(ins, cfg):
    """Positions in a unit of the pairs that start a :class:`DsCouple` (with the next pair): every
    other pair when the kv head's query groups stay in SBUF (``q_cached``) or D > 128 (twice the
    TensorE work per pair for the same dS^T DMA); else only the first, since each unit then also
    reloads its group's Q^T, dO^T and rows and the DMA queue would bound the kernel (B = 1,
    Hq = 8, Hkv = 1, S = 2048, D = 128 causal: 394.7 us without couples, 401.7 with every pair
    coupled (DMA-bound), 373.5 us with one couple per unit; docs/perf-log.md §12.5)."""
    return (0, 2) if ins.q_cache is not None or cfg.head_dim > nl.tile_size.pmax else (0,)


def _interior(pair, kv, cfg):
    """Whether every row of the pair sees every key of a full key tile, in a 2-byte dtype (a
    :class:`DsCouple` member: its dS^T comes from a DMA transpose)."""
    full = pair.qn == nl.tile_size.pmax and kv.kn == tiles.key_tile_width()
    return full and pair.loaded[0].dtype != nl.float32 and \
        len(seen_blocks(cfg, pair.t, pair.qn, kv.k0, kv.kn)) == len(kv.blocks)


def _seen_width(pair, kv, cfg):
    """Keys of the tile the scores stages compute: up to the end of the last 128-key block some
    row of the pair sees (a diagonal tile skips the S/dP/exp/dS columns past the diagonal)."""
    s0, sn = kv.blocks[seen_blocks(cfg, pair.t, pair.qn, kv.k0, kv.kn)[-1]]
    return s0 + sn


def _alloc_kv_grads(kv, cfg):
    pmax = nl.tile_size.pmax
    acc_free = _acc_stride(cfg.head_dim)
    kv.dk_psum = nl.ndarray((pmax, len(kv.blocks), acc_free), dtype=nl.float32, buffer=nl.psum)
    kv.dv_psum = nl.ndarray((pmax, len(kv.blocks), acc_free), dtype=nl.float32, buffer=nl.psum)


# --------------------------------------------------------------------------- kernel

def _visits(plans, k0):
    """``((query tile, masked), ...)`` of the query tiles whose plan visits key tile ``k0``."""
    return tuple((t, masked) for t, plan in enumerate(plans) for pk0, _, masked in plan if pk0 == k0)


def head_split(batch, num_kv_heads, group, num_progs):
    """Whether the programs split every kv head's query heads (LNC2 with an odd number of
    (batch, kv head) units and a GQA group the programs divide): no core idles, each writes fp32
    partial dK/dV that the launcher adds."""
    return num_progs > 1 and (batch * num_kv_heads) % num_progs != 0 and group % num_progs == 0


def program_units(batch, num_kv_heads, group, num_progs, pid):
    """The units ``(b, hk, gs)`` program ``pid`` of ``num_progs`` serves (LNC2: one program per
    NeuronCore), ``gs`` the query heads ``hk * group + g`` it takes of kv head hk. Whole kv heads:
    every ``num_progs``-th (batch, kv head) of the batch-major order, so the cores share batch and
    heads alike (with one kv head and B = 2 each core takes one batch; with an even number of kv
    heads a kv head's units all land on one program). Under :func:`head_split` every program
    takes its share of every kv head's query heads."""
    units = [(b, hk) for b in range(batch) for hk in range(num_kv_heads)]
    if head_split(batch, num_kv_heads, group, num_progs):
        share = group // num_progs
        return [(b, hk, tuple(range(pid * share, (pid + 1) * share))) for b, hk in units]
    return [(b, hk, tuple(range(group))) for b, hk in units[pid::num_progs]]


def dsinks_writers(batch, num_kv_heads, group, num_progs):
    """Rows of the kernel's dsinks output: 1 when each query head's units all run on one program
    (it owns dsinks[h]), else one row of partial sums per program (the launcher adds them)."""
    whole = num_kv_heads % num_progs == 0 or batch == 1 or head_split(batch, num_kv_heads, group, num_progs)
    return 1 if whole else num_progs


@nki.jit
def flash_attention_bwd_kernel(q_rows, q_src, do_src, dlse, k_rows, k_src, v_src, lse, sinks, doc, causal, scale,
                               window_left, window_right, softcap, natural):
    """Returns ``(dq, dkv, dsinks)`` (dq, dkv in row-group layout); see the module docstring."""
    batch, num_heads, seqlen_q = lse.shape
    num_kv_heads, head_dim = k_rows.shape[1], k_rows.shape[5]
    seqlen_k = k_src.shape[2] if natural else k_src.shape[3]
    qdo_rows = q_rows[:, :, :, :, 0:2]    # Q, dO (reloads of a group after its phase 0)
    group = num_heads // num_kv_heads
    pmax = nl.tile_size.pmax
    per = _group_tiles()
    mask = tiles.MaskSpec(seqlen_q, seqlen_k, causal, window_left, window_right, doc is not None)
    cfg = Config(mask, scale, softcap, head_dim, flash_attention_bwd_prep.num_stats(mask.has_docs))
    q_tiles = tiles.query_tiles(seqlen_q)
    num_groups = q_rows.shape[2]

    # LNC2: the programs share the (batch, kv head) units (see program_units); each unit owns its
    # GQA group's dq/dk/dv rows, so every output row has one writer
    num_progs = nl.num_programs(0) if nl.program_ndim() > 0 else 1
    pid = nl.program_id(0) if num_progs > 1 else 0
    units = program_units(batch, num_kv_heads, group, num_progs, pid)
    writers = dsinks_writers(batch, num_kv_heads, group, num_progs) if sinks is not None else 1
    split = head_split(batch, num_kv_heads, group, num_progs)

    dq = nl.ndarray(q_rows.shape[:4] + (per, head_dim), dtype=q_rows.dtype, buffer=nl.shared_hbm)
    dkv_shape = k_rows.shape[:4] + (2,) + k_rows.shape[4:]   # dK and dV rows side by side
    if split:   # one fp32 partial dK/dV per program, added by the launcher
        dkv = nl.ndarray((num_progs,) + dkv_shape, dtype=nl.float32, buffer=nl.shared_hbm)
        dkv_out = dkv[pid]
    else:
        dkv = dkv_out = nl.ndarray(dkv_shape, dtype=k_rows.dtype, buffer=nl.shared_hbm)
    dsinks = nl.ndarray((writers, num_heads), dtype=nl.float32, buffer=nl.shared_hbm)
    resident = dq_resident(group, seqlen_q, head_dim)
    keep_q = q_cached(group, seqlen_q, head_dim, 4 if q_rows.dtype == nl.float32 else 2)
    dq_acc = None if resident else nl.ndarray(dq.shape, dtype=nl.float32, buffer=nl.private_hbm)
    ins = Streams(qdo_rows, q_src, do_src, natural, dq, dq_acc, seqlen_q)

    heads = sorted({hk * group + g for _, hk, gs in units for g in gs})
    prep = flash_attention_bwd_prep.Prep(q_rows, dlse, lse, sinks, doc, mask, cfg.num_stats)
    row = pid if writers > 1 else 0
    # without sinks program 0 zero-fills dsinks; with per-program partial rows each program
    # zero-fills its own row first (heads it serves no unit of keep 0)
    zero_row = pid == 0 if sinks is None else writers > 1
    flash_attention_bwd_prep.start(prep, dsinks[row], heads, zero_dsinks=zero_row)

    plans = [tiles.plan_row(mask, q0, qn) for q0, qn in q_tiles]
    for b, hk, gs in units:
        if resident:
            ins.dq_res = nl.ndarray((pmax, group, num_groups * per, head_dim), dtype=nl.float32, buffer=nl.sbuf)
        ins.q_cache = {} if keep_q else None
        _kv_pass(ins, (k_rows, k_src, v_src, dkv_out), prep, b, hk, group, gs, plans, cfg)
        ins.dq_res = ins.q_cache = None
        for h in (hk * group + g for g in gs):
            for t, (q0, qn) in enumerate(q_tiles):
                if not plans[t]:
                    zeros_sb = nl.ndarray((pmax, head_dim), dtype=dq.dtype, buffer=nl.sbuf)
                    nisa.memset(dst=zeros_sb[:qn, :], value=0.0)
                    nisa.dma_copy(dst=dq[b, h, t // per, :qn, t % per, :], src=zeros_sb[:qn, :])
    flash_attention_bwd_prep.finish(prep, dsinks[row])
    return dq, dkv, dsinks


# --------------------------------------------------------------------------- launcher

def launch_flash_attention_bwd(dout, dlse, q, k, v, out, lse, sinks, key_bounds, *, causal, scale, window_left,
              window_right, softcap):
    """The launch of the backward kernel (``key_bounds`` (B, 2, Sq) float32 or None and the flags
    from ``key_bounds.plan``); it returns ``(dq, dk, dv, dsinks)`` (dsinks float32 (Hq,),
    zeros without sinks). Raises :class:`Unsupported` when the kernel cannot serve the call."""
    if q.dtype not in KERNEL_DTYPES:
        raise Unsupported(f"dtype {q.dtype} (the backward kernel handles bfloat16, float16, float32)")
    if q.shape[-1] > MAX_HEAD_DIM:
        raise Unsupported(f"head dim {q.shape[-1]} > {MAX_HEAD_DIM}")
    if q.shape[2] + k.shape[2] >= tiles.MAX_INDEX:
        raise Unsupported(f"Sq + Sk = {q.shape[2] + k.shape[2]} >= 2**24 (key indices are float32 in the kernel)")
    if key_bounds is not None and softcap == 0 and scale <= 0:
        raise Unsupported("scale <= 0 with per-row key bounds (cu_seqlens, attn_mask): masked scores "
                          "would not vanish under exp")
    grid = lnc_degree()
    natural = on_chip(q)   # Q^T, dO^T, K^T, V^T by DMA transposes of the natural rows, else host transposes
    srcs = [as_kernel_layout(x, natural) for x in (q, dout, k, v)]
    return KernelLaunch(
        flash_attention_bwd_kernel,
        (query_rows(q, dout, out), srcs[0], srcs[1], dlse.contiguous(), row_groups(k), srcs[2], srcs[3],
         lse.contiguous(), None if sinks is None else sinks.contiguous(),
         None if key_bounds is None else tiles.bounds_layout(key_bounds)),
        dict(causal=bool(causal), scale=float(scale), window_left=int(window_left), window_right=int(window_right),
             softcap=float(softcap), natural=natural),
        grid=grid, unpack=partial(_unpack_grads, q.shape[2], k.shape[2], k.dtype))


def _unpack_grads(seqlen_q, seqlen_k, kv_dtype, grads):
    """The kernel's ``(dq, dkv, dsinks)`` in row groups -> the op's ``(B, H, S, D)`` gradients
    (dK and dV are ``dkv[:, :, :, :, 0]`` and ``[.., 1]``); per-program partial dK/dV (LNC2 head
    split, fp32) and dsinks rows are added here."""
    dq, dkv, dsinks = grads
    dsinks = dsinks[0] if dsinks.shape[0] == 1 else dsinks.sum(dim=0)
    partial_sums = dkv.dim() == dq.dim() + 2
    if partial_sums:
        dkv = dkv.sum(dim=0)
    kv = [from_row_groups(dkv[:, :, :, :, i], seqlen_k, kv_dtype if partial_sums else None) for i in (0, 1)]
    return from_row_groups(dq, seqlen_q), kv[0], kv[1], dsinks


def _padded(x, dim):
    """x with zero rows appended along ``dim`` up to a multiple of the group rows."""
    rows = _group_tiles() * nl.tile_size.pmax
    pad = -x.shape[dim] % rows
    if not pad:
        return x
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def _row_group_view(x):
    """``(B, H, S, D)`` -> ``(B, H, NG, pmax, per, D)`` with ``[.., g, p, s, :] = x[.., (g * per + s)
    * pmax + p, :]`` (zero rows past S): a view of x when S is a multiple of the group rows."""
    per, pmax = _group_tiles(), nl.tile_size.pmax
    b, h, _, d = x.shape
    return _padded(x, 2).reshape(b, h, -1, per, pmax, d).transpose(3, 4)


def row_groups(x):
    """Layout glue: :func:`_row_group_view` as one contiguous copy, so one DMA moves a group of
    ``per`` row tiles with one contiguous run per partition."""
    return _row_group_view(x).contiguous()


def query_rows(q, dout, out):
    """Layout glue: Q, dO and O rows in one ``(B, Hq, NG, pmax, 3, per, D)`` tensor (one host op):
    ``[.., g, p, i, s, :]`` = row ``(g * per + s) * pmax + p`` of (Q, dO, O)[i], so the kernel moves
    a group's Q and dO rows (``[.., 0:2, :, :]``) or its dO and O rows (``[.., 1:3, :, :]``) with one
    2 KiB contiguous run per partition."""
    return torch.stack([_row_group_view(x) for x in (q, dout, out)], dim=4)


def from_row_groups(y, s, dtype=None):
    """Inverse of :func:`row_groups` (drops the padding rows), cast to ``dtype`` in the same copy."""
    b, h, ng, pmax, per, d = y.shape
    rows = y.transpose(3, 4).to(dtype or y.dtype, memory_format=torch.contiguous_format)
    return rows.reshape(b, h, ng * per * pmax, d)[:, :, :s].contiguous()
