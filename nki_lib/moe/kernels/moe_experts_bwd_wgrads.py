"""Weight and bias gradients of one I chunk of the expert-MLP backward.

Algorithm: contractions over the block's slots on TensorE, accumulated in fp32 PSUM across the
live slot tiles: dW_down[:, chunk] = do^T h, dW_gate[chunk, :] = dg^T x, dW_up[chunk, :] = du^T x
(:func:`chunk_weight_grads`); with biases, db_down = sum of do (first chunk only) and
db_gate/up[chunk] = sum of dg / du (contractions against a column of ones), and
d topk_weights += <dy_t, b_down[e]> (:func:`dtopk_bias`: dyT against the bias column). Each row
piece (up to ROW_BANKS PSUM banks) is written by the block's mode (:mod:`.moe_experts_bwd_accum`).

Loop structure: W_down: H tiles > slot tiles (guarded) > one matmul; W_gate/W_up: I tiles of the
chunk > row pieces of ROW_BANKS * 512 columns > banks > slot tiles (guarded); then the mode guards.

Shapes (dimension legend): H hidden, I intermediate, E experts, S slots of the block (group), ps <= 128 slots of one slot tile, P = 128 partitions, cn <= 512 columns of one I chunk, per slot tile: do and x rows (ps, H), h, dg, du (ps, cn); gradients
(E, 2I, H) and (E, H, I), bias gradients (E, 2I, 1) and (E, H, 1); PSUM pieces (<= 128, <= 512) fp32.

Limits: one row piece is at most ROW_BANKS fp32 PSUM banks (evicted into one SBUF row, one DMA),
but a dW_down piece over several I chunks holds a bank per chunk narrower than one bank
(:func:`down_piece`: 16 at I = 2048 in 128-column chunks); the launcher takes whole rows of I
only where those banks fit PSUM (no other PSUM tile is live in that step).
"""

from __future__ import annotations

from nki_lib._nki import nisa, nl
from nki_lib.moe.kernels.moe_experts_bwd_accum import accumulate_rows
from nki_lib.moe.kernels.moe_experts_bwd_rows import if_live
from nki_lib.moe.kernels.moe_experts_steps import interleaved_blocks
from nki_lib.sizes import ceil_div, spans

ROW_BANKS = 4       # PSUM banks (fmax fp32 columns each) of one weight-gradient row piece, stored with one DMA


def _bias_grads(slot_tiles, do_rows, chunk, bias, mode_regs, expert_reg, c0, inter):
    """db_down += sum over slots of do (once per block: the first I chunk); db_gate/up[chunk] +=
    sum over slots of dg / du: contractions over the slots against a column of ones."""
    pmax = nl.tile_size.pmax
    _, _, _, ones_col, (acc_bgu, db_gate_up), (acc_bd, db_down) = bias
    hidden = acc_bd.shape[1]
    cn = chunk[0][0].shape[1]
    if c0 == 0:
        for h0, hs in spans(hidden, pmax):
            part_psum = nl.ndarray((hs, 1), dtype=nl.float32, buffer=nl.psum)
            for st, (tile, do_sb) in enumerate(zip(slot_tiles, do_rows)):
                for _ in if_live(tile):
                    nisa.nc_matmul(dst=part_psum, stationary=do_sb[:, h0:h0 + hs], moving=ones_col[:tile.ps, :],
                                   accumulate=st > 0)
            accumulate_rows(acc_bd, db_down, mode_regs, expert_reg, h0, 0, [part_psum])
    for which, row0 in ((1, c0), (2, inter + c0)):
        for i0, isz in spans(cn, pmax):
            part_psum = nl.ndarray((isz, 1), dtype=nl.float32, buffer=nl.psum)
            for st, (tile, grads) in enumerate(zip(slot_tiles, chunk)):
                for _ in if_live(tile):
                    nisa.nc_matmul(dst=part_psum, stationary=grads[which][:, i0:i0 + isz],
                                   moving=ones_col[:tile.ps, :], accumulate=st > 0)
            accumulate_rows(acc_bgu, db_gate_up, mode_regs, expert_reg, row0 + i0, 0, [part_psum])


def dtopk_bias(dy_t, slot_tiles, dw_accs, bias, expert_reg, interleave=1):
    """d topk_weights[a] += <dy_t, b_down[e]>: contraction over H tiles of dyT against the bias
    column (H on partitions, the tiles in dyT's order: ``interleave``, as
    ``moe_experts_steps.interleaved_blocks``)."""
    pmax = nl.tile_size.pmax
    b_down = bias[1]
    hidden = b_down.shape[1]
    h_tiles = spans(hidden, pmax)
    col_sb = nl.ndarray((pmax, len(h_tiles), 1), dtype=b_down.dtype, buffer=nl.sbuf)
    for ht, m, h0 in interleaved_blocks(h_tiles, interleave):
        hs = h_tiles[ht][1]
        nisa.dma_copy(dst=col_sb[:hs, ht:ht + m, :], src=b_down.ap([[m, hs], [1, m], [1, 1]], offset=h0,
                                                                   scalar_offset=expert_reg, indirect_dim=0))
    for tile, dw_acc in zip(slot_tiles, dw_accs):
        s0, ps = tile.s0, tile.ps
        for _ in if_live(tile):
            part_psum = nl.ndarray((ps, 1), dtype=nl.float32, buffer=nl.psum)
            for ht, (h0, hs) in enumerate(h_tiles):
                nisa.nc_matmul(dst=part_psum, stationary=dy_t[:hs, ht, s0:s0 + ps], moving=col_sb[:hs, ht, :],
                               accumulate=ht > 0)
            nisa.tensor_tensor(dst=dw_acc, data1=dw_acc, data2=part_psum, op=nl.add)


def down_piece(widths, whole):
    """(m, banks) of one dW_down row piece of :func:`down_weight_grads` over I chunks of these
    widths: m rows of H per partition (> 1 only for ``whole`` rows of I of at most ROW_BANKS // 2
    banks) and the PSUM banks it holds (one fp32 piece per chunk and row, each a whole bank or more)."""
    bank = nl.tile_size.psum_fmax
    per_row = sum(ceil_div(w, bank) for w in widths)           # PSUM banks of one row
    m = max(1, ROW_BANKS // per_row) if whole else 1
    return m, m * per_row


def column_grads(slot_tiles, lhs_rows, sources, bufs, mode_regs, expert_reg, c0=0):
    """grad[:, c0 : c0 + sum of the sources' widths] += lhs^T grads[which] over the slots (rows:
    the columns of ``lhs_rows``, one (ps, R) tile per slot tile; ``bufs`` = (fp32 accumulator,
    gradient) (E, R, C)); ``sources``: (chunk, which) pairs side by side from column c0, a chunk
    being the per-slot-tile (h, dg, du) entries of one I chunk (one PSUM piece each: with several
    sources a row piece spans them, one DMA per row tile with longer runs). When the chunks cover whole rows (C columns), m = ROW_BANKS //
    (PSUM banks of one row) rows per partition (``moe_experts_steps.interleaved_blocks``: lhs's
    columns read with a step of m) make one row piece and one DMA, a contiguous run of m rows per
    partition. out_in dW_down = do^T h; in_out dW_gate / dW_up = x^T dg / x^T du."""
    pmax = nl.tile_size.pmax
    acc, out = bufs
    rows, cols = acc.shape[1], acc.shape[2]
    widths = [chunk[0][which].shape[1] for chunk, which in sources]
    r_tiles = spans(rows, pmax)
    for t0, m, r0 in interleaved_blocks(r_tiles, down_piece(widths, c0 == 0 and sum(widths) == cols)[0]):
        rs = r_tiles[t0][1]
        parts = []
        for r in range(m):
            for chunk, which in sources:
                part_psum = nl.ndarray((rs, chunk[0][which].shape[1]), dtype=nl.float32, buffer=nl.psum)
                for st, (tile, lhs_sb, grads) in enumerate(zip(slot_tiles, lhs_rows, chunk)):
                    for _ in if_live(tile):
                        nisa.nc_matmul(dst=part_psum, stationary=lhs_sb[:, r0 + r:r0 + m * rs:m], moving=grads[which],
                                       accumulate=st > 0)
                parts.append(part_psum)
        accumulate_rows(acc, out, mode_regs, expert_reg, r0, c0, parts, row_step=m)


def down_weight_grads(slot_tiles, do_rows, chunks, grad_bufs, mode_regs, expert_reg, c0=0):
    """out_in dW_down[:, c0 : c0 + sum of the chunks' widths] += do^T h over the slots
    (:func:`column_grads`)."""
    column_grads(slot_tiles, do_rows, [(chunk, 0) for chunk in chunks], grad_bufs[1], mode_regs, expert_reg, c0)


def gate_up_grads(slot_tiles, chunks, grad_bufs, mode_regs, expert_reg, c0=0):
    """in_out dW_gate/up[:, chunks' columns] += x^T dg / x^T du over the slots (:func:`column_grads`),
    ``chunks`` consecutive I chunks from c0: the gate and up pieces in row pieces of consecutive
    columns of at most ROW_BANKS PSUM banks (W_gate then W_up: whole rows of 2I when the chunks
    cover I, one DMA per H tile with runs of 2I elements, where their banks fit)."""
    bank = nl.tile_size.psum_fmax
    inter = grad_bufs[0][0].shape[2] // 2
    pieces = []                         # [first column, sources, banks, columns] of each row piece
    for first, which in ((c0, 1), (inter + c0, 2)):
        for chunk in chunks:
            width = chunk[0][which].shape[1]
            banks = ceil_div(width, bank)
            last = pieces[-1] if pieces else None
            if last is not None and last[0] + last[3] == first and last[2] + banks <= ROW_BANKS:
                last[1].append((chunk, which))
                last[2] += banks
                last[3] += width
            else:
                pieces.append([first, [(chunk, which)], banks, width])
            first += width
    x_rows = [tile.x_rows for tile in slot_tiles]
    for first, sources, _, _ in pieces:
        column_grads(slot_tiles, x_rows, sources, grad_bufs[0], mode_regs, expert_reg, first)


def row_grads(slot_tiles, rhs_rows, chunk, which, bufs, mode_regs, expert_reg, row0):
    """grad[row0 : row0 + cn, :] += grads[which]^T rhs over the slots (``rhs_rows``: one (ps, C)
    tile per slot tile; ``bufs`` = (fp32 accumulator, gradient) (E, R, C)), in whole rows of at
    most ROW_BANKS PSUM banks per row piece. out_in dW_gate / dW_up = dg^T x / du^T x; in_out
    dW_down = h^T do."""
    pmax, fmax = nl.tile_size.pmax, nl.tile_size.gemm_moving_fmax
    acc, out = bufs
    cols = acc.shape[2]
    for i0, isz in spans(chunk[0][which].shape[1], pmax):
        for g0, gn in spans(cols, ROW_BANKS * fmax):          # whole rows (at most ROW_BANKS PSUM banks)
            parts = []
            for h0, hn in spans(gn, fmax):
                part_psum = nl.ndarray((isz, hn), dtype=nl.float32, buffer=nl.psum)
                for st, (tile, rhs_sb, grads) in enumerate(zip(slot_tiles, rhs_rows, chunk)):
                    for _ in if_live(tile):
                        nisa.nc_matmul(dst=part_psum, stationary=grads[which][:, i0:i0 + isz],
                                       moving=rhs_sb[:, g0 + h0:g0 + h0 + hn], accumulate=st > 0)
                parts.append(part_psum)
            accumulate_rows(acc, out, mode_regs, expert_reg, row0 + i0, g0, parts)


def chunk_weight_grads(slot_tiles, do_rows, chunk, grad_bufs, mode_regs, expert_reg, c0, inter, down=True,
                       in_out=False):
    """dW_down[:, chunk] += do^T h (unless ``down`` is False: see :func:`down_weight_grads`);
    dW_gate/up[chunk, :] += dg^T x / du^T x (over the slots). ``in_out``: the transposed
    gradients, dW_down[chunk, :] += h^T do and dW_gate/up[:, chunk] += x^T dg / x^T du (the
    same products, operands swapped: each gradient stored in its weight's natural rows); there
    ``down`` False leaves out dW_gate/up instead (:func:`gate_up_grads` after the last chunk, the
    gradient whose rows are rows of I)."""
    gu_bufs, d_bufs, bias = grad_bufs
    if bias is not None:
        _bias_grads(slot_tiles, do_rows, chunk, bias, mode_regs, expert_reg, c0, inter)
    x_rows = [tile.x_rows for tile in slot_tiles]
    if in_out:
        row_grads(slot_tiles, do_rows, chunk, 0, d_bufs, mode_regs, expert_reg, c0)
        if down:
            gate_up_grads(slot_tiles, [chunk], grad_bufs, mode_regs, expert_reg, c0)
        return
    if down:
        down_weight_grads(slot_tiles, do_rows, [chunk], grad_bufs, mode_regs, expert_reg, c0)
    for which, row0 in ((1, c0), (2, inter + c0)):
        row_grads(slot_tiles, x_rows, chunk, which, gu_bufs, mode_regs, expert_reg, row0)
