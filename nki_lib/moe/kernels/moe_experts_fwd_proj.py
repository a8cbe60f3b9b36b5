"""The projections of the expert-MLP forward (:mod:`.moe_experts_fwd`): gate/up and down.

Algorithm: :func:`gate_up_projection`: per I tile (128) the expert's W_gate^T / W_up^T tiles (out_in:
the weight rows loaded and PE-transposed; in_out: loaded as they are, per span of ``gu_cols`` I
columns, or the next group's tile prefetched by :func:`.moe_experts_fwd_dmas.next_group_dmas`),
per live slot tile gT/uT = W^T x xT into fp32 PSUM (contraction over H tiles; a bias first as
bias_row^T x ones), hT = gate(gT, uT) (:func:`gate_into`) into SBUF, optionally the
pre-activations kept for the backward. :func:`down_projection`: per staging group of ``y_cols``
columns and H chunk (<= 512), o = h x W_down^T (+ b_down first as ones^T x bias_row) into fp32
PSUM per live slot tile (contraction over I tiles), evicted on ScalarE (scaled by the routing
weight with the "accumulate" combine) into the staged fp32 rows, written by the group's sink
(the last staging group's deferred); :func:`preload_down` loads the in_out W_down^T of every I
span H wide once per group.

Loop structure: gate/up: I tiles > slot tiles (guarded) > H tiles. Down: staging groups >
W_down column blocks > H chunks > I spans > slot tiles (guarded) > I tiles; then the evictions per
slot tile.

Shapes (dimension legend): H hidden, I intermediate, E experts, P = 128 partitions, S slots per
group, ps slots of a tile, HT/IT H/I tiles. xT (P, HT, S) and hT (P, IT, S) SBUF in x's dtype;
W^T tiles (P, HT, cols) with H on partitions; w_gate_up (E, 2I, H) / w_down (E, H, I) (out_in)
or (E, H, 2I) / (E, I, H) (in_out) HBM; g/u PSUM (isz, ps) and y PSUM (ps, hn) fp32; staged y
rows (ps, cols) fp32; saved g/u tiles (P, 2 IT, ps).

Limits: as :mod:`.moe_experts_fwd` (one PSUM bank per slot tile and H chunk, hn <= 512; at most
4 slot tiles in flight).
"""

from __future__ import annotations

from nki_lib._nki import nisa, nl
from nki_lib.moe.kernels.moe_experts_fwd_dmas import H_INTERLEAVE, scatter_deferred
from nki_lib.moe.kernels.moe_experts_gate import add_outer, bias_row, clamped_swiglu
from nki_lib.moe.kernels.moe_experts_steps import act_fn, load_expert_cols, load_expert_t, weight_spans
from nki_lib.sizes import spans


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
    one span, the ``prefetched`` tile (loaded during the previous group, :func:`.moe_experts_fwd_dmas.next_group_dmas`)."""
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


def gate_up_projection(x_t, w_gate_up, b_gate_up, expert_reg, slot_tiles, h_tiles, gate, h_t, ones_sb, inter,
                       gu_cols, saved=None, prefetched=None):
    """hT[:, it, slots] = gate(W_gate x + b_gate, W_up x + b_up) per I tile (I on partitions, slots
    free); the W^T tiles are shared by all live slot tiles, each slot tile is computed under its
    guard. A bias enters the PSUM first, as bias_row^T x ones (a contraction of size 1).
    ``saved``: per slot tile a (P, 2 IT, ps) tile that receives gT (I tile it) and uT (IT + it)
    in x's dtype, for the backward (:func:`.moe_experts_fwd_dmas.store_saved`), or None. ``prefetched``: the in_out
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


def down_projection(h_t, w_down, b_down, expert_reg, i_tiles, slot_tiles, sink, tiles, ones_sb, last_rows,
                    preloaded=None):
    """y_slots[a] = h @ W_down^T (+ b_down) for the assignment a of each slot: per H chunk,
    contraction over I tiles in PSUM (per live slot tile; the bias first, as ones^T x bias_row);
    the rows are staged ``y_cols`` wide in SBUF and written by ``sink`` (:class:`.moe_experts_fwd_combine.GroupSink`: one
    indirect DMA per live slot tile and staging group, padding slots not written; scattered in
    assignment order for the final k-sum, or weighted at the eviction and added into the token-
    ordered accumulator, :mod:`.moe_experts_fwd_combine`). The last staging group is staged in
    ``last_rows`` and not scattered here (see :func:`scatter_deferred`). ``tiles`` = (h_chunk,
    y_cols, gu_cols, wd_cols); with the in_out layout (gu_cols > 0) the W_down^T tiles are
    w_down's own rows (I on partitions), loaded without transposes: with ``wd_cols`` > 0, every
    I tile's rows ``wd_cols`` columns wide at once (long runs, shared by the H chunks of those
    columns), else per H chunk and I span; ``preloaded``: those tiles of the one column block
    when one block covers H (loaded earlier by :func:`preload_down`)."""
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


def preload_down(w_down, expert_reg, i_tiles, hidden, trips_reg):
    """The in_out W_down^T tiles of every I span, H wide (the one column block of :func:`down_projection`),
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
    """One H chunk of :func:`down_projection`: ``chunk`` = (first column of H, width, first column in the
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
