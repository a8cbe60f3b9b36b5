"""Flash-attention backward: the software pipeline of one kv head's pass (``kv_pass``, ``STAGES``).

Called by ``flash_attention_bwd.flash_attention_bwd_kernel`` once per (batch, kv head) unit (plain
NKI helpers, inlined at trace time). Loop structure:

    pairs = [(key tile, query head, query group, query tile)
             for every key tile, query head of the unit, query group visiting it, visiting tile]
    for step in range(len(pairs) + PIPELINE_LAG):
        for (lag, stage) in STAGES:            pair j's stage runs at step j + lag
            scores: loads one unit ahead (K/V of the next key tile, the next group's rows and
                    phase 0), couples of interior neighbours (one dS^T DMA, ``DsCouple``); a
                    key tile's first: its K rows (TensorE transposes of K^T at D <= 128); a
                    group visit's first, before the scores: its Q rows when on chip
            probs, dscores, dv, dk (last pair of a key tile: dK/dV out), evict, dq,
            acc (last pair of a group: dq out / accumulators back)

The stages themselves are ``flash_attention_bwd_tile``; key tiles ``flash_attention_bwd_kv``;
query groups ``flash_attention_bwd_groups``; phase 0 ``flash_attention_bwd_prep``.
Shapes: pairs of a query tile (qn <= 128 rows) and a key tile (kn <= 512 keys); the scores stages
compute up to the last 128-key block some row sees (``_seen_width``).
Dimension legend: qn/kn rows/keys of the tile, D head dim.
Limits: at most dK, dV, S, dP, dS^T and dQ PSUM tiles live, plus at D <= 128 one K-row or
Q-row transposes' tile (at most 7 banks at D <= 128, 8 at D = 256);
couples only for full interior pairs in a 2-byte dtype.
"""

from __future__ import annotations

from functools import partial

from nki_lib._nki import nl
from nki_lib.attention.kernels import flash_attention_bwd_prep, tiles
from nki_lib.attention.kernels.flash_attention_bwd_groups import (
    fill_q_rows,
    finish_group,
    group_flags,
    load_group,
    q_groups,
)
from nki_lib.attention.kernels.flash_attention_bwd_kv import (
    KeyTile,
    alloc_kv_grads,
    k_rows_on_chip,
    kv_batch,
    load_k_rows,
    load_kv,
    store_kv_grads,
    transpose_k_rows,
)
from nki_lib.attention.kernels.flash_attention_bwd_tile import (
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


def kv_pass(ins, kvs, prep, b, hk, group, gs, plans, cfg):
    """Everything of kv head hk for its query heads ``hk * group + g`` (g in ``gs``: the whole GQA
    group, or this program's share of it under an LNC2 head split): every (query head, key tile,
    query tile) pair in
    one software pipeline (:data:`STAGES`), key tile by key tile, so it never drains between key
    tiles or query heads. Loads run one unit ahead (the next key tile's K/V when a key tile's
    first pair is scored, the next query group's rows when a group's first pair is scored);
    a group finishes (dq out / accumulators back) after its last pair's accumulate stage, a key
    tile's dK/dV leave after its last pair's dK stage."""
    k, k_src, v_src, dkv = kvs
    k_on_chip = k_rows_on_chip(cfg.head_dim)
    q_tiles = tiles.query_tiles(ins.seqlen_q)
    units = []   # (key tile, query head, group id, visits of the group, flags)
    order = []   # (unit, index in the unit)
    ktiles = []
    for kt, (k0, kn) in enumerate(tiles.key_tiles(cfg.mask.sk)):
        kv = KeyTile(kt, k0, kn)
        visits = _visits(plans, k0)
        if not visits:
            store_kv_grads(dkv, b, hk, kv, cfg)
            continue
        ktiles.append(kv)
        for g in gs:
            for gid, grp in q_groups(visits):
                flags = group_flags(grp, gid, k0, plans, len(q_tiles), q_tiles[-1][1])
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
            loaded[n] = load_group(ins, b, hk * group + g, gid, flags, cfg,
                                    partial(flash_attention_bwd_prep.prefetch_group, prep, hstats[g], gid))
            for m in range(n + 1, min(n + STATS_AHEAD + 1, len(units))):   # O/dO rows a few groups ahead
                flash_attention_bwd_prep.prefetch_group(prep, hstats[units[m][1]], units[m][2])
            flash_attention_bwd_prep.group_stats(prep, hstats[g], gid)

    def ensure_kv(m):
        if m < len(ktiles) and ktiles[m].kT_sb is None:
            load_kv(kv_batch(ktiles, m), k_src, v_src, ins.natural, b, hk, cfg.head_dim)

    def ensure_rows(m):
        if m < len(ktiles) and ktiles[m].k_sb is None and not k_on_chip:
            load_k_rows(ktiles[m], k, b, hk, cfg.head_dim)

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
                fill_q_rows(ins, loaded[n], cfg.head_dim)
                scores_stage(pairs[j], kv, k0, _seen_width(pairs[j], kv, cfg), cfg)
                if kv.k_sb is None and k_on_chip:   # K rows on chip, behind the key tile's first scores (its K^T is in)
                    transpose_k_rows(kv, cfg.head_dim)
            elif stage == "probs":
                probs_stage(pairs[j], hstats[g].stats_sb, k0, _seen_width(pairs[j], kv, cfg), cfg)
            elif stage == "dscores":
                dscores_stage(pairs[j], _seen_width(pairs[j], kv, cfg))
            elif stage == "dv":
                if kv.dv_psum is None:
                    alloc_kv_grads(kv, cfg)
                dv_stage(pairs[j], kv, k0, kn, cfg)
            elif stage == "dk":
                dk_stage(pairs[j], kv, k0, kn, cfg)
                if last_pair[ktiles.index(kv)] == j:
                    store_kv_grads(dkv, b, hk, kv, cfg)
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
                    finish_group(ins, loaded[n], b, hk * group + g, gid, flags, q_tiles, cfg)
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


def _visits(plans, k0):
    """``((query tile, masked), ...)`` of the query tiles whose plan visits key tile ``k0``."""
    return tuple((t, masked) for t, plan in enumerate(plans) for pk0, _, masked in plan if pk0 == k0)

