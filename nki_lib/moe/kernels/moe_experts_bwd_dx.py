"""The dx phase of the expert-MLP backward: dx_slots[a, :H] = dg @ W_gate + du @ W_up, d topk_weights in column H.

Algorithm: per staging group of dx_cols columns, the natural W_gate/W_up rows of all I tiles are
loaded once per dx_span columns (:func:`dx_first_weights`: the first span early, by the last I
chunk's prefetch); per H chunk (<= 512) and live slot tile, contraction over I tiles of dgT/duT
(stationary) against the W rows (moving) in fp32 PSUM, evicted into SBUF rows; the rows are
scattered once per slot tile and group, the last group's with one more column holding d
topk_weights[a], so no scatter of its own is needed.

Loop structure: staging groups > W spans > H chunks > I tiles (W_gate then W_up) > slot tiles
(guarded); then evictions and scatters per slot tile (guarded).

Shapes (dimension legend): H hidden, I intermediate, E experts, S slots of the block (group), ps <= 128 slots of one slot tile, P = 128 partitions, cn <= 512 columns of one I chunk, N assignments. dgT, duT (P, ceil(I / P), S); W rows (P, 2 ceil(I / P), dx_span);
dx rows (ps, dx_cols [+1]) fp32; dx_slots (N, H + 1) fp32 shared HBM.

Limits: dx_span and dx_cols chosen by the launcher's SBUF estimate; padding slots are not written.
"""

from __future__ import annotations

from nki_lib._nki import nisa, nl
from nki_lib.moe.kernels.moe_experts_bwd_rows import if_live
from nki_lib.moe.kernels.moe_experts_steps import (
    load_expert_cols,
    load_expert_t,
    scatter_rows,
)
from nki_lib.sizes import spans


def _gu_dims(w_gate_up, in_out):
    """(H, I) from W_gate_up: (E, 2I, H) out_in, (E, H, 2I) in_out."""
    return (w_gate_up.shape[1], w_gate_up.shape[2] // 2) if in_out else (w_gate_up.shape[2], w_gate_up.shape[1] // 2)


def _dx_row_tiles(inter):
    """The (row, rows) tiles of W_gate then W_up (I tiles of 128 rows, natural in out_in)."""
    i_tiles = spans(inter, nl.tile_size.pmax)
    return [*i_tiles, *((inter + i0, isz) for i0, isz in i_tiles)]


def dx_weights(w_gate_up, expert_reg, h0, wn, in_out=False):
    """(P, 2 ceil(I / P), wn) tile of W_gate/W_up rows, I on partitions, H columns h0 : h0 + wn.
    out_in: natural rows (one DMA per 128 rows); ``in_out``: W_gate and W_up columns transposed
    on TensorE (``load_expert_t`` of rows h0 : h0 + wn, once each for W_gate and W_up, so a partial
    I tile is always its call's last)."""
    _, inter = _gu_dims(w_gate_up, in_out)
    row_tiles = _dx_row_tiles(inter)
    if not in_out:
        return load_expert_cols(w_gate_up, expert_reg, row_tiles, h0, wn)
    n_it = len(row_tiles) // 2
    w_sb = nl.ndarray((nl.tile_size.pmax, len(row_tiles), wn), dtype=w_gate_up.dtype, buffer=nl.sbuf)
    for first in (0, n_it):
        load_expert_t(w_gate_up, expert_reg, row_tiles[first:first + n_it], h0, wn, w_t=w_sb[:, first:first + n_it, :])
    return w_sb


def dx_first_weights(w_gate_up, expert_reg, dx_tiling, in_out=False):
    """The dx phase's first span of W_gate/W_up rows (loaded early: see :func:`_block_grads`)."""
    dx_cols, dx_span = dx_tiling
    wn = min(dx_cols, dx_span, _gu_dims(w_gate_up, in_out)[0])
    return dx_weights(w_gate_up, expert_reg, 0, wn, in_out)


def dx_phase(dg_t, du_t, w_gate_up, expert_reg, slot_tiles, dw_accs, dx_slots, dx_tiling, first_w=None,
             in_out=False):
    """dx_slots[a, :H] = dg @ W_gate + du @ W_up: per H chunk, contraction over I tiles in PSUM;
    rows staged ``dx_cols`` wide in SBUF and scattered once per slot tile and group, the last
    group's rows with one more column, dx_slots[a, H] = d topk_weights[a] (``dw_accs``), so that
    no scatter of its own is needed (each indirect DMA costs GpSimd a descriptor per row). The natural
    W_gate/W_up rows of all I tiles are loaded once per ``dx_span`` columns (one DMA per 128 rows,
    runs of dx_span elements; ``in_out``: PE-transposed, :func:`dx_weights`), and the H chunks
    inside the span read them from SBUF."""
    dx_cols, dx_span = dx_tiling
    hidden, inter = _gu_dims(w_gate_up, in_out)
    i_tiles = spans(inter, nl.tile_size.pmax)
    grads = [(dg_t, it, isz) for it, (_, isz) in enumerate(i_tiles)] + \
            [(du_t, it, isz) for it, (_, isz) in enumerate(i_tiles)]
    for g0, gn in spans(hidden, dx_cols):
        extra = int(g0 + gn == hidden)                                  # the d topk_weights column
        dx_rows = [nl.ndarray((tile.ps, gn + extra), dtype=nl.float32, buffer=nl.sbuf) for tile in slot_tiles]
        for w0, wn in spans(gn, dx_span):
            w_sb = first_w if first_w is not None and g0 + w0 == 0 else \
                dx_weights(w_gate_up, expert_reg, g0 + w0, wn, in_out)
            for h0, hn in spans(wn, nl.tile_size.gemm_moving_fmax):
                dx_psums = [nl.ndarray((tile.ps, hn), dtype=nl.float32, buffer=nl.psum) for tile in slot_tiles]
                for rt, (grad_t, it, isz) in enumerate(grads):
                    for tile, dx_psum in zip(slot_tiles, dx_psums):
                        for _ in if_live(tile):
                            nisa.nc_matmul(dst=dx_psum, stationary=grad_t[:isz, it, tile.s0:tile.s0 + tile.ps],
                                           moving=w_sb[:isz, rt, h0:h0 + hn], accumulate=rt > 0)
                for tile, dx_psum, dx_sb in zip(slot_tiles, dx_psums, dx_rows):
                    for _ in if_live(tile):
                        nisa.tensor_copy(dst=dx_sb[:, w0 + h0:w0 + h0 + hn], src=dx_psum)
        for tile, dx_sb, dw_acc in zip(slot_tiles, dx_rows, dw_accs):
            for _ in if_live(tile):
                if extra:
                    nisa.tensor_copy(dst=dx_sb[:, gn:gn + 1], src=dw_acc)
                scatter_rows(dx_slots, tile.asg, dx_sb, g0)
