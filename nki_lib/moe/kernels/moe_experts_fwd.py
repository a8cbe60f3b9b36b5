"""Fused MoE expert MLP forward over a block plan (NKI kernel + launcher).

Algorithm (one kernel launch, docs/contract.md §4.3 ``moe_experts``):
host (index metadata only, :mod:`.moe_experts_groups`): up to G consecutive blocks of one expert are
  merged into a group of S = G*B slots (S <= 512, the largest whose SBUF estimate fits, or fewer,
  down to an expert's blocks on balanced routing, when only those stage the output rows whole:
  :func:`group_blocks`), so every weight tile is loaded and transposed once per group instead of
  once per block; per group the
  expert id, per slot the assignment id a and the token id a // k (-1 = padding).
once: the slot token and assignment ids are loaded with one contiguous DMA per 128 groups each and
  PE-transposed so that slots sit on partitions; on VectorE the group flags valid[g] =
  (group_expert[g] >= 0) and each slot tile's live flag (max of its assignment ids >= 0).
for each group g of this program (static loop, in order; LNC2: the two cores take alternate
  groups, LNC1: all of them), with the expert id and a 0/1 trip count in
  registers (a dynamic loop runs the body once, or not at all for unused groups), and each slot
  tile under its own 0/1 live guard (padding tiles cost no gather, matmul or write):
  1. gather the token rows of x with an indirect DMA per slot tile (``vector_offset``; -1 rows are
     skipped and keep the zero fill); issued during the previous group (GpSimd issues DMAs in
     program order), then PE-transposed into xT (H on partitions, slots on the free axis).
  2. per I tile (128): the expert's gate and up weight rows (``scalar_offset`` = the expert
     register; nn.Linear layout, long contiguous runs) PE-transposed to W^T tiles (H on
     partitions; evictions alternate VectorE/ScalarE) -- or, with the in_out weight layout
     (``gu_cols`` > 0), the W^T tiles loaded as they are, per span of ``gu_cols`` I columns (gate
     and up columns in one run of 2I per H row when the span is all of I; two consecutive H rows
     per partition, ``H_INTERLEAVE``, so one run of 4I, with xT and out_in's W^T tiles in the same
     H order), no transposes; when the span is all of I and SBUF allows (``prefetch_gu``), the
     next group's tile is loaded during this group, between the deferred writes and the next
     gathers (see the group loop below); per live slot tile gT/uT = W^T-tile x xT
     into fp32 PSUM (contraction over H tiles; an expert bias enters first as bias_row^T x ones,
     a contraction of size 1); hT = act(gT) * uT, or gpt-oss's clamped swiglu
     (:mod:`.moe_experts_gate`), -> SBUF (I on partitions).
  3. per H chunk (<= 512): W_down^T tiles (rows loaded and PE-transposed per span of I tiles;
     in_out: w_down's own rows, I on partitions, loaded as they are),
     o = h x W_down^T (+ b_down: ones^T x bias_row first) into fp32 PSUM per live slot tile
     (contraction over I tiles), evicted on
     ScalarE into fp32 rows staged in SBUF and written by one indirect DMA per live slot tile and
     staging group (padding slots not written), as the combine (:mod:`.moe_experts_fwd_combine`)
     says: "sum" (LNC2, or a token holding two slots of one expert): scattered into the
     assignment-ordered scratch y_slots[a] (shared HBM: every assignment written exactly once, by
     one core); "accumulate" (LNC1, rows staged whole): each row scaled by its routing weight at the eviction and
     added into the token-ordered accumulator by a DMA read-modify-write (``dma_compute``),
     zeroed at the start.
finally, "sum" (LNC2: after a core barrier, so that each core sees the other's rows; the cores
take alternate 128-token tiles): y[t] = sum_j topk_weights[t, j] * y_slots[t * k + j] in the fixed
order j = 0..k-1 (contiguous loads in token order, no gather; fp32 sum), cast to x's dtype. Every
row is computed by the same instructions on either core, so LNC2 is bitwise LNC1's "sum".
"accumulate": nothing (y is the accumulator), or the fp32 accumulator's conversion to x's dtype.

With ``prefetch_gu`` each group body issues, one slot tile at a time, the previous group's
write, a share of the next group's gate/up weight blocks and the next group's gather: GpSimd
(descriptors) and the DMA queues take instructions in program order, and the writes form a
chain (each waits for the previous one), so the gathers' descriptors are made while a write is
in flight and the weight loads fill the queues meanwhile (docs/perf-log.md §16.1).

Loop structure: ids; groups (static) > guard (dynamic, 0/1 trips) > {slot tiles (guarded);
I tiles > slot tiles (guarded) > H tiles; staging groups > H chunks > I spans > slot tiles
(guarded) > I tiles}; then (barrier) token tiles > H chunks > j.

Shapes (dimension legend): T tokens, H hidden, I intermediate, E experts, k top-k, N = T*k
assignments, B plan block size, NG groups, S slots per group, ST slot tiles per group. Kernel
inputs (HBM): x (T, H), topk_w (N, 1) fp32 ("sum": per assignment; "accumulate": (NG*S,), per
slot, 0 for padding), group_expert (NG,) int32, slot_token and
slot_assignment (NG*S,) int32 (a // k and a, or -1), w_gate_up
(E, 2I, H), w_down (E, H, I) (nn.Linear layouts, as the op receives them) or, in_out,
(E, H, 2I) and (E, I, H), b_gate_up (E, 2I) and
b_down (E, H) or None; compile-time activation, swiglu_alpha, swiglu_limit, top_k, h_chunk,
y_cols, defer_scatters, gu_cols and wd_cols (0: the out_in layout), combine ("sum" or
"accumulate"), prefetch_gu (in_out, one gate/up span: the next group's weights loaded during the
current group). Output y (T, H) in x's dtype; scratch y_slots (N, H) fp32 ("sum") or the fp32
accumulator (T, H) ("accumulate" with FP32_ACCUMULATOR) in shared HBM.

Limits: x and weights bf16/fp16/fp32 (one dtype); B <= 512 and S <= 512 (one PSUM bank per slot
tile, at most 4 slot tiles in flight); the SBUF estimate :func:`sbuf_bytes` (dominated by xT, hT,
two generations of x rows, double-buffered W_gate^T/W_up^T tiles and the staged y rows) must fit
``nl.tile_size.total_available_sbuf_size`` for the plan's block at the narrowest tiling, else the
launcher raises Unsupported; every assignment appears exactly once in the plan (validated by the
op); LNC1 or LNC2 (``NEURON_LOGICAL_NC_CONFIG``). The group loop is unrolled NG times (program size grows with NG).
"""

from __future__ import annotations

from nki_lib._nki import nisa, nki, nl
from nki_lib.backend import lnc_degree
from nki_lib.dispatch import KernelLaunch, Unsupported
from nki_lib.moe.kernels.moe_experts_fwd_combine import (
    GroupSink,
    accumulate_sbuf_bytes,
    accumulator,
    combine_mode,
    convert_rows,
    zero_rows,
)
from nki_lib.moe.kernels.moe_experts_gate import add_outer, bias_row, clamped_swiglu, ones_row
from nki_lib.moe.kernels.moe_experts_groups import group_count, merge_blocks
from nki_lib.moe.kernels.moe_experts_host import (
    check_supported,
    choose_overlap_tiling,
    flags_sbuf_bytes,
    group_blocks_fitting,
    planned_blocks,
    planned_groups,
    repeats_a_token,
    routing_weights,
    slot_tokens,
    slot_weights,
    staged_bytes,
    tail_sbuf_bytes,
)
from nki_lib.moe.kernels.moe_experts_steps import (
    WEIGHT_SPAN,
    act_fn,
    block_flags,
    block_registers,
    gather_rows_into,
    interleaved_blocks,
    load_all_ids,
    load_expert_cols,
    load_expert_t,
    reduce_assignments,
    transpose_rows,
    weight_spans,
)
from nki_lib.sizes import ceil_div, spans

# H rows per partition of the in_out gate/up weight loads: w_gate_up[e] is (H, 2I) row-major, so
# 2 consecutive H rows on one partition make one contiguous run of 4I elements (6 KiB at qwen3's
# I = 768, bf16) instead of 2I (3 KiB): past the 4 KiB where a DMA saturates (docs/cost-model.md
# §2.6), at every documented bound of the chunk floor. xT takes the same H order (its transposes
# read x's columns with a step of 2 elements, 4 B for bf16: within the 16 B innermost stride of
# full port bandwidth, §2.5), and so do the out_in layout's W^T tiles (transposes of its natural
# rows with the same step), so that both layouts sum the same products in the same order.
H_INTERLEAVE = 2

# --------------------------------------------------------------------------- kernel


def gate_into(h_dst, g_psum, u_psum, gate):
    """h_dst = gate(g, u): act(g) * u, or gpt-oss's clamped swiglu (``gate`` = (activation,
    alpha, limit))."""
    activation, alpha, limit = gate
    if activation == "clamped_swiglu":
        clamped_swiglu(h_dst, g_psum, u_psum, alpha, limit)
        return
    act_sb = nl.ndarray(g_psum.shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=act_sb, op=act_fn(activation), data=g_psum)
    nisa.tensor_tensor(dst=h_dst, data1=act_sb, data2=u_psum, op=nl.multiply)


def _gate_up_weights(w_gate_up, expert_reg, h_tiles, inter, gu_cols, prefetched=None):
    """Per I tile: (i0, isz, W_gate^T tile, its column, W_up^T tile, its column), the tiles
    (P, HT, cols) with H on partitions. out_in (``gu_cols`` 0): the tile's weight rows loaded
    and PE-transposed (:func:`load_expert_t`). in_out: the weights are already W^T, loaded as
    they are (:func:`load_expert_cols`) per span of at most ``gu_cols`` I columns, gate and up
    columns in one DMA per H block when the span is all of I (runs of 2I elements), or, for that
    one span, the ``prefetched`` tile (loaded during the previous group, :func:`_next_group_dmas`)."""
    i_tiles = spans(inter, nl.tile_size.pmax)
    if not gu_cols:
        for i0, isz in i_tiles:
            yield (i0, isz, load_expert_t(w_gate_up, expert_reg, h_tiles, i0, isz, H_INTERLEAVE), 0,
                   load_expert_t(w_gate_up, expert_reg, h_tiles, inter + i0, isz, H_INTERLEAVE), 0)
        return
    per_span = max(1, gu_cols // nl.tile_size.pmax)
    for span in (i_tiles[n:n + per_span] for n in range(0, len(i_tiles), per_span)):
        c0, ncols = span[0][0], span[-1][0] + span[-1][1] - span[0][0]
        if ncols == inter:
            wg_sb = wu_sb = prefetched if prefetched is not None else \
                load_expert_cols(w_gate_up, expert_reg, h_tiles, 0, 2 * inter, interleave=H_INTERLEAVE)
            g0, u0 = 0, inter
        else:
            wg_sb = load_expert_cols(w_gate_up, expert_reg, h_tiles, c0, ncols, interleave=H_INTERLEAVE)
            wu_sb = load_expert_cols(w_gate_up, expert_reg, h_tiles, inter + c0, ncols, interleave=H_INTERLEAVE)
            g0 = u0 = -c0
        for i0, isz in span:
            yield i0, isz, wg_sb, g0 + i0, wu_sb, u0 + i0


def _gate_up(x_t, w_gate_up, b_gate_up, expert_reg, slot_tiles, h_tiles, gate, h_t, ones_sb, inter, gu_cols,
             saved=None, prefetched=None):
    """hT[:, it, slots] = gate(W_gate x + b_gate, W_up x + b_up) per I tile (I on partitions, slots
    free); the W^T tiles are shared by all live slot tiles, each slot tile is computed under its
    guard. A bias enters the PSUM first, as bias_row^T x ones (a contraction of size 1).
    ``saved``: per slot tile a (P, 2 IT, ps) tile that receives gT (I tile it) and uT (IT + it)
    in x's dtype, for the backward (:func:`store_saved`), or None. ``prefetched``: the in_out
    gate/up tile of all of I, already loaded (see :func:`_gate_up_weights`), or None."""
    for it, (i0, isz, wg_sb, gc, wu_sb, uc) in enumerate(_gate_up_weights(w_gate_up, expert_reg, h_tiles, inter,
                                                                           gu_cols, prefetched)):
        rows = (None, None)
        if b_gate_up is not None:
            rows = (bias_row(b_gate_up, expert_reg, i0, isz), bias_row(b_gate_up, expert_reg, inter + i0, isz))
        for s0, ps, _, live_reg, _, _ in slot_tiles:
            for _ in nl.dynamic_range(0, live_reg):
                g_psum = nl.ndarray((isz, ps), dtype=nl.float32, buffer=nl.psum)
                u_psum = nl.ndarray((isz, ps), dtype=nl.float32, buffer=nl.psum)
                for acc_psum, row_sb in zip((g_psum, u_psum), rows):
                    if row_sb is not None:
                        add_outer(acc_psum, row_sb, ones_sb[:, :ps])
                for ht, (h0, hs) in enumerate(h_tiles):
                    nisa.nc_matmul(dst=g_psum, stationary=wg_sb[:hs, ht, gc:gc + isz],
                                   moving=x_t[:hs, ht, s0:s0 + ps], accumulate=ht > 0 or rows[0] is not None)
                    nisa.nc_matmul(dst=u_psum, stationary=wu_sb[:hs, ht, uc:uc + isz],
                                   moving=x_t[:hs, ht, s0:s0 + ps], accumulate=ht > 0 or rows[1] is not None)
                gate_into(h_t[:isz, it, s0:s0 + ps], g_psum, u_psum, gate)
                if saved is not None:
                    save_sb = saved[s0 // nl.tile_size.pmax]
                    nisa.tensor_copy(dst=save_sb[:isz, it, :], src=g_psum, engine=nisa.engine.vector)
                    nisa.activation(dst=save_sb[:isz, save_sb.shape[1] // 2 + it, :], op=nl.copy, data=u_psum)


def _down(h_t, w_down, b_down, expert_reg, i_tiles, slot_tiles, sink, tiles, ones_sb, last_rows, preloaded=None):
    """y_slots[a] = h @ W_down^T (+ b_down) for the assignment a of each slot: per H chunk,
    contraction over I tiles in PSUM (per live slot tile; the bias first, as ones^T x bias_row);
    the rows are staged ``y_cols`` wide in SBUF and written by ``sink`` (:class:`GroupSink`: one
    indirect DMA per live slot tile and staging group, padding slots not written; scattered in
    assignment order for the final k-sum, or weighted at the eviction and added into the token-
    ordered accumulator, :mod:`.moe_experts_fwd_combine`). The last staging group is staged in
    ``last_rows`` and not scattered here (see :func:`scatter_deferred`). ``tiles`` = (h_chunk,
    y_cols, gu_cols, wd_cols); with the in_out layout (gu_cols > 0) the W_down^T tiles are
    w_down's own rows (I on partitions), loaded without transposes: with ``wd_cols`` > 0, every
    I tile's rows ``wd_cols`` columns wide at once (long runs, shared by the H chunks of those
    columns), else per H chunk and I span; ``preloaded``: those tiles of the one column block
    when one block covers H (loaded earlier by :func:`_preload_down`)."""
    h_chunk, y_cols, gu_cols, wd_cols = tiles
    hidden = w_down.shape[2] if gu_cols else w_down.shape[1]
    groups = spans(hidden, y_cols)
    for g0, gn in groups:
        last = g0 == groups[-1][0]
        y_rows = last_rows if last else [nl.ndarray((ps, gn), dtype=nl.float32, buffer=nl.sbuf)
                                         for _, ps, *_ in slot_tiles]
        for b0, bn in spans(gn, wd_cols or gn):
            wide = preloaded
            if wd_cols and wide is None:
                wide = [load_expert_cols(w_down, expert_reg, span, g0 + b0, bn) for span in weight_spans(i_tiles)]
            for h0, hn in spans(bn, h_chunk):
                chunk = (g0 + b0 + h0, hn, b0 + h0, h0)
                _down_chunk(h_t, w_down, b_down, expert_reg, i_tiles, slot_tiles, y_rows, chunk, gu_cols, wide,
                            ones_sb, sink)
        if not last:
            scatter_deferred([None, slot_tiles, y_rows, g0, sink])


def _preload_down(w_down, expert_reg, i_tiles, hidden, trips_reg):
    """The in_out W_down^T tiles of every I span, H wide (the one column block of :func:`_down`),
    loaded under the group's guard before the next group's gather and the deferred scatters:
    DMAs start in program order, and those wait for GpSimd's descriptors (docs/perf-log.md
    §12.2)."""
    wide = [nl.ndarray((nl.tile_size.pmax, len(span), hidden), dtype=w_down.dtype, buffer=nl.sbuf)
            for span in weight_spans(i_tiles)]
    for _ in nl.dynamic_range(0, trips_reg):
        for span, wd_sb in zip(weight_spans(i_tiles), wide):
            load_expert_cols(w_down, expert_reg, span, 0, hidden, wd_sb)
    return wide


def _down_chunk(h_t, w_down, b_down, expert_reg, i_tiles, slot_tiles, y_rows, chunk, gu_cols, wide, ones_sb, sink):
    """One H chunk of :func:`_down`: ``chunk`` = (first column of H, width, first column in the
    staged rows, first column in the ``wide`` tiles); ``wide``: the W_down^T tiles of every I span
    loaded already, or None (loaded here); the eviction scales each slot's row by ``sink``'s
    per-slot scale (the routing weights) when it has one."""
    c0, hn, y0, w0 = chunk
    y_psums = [nl.ndarray((ps, hn), dtype=nl.float32, buffer=nl.psum) for _, ps, *_ in slot_tiles]
    if b_down is not None:
        row_sb = bias_row(b_down, expert_reg, c0, hn)
        for (_, ps, _, live_reg, _, _), y_psum in zip(slot_tiles, y_psums):
            for _ in nl.dynamic_range(0, live_reg):
                add_outer(y_psum, ones_sb[:, :ps], row_sb)
    load = load_expert_cols if gu_cols else load_expert_t
    for n, span in enumerate(weight_spans(i_tiles)):
        wd_t, col = (load(w_down, expert_reg, span, c0, hn), 0) if wide is None else (wide[n], w0)
        for (s0, ps, _, live_reg, _, _), y_psum in zip(slot_tiles, y_psums):
            for _ in nl.dynamic_range(0, live_reg):
                for si, (i0, isz) in enumerate(span):
                    it = i0 // nl.tile_size.pmax
                    nisa.nc_matmul(dst=y_psum, stationary=h_t[:isz, it, s0:s0 + ps],
                                   moving=wd_t[:isz, si, col:col + hn], accumulate=it > 0 or b_down is not None)
    for st, ((_, ps, _, live_reg, _, _), y_psum, y_sb) in enumerate(zip(slot_tiles, y_psums, y_rows)):
        scale = sink.scale(st, ps)
        for _ in nl.dynamic_range(0, live_reg):
            nisa.activation(dst=y_sb[:, y0:y0 + hn], op=nl.copy, data=y_psum, scale=1.0 if scale is None else scale)


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


def _group_tiles(ids, live_sb, g, group):
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


def _gather_group(x, slot_tiles, trips_reg):
    """Token rows of x per slot tile of a group (indirect gathers under the group's guard and each
    tile's guard)."""
    x_rows = [nl.ndarray((ps, x.shape[1]), dtype=x.dtype, buffer=nl.sbuf) for _, ps, *_ in slot_tiles]
    for _ in nl.dynamic_range(0, trips_reg):
        for (_, _, tok_sb, live_reg, _, partial_reg), rows_sb in zip(slot_tiles, x_rows):
            for _ in nl.dynamic_range(0, live_reg):
                gather_rows_into(rows_sb, x, tok_sb, fill_reg=partial_reg)
    return x_rows


def _transpose_group(x_t, slot_tiles, x_rows, trips_reg, interleave=1):
    """xT[:, :, slots] = x rows^T per live slot tile (a function, so that no loop variable keeps a
    row tile alive after the caller releases the rows); ``interleave``: the H tiles in the order
    of the gate/up weight tiles (:data:`H_INTERLEAVE`)."""
    for _ in nl.dynamic_range(0, trips_reg):
        for (s0, _, _, live_reg, _, _), rows_sb in zip(slot_tiles, x_rows):
            for _ in nl.dynamic_range(0, live_reg):
                transpose_rows(x_t, rows_sb, s0, interleave)


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


def _next_group_dmas(x, w_gate_up, next_group, deferred, h_tiles, prefetch):
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
        next_rows = _gather_group(x, next_tiles, next_trips)
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


def _group_fwd(x, slot_tiles, x_rows, weights, regs, next_group, group, gate, tiles, sink, ones_sb,
               deferred, defer, gu_saved=None, group_index=0, prefetch=(False, None)):
    """Group body in guarded phases: xT (then the x rows are released), h (gate/up; then xT is
    released), the gather of the next group's rows (``next_group`` = (registers, slot tiles) or
    None), the previous group's ``deferred`` y scatters, the down projection and the writes of y
    but the last staging group's. Returns (next group's rows, this group's deferred
    scatters); with ``defer`` False (see :func:`tiling`) the last scatters follow the down
    projection at once and None is returned in their place. ``gu_saved``: the backward's saved
    g/u (HBM, see :func:`saved_shape`), written for group ``group_index`` after the gate/up
    projections, or None. GpSimd issues DMAs in program order, so the next gather is issued before this
    group's last matmul; the releases keep the x rows of two groups and xT from being live at
    once (SBUF: see :func:`sbuf_bytes_at`). ``prefetch`` = (whether the in_out gate/up weights
    of the next group are loaded in this body, this group's tile loaded so or None), see
    :func:`_next_group_dmas`; the third value returned is the next group's tile or None."""
    pmax = nl.tile_size.pmax
    w_gate_up, w_down, b_gate_up, b_down = weights
    expert_reg, trips_reg = regs
    gu_cols = tiles[2]
    inter = (w_gate_up.shape[2] if gu_cols else w_gate_up.shape[1]) // 2
    h_tiles, i_tiles = spans(x.shape[1], pmax), spans(inter, pmax)
    x_t = nl.ndarray((pmax, len(h_tiles), group), dtype=x.dtype, buffer=nl.sbuf)
    h_t = nl.ndarray((pmax, len(i_tiles), group), dtype=x.dtype, buffer=nl.sbuf)
    _transpose_group(x_t, slot_tiles, x_rows, trips_reg, H_INTERLEAVE)
    x_rows.clear()                      # last use of this group's x rows
    saved = None if gu_saved is None else [nl.ndarray((pmax, 2 * len(i_tiles), ps), dtype=x.dtype, buffer=nl.sbuf)
                                            for _, ps, *_ in slot_tiles]
    for _ in nl.dynamic_range(0, trips_reg):
        _gate_up(x_t, w_gate_up, b_gate_up, expert_reg, slot_tiles, h_tiles, gate, h_t, ones_sb, inter, gu_cols,
                 saved, prefetch[1])
    del x_t                             # last use of xT
    hidden = x.shape[1]
    one_block = tiles[3] >= hidden and tiles[1] >= hidden     # in_out: W_down rows H wide, staged whole
    preloaded = _preload_down(w_down, expert_reg, i_tiles, hidden, trips_reg) if one_block else None
    # the next group's gathers (and weights), the previous group's last writes (own guards)
    next_rows, next_gu = _next_group_dmas(x, w_gate_up, next_group, deferred, h_tiles, prefetch[0])
    last_cols = spans(x.shape[1], tiles[1])[-1][1]
    last_rows = [nl.ndarray((ps, last_cols), dtype=nl.float32, buffer=nl.sbuf) for _, ps, *_ in slot_tiles]
    for _ in nl.dynamic_range(0, trips_reg):
        _down(h_t, w_down, b_down, expert_reg, i_tiles, slot_tiles, sink, tiles, ones_sb, last_rows, preloaded)
    if saved is not None:
        # after the down projection in program order: DMAs start in program order, and these
        # stores wait for the gate/up evictions, which the next loads must not queue behind
        store_saved(gu_saved, group_index, slot_tiles, saved, trips_reg)
        saved.clear()                   # released (the stores read them)
    last = [trips_reg, slot_tiles, last_rows, x.shape[1] - last_cols, sink]
    if not defer:
        scatter_deferred(last)
        last = None
    return next_rows, last, next_gu


@nki.jit
def moe_experts_fwd_kernel(x, topk_w, group_expert, slot_token, slot_assignment, w_gate_up, w_down, b_gate_up,
                           b_down, activation, swiglu_alpha, swiglu_limit, top_k, h_chunk, y_cols, defer_scatters,
                           gu_cols, wd_cols, save_gu=False, combine="sum", prefetch_gu=False):
    t_len, hidden = x.shape
    n_groups = group_expert.shape[0]
    group = slot_token.shape[0] // n_groups
    n_prog, pid = nl.num_programs(axes=0), nl.program_id(axis=0)
    y = nl.ndarray((t_len, hidden), dtype=x.dtype, buffer=nl.shared_hbm)
    if combine == "accumulate":      # topk_w: the routing weight of each slot (NG*S,), 0 for padding
        out = accumulator(y, t_len, hidden)
        slot_w_sb = load_all_ids(topk_w, n_groups, group, dtype=nl.float32)
    else:
        out = nl.ndarray((topk_w.shape[0], hidden), dtype=nl.float32, buffer=nl.shared_hbm)   # y_slots
        slot_w_sb = None
    inter = (w_gate_up.shape[2] if gu_cols else w_gate_up.shape[1]) // 2
    gu_saved = nl.ndarray(saved_shape(n_groups, group, inter), dtype=x.dtype, buffer=nl.shared_hbm) if save_gu \
        else None
    expert_sb, valid_sb = block_flags(group_expert)
    asg_ids, live_sb, partial_sb = load_all_ids(slot_assignment, n_groups, group, live=True, partial=True)
    ids = (load_all_ids(slot_token, n_groups, group), asg_ids, partial_sb)
    ones_sb = ones_row(nl.tile_size.pmax, x.dtype)
    weights = (w_gate_up, w_down, b_gate_up, b_down)
    gate = (activation, swiglu_alpha, swiglu_limit)
    # LNC2: the cores take alternate groups (all of them under LNC1).
    mine = list(range(pid, n_groups, n_prog))
    if mine:
        current = (block_registers(expert_sb, valid_sb, mine[0]), _group_tiles(ids, live_sb, mine[0], group))
        x_rows = _gather_group(x, current[1], current[0][1])
    if combine == "accumulate":
        zero_rows(out)                 # before the first read-modify-write (program order)
    deferred = next_gu = None
    # Static unroll (compile-time Python loop): each group's body also issues the next one's gather
    # and the previous one's last y scatters.
    for n, g in enumerate(mine):
        following = None
        if n + 1 < len(mine):
            following = (block_registers(expert_sb, valid_sb, mine[n + 1]),
                         _group_tiles(ids, live_sb, mine[n + 1], group))
        sink = GroupSink(combine, out, slot_w_sb, g)
        x_rows, deferred, next_gu = _group_fwd(x, current[1], x_rows, weights, current[0], following, group, gate,
                                      (h_chunk, y_cols, gu_cols, wd_cols), sink, ones_sb, deferred, defer_scatters,
                                      gu_saved, g, (prefetch_gu, next_gu))
        current = following
    scatter_deferred(deferred)
    if combine == "accumulate":
        if out is not y:
            convert_rows(out, y)
    else:
        if n_prog > 1:
            nisa.core_barrier(out, (0, 1))     # the k-sum reads rows the other core wrote
        reduce_assignments(out, y, top_k, topk_w, share=(pid, n_prog))
    if save_gu:
        return y, gu_saved
    return y


def saved_shape(n_groups, group, inter):
    """Shape of the forward's saved g/u for the backward (``save_gu``): (NG, ST, P, 2 IT ps_max),
    [g, st, p, j ps + s] = g (j < IT) or u (j >= IT) of I row (j mod IT) * 128 + p at slot
    st * 128 + s of group g (pre-activation, biases included, in x's dtype); rows of padding
    slot tiles are not written."""
    pmax = nl.tile_size.pmax
    return (n_groups, ceil_div(group, pmax), pmax, 2 * ceil_div(inter, pmax) * min(group, pmax))


# --------------------------------------------------------------------------- launcher


def sbuf_bytes_at(hidden, inter, block, itemsize, h_chunk, y_cols, *, top_k, n_blocks, clamped=False,
                  biases=False, overlap=True, in_out=False, gu_cols=None, wd_cols=0, save=False, accumulate=False,
                  prefetch=False):
    """Peak SBUF bytes per partition of the forward kernel at down-projection H chunk ``h_chunk``
    and y staging width ``y_cols`` (upper bound: two generations of every streamed tile; with the
    clamped swiglu's three more fp32 temporaries and the bias rows and ones when asked; with
    ``overlap``, the previous group's last staged y rows, whose scatters are deferred). ``in_out``:
    the weights come as W^T (no natural rows staged for transposes), the gate/up tiles ``gu_cols``
    I columns wide (default all of I) for gate and up together, and with ``wd_cols`` the W_down^T
    rows of every I tile ``wd_cols`` columns wide. ``save``: the saved g/u tiles of the group
    (``save_gu``, live from the gate/up phase to the end of the down projection). ``accumulate``:
    the launch may take the "accumulate" combine (:mod:`.moe_experts_fwd_combine`): its slot
    weights and its other buffers are counted (:func:`accumulate_sbuf_bytes`), and the tail is the
    larger of its own and the k-sum's (the "sum" combine serves the same plan when a group names a
    token twice). ``prefetch``: the next group's in_out gate/up tile (all of I) is loaded during
    the down projection (:func:`_next_group_dmas`) and counted there; W_down, then preloaded
    whole once per group after the gate/up projections, is counted once in that phase."""
    pmax, fmax = nl.tile_size.pmax, nl.tile_size.gemm_moving_fmax
    ht, it, st = ceil_div(hidden, pmax), ceil_div(inter, pmax), ceil_div(block, pmax)
    rows = st * hidden * itemsize                                # x rows of one group
    x_t, h_t = ht * block * itemsize, it * block * itemsize
    if in_out:
        staging = 0
        gu_width = min(inter, gu_cols or inter)
        gate_up = 2 * (2 * ht * gu_width * itemsize + fmax * 4)  # W_gate^T/W_up^T column spans, act
    else:
        staging = 2 * min(max(hidden, inter), WEIGHT_SPAN) * itemsize   # natural weight rows before transposes
        gate_up = 2 * (2 * ht * pmax * itemsize + fmax * 4)     # W_gate^T/W_up^T tiles, act
    gate_up += 2 * 3 * fmax * 4 if clamped else 0               # gc, s, v of the clamped swiglu
    bias = 2 * (3 * pmax + fmax) * itemsize if biases else 0    # gate/up/down bias rows, ones row
    span_tiles = min(it, WEIGHT_SPAN // pmax)
    wd_bytes = it * wd_cols if in_out and wd_cols else span_tiles * h_chunk       # W_down^T: all I tiles, or a span
    down = 2 * wd_bytes * itemsize + staged_bytes(y_cols, hidden, st)            # W_down^T, o rows
    if prefetch:                                                # one W_down^T block, the next gate/up tile
        down += 2 * ht * inter * itemsize - wd_bytes * itemsize
    phases = (rows + x_t + h_t,                                 # transposes: x rows -> xT
              x_t + h_t + staging + gate_up + bias + (2 * it * block * itemsize if save else 0),  # gate/up (+ saved g/u)
              rows + h_t + staging + down + bias + (2 * it * block * itemsize if save else 0))   # down, next rows
    deferred = st * min(y_cols, hidden) * 4 if overlap else 0   # previous group's last staged y rows
    body = max(phases) + deferred
    live_flags = 2 * n_blocks * st * 4                        # live and partial flags of the slot tiles
    tail = tail_sbuf_bytes(hidden, top_k, itemsize)
    if accumulate:
        zero, convert = accumulate_sbuf_bytes(hidden, itemsize)
        live_flags += n_blocks * st * 4 + zero                  # slot weights, zero tile
        tail = max(tail, convert)
    return flags_sbuf_bytes(n_blocks, block) + live_flags + max(body, tail)


def gate_up_widths(inter):
    """The in_out layout's gate/up column spans, widest first: all of I (gate and up in one run
    per H row), then 1024 halved down to 128."""
    pmax, widths, width = nl.tile_size.pmax, [inter], 8 * nl.tile_size.pmax
    while width >= pmax:
        if width < inter:
            widths.append(width)
        width //= 2
    return widths


def tiling(hidden, inter, block, itemsize, *, in_out=False, **counts):
    """(h_chunk, y_cols, defer_scatters, gu_cols, wd_cols) of the forward kernel for this shape
    (gu_cols, wd_cols 0: the out_in layout; in_out: the widest gate/up span, then W_down rows
    loaded WEIGHT_SPAN columns wide for all I tiles at once if possible, whose tiling fits)."""
    if not in_out:
        return (*choose_overlap_tiling(sbuf_bytes_at, hidden, hidden, inter, block, itemsize, **counts), 0, 0)
    fit = nl.tile_size.total_available_sbuf_size
    for cols in gate_up_widths(inter):
        for wd_cols in (min(hidden, WEIGHT_SPAN), 0):
            choice = choose_overlap_tiling(sbuf_bytes_at, hidden, hidden, inter, block, itemsize, in_out=True,
                                           gu_cols=cols, wd_cols=wd_cols, **counts)
            h_chunk, y_cols, overlap = choice
            if wd_cols % h_chunk:
                continue
            if sbuf_bytes_at(hidden, inter, block, itemsize, h_chunk, y_cols, overlap=overlap, in_out=True,
                             gu_cols=cols, wd_cols=wd_cols, **counts) <= fit:
                return (*choice, cols, wd_cols)
    return (*choice, cols, wd_cols)


def sbuf_bytes(hidden, inter, block, itemsize, *, in_out=False, **counts):
    """Peak SBUF bytes per partition at the chosen tiling."""
    h_chunk, y_cols, overlap, gu_cols, wd_cols = tiling(hidden, inter, block, itemsize, in_out=in_out, **counts)
    return sbuf_bytes_at(hidden, inter, block, itemsize, h_chunk, y_cols, overlap=overlap, in_out=in_out,
                         gu_cols=gu_cols or None, wd_cols=wd_cols, **counts)


def group_blocks(hidden, inter, block, itemsize, *, routed=None, **counts):
    """Blocks per group (see :mod:`.moe_experts_groups`): the most, up to MAX_PSUM_SLOT_TILES * 128
    slots, whose SBUF estimate fits (1 when no larger group does). With ``routed`` = (assignments
    N, experts E) of the plan: fewer blocks, down to :func:`filled_group_blocks`, when those stage
    the output rows whole and the most that fit do not. A group larger than an expert's blocks
    holds only padding slot tiles past them (skipped, no work), yet its SBUF estimate counts them:
    at H = 7168 (deepseek-v3) four 128-slot tiles stage y in 14 column groups of 512, so each live
    slot tile makes 14 indirect writes (14 software-DGE descriptors per row instead of one;
    docs/perf-log.md §16.4), while an expert holds 1 block (prefill, 32 tokens) or 2 (expert
    parallelism, 160)."""
    blocks = group_blocks_fitting(sbuf_bytes, hidden, inter, block, itemsize, **counts)
    if routed is None:
        return blocks
    fewer = min(blocks, filled_group_blocks(*routed, block))
    if fewer < blocks and _stages_whole(hidden, inter, block, itemsize, fewer, routed[1], counts) and \
            not _stages_whole(hidden, inter, block, itemsize, blocks, routed[1], counts):
        return fewer
    return blocks


def filled_group_blocks(n_assignments, n_experts, block):
    """Blocks of one expert when the routing is balanced, ceil(N / (E B)), rounded up to a power of
    two (the group sizes :func:`group_blocks` takes): a larger group only adds padding slot tiles."""
    per_expert, blocks = ceil_div(n_assignments, max(1, n_experts) * block), 1
    while blocks < per_expert:
        blocks *= 2
    return blocks


def _stages_whole(hidden, inter, block, itemsize, blocks, n_experts, counts):
    """Whether the forward's tiling at ``blocks`` blocks per group stages the output rows whole
    (``counts`` with the plan's blocks; its groups as the launcher counts them)."""
    n_groups = planned_groups(group_count(counts["n_blocks"], n_experts, blocks, 0), blocks)
    return tiling(hidden, inter, blocks * block, itemsize, **dict(counts, n_blocks=n_groups))[1] >= hidden


def _launch_flags(x, topk_weights, block_expert, slot_assignment, w_down, b_gate_up, b_down, activation,
                  weight_layout, save):
    """(inter, flags, block size) of a forward launch; raises Unsupported as the launcher does. The
    SBUF figures count the "accumulate" combine's buffers (``accumulate``) when the launch may take
    it: on one core, where they still fit and leave the output rows staged whole
    (:func:`_accumulate_fits`), whichever combine the data then selects, so the grouping does not
    depend on the data."""
    in_out = weight_layout == "in_out"
    inter = w_down.shape[1] if in_out else w_down.shape[2]
    flags = dict(clamped=activation == "clamped_swiglu", biases=b_gate_up is not None or b_down is not None,
                 in_out=in_out, save=save, accumulate=False)
    block_size = check_supported(x, topk_weights, block_expert, slot_assignment, inter, sbuf_fn=sbuf_bytes, **flags)
    shape = (x.shape[1], inter, block_size, x.element_size(), topk_weights.shape[1],
             planned_blocks(block_expert.shape[0]), w_down.shape[0], topk_weights.numel())
    if lnc_degree() == 1 and _accumulate_fits(shape, dict(flags, accumulate=True)):
        flags["accumulate"] = True
    return inter, flags, block_size


def _launch_group_blocks(x, topk_weights, block_expert, inter, block_size, flags, n_experts):
    """Blocks per group of a forward launch (:func:`group_blocks` at the planned plan size; fewer
    for its assignments and experts only without saved g/u, see :func:`_routed`)."""
    return group_blocks(x.shape[1], inter, block_size, x.element_size(), top_k=topk_weights.shape[1],
                        n_blocks=planned_blocks(block_expert.shape[0]),
                        routed=_routed(topk_weights.numel(), n_experts, flags), **flags)


def _routed(n_assignments, n_experts, flags):
    """``routed`` of :func:`group_blocks` for a launch: (N, E), or None when the launch saves g/u.
    The backward reads saved g/u grouped as the forward grouped them, so a saving forward keeps
    the groups the backward was measured with: the smaller groups were measured only without
    saved g/u (docs/perf-log.md §16.4; the first try with them, at deepseek-v3's expert-parallel
    shape, met the backward's PSUM overflow that ``moe_experts_bwd.down_rows_fit`` now rules out,
    and was not re-measured)."""
    return None if flags.get("save") else (n_assignments, n_experts)


def _accumulate_fits(shape, flags):
    """Whether the forward with the "accumulate" combine's buffers counted (``flags``) fits SBUF
    and stages its output rows whole; ``shape`` = (H, I, block size, itemsize, k, plan blocks,
    experts, assignments)."""
    hidden, inter, block_size, itemsize, top_k, n_blocks, n_experts, n_assignments = shape
    fit = nl.tile_size.total_available_sbuf_size
    if sbuf_bytes(hidden, inter, block_size, itemsize, top_k=top_k, n_blocks=n_blocks, **flags) > fit:
        return False
    blocks = group_blocks(hidden, inter, block_size, itemsize, top_k=top_k, n_blocks=n_blocks,
                          routed=_routed(n_assignments, n_experts, flags), **flags)
    n_groups = group_count(n_blocks, n_experts, blocks, 0)
    return tiling(hidden, inter, blocks * block_size, itemsize, top_k=top_k, n_blocks=n_groups, **flags)[1] >= hidden


def _prefetch_fits(shape, tiles, counts):
    """Whether the forward loads each next group's in_out gate/up weights during the current group
    (kernel flag ``prefetch_gu``): with the in_out layout, one gate/up span of all of I, W_down
    preloaded whole and the output rows staged whole, when the SBUF estimate with that tile
    counted (``sbuf_bytes_at(..., prefetch=True)``) fits at the tiling already chosen
    (``tiles`` = (h_chunk, y_cols, overlap, gu_cols, wd_cols); ``shape`` = (H, I, S, itemsize);
    ``counts``: the launch's flags and counts), so the tiling never depends on it."""
    hidden, inter, group, itemsize = shape
    h_chunk, y_cols, overlap, gu_cols, wd_cols = tiles
    if not counts.get("in_out") or gu_cols < inter or wd_cols < hidden or y_cols < hidden:
        return False
    need = sbuf_bytes_at(hidden, inter, group, itemsize, h_chunk, y_cols, overlap=overlap, gu_cols=gu_cols,
                         wd_cols=wd_cols, prefetch=True, **counts)
    return need <= nl.tile_size.total_available_sbuf_size


def saved_grouping(x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down, b_gate_up=None, b_down=None,
                   *, activation, weight_layout="out_in"):
    """(blocks per group, saved_shape) of a forward launch with ``save_activations`` (no data read:
    the op's fake uses it); raises Unsupported where the forward kernel cannot serve the call, or
    where the backward would not read the saved g/u at these groups (its SBUF estimate does not
    fit them: it recomputes g and u, and saving them would only cost the forward their SBUF, which
    at deepseek-v3's H = 7168 stages the output rows in 14 column groups, and their stores;
    docs/perf-log.md §16.4)."""
    from nki_lib.moe.kernels.moe_experts_bwd import reads_saved

    inter, flags, block_size = _launch_flags(x, topk_weights, block_expert, slot_assignment, w_down, b_gate_up,
                                             b_down, activation, weight_layout, True)
    blocks = _launch_group_blocks(x, topk_weights, block_expert, inter, block_size, flags, w_down.shape[0])
    if not reads_saved(x, topk_weights, block_expert, block_size, inter, blocks, activation=activation,
                       biases=flags["biases"]):
        raise Unsupported("the backward would recompute g and u at these groups (its SBUF estimate)")
    n_groups = group_count(block_expert.shape[0], w_gate_up.shape[0], blocks, 0)
    return blocks, saved_shape(n_groups, blocks * block_size, inter)


def launch_moe_experts_fwd(x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down, b_gate_up=None,
                           b_down=None, *, activation, swiglu_alpha, swiglu_limit, weight_layout="out_in",
                           save_activations=False):
    """The launch of the forward kernel, which returns y (T, H) (host side: index metadata, views and
    the exact widening of the routing weights to fp32). ``weight_layout`` "in_out": w_gate_up
    (E, H, 2I), w_down (E, I, H), multiplied as they are (no weight transposes on chip).
    ``save_activations``: the kernel also returns the pre-activation g and u in the layout
    :func:`saved_shape` (for the backward, which then does not recompute them). The combine
    (:func:`combine_mode`): "accumulate" on one core with the output rows staged whole, unless a
    group's slots name a token twice;
    its routing weights are per slot (:func:`slot_weights`)."""
    inter, flags, block_size = _launch_flags(x, topk_weights, block_expert, slot_assignment, w_down, b_gate_up,
                                             b_down, activation, weight_layout, save_activations)
    top_k = topk_weights.shape[1]
    hidden, itemsize = x.shape[1], x.element_size()
    blocks = _launch_group_blocks(x, topk_weights, block_expert, inter, block_size, flags, w_down.shape[0])
    group_expert, group_slots = merge_blocks(block_expert, slot_assignment, blocks, w_down.shape[0])
    h_chunk, y_cols, defer, gu_cols, wd_cols = tiling(hidden, inter, blocks * block_size, itemsize, top_k=top_k,
                                                      n_blocks=planned_groups(group_expert.shape[0], blocks), **flags)
    tokens = slot_tokens(group_slots, top_k)
    whole_rows = flags["accumulate"] and y_cols >= hidden     # its buffers counted, rows staged whole
    repeated = whole_rows and repeats_a_token(tokens, group_expert.shape[0])
    combine = combine_mode(lnc_degree(), repeated, whole_rows)
    weights = slot_weights(topk_weights, group_slots) if combine == "accumulate" else routing_weights(topk_weights)
    n_groups = planned_groups(group_expert.shape[0], blocks)
    prefetch = _prefetch_fits((hidden, inter, blocks * block_size, itemsize), (h_chunk, y_cols, defer, gu_cols, wd_cols),
                              dict(flags, top_k=top_k, n_blocks=n_groups))
    return KernelLaunch(moe_experts_fwd_kernel,
                        (x.contiguous(), weights, group_expert, tokens,
                         group_slots, w_gate_up.contiguous(), w_down.contiguous(), b_gate_up, b_down,
                         activation, float(swiglu_alpha), float(swiglu_limit), top_k, h_chunk, y_cols, defer, gu_cols,
                         wd_cols, save_activations, combine, prefetch),
                        grid=lnc_degree())
