"""Flash-attention backward: the row-group HBM layout (host layout glue and the group size).

Used by the launcher ``flash_attention_bwd.launch_flash_attention_bwd`` (torch, one host op per
tensor) and by the kernel's query-group and key-tile loads and stores (``group_tiles``). Queries
and keys share one layout: a group of ``per`` 128-row tiles, row ``(g * per + s) * pmax + p`` at
``[.., g, p, s, :]``, so one DMA moves a group with one contiguous run per partition (K rows
need none: the kernel transposes K^T on chip, or reads natural rows at D > 128).

    query_rows       Q, dO, O -> (B, Hq, NG, pmax, 3, per, D) in one tensor (one host op); dO,
                     O only -> (.., 2, per, D) when the kernel makes the Q rows on chip
    from_row_groups  row groups (B, H, NG, pmax, per, D) -> (B, H, S, D) (drops the padding
                     rows), cast in the same copy: one host op, the 128-row tiles' views
                     concatenated (no second copy to cut the padding when S is not a multiple
                     of the group rows)
    rows_from_transposed  (kernel) rows (pmax, nblocks, D) of an SBUF tile's transpose (D, rows):
                     the Q and K rows the kernel makes on chip

Shapes as above. Dimension legend: B batch, H heads, S rows (Sq or Sk), D head dim, NG groups
(ceil(S / (per * pmax))), pmax partitions, per = 128-row tiles per group (= 128-key blocks per
key tile, 4).
Limits: none of its own (any S, D; padding rows are zeros and dropped on the way back).
"""

from __future__ import annotations

import torch

from nki_lib._nki import nisa, nl
from nki_lib.attention.kernels import tiles
from nki_lib.sizes import ceil_div


def group_tiles():
    """Query tiles per group: as many 128-row tiles as a key tile has 128-key blocks (queries and
    the dk/dv outputs share the row-group HBM layout)."""
    return tiles.key_tile_width() // nl.tile_size.pmax


def full_blocks(blocks):
    """Number of leading full (pmax-row) blocks of ``blocks`` ((first row, rows) each); a partial
    last block moves on its own."""
    pmax = nl.tile_size.pmax
    return sum(1 for _, sn in blocks if sn == pmax)


def rows_from_transposed(rows_sb, src_t, blocks, head_dim):
    """``rows_sb[:sn, c, :]`` = the transpose of ``src_t[:head_dim, s0:s0 + sn]`` for each block
    (s0, sn) of ``blocks``: one TensorE transpose per block into one PSUM tile (bit-exact), then
    VectorE copies to SBUF (the full blocks in one, a partial last block in another). ``src_t``
    (>= D, rows) in SBUF (a Q^T or K^T tile), ``rows_sb`` (pmax, nblocks, D)."""
    pmax = nl.tile_size.pmax
    nblocks = len(blocks)
    rows_psum = nl.ndarray((pmax, nblocks, head_dim), dtype=src_t.dtype, buffer=nl.psum)
    for c, (s0, sn) in enumerate(blocks):
        nisa.nc_transpose(dst=rows_psum[:sn, c, :], data=src_t[:head_dim, s0:s0 + sn], engine=nisa.engine.tensor)
    nfull = full_blocks(blocks)
    if nfull:
        nisa.tensor_copy(dst=rows_sb[:, :nfull, :], src=rows_psum[:, :nfull, :], engine=nisa.engine.vector)
    if nfull < nblocks:
        sn = blocks[nfull][1]
        nisa.tensor_copy(dst=rows_sb[:sn, nfull, :], src=rows_psum[:sn, nfull, :], engine=nisa.engine.vector)


def _padded(x, dim):
    """x with zero rows appended along ``dim`` up to a multiple of the group rows (one host op)."""
    rows = group_tiles() * nl.tile_size.pmax
    pad = -x.shape[dim] % rows
    if not pad:
        return x
    return torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1 - dim % x.dim()) + (0, pad))


def _row_group_view(x):
    """``(B, H, S, D)`` -> ``(B, H, NG, pmax, per, D)`` with ``[.., g, p, s, :] = x[.., (g * per + s)
    * pmax + p, :]`` (zero rows past S): a view of x when S is a multiple of the group rows."""
    per, pmax = group_tiles(), nl.tile_size.pmax
    b, h, _, d = x.shape
    return _padded(x, 2).reshape(b, h, -1, per, pmax, d).transpose(3, 4)


def query_rows(q, dout, out, q_on_chip=False):
    """Layout glue: Q, dO and O rows in one ``(B, Hq, NG, pmax, 3, per, D)`` tensor (one host op):
    ``[.., g, p, i, s, :]`` = row ``(g * per + s) * pmax + p`` of (Q, dO, O)[i], so the kernel moves
    a group's Q and dO rows (``[.., 0:2, :, :]``) or its dO and O rows (``[.., 1:3, :, :]``) with one
    2 KiB contiguous run per partition. ``q_on_chip``: dO and O only (``[.., 0:2, :, :]``), the
    kernel transposes Q^T into the Q rows (``flash_attention_bwd.q_rows_on_chip``)."""
    return torch.stack([_row_group_view(x) for x in ((dout, out) if q_on_chip else (q, dout, out))], dim=4)


def _tile_rows(y, s):
    """Views ``(B, H, rows, D)`` of the row groups' 128-row tiles in row order, the last one cut
    at row ``s`` (tiles wholly past ``s``, padding only, left out)."""
    pmax, per = y.shape[3], y.shape[4]
    tiles_used = ceil_div(s, pmax)
    return [y[:, :, t // per, :min(pmax, s - t * pmax), t % per, :] for t in range(tiles_used)]


def from_row_groups(y, s, dtype=None):
    """Inverse of :func:`_row_group_view` (drops the padding rows), cast to ``dtype``: one host op
    (a concatenation of the tiles' views into a contiguous ``(B, H, S, D)`` tensor), each kept row
    read and written once."""
    b, h, _, _, _, d = y.shape
    rows = y.new_empty((b, h, s, d), dtype=dtype or y.dtype)
    return torch.cat(_tile_rows(y, s), dim=2, out=rows)
