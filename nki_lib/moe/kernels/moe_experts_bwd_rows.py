"""Slot tiles and gathered rows of one block (group) of the expert-MLP backward.

Algorithm: a block's S slots are cut into slot tiles of up to 128 (:class:`SlotTile`); each but
the first gets a 0/1 live register from the plan's live flags (:func:`if_live`: padding tiles
skip their body). Per live tile, indirect DMAs gather the token rows of x and dy and the routing
weights (padding slots, id -1, skipped: the rows stay zero) into rows allocated before the
previous block's scatters (:func:`block_rows`, :func:`gather_block`); then do = w_a dy and dyT
(H on partitions, by PE transposes) (:func:`load_grad_rows`).

Loop structure: slot tiles (static) > live guard (dynamic 0/1) > gathers / transposes.

Shapes (dimension legend): H hidden, I intermediate, E experts, S slots of the block (group), ps <= 128 slots of one slot tile, P = 128 partitions, cn <= 512 columns of one I chunk, T tokens, N = T*k assignments. x, dy (T, H) HBM; routing weights (P, ST, NB) fp32 in SBUF;
per tile: ids (ps, 1) int32, w_col (ps, 1) fp32, x / dy / do rows (ps, H); dyT (P, ceil(H / P), S).

Limits: S <= 512 (at most 4 slot tiles: one PSUM bank of fp32 slots in the contractions over
slots); the first tile is always computed (its padding rows are zero).
"""

from __future__ import annotations

from typing import NamedTuple

from nki_lib._nki import nisa, nl
from nki_lib.moe.kernels.moe_experts_steps import (
    gather_rows_into,
    transpose_rows,
)
from nki_lib.sizes import spans


class SlotTile(NamedTuple):
    """One slot tile (<= 128 slots) of a group: first slot, slots, token and assignment ids
    (ps, 1), routing weights (ps, 1) fp32, x rows (ps, H), and its 0/1 live register (None for
    the group's first tile, which is always computed: padding rows are zero, so a padding tile
    computed adds zeros, and the contractions over slots start their PSUM accumulation there),
    and the tile's saved g/u (P, 2 IT, ps) from the forward (None: g and u are recomputed)."""

    s0: int
    ps: int
    tok: object
    asg: object
    w_col: object
    x_rows: object
    live: object
    saved: object = None


def if_live(tile):
    """The tile's guard: one trip, or a dynamic loop of 0/1 trips (padding tiles skipped)."""
    return range(1) if tile.live is None else nl.dynamic_range(0, tile.live)


def saved_cols(gu_saved, inter):
    """Columns (2 IT) of a slot tile's saved g/u tile, 0 without saved g/u."""
    return 0 if gu_saved is None else 2 * len(spans(inter, nl.tile_size.pmax))


def _live_register(flags_sb, b, st):
    pmax = nl.tile_size.pmax
    reg = nisa.register_alloc()
    nisa.register_load(reg, flags_sb[b % pmax:b % pmax + 1, b // pmax, st:st + 1])
    return reg


def block_rows(x, dy, ids, b, block, saved_cols=0):
    """Group b's slot tiles (:class:`SlotTile`, ``ids`` = (token ids, assignment ids, live
    flags, routing weights (P, ST, NB) fp32[, dead flags, with saved g/u])) and dy rows, allocated here and filled by
    ``gather_block``; ``saved_cols`` > 0: each tile also gets a (P, saved_cols, ps) tile for its
    saved g/u (2 IT columns), and the group the first tile's live and dead registers (returned
    third, else None)."""
    pmax = nl.tile_size.pmax
    tok_ids, asg_ids, live_sb = ids[:3]
    slot_tiles, dy_rows = [], []
    for st, (s0, ps) in enumerate(spans(block, pmax)):
        live_reg = _live_register(live_sb, b, st) if st > 0 else None
        saved_sb = nl.ndarray((pmax, saved_cols, ps), dtype=x.dtype, buffer=nl.sbuf) if saved_cols else None
        slot_tiles.append(SlotTile(s0, ps, tok_ids[:ps, st, b:b + 1], asg_ids[:ps, st, b:b + 1],
                                   ids[3][:ps, st, b:b + 1],
                                   nl.ndarray((ps, x.shape[1]), dtype=x.dtype, buffer=nl.sbuf), live_reg, saved_sb))
        dy_rows.append(nl.ndarray((ps, dy.shape[1]), dtype=dy.dtype, buffer=nl.sbuf))
    first = (_live_register(live_sb, b, 0), _live_register(ids[4], b, 0)) if saved_cols else None
    return slot_tiles, dy_rows, first


def gather_block(x, dy, slot_tiles, dy_rows, first=None, saved=None):
    """Indirect gathers of the group's x rows and dy rows per live slot tile
    (padding slots stay zero); with ``saved`` = (the forward's saved g/u in HBM, group index),
    each live tile's saved g/u too (one plain DMA; the first tile's is zeroed when it holds only
    padding: the forward wrote nothing there, and the first tile is always computed)."""
    for st, (tile, dy_sb) in enumerate(zip(slot_tiles, dy_rows)):
        for _ in if_live(tile):
            gather_rows_into(tile.x_rows, x, tile.tok)
            gather_rows_into(dy_sb, dy, tile.tok)
            if saved is not None and st > 0:
                load_saved(tile.saved, *saved, st)
    if saved is not None:
        live_reg, dead_reg = first
        for _ in nl.dynamic_range(0, dead_reg):
            nisa.memset(dst=slot_tiles[0].saved, value=0.0, engine=nisa.engine.vector)
        for _ in nl.dynamic_range(0, live_reg):
            load_saved(slot_tiles[0].saved, *saved, 0)


def load_saved(saved_sb, gu_saved, g, st):
    """saved_sb (P, 2 IT, ps) = the forward's saved g/u of slot tile st of group g (one
    contiguous run per partition; layout: ``moe_experts_fwd.saved_shape``)."""
    _, st_len, pmax, row = gu_saved.shape
    _, n_cols, ps = saved_sb.shape
    nisa.dma_copy(dst=saved_sb, src=gu_saved.ap([[row, pmax], [ps, n_cols], [1, ps]],
                                                offset=(g * st_len + st) * pmax * row))


def load_grad_rows(dy_rows, slot_tiles, block, interleave=1):
    """Per slot tile: dy rows scaled by the routing weight (do); and dyT (P, HT, B), its H tiles
    in the order of ``moe_experts_steps.interleaved_blocks`` with ``interleave`` (W_down's)."""
    pmax = nl.tile_size.pmax
    hidden = dy_rows[0].shape[1]
    dy_t = nl.ndarray((pmax, len(spans(hidden, pmax)), block), dtype=dy_rows[0].dtype, buffer=nl.sbuf)
    do_rows = []
    for tile, dy_sb in zip(slot_tiles, dy_rows):
        do_sb = nl.ndarray((tile.ps, hidden), dtype=dy_sb.dtype, buffer=nl.sbuf)
        for _ in if_live(tile):
            transpose_rows(dy_t, dy_sb, tile.s0, interleave)
            nisa.tensor_scalar(dst=do_sb, data=dy_sb, op0=nl.multiply, operand0=tile.w_col)
        do_rows.append(do_sb)
    dy_rows.clear()                     # last use of the dy rows
    return do_rows, dy_t
