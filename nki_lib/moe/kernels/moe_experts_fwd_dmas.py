"""Group DMAs of the expert-MLP forward (:mod:`.moe_experts_fwd`): slot tiles, gathers, x
transposes, the deferred y writes, the saved g/u stores and the next group's prefetch.

Algorithm: per group, :func:`group_tiles` loads each slot tile's 0/1 live and partial registers;
:func:`gather_group` gathers the token rows of x per live slot tile (an indirect DMA,
``vector_offset``; -1 rows skipped, zero fill where the tile is partial) and
:func:`transpose_group` PE-transposes them into xT (H on partitions, in :data:`H_INTERLEAVE`
order). A group's staged output rows are written by its sink (:mod:`.moe_experts_fwd_combine`),
the last staging group's late, in the next group's body (:func:`scatter_deferred`);
:func:`next_group_dmas` orders the DMAs of a group body that serve other groups (the previous
group's writes, the next group's gathers and, with ``prefetch``, its in_out gate/up weights, one
slot tile at a time); :func:`store_saved` writes the saved g/u of a group for the backward.

Loop structure: group guard (dynamic, 0/1 trips) > slot tiles (guarded by their live register) >
one DMA or transpose per tile; with ``prefetch``: steps (max of the slot tiles of the two groups)
> {one write, a share of the H blocks of the next gate/up tile, one gather}.

Shapes (dimension legend): T tokens, H hidden, I intermediate, P = 128 partitions, S slots per
group, ST slot tiles per group, ps slots of a tile (<= P), HT = ceil(H / P) H tiles, IT I tiles.
x (T, H) HBM; x rows (ps, H) and xT (P, HT, S) SBUF; the in_out w_gate_up (E, H, 2I) HBM and its
prefetched tile (P, HT, 2I) SBUF; staged y rows (ps, cols) fp32 SBUF; saved g/u (NG, ST, P,
2 IT ps_max) HBM (:func:`.moe_experts_fwd.saved_shape`).

Limits: as :mod:`.moe_experts_fwd` (S <= 512: at most 4 slot tiles; a gather's row indices from
the loaded slot token ids, -1 skipped).
"""

from __future__ import annotations

from nki_lib._nki import nisa, nl
from nki_lib.moe.kernels.moe_experts_steps import gather_rows_into, interleaved_blocks, load_expert_cols, transpose_rows
from nki_lib.sizes import ceil_div, spans

# H rows per partition of the in_out gate/up weight loads: w_gate_up[e] is (H, 2I) row-major, so
# 2 consecutive H rows on one partition make one contiguous run of 4I elements (6 KiB at qwen3's
# I = 768, bf16) instead of 2I (3 KiB): past the 4 KiB where a DMA saturates (docs/cost-model.md
# §2.6), at every documented bound of the chunk floor. xT takes the same H order (its transposes
# read x's columns with a step of 2 elements, 4 B for bf16: within the 16 B innermost stride of
# full port bandwidth, §2.5), and so do the out_in layout's W^T tiles (transposes of its natural
# rows with the same step), so that both layouts sum the same products in the same order.
H_INTERLEAVE = 2


def group_tiles(ids, live_sb, g, group):
    """Slot tiles (s0, ps, token ids (ps, 1), live register, assignment ids (ps, 1), partial
    register) of group g (``ids`` = the (token, assignment) id tiles and the partial flags); the
    live register is the tile's 0/1 guard, the partial one guards the zero fill of its gather."""
    slot_tiles = []
    for st, (s0, ps) in enumerate(spans(group, nl.tile_size.pmax)):
        live_reg, partial_reg = nisa.register_alloc(), nisa.register_alloc()
        p, gt = g % nl.tile_size.pmax, g // nl.tile_size.pmax
        nisa.register_load(live_reg, live_sb[p:p + 1, gt, st:st + 1])
        nisa.register_load(partial_reg, ids[2][p:p + 1, gt, st:st + 1])
        slot_tiles.append((s0, ps, ids[0][:ps, st, g:g + 1], live_reg, ids[1][:ps, st, g:g + 1], partial_reg))
    return slot_tiles


def gather_group(x, slot_tiles, trips_reg):
    """Token rows of x per slot tile of a group (indirect gathers under the group's guard and each
    tile's guard)."""
    x_rows = [nl.ndarray((ps, x.shape[1]), dtype=x.dtype, buffer=nl.sbuf) for _, ps, *_ in slot_tiles]
    for _ in nl.dynamic_range(0, trips_reg):
        for (_, _, tok_sb, live_reg, _, partial_reg), rows_sb in zip(slot_tiles, x_rows):
            for _ in nl.dynamic_range(0, live_reg):
                gather_rows_into(rows_sb, x, tok_sb, fill_reg=partial_reg)
    return x_rows


def transpose_group(x_t, slot_tiles, x_rows, trips_reg, interleave=1):
    """xT[:, :, slots] = x rows^T per live slot tile (a function, so that no loop variable keeps a
    row tile alive after the caller releases the rows); ``interleave``: the H tiles in the order
    of the gate/up weight tiles (:data:`H_INTERLEAVE`)."""
    for _ in nl.dynamic_range(0, trips_reg):
        for (s0, _, _, live_reg, _, _), rows_sb in zip(slot_tiles, x_rows):
            for _ in nl.dynamic_range(0, live_reg):
                transpose_rows(x_t, rows_sb, s0, interleave)


def scatter_deferred(deferred):
    """Scatter staged y rows: ``deferred`` = [group trip register (None: already inside the
    group's guard), slot tiles, their staged rows, first column, the group's sink], or None. A group's last
    scatters are issued late in program order, in the next group's body after its gate/up
    projections and its gather of the following group's rows: DMAs start in program order, so a
    scatter issued right after the down projection, still waiting for its GpSimd descriptors,
    held back the next group's weight loads and left TensorE idle at every group boundary
    (docs/perf-log.md §10.2). The rows are released afterwards."""
    if deferred is None:
        return
    trips_reg, slot_tiles, rows, g0, sink = deferred
    for _ in (range(1) if trips_reg is None else nl.dynamic_range(0, trips_reg)):
        for tile, y_sb in zip(slot_tiles, rows):
            for _ in nl.dynamic_range(0, tile[3]):
                sink.write(tile, y_sb, g0)
    rows.clear()


def store_saved(gu_saved, g, slot_tiles, saved, trips_reg):
    """gu_saved[g, st, p, :] = slot tile st's saved tile (P, 2 IT, ps) of group g, one DMA per
    live slot tile (one contiguous run of 2 IT ps elements per partition)."""
    _, _, pmax, row = gu_saved.shape
    st_len = gu_saved.shape[1]
    for _ in nl.dynamic_range(0, trips_reg):
        for st, ((_, ps, _, live_reg, _, _), save_sb) in enumerate(zip(slot_tiles, saved)):
            n_cols = save_sb.shape[1]
            for _ in nl.dynamic_range(0, live_reg):
                nisa.dma_copy(dst=gu_saved.ap([[row, pmax], [ps, n_cols], [1, ps]], offset=(g * st_len + st) * pmax * row),
                              src=save_sb)


def next_group_dmas(x, w_gate_up, next_group, deferred, h_tiles, prefetch):
    """The DMAs of a group body that serve other groups: the previous group's ``deferred`` y
    writes, the next group's x-row gathers and (``prefetch``) its in_out gate/up weights (one
    (P, HT, 2I) tile, loaded per block of :data:`H_INTERLEAVE` H tiles). Returns (the next
    group's x rows, its gate/up tile or None); (None, None) without a next group.

    Without ``prefetch``: all gathers, then all writes (the next group's weights load in its own
    body). With it, one slot tile at a time: a read-modify-write, a share of the next group's
    weight blocks, a gather. The read-modify-writes form a chain (each waits for the previous
    one's completion, whole-tensor hazard, then for its descriptors on GpSimd) and GpSimd and the
    DMA queues take their instructions in program order: with the gathers interleaved, GpSimd
    generates a gather's descriptors while a write is in flight instead of after the chain, and
    the weight loads (hardware DGE, ready at once) fill the DMA queues meanwhile, so the next
    group's weights have landed when TensorE reaches it (docs/perf-log.md §16.1)."""
    if next_group is None:
        scatter_deferred(deferred)
        return None, None
    (next_expert, next_trips), next_tiles = next_group
    if not prefetch:
        next_rows = gather_group(x, next_tiles, next_trips)
        scatter_deferred(deferred)
        return next_rows, None
    inter = w_gate_up.shape[2] // 2
    next_rows = [nl.ndarray((ps, x.shape[1]), dtype=x.dtype, buffer=nl.sbuf) for _, ps, *_ in next_tiles]
    next_gu = nl.ndarray((nl.tile_size.pmax, len(h_tiles), 2 * inter), dtype=w_gate_up.dtype, buffer=nl.sbuf)
    blocks = interleaved_blocks(h_tiles, H_INTERLEAVE)
    trips_w, tiles_w, rows_w, g0_w, sink_w = deferred if deferred is not None else (None, [], [], 0, None)
    steps = max(len(next_tiles), len(tiles_w))
    per_step = ceil_div(len(blocks), steps)
    for st in range(steps):
        if st < len(tiles_w):           # one slot tile's write of the previous group
            scatter_deferred([trips_w, tiles_w[st:st + 1], rows_w[st:st + 1], g0_w, sink_w])
        for t0, m, _ in blocks[st * per_step:(st + 1) * per_step]:
            for _ in nl.dynamic_range(0, next_trips):
                load_expert_cols(w_gate_up, next_expert, h_tiles[t0:t0 + m], 0, 2 * inter,
                                 next_gu[:, t0:t0 + m, :], interleave=H_INTERLEAVE)
        if st < len(next_tiles):
            _, _, tok_sb, live_reg, _, partial_reg = next_tiles[st]
            for _ in nl.dynamic_range(0, next_trips):
                for _ in nl.dynamic_range(0, live_reg):
                    gather_rows_into(next_rows[st], x, tok_sb, fill_reg=partial_reg)
    rows_w.clear()                      # the previous group's staged rows are released
    return next_rows, next_gu
