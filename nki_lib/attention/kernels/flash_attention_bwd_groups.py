"""Flash-attention backward: the query groups of one kv head's pass (loads, dQ accumulators).

Used by ``flash_attention_bwd_pipeline.kv_pass`` and the kernel ``flash_attention_bwd`` (plain NKI
helpers, inlined at trace time). A query group is ``per`` aligned 128-row query tiles
(``q_groups``); per (query head, group) visit of a key tile:

    load_group       Q^T, dO^T (one DMA each per head-dim chunk, with the next group's when cached;
                     columns past Sq zeroed), Q and dO rows (views of the phase-0 rows, else one
                     DMA), kept for the kv head's later key tiles when ``q_cached``; and the fp32
                     dQ accumulator: SBUF-resident for the pass (``dq_resident``), else loaded
                     from the fp32 HBM scratch for the tiles visited before (one DMA per run)
    fill_q_rows      natural inputs with cached groups: the Q rows as TensorE transposes of Q^T
                     (the host passes only dO and O rows), at the visit's first scores
    finish_group     after the group's last pair on this key tile: dq = scale * acc in the output
                     dtype for the tiles whose last key tile this is; the other accumulators go
                     back to the scratch when not resident

Shapes: Q^T/dO^T (pmax, nchunks, 2, per * pmax); Q/dO rows (pmax, 2, per, D); dQ accumulator
(pmax, per, D) fp32 (resident: (pmax, G, NG * per, D)); HBM qdo_rows (B, Hq, NG, pmax, 2, per, D),
dq and dq_acc (B, Hq, NG, pmax, per, D).
Dimension legend: B batch, Hq query heads, G query heads per kv head, NG query groups, pmax
partitions, per = query tiles per group (4), nchunks head-dim chunks of <= 128, D head dim.
Limits: residency and caching each take at most half a partition's SBUF (``dq_resident``: Sq <=
16384 at G = 1, D = 128; ``q_cached``: Sq <= 8192 at G = 1, D = 128, bf16).
"""

from __future__ import annotations

from nki_lib._nki import nisa, nl
from nki_lib.attention.kernels import tiles
from nki_lib.attention.kernels.flash_attention_bwd_rows import group_tiles, rows_from_transposed
from nki_lib.attention.kernels.flash_attention_transposed_loads import load_transposed_into
from nki_lib.sizes import ceil_div


def q_groups(visits):
    """``((group id, visits of the group), ...)`` by aligned query group (``group_tiles`` query
    tiles each): one DMA moves a group's Q^T, dO^T, Q, dO or dQ rows (>= 1 KiB per partition)."""
    per = group_tiles()
    gids = []
    for t, _ in visits:
        if t // per not in gids:
            gids.append(t // per)
    return tuple((gid, tuple(v for v in visits if v[0] // per == gid)) for gid in gids)


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

    def __init__(self, qdo_rows, q_src, do_src, natural, dq, dq_acc, seqlen_q, q_on_chip):
        self.qdo_rows = qdo_rows
        self.q_on_chip = q_on_chip
        self.q_todo = []
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
    per = group_tiles()
    qdoT_sb = ins.qT_ahead.pop((h, gid), None)
    if qdoT_sb is None:
        ahead = ins.q_cache is not None and (h, gid + 1) in ins.q_visits and (h, gid + 1) not in ins.q_cache
        views = _load_qdoT(ins, b, h, gid, 2 if ahead else 1, head_dim)
        qdoT_sb = views[0]
        if ahead:
            ins.qT_ahead[(h, gid + 1)] = views[1]
    rows_sb = phase0_rows()
    if rows_sb is not None:
        qdo_sb = rows_sb[:, 0:2, :, :]
    elif ins.q_on_chip:   # dO rows only; Q rows by fill_q_rows
        qdo_sb = nl.ndarray((pmax, 2, per, head_dim), dtype=ins.qdo_rows.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=qdo_sb[:, 1, :, :], src=ins.qdo_rows[b, h, gid, :, 0, :, :])
    else:
        qdo_sb = nl.ndarray((pmax, 2, per, head_dim), dtype=ins.qdo_rows.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=qdo_sb, src=ins.qdo_rows[b, h, gid])
    if ins.q_on_chip:
        ins.q_todo.append((qdoT_sb, qdo_sb))
    return qdoT_sb, qdo_sb


def fill_q_rows(ins, loaded, head_dim):
    """Q rows of a freshly loaded group visit ``loaded`` (natural inputs): one TensorE transpose
    of its Q^T per 128-row tile into one PSUM tile (bit-exact), one VectorE copy into the rows
    tile; once, at the visit's first scores (its Q^T is in SBUF by then)."""
    todo = [i for i, (_, rows) in enumerate(ins.q_todo) if rows is loaded[1]]
    if not todo:
        return
    qdoT_sb, qdo_sb = ins.q_todo.pop(todo[0])
    pmax = nl.tile_size.pmax
    blocks = [(s * pmax, pmax) for s in range(group_tiles())]
    rows_from_transposed(qdo_sb[:, 0, :, :], qdoT_sb[:, 0, 0, :], blocks, head_dim)


def _load_qdoT(ins, b, h, gid, n, head_dim):
    """Q^T and dO^T of ``n`` (1 or 2) consecutive query groups from ``gid``, one DMA each per
    head-dim chunk (each partition moves one run of up to 2 KiB: the per-chunk DMA floor is paid
    once for both groups, docs/cost-model.md §2.6; columns past Sq zeroed): one
    ``(pmax, nchunks, 2, group rows)`` view per group."""
    pmax = nl.tile_size.pmax
    width = group_tiles() * pmax
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
    per = group_tiles()
    for s0, s1 in runs:
        rows = q_tiles[gid * per + s0][1]
        hbm = hbm_grp[:rows, s0:s1, :]
        sb = dq_grp[:rows, s0:s1, :]
        nisa.dma_copy(dst=sb if to_sbuf else hbm, src=hbm if to_sbuf else sb)


def group_flags(group, gid, k0, plans, num_q_tiles, last_rows):
    """Slots of the group's visiting tiles, whether this is their first / last key tile, and the
    slot of the partial last query tile (-1 if none in this group)."""
    pmax = nl.tile_size.pmax
    per = group_tiles()
    partial = num_q_tiles - 1 - gid * per if last_rows < pmax else -1
    slots = [t - gid * per for t, _ in group]
    first = [plans[t][0][0] == k0 for t, _ in group]
    last = [plans[t][-1][0] == k0 for t, _ in group]
    return slots, first, last, partial


def load_group(ins, b, h, gid, flags, cfg, phase0_rows):
    """Q^T, dO^T, Q, dO and the dQ accumulator (tiles visited before) of one query group.
    ``phase0_rows()`` issues the group's phase-0 rows (Q, dO, O; once per pass) after the
    transposes and returns them, or None once its statistics are done: Q and dO rows are then
    views of that tile instead of a DMA of their own."""
    pmax = nl.tile_size.pmax
    per = group_tiles()
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


def finish_group(ins, loaded, b, h, gid, flags, q_tiles, cfg):
    """After the group's last pair on this key tile: dq (scale applied, output dtype) leaves for
    the tiles whose last key tile this is; without SBUF residency the other accumulators return
    to the fp32 scratch."""
    slots, _, last, partial = flags
    per = group_tiles()
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
    per = group_tiles()
    rows = ceil_div(seqlen_q, per * nl.tile_size.pmax) * per
    return group * rows * head_dim * 4 <= nl.tile_size.sbuf_fmax_bytes // 2


def q_cached(group, seqlen_q, head_dim, itemsize):
    """Whether a kv head's query groups stay in SBUF once loaded (Q^T, dO^T, Q and dO rows of every
    query head of the GQA group, reused by every later key tile instead of one reload per visit):
    when they and the resident dQ accumulators (:func:`dq_resident`) take at most half of a
    partition's SBUF (Sq <= 8192 at G = 1, D = 128, bf16)."""
    pmax, per = nl.tile_size.pmax, group_tiles()
    num_groups = ceil_div(seqlen_q, per * pmax)
    chunks = len(tiles.head_dim_chunks(head_dim))
    group_bytes = (chunks * 2 * per * pmax + 2 * per * head_dim) * itemsize
    dq_bytes = per * head_dim * 4 if dq_resident(group, seqlen_q, head_dim) else 0
    return group * num_groups * (group_bytes + dq_bytes) <= nl.tile_size.sbuf_fmax_bytes // 2
