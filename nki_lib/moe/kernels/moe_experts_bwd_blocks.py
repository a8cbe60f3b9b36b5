"""Block phases and I chunks of the expert-MLP backward (steps 1-3 of :mod:`.moe_experts_bwd`).

Algorithm: per block (group), under its 0/1 guard: xT, dyT and do from the gathered rows; per I
chunk: the weights W_gate^T / W_up^T (PE-transposed) and W_down columns (:func:`chunk_weights`,
the next chunk's prefetched before this chunk's gradient stores; or W_down whole per group,
:func:`load_group_down`, the next group's by the last chunk's prefetch); per live slot tile g, u, dhy in
fp32 PSUM (contraction over H tiles, the gate/up biases first as ones^T x bias_row), the
elementwise gradients, dg/du PE-transposed into dgT/duT (software-pipelined one tile behind the
matmuls); the chunk's weight gradients. Then the next block's gathers (GpSimd issues DMAs in
program order, so they precede this block's scatters), then dx and d topk_weights.

Loop structure: block guard (dynamic) > {slot tiles (guarded) > transposes; I chunks > slot tiles
(guarded) > H tiles; weight-grad tiles}; next block's gathers (its guard); block guard > dx phase.

Shapes (dimension legend): H hidden, I intermediate, E experts, S slots of the block (group), ps <= 128 slots of one slot tile, P = 128 partitions, cn <= 512 columns of one I chunk, xT, dyT (P, ceil(H / P), S); dgT, duT (P, ceil(I / P), S); chunk weights
(P, ceil(H / P), cn); g, u, dhy (ps, cn) fp32 PSUM.

Limits: as :mod:`.moe_experts_bwd` (S <= 512, the SBUF estimate :func:`.moe_experts_bwd.sbuf_bytes`).
"""

from __future__ import annotations

from nki_lib._nki import nisa, nl
from nki_lib.moe.kernels.moe_experts_bwd_dx import dx_first_weights, dx_phase
from nki_lib.moe.kernels.moe_experts_bwd_grads import mlp_grads
from nki_lib.moe.kernels.moe_experts_bwd_rows import block_rows, gather_block, if_live, load_grad_rows, saved_cols
from nki_lib.moe.kernels.moe_experts_bwd_wgrads import (
    chunk_weight_grads,
    down_weight_grads,
    dtopk_bias,
    gate_up_grads,
)
from nki_lib.moe.kernels.moe_experts_gate import add_outer, bias_row
from nki_lib.moe.kernels.moe_experts_steps import (
    load_expert_cols,
    load_expert_t,
    mlp_dims,
    transpose_rows,
)
from nki_lib.sizes import spans

# Rows of H per partition in the group's W_down tile (:func:`load_group_down`): runs of 4 I
# elements per partition (6 KiB at qwen3's I = 768 in bf16, past the cost model's 178 ns chunk
# floor at 23 B/ns), while dyT's transposes read dy's columns with a step of 4 elements, 8 B in
# bf16 and 16 B in fp32: within the 16 B innermost stride of full port bandwidth
# (docs/cost-model.md §2.5).
DOWN_INTERLEAVE = 4


def chunk_weights(w_gate_up, w_down, expert_reg, c0, cn, saved=False, down_sb=None, in_out=False):
    """The weights of one I chunk, H on partitions: W_gate^T and W_up^T columns (None with
    ``saved`` g/u: not needed) and W_down columns (or a view of ``down_sb``, the group's W_down
    loaded whole by :func:`load_group_down`). out_in: W_gate/W_up rows PE-transposed, W_down
    columns natural; ``in_out``: W_gate/W_up columns natural, W_down rows PE-transposed."""
    hidden, inter = mlp_dims(w_down, in_out)
    h_tiles = spans(hidden, nl.tile_size.pmax)
    if down_sb is not None:
        down = down_sb[:, :, c0:c0 + cn]
    elif in_out:
        down = load_expert_t(w_down, expert_reg, h_tiles, c0, cn)
    else:
        down = load_expert_cols(w_down, expert_reg, h_tiles, c0, cn)
    if saved:
        return [None, None, down]
    load_gu = load_expert_cols if in_out else load_expert_t
    return [load_gu(w_gate_up, expert_reg, h_tiles, c0, cn), load_gu(w_gate_up, expert_reg, h_tiles, inter + c0, cn),
            down]


def group_down_tile(w_down, in_out=False):
    """An SBUF tile for one group's whole W_down (P, ceil(H / P), I), filled by :func:`load_group_down`."""
    hidden, inter = mlp_dims(w_down, in_out)
    return nl.ndarray((nl.tile_size.pmax, len(spans(hidden, nl.tile_size.pmax)), inter),
                      dtype=w_down.dtype, buffer=nl.sbuf)


def load_group_down(w_down, regs, down_sb, in_out=False):
    """down_sb = W_down[e] (H on partitions) of the group with registers ``regs`` (expert, 0/1
    trips), under the group's guard, the H tiles in the order of
    ``moe_experts_steps.interleaved_blocks`` with DOWN_INTERLEAVE. out_in: whole rows of I,
    DOWN_INTERLEAVE rows per partition (one DMA per DOWN_INTERLEAVE x 128 rows, one contiguous
    run of DOWN_INTERLEAVE x I elements per partition); ``in_out``: rows of H PE-transposed
    (``load_expert_t``, its transposes reading H with the interleave's step)."""
    hidden, inter = mlp_dims(w_down, in_out)
    h_tiles = spans(hidden, nl.tile_size.pmax)
    for _ in nl.dynamic_range(0, regs[1]):
        if in_out:
            load_expert_t(w_down, regs[0], h_tiles, 0, inter, interleave=DOWN_INTERLEAVE, w_t=down_sb)
        else:
            load_expert_cols(w_down, regs[0], h_tiles, 0, inter, w_sb=down_sb, interleave=DOWN_INTERLEAVE)


def _saved_gu(tile, c0, cn):
    """g and u of one slot tile and I chunk from the forward's saved gT/uT (I on partitions): PE
    transposes into PSUM (slots on partitions), in the activations' dtype."""
    pmax = nl.tile_size.pmax
    n_it = tile.saved.shape[1] // 2
    psums = []
    for first in (0, n_it):
        gu_psum = nl.ndarray((tile.ps, cn), dtype=tile.saved.dtype, buffer=nl.psum)
        for i0, isz in spans(cn, pmax):
            nisa.nc_transpose(dst=gu_psum[:, i0:i0 + isz], data=tile.saved[:isz, first + (c0 + i0) // pmax, :])
        psums.append(gu_psum)
    return psums


def _slot_tile_grads(x_t, dy_t, tile, dw_acc, weights, rows, bias, gate, chunk):
    """One slot tile of an I chunk: g, u (recomputed, or from the saved g/u), dhy (slots on
    partitions, contraction over H tiles in PSUM), the elementwise gradients (returned: h, dg, du)."""
    s0, ps = tile.s0, tile.ps
    c0, cn, h_tiles = chunk
    if tile.saved is None:
        psums = [nl.ndarray((ps, cn), dtype=nl.float32, buffer=nl.psum) for _ in weights]
        srcs = (x_t, x_t, dy_t)
    else:
        psums = _saved_gu(tile, c0, cn) + [nl.ndarray((ps, cn), dtype=nl.float32, buffer=nl.psum)]
        srcs = (None, None, dy_t)
    for dst, row_sb in zip(psums, rows):
        if row_sb is not None:
            add_outer(dst, bias[2][:, :ps], row_sb)
    for ht, (h0, hs) in enumerate(h_tiles):
        for dst, src_t, w_sb, row_sb in zip(psums, srcs, weights, rows):
            if src_t is not None:
                nisa.nc_matmul(dst=dst, stationary=src_t[:hs, ht, s0:s0 + ps], moving=w_sb[:hs, ht, :],
                               accumulate=ht > 0 or row_sb is not None)
    return mlp_grads(*psums, tile.w_col, gate, dy_t.dtype, dw_acc, c0 == 0)


def _transpose_grads(grads_t, tile, grads, c0):
    """dg/du of one slot tile (slots on partitions, an I chunk from c0) into dgT/duT."""
    pmax = nl.tile_size.pmax
    it0 = c0 // pmax
    for _ in if_live(tile):
        n_sub = len(spans(grads[1].shape[1], pmax))
        for grad_t, grad_sb in zip(grads_t, grads[1:]):
            transpose_rows(grad_t[:, it0:it0 + n_sub, :], grad_sb, tile.s0)


def _i_chunk(x_t, dy_t, slot_tiles, do_rows, dw_accs, weights, prefetch, expert_reg, c0, cn, gate,
             dg_t, du_t, grad_bufs, mode_regs, h_chunks=None, in_out=False):
    """One I chunk of a block (all its tiles die on return): g, u, dhy per slot tile (contraction
    over H tiles in PSUM; the gate/up biases first, as ones^T x bias_row), the elementwise
    gradients, dg/du transposed into dgT/duT, then the next chunk's weights (``prefetch()``,
    returned; ``weights``, a list, is released first), then the chunk's weight gradients
    accumulated into the expert's fp32 rows (``h_chunks``, a list: dW_down is left out and the
    chunk's entries appended, for :func:`.moe_experts_bwd_wgrads.down_weight_grads` after the
    last chunk). ``in_out``: the weights (and their gradients) in the in_out layout."""
    pmax = nl.tile_size.pmax
    hidden, inter = mlp_dims(grad_bufs[1][0], in_out)     # the fp32 W_down accumulator: W_down's shape
    h_tiles = spans(hidden, pmax)
    bias = grad_bufs[2]
    rows = (None, None, None)
    if bias is not None and slot_tiles[0].saved is None:      # saved g/u include the biases
        rows = (bias_row(bias[0], expert_reg, c0, cn), bias_row(bias[0], expert_reg, inter + c0, cn), None)
    # software-pipelined: slot tile n's dg/du transposes follow tile n + 1's matmuls (TensorE runs
    # in program order: it would otherwise wait out tile n's elementwise chain)
    # (one entry per slot tile, None for a skipped one: a 0-trip guard does not run its body, so
    # the entries stay aligned with slot_tiles whichever tiles are padding)
    chunk = []
    for n, (tile, dw_acc) in enumerate(zip(slot_tiles, dw_accs)):
        entry = [None]
        for _ in if_live(tile):
            entry[0] = _slot_tile_grads(x_t, dy_t, tile, dw_acc, weights, rows, bias, gate, (c0, cn, h_tiles))
        chunk.append(entry[0])
        if n > 0:
            _transpose_grads((dg_t, du_t), slot_tiles[n - 1], chunk[n - 1], c0)
    _transpose_grads((dg_t, du_t), slot_tiles[-1], chunk[-1], c0)
    weights.clear()                     # last use of this chunk's weights (released)
    next_weights = prefetch()
    chunk_weight_grads(slot_tiles, do_rows, chunk, grad_bufs, mode_regs, expert_reg, c0, inter,
                       down=h_chunks is None, in_out=in_out)
    if h_chunks is not None:
        h_chunks.append(chunk)
    return next_weights


def block_bwd(dy, x, ids, w_gate_up, w_down, regs, mode_regs, rows, next_regs, b, block,
               gate, i_chunk, dx_tiling, grad_bufs, dx_slots, prefetch, gu_saved=None, down_rows=False,
               down_sb=None, in_out=False):
    """Block b in guarded phases: transposes, I chunks and weight gradients; then the gathers of
    block b + 1 into rows allocated here (``next_regs`` = its registers, or None; the rows are
    returned); then dx and d topk_weights. GpSimd issues DMAs in program order, so the next
    block's gathers must precede this block's scatters (which wait for its last matmul) to overlap
    this block's compute. ``gu_saved``: the forward's saved g/u (HBM), or None (recomputed).
    ``down_rows``: dW_down contracted after the last I chunk in whole rows of I (h of every chunk
    kept; one store per H tile, runs of I elements) instead of per chunk; ``in_out``: dW_gate/up
    (dg, du of every chunk kept; rows of 2I, ``gate_up_grads``). ``down_sb``: this
    group's whole W_down (already loaded), or None (W_down columns loaded per I chunk); with it,
    the next group's is loaded by the last I chunk's prefetch, before its weight-gradient stores
    and this group's dx scatters (DMAs start in program order), and returned second. Unused
    groups (expert -1) come only after the used ones (``merge_blocks``), so a group not run has
    no next group to load. ``in_out``: the weights in the in_out layout ((E, H, 2I), (E, I, H)),
    their gradients too."""
    pmax = nl.tile_size.pmax
    _, inter = mlp_dims(w_down, in_out)
    expert_reg, trips_reg = regs
    slot_tiles, dy_rows, _ = rows
    n_it = len(spans(inter, pmax))
    dg_t = nl.ndarray((pmax, n_it, block), dtype=x.dtype, buffer=nl.sbuf)
    du_t = nl.ndarray((pmax, n_it, block), dtype=x.dtype, buffer=nl.sbuf)
    dw_accs = [nl.ndarray((tile.ps, 1), dtype=nl.float32, buffer=nl.sbuf) for tile in slot_tiles]
    dx_first = []                       # the dx phase's first W rows, loaded with the last chunk
    next_down = group_down_tile(w_down, in_out) if down_sb is not None and next_regs is not None else None
    downs = (down_sb, next_down, next_regs)
    for _ in nl.dynamic_range(0, trips_reg):
        _block_grads(x, slot_tiles, dy_rows, dw_accs, w_gate_up, w_down, expert_reg, mode_regs, block,
                     gate, (i_chunk, prefetch, dx_tiling, dx_first, down_rows, downs, in_out), dg_t, du_t,
                     grad_bufs)
    next_rows = None
    if next_regs is not None:
        next_rows = block_rows(x, dy, ids, b + 1, block, saved_cols(gu_saved, inter))
        for _ in nl.dynamic_range(0, next_regs[1]):
            gather_block(x, dy, *next_rows, saved=None if gu_saved is None else (gu_saved, b + 1))
    for _ in nl.dynamic_range(0, trips_reg):
        dx_phase(dg_t, du_t, w_gate_up, expert_reg, slot_tiles, dw_accs, dx_slots, dx_tiling,
                 dx_first[0] if dx_first else None, in_out)
    return next_rows, next_down


def _block_grads(x, slot_tiles, dy_rows, dw_accs, w_gate_up, w_down, expert_reg, mode_regs, block,
                 gate, chunking, dg_t, du_t, grad_bufs):
    """xT, dyT and do from the gathered rows, then the I chunks (weight gradients, dgT, duT), then
    the down bias's share of d topk_weights. ``chunking`` = (I chunk, prefetch, dx tiling, dx
    phase's first W rows (a list, filled here), down_rows, (this group's W_down tile, the next
    group's, its registers), in_out): with prefetch the next chunk's weights are loaded inside this chunk,
    else after it (see ``moe_experts_bwd.tiling``); the next group's W_down always by the last chunk."""
    i_chunk, prefetch, dx_tiling, dx_first, down_rows, (down_sb, next_down, next_regs), in_out = chunking

    def last_prefetch():
        # the dx phase's first W rows (with prefetch) and the next group's W_down, before the
        # last chunk's weight-gradient stores
        if prefetch:
            dx_first.append(dx_first_weights(w_gate_up, expert_reg, dx_tiling, in_out))
        if next_down is not None:
            load_group_down(w_down, next_regs, next_down, in_out)
    pmax = nl.tile_size.pmax
    saved = slot_tiles[0].saved is not None         # xT only feeds the recompute of g and u
    x_t = None if saved else nl.ndarray((pmax, len(spans(x.shape[1], pmax)), block), dtype=x.dtype, buffer=nl.sbuf)
    for tile in slot_tiles if not saved else ():
        for _ in if_live(tile):
            transpose_rows(x_t, tile.x_rows, tile.s0)
    interleave = 1 if down_sb is None else DOWN_INTERLEAVE      # dyT's H tiles in W_down's order
    do_rows, dy_t = load_grad_rows(dy_rows, slot_tiles, block, interleave)
    chunks = spans(mlp_dims(w_down, in_out)[1], i_chunk)

    def load_chunk(c0, cn):
        return chunk_weights(w_gate_up, w_down, expert_reg, c0, cn, saved, down_sb, in_out)
    weights = load_chunk(*chunks[0])
    h_chunks = [] if down_rows else None        # dW_down (in_out: dW_gate/up) in whole rows of I, after the last chunk
    for n, (c0, cn) in enumerate(chunks):
        # the next chunk's weights are loaded before this chunk's weight-gradient stores (DMAs
        # start in program order; the stores wait for their PSUM evictions)
        following = chunks[n + 1] if n + 1 < len(chunks) else None
        weights = _i_chunk(x_t, dy_t, slot_tiles, do_rows, dw_accs, weights,
                           last_prefetch if following is None else
                           (lambda: None) if not prefetch else (lambda c=following: load_chunk(*c)),
                           expert_reg, c0, cn, gate, dg_t, du_t, grad_bufs, mode_regs, h_chunks, in_out)
        if following is not None and not prefetch:
            weights = load_chunk(*following)
    if h_chunks is not None and in_out:
        gate_up_grads(slot_tiles, h_chunks, grad_bufs, mode_regs, expert_reg)
    elif h_chunks is not None:
        down_weight_grads(slot_tiles, do_rows, h_chunks, grad_bufs, mode_regs, expert_reg)
    if grad_bufs[2] is not None:
        dtopk_bias(dy_t, slot_tiles, dw_accs, grad_bufs[2], expert_reg, interleave)
