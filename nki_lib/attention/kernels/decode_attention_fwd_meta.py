"""Decode-attention kernel: the runtime metadata of every (sequence, split), derived on chip from
the lengths, and the skipping of units that hold no needed key.

Algorithm: the lengths ``L_b`` (and ``cache_start``) land as one partition row by one DMA of one
descriptor each; small fp32 and int32 ops on that row (VectorE; int32 ``tensor_tensor`` on GpSimd,
exact) give, per sequence, ``first = max(0, L_b - Sq - window_left, cache_start_b)``, the chunk
counts ``end = ceil(L_b / C)``, ``c0 = first // C`` (right shifts: C is a power of two), the
interior chunks ``[lo, hi) = [ceil(first / C), L_b // C)``, and per split s the edges ``e_s = c0 +
(s * (end - c0)) // S`` (a right shift when S is a power of two, else an fp32 round-to-nearest of
``x / S - (S - 1) / (2S)``, exact for the small integers here). From them:

* ``bounds`` (1, B*S*4) int32: ``start = e_s <= lo_s <= hi_s <= stop = e_{s+1}`` (``lo_s``,
  ``hi_s`` the interior clamped into the split: an empty interior stays empty), in unit columns
  (left shifts by log2(C/u)), stored start | stop | lo | hi (``BOUND_COLUMNS``), the stream
  registers;
* ``window`` (128, B*S*2) fp32 on every partition: ``[first, L_b) - e_s * C``, broadcast from the
  row by one K = 1 matmul of a ones row (every element one exact product 1.0 * x) and a ScalarE
  copy; one split of one chunk (the single-chunk path): the gate itself (e_0 = c0 = 0);
* ``gate`` (128, B*2) fp32: ``[first, L_b)`` (the single-chunk gathers' skipping, issued right
  after the bounds on the broadcast's PSUM bank).

Unit skipping (``skip_unneeded_units``): unit i of a chunk holds keys ``[i*u, (i+1)*u)`` of the
chunk; its id becomes the out-of-range sentinel (the cache's row count, which the indirect DMA's
``oob_mode.skip`` drops) when ``i*u >= L_rel`` or ``(i+1)*u <= first_rel`` -- two compares and one
predicated copy on VectorE. The single-chunk contiguous path with first = 0 (``load_lengths``)
needs only ``L_b``: one row, the windows ``[0, L_b)`` broadcast by PE transposes. No loops.

Shapes: lengths, cache_start (B,) int32 (HBM); the tiles above; unit ids (C/u, 1) int32.
Dimension legend as in ``decode_attention_fwd``.

Limits: B*(2 + 2S) fp32 and a few B*S*4 int32 tiles on one SBUF partition row; every position and unit id
below 2**24 (fp32 arithmetic, checked by the launcher); at most 64 sequences on the lengths path.
"""

from __future__ import annotations

from nki_lib._nki import nisa, nl
from nki_lib.attention.kernels.decode_attention_fwd_io import RANGE_BOUNDS
from nki_lib.attention.kernels.tiles import MAX_INDEX

__all__ = ["BatchMeta", "load_meta", "skip_unneeded_units", "contiguous_unit_ids"]

BROADCAST_COLUMNS = 512           # fp32 elements per partition of one PSUM bank (2 KiB)
ROUND_MAGIC = 12582912.0          # 1.5 * 2**23: x + M - M rounds an fp32 |x| < 2**22 to the nearest integer


class BatchMeta(nl.NKIObject):
    """Runtime metadata of every (b, split), derived at the kernel start."""
    bounds: object     # (1, B*S*4) int32: per (b, s) the unit columns of its three chunk ranges (edge
                       # [start, lo), interior [lo, hi), edge [hi, stop)), stored start | stop | lo | hi;
                       # None when the kernel reads the lengths instead (single chunk, first = 0)
    lengths: object    # (1, B) int32 L_b when ``bounds`` is None, else None
    chunk_keys: int    # keys of a chunk (128*M)
    window: object     # (128, B*S*2) float32: per (b, s) [first, L_b) relative to the split's first key
    window_pm: object  # (128, B*S*2) float32: ``window`` - p*M on partition p
    gate: object       # (128, B*2) float32 [first, L_b) per sequence (None on the lengths path)
    unit_keys: object  # (128, 2) float32 [p*u, (p+1)*u): the keys of unit p of a chunk
    unit_index: object  # (128, 1) float32 p
    row_pos: object    # (128, R) float32: t_r - Sq for row r = g*Sq + t_r (its position minus L_b)
    reach: float       # keys a row sees before its own position: window_left, or MAX_INDEX unbounded
    sq: int            # new tokens per sequence


def _broadcast_column(col_sb, window_sb):
    """(n, 1) float32 column -> every partition of ``window_sb`` (128, n): a PE transpose of its
    stride-0 view (fp32 transposes are bit-exact) and a copy."""
    pmax = nl.tile_size.pmax
    window_psum = nl.ndarray((pmax, col_sb.shape[0]), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_transpose(dst=window_psum, data=col_sb.broadcast(1, pmax))
    nisa.tensor_copy(dst=window_sb, src=window_psum)


def _row_to_column(row_sb):
    """(1, n) float32 row -> (n, 1) SBUF column: one PE transpose and a ScalarE copy."""
    n = row_sb.shape[1]
    col_psum = nl.ndarray((n, 1), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_transpose(dst=col_psum, data=row_sb)
    col_sb = nl.ndarray((n, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=col_sb, src=col_psum, engine=nisa.engine.scalar)
    return col_sb


def _load_lengths(lengths, window_sb):
    """The lengths (B,) int32 as one (1, B) row (the stream registers) and the key windows [0, L_b)
    of every partition in ``window_sb`` (128, B*2): for one sequence the L_b column is its one-row
    load (one descriptor either way), else it is made from the row by a PE transpose (one
    descriptor instead of B: each partition row of a DMA pays the per-descriptor floor, and the
    windows are first read by the mask, behind the K loads)."""
    pmax = nl.tile_size.pmax
    n_seq = lengths.shape[0]
    lengths_sb = _row(lengths)
    if n_seq == 1:
        col_i = nl.ndarray((n_seq, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=col_i, src=lengths.ap([[1, n_seq], [1, 1]]))
        col_sb = nl.ndarray((n_seq, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=col_sb, src=col_i, engine=nisa.engine.gpsimd)
    else:
        length_f = _row_tile(n_seq, dtype=nl.float32)
        nisa.tensor_copy(dst=length_f, src=lengths_sb, engine=nisa.engine.gpsimd)
        col_sb = _row_to_column(length_f)
    pairs = window_sb.reshape((pmax, n_seq, 2))
    nisa.memset(dst=pairs[:, :, 0], value=0.0, engine=nisa.engine.gpsimd)
    _broadcast_column(col_sb, pairs[:, :, 1])
    return lengths_sb


def _row_tile(*shape, dtype=nl.int32):
    return nl.ndarray((1,) + shape, dtype=dtype, buffer=nl.sbuf)


def _row(src, dst=None):
    """(B,) int32 HBM -> (1, B) SBUF (int32, or ``dst``'s dtype: the DMA converts through fp32, exact
    below 2**24): one DMA of one descriptor."""
    n = src.shape[0]
    dst = _row_tile(n) if dst is None else dst
    nisa.dma_copy(dst=dst, src=src.ap([[n, 1], [1, n]]))
    return dst


def _broadcast_rows(row_sb):
    """(1, n) float32 row -> (128, n) SBUF, every partition: matmuls of a ones row (K = 1: each
    element one exact product 1.0 * x) into PSUM, one bank of ``BROADCAST_COLUMNS`` at a time."""
    pmax = nl.tile_size.pmax
    n = row_sb.shape[1]
    ones = _row_tile(pmax, dtype=nl.float32)
    nisa.memset(dst=ones, value=1.0, engine=nisa.engine.gpsimd)
    out = nl.ndarray((pmax, n), dtype=nl.float32, buffer=nl.sbuf)
    bank = None
    for j0 in range(0, n, BROADCAST_COLUMNS):
        nn = min(BROADCAST_COLUMNS, n - j0)
        bank = nl.ndarray((pmax, nn), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=bank, stationary=ones, moving=row_sb[:, j0:j0 + nn])
        nisa.tensor_copy(dst=out[:, j0:j0 + nn], src=bank, engine=nisa.engine.scalar)   # VectorE derives
    return out, (bank if n <= BROADCAST_COLUMNS else out)


def _floor_chunks(src, add, shift, to_units=0, dst=None):
    """``((src + add) >> shift) << to_units`` (int32, non-negative): whole chunks of 2**shift keys,
    in unit columns when ``to_units`` = log2(C/u)."""
    out = _row_tile(*src.shape[1:]) if dst is None else dst
    if add:
        tmp = _row_tile(*src.shape[1:])
        nisa.tensor_scalar(dst=tmp, data=src, op0=nl.add, operand0=float(add))
        src = tmp
    nisa.tensor_scalar(dst=out, data=src, op0=nl.right_shift, operand0=shift, op1=nl.left_shift,
                       operand1=to_units)
    return out


def _first_keys(length_f, cache_start, sq, window_left, first_f):
    """first = max(0, L_b - Sq - window_left, cache_start_b) -> ``first_f`` (1, B) fp32 (0 without a
    window or cache start); returns whether it can be > 0."""
    if window_left < 0 and cache_start is None:
        nisa.memset(dst=first_f, value=0.0)
        return False
    if window_left >= 0:
        nisa.tensor_scalar(dst=first_f, data=length_f, op0=nl.add, operand0=-float(sq + window_left),
                           op1=nl.maximum, operand1=0.0)
    if cache_start is not None:
        if window_left < 0:
            _row(cache_start, first_f)
        else:
            start = _row(cache_start, _row_tile(length_f.shape[1], dtype=nl.float32))
            nisa.tensor_tensor(dst=first_f, data1=first_f, data2=start, op=nl.maximum)
    return True


def _as_int(row_f):
    """An fp32 row of integers -> int32 (exact below 2**24), for the shifts of the chunk arithmetic."""
    out = _row_tile(*row_f.shape[1:])
    nisa.tensor_copy(dst=out, src=row_f)
    return out


def _split_edges(bounds, end, c0, n_split, to_units):
    """[start, stop] = [e_s, e_{s+1}] -> ``bounds[..., 0:2]`` (1, B, S, 2) int32 in unit columns,
    e_s = c0 + (s * (end - c0)) // S: one iota of s + j, one product, a right shift when S is a
    power of two (else an fp32 round to nearest of x / S - (S - 1) / (2S), off every .5 by >= 1/(2S)),
    a left shift to units."""
    n_seq = end.shape[1]
    pair = bounds[:, :, :, 0:2]
    span = end
    if c0 is not None:
        span = _row_tile(n_seq)
        nisa.tensor_tensor(dst=span, data1=end, data2=c0, op=nl.subtract)
    s_idx = _row_tile(n_split, 2)
    nisa.iota(dst=s_idx, pattern=[[1, n_split], [1, 2]], offset=0, channel_multiplier=0)
    scaled = _row_tile(n_seq, n_split, 2)
    nisa.tensor_tensor(dst=scaled, data1=span.expand_dim(2).expand_dim(3).broadcast(2, n_split).broadcast(3, 2),
                       data2=s_idx.expand_dim(1).broadcast(1, n_seq), op=nl.multiply)
    power = n_split & (n_split - 1) == 0
    if power and c0 is None:
        nisa.tensor_scalar(dst=pair, data=scaled, op0=nl.right_shift, operand0=n_split.bit_length() - 1,
                           op1=nl.left_shift, operand1=to_units)
        return
    edges = _row_tile(n_seq, n_split, 2)
    if power:
        nisa.tensor_scalar(dst=edges, data=scaled, op0=nl.right_shift, operand0=n_split.bit_length() - 1)
    else:
        frac = _row_tile(n_seq, n_split, 2, dtype=nl.float32)
        nisa.tensor_scalar(dst=frac, data=scaled, op0=nl.multiply, operand0=1.0 / n_split,
                           op1=nl.add, operand1=-(n_split - 1) / (2.0 * n_split))
        nisa.tensor_scalar(dst=edges, data=frac, op0=nl.add, operand0=ROUND_MAGIC, op1=nl.subtract,
                           operand1=ROUND_MAGIC)
    if c0 is not None:
        nisa.tensor_tensor(dst=edges, data1=edges, data2=c0.expand_dim(2).expand_dim(3).broadcast(2, n_split)
                           .broadcast(3, 2), op=nl.add)
    nisa.tensor_scalar(dst=pair, data=edges, op0=nl.left_shift, operand0=to_units)


def _split_bounds(length, first, shift, n_split, units_per_chunk):
    """(1, B*S*4) int32 in unit columns, stored start | stop | lo | hi (``BOUND_COLUMNS``): start =
    e_s, stop = e_{s+1} (``_split_edges``), lo_s = clamp(ceil(first / C), start, stop), hi_s =
    clamp(L_b // C, lo_s, stop). Without an interior chunk (L_b // C <= ceil(first / C)) the clamps
    leave [lo_s, hi_s) empty and every chunk of the split an edge chunk."""
    n_seq = length.shape[1]
    to_units = units_per_chunk.bit_length() - 1
    bounds = _row_tile(n_seq, n_split, RANGE_BOUNDS)
    hi = _floor_chunks(length, 0, shift, to_units)          # independent of the edges: issued first
    end = _floor_chunks(length, (1 << shift) - 1, shift)
    c0 = None if first is None else _floor_chunks(first, 0, shift)
    _split_edges(bounds, end, c0, n_split, to_units)
    start, stop = bounds[:, :, :, 0], bounds[:, :, :, 1]
    inner = [(3, hi, 2 if first is not None else 0)]    # first = 0: lo_s = start
    if first is not None:
        inner.insert(0, (2, _floor_chunks(first, (1 << shift) - 1, shift, to_units), 0))
    for j, chunk, low in inner:                   # clamp into [start (or lo_s), stop]
        nisa.tensor_tensor(dst=bounds[:, :, :, j], data1=chunk.expand_dim(2).broadcast(2, n_split),
                           data2=bounds[:, :, :, low], op=nl.maximum)
        nisa.tensor_tensor(dst=bounds[:, :, :, j], data1=bounds[:, :, :, j], data2=stop, op=nl.minimum)
    if first is None:
        nisa.tensor_copy(dst=bounds[:, :, :, 2], src=start)
    return bounds


def _one_split_bounds(length, first, shift, units_per_chunk):
    """``_split_bounds`` of one split from chunk 0 (c0 = 0: one chunk per sequence), stored start |
    stop | lo | hi: [0, end, min(lo, end), min(max(hi, lo_s), end)] (first = 0: [0, end, 0, hi],
    hi <= end)."""
    n_seq = length.shape[1]
    to_units = units_per_chunk.bit_length() - 1
    bounds = _row_tile(n_seq, RANGE_BOUNDS)
    nisa.memset(dst=bounds[:, :, 0:1], value=0)
    if first is None:
        nisa.memset(dst=bounds[:, :, 2:3], value=0)
    _floor_chunks(length, (1 << shift) - 1, shift, to_units, bounds[:, :, 1])
    _floor_chunks(length, 0, shift, to_units, bounds[:, :, 3])
    if first is not None:
        _floor_chunks(first, (1 << shift) - 1, shift, to_units, bounds[:, :, 2])
        nisa.tensor_tensor(dst=bounds[:, :, 2], data1=bounds[:, :, 2], data2=bounds[:, :, 1], op=nl.minimum)
        nisa.tensor_tensor(dst=bounds[:, :, 3], data1=bounds[:, :, 3], data2=bounds[:, :, 2], op=nl.maximum)
        nisa.tensor_tensor(dst=bounds[:, :, 3], data1=bounds[:, :, 3], data2=bounds[:, :, 1], op=nl.minimum)
    return bounds.reshape((1, n_seq * RANGE_BOUNDS))


def _derive(lengths, cache_start, n_split, sq, window_left, chunk_keys, units_per_chunk, single, early):
    """(bounds (1, B*S*4) int32, window (128, B*S*2) fp32, gate (128, B*2) fp32); see the module
    docstring. All arithmetic on one partition row; one broadcast to the partitions at the end (on
    the single-chunk path, whose window is the gate since e_0 = c0 = 0, before the bounds, and
    ``early(gate)`` right after them: the gathers' skipping)."""
    n_seq = lengths.shape[0]
    shift = chunk_keys.bit_length() - 1
    n_window = 0 if single else n_seq * n_split * 2
    wide = _row_tile(n_seq * 2 + n_window, dtype=nl.float32)     # [gate | window] rows
    gate_row = wide[:, 0:n_seq * 2].reshape((1, n_seq, 2))
    _row(lengths, gate_row[:, :, 1])
    has_first = _first_keys(gate_row[:, :, 1], cache_start, sq, window_left, gate_row[:, :, 0])
    gate, gate_now = _broadcast_rows(wide) if single else (None, None)   # PE and ScalarE, while VectorE
                                                                          # derives the bounds
    length = _as_int(gate_row[:, :, 1]) if single else _row(lengths)   # multi-chunk: the registers' chain
    first = _as_int(gate_row[:, :, 0]) if has_first else None
    if single:                                  # one chunk: c0 = 0, the window is the gate
        bounds = _one_split_bounds(length, first, shift, units_per_chunk)
        early(gate_now)                         # its PSUM bank: no wait for the SBUF copy
        return bounds, gate, gate
    bounds = _split_bounds(length, first, shift, n_split, units_per_chunk)
    key0 = _row_tile(n_seq, n_split, dtype=nl.float32)      # -(the split's first key)
    nisa.tensor_scalar(dst=key0, data=bounds[:, :, :, 0], op0=nl.multiply, operand0=-float(chunk_keys // units_per_chunk))
    window_row = wide[:, n_seq * 2:].reshape((1, n_seq, n_split, 2))
    nisa.tensor_tensor(dst=window_row, data1=key0.expand_dim(3).broadcast(3, 2),
                       data2=gate_row.expand_dim(2).broadcast(2, n_split), op=nl.add)
    both, _ = _broadcast_rows(wide)
    return bounds.reshape((1, n_seq * n_split * RANGE_BOUNDS)), both[:, n_seq * 2:], both[:, 0:n_seq * 2]


def load_meta(lengths, cache_start, n_split, derive, rows, sq, part_keys, window_left, chunk_keys, unit_keys,
              single=False, early=None):
    """The batch's metadata (``BatchMeta``): derived on chip from the lengths (``derive``; ``early(gate,
    unit keys)`` issued as soon as the gate is, on the single-chunk path), or, on the single-chunk
    contiguous path with first = 0, the lengths row and the windows [0, L_b) (``_load_lengths``);
    the rows' positions relative to L_b and the units' keys (iotas)."""
    pmax = nl.tile_size.pmax
    unit_key_tile = nl.ndarray((pmax, 2), dtype=nl.float32, buffer=nl.sbuf)
    nisa.iota(dst=unit_key_tile, pattern=[[unit_keys, 2]], offset=0, channel_multiplier=unit_keys)
    unit_index = nl.ndarray((pmax, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.iota(dst=unit_index, pattern=[[0, 1]], offset=0, channel_multiplier=1)
    lengths_sb, bounds_sb, gate = None, None, None
    if derive:
        bounds_sb, window_sb, gate = _derive(lengths, cache_start, n_split, sq, window_left, chunk_keys,
                                             chunk_keys // unit_keys, single,
                                             lambda g: early(g, unit_key_tile) if early else None)
    else:
        n_window = 2 * lengths.shape[0]
        if n_window > pmax:
            raise ValueError(f"cache_seqlens: the lengths of at most {pmax // 2} sequences (see reads_lengths)")
        window_sb = nl.ndarray((pmax, n_window), dtype=nl.float32, buffer=nl.sbuf)
        lengths_sb = _load_lengths(lengths, window_sb)
    window_pm = nl.ndarray(window_sb.shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=window_pm, data=window_sb, op0=nl.subtract, operand0=part_keys)
    row_pos = nl.ndarray((pmax, rows // sq, sq), dtype=nl.float32, buffer=nl.sbuf)
    nisa.iota(dst=row_pos, pattern=[[0, rows // sq], [1, sq]], offset=-sq)
    reach = float(window_left) if window_left >= 0 else float(MAX_INDEX)
    return BatchMeta(bounds=bounds_sb, lengths=lengths_sb, chunk_keys=chunk_keys, window=window_sb,
                     window_pm=window_pm, gate=gate, unit_keys=unit_key_tile, unit_index=unit_index,
                     row_pos=row_pos.reshape((pmax, rows)), reach=reach, sq=sq)


def skip_unneeded_units(idx_sb, unit_keys, window, sentinel, first=True):
    """Unit ids (n, 1) int32 of a chunk -> the out-of-range ``sentinel`` for every unit holding no
    key of [first, L) (``window`` (>= n, 2) fp32 in SBUF or PSUM, relative to the chunk; ``unit_keys`` (128, 2) fp32
    [p*u, (p+1)*u)): the gather skips them. ``first`` False: first <= 0 (only L counts)."""
    n = idx_sb.shape[0]
    outside = nl.ndarray((n, 1), dtype=nl.uint8, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=outside, data=window[0:n, 1:2], op0=nl.less_equal, operand0=unit_keys[0:n, 0:1])
    if first:
        nisa.scalar_tensor_tensor(dst=outside, data=window[0:n, 0:1], op0=nl.greater_equal,
                                  operand0=unit_keys[0:n, 1:2], op1=nl.maximum, operand1=outside)
    nisa.tensor_copy_predicated(dst=idx_sb, src=int(sentinel), predicate=outside)


def contiguous_unit_ids(meta, window, b, seq_units, unit_keys, n):
    """The unit ids (n, 1) int32 of a contiguous cache's chunk whose key window is ``window`` (fp32,
    relative to the chunk): row ``b * seq_units + key0 / u + i`` of the cache viewed as rows of units
    for unit i of the chunk, ``key0 = L_b - L_rel`` its first key (exact: below 2**24)."""
    col = nl.ndarray((n, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=col, data=window[0:n, 1:2], op0=nl.subtract, operand0=meta.gate[0:n, 2 * b + 1:2 * b + 2],
                       reverse0=True, op1=nl.multiply, operand1=1.0 / unit_keys)
    ids = nl.ndarray((n, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=ids, data=col, op0=nl.add, operand0=meta.unit_index[0:n, 0:1], op1=nl.add,
                       operand1=float(b * seq_units))
    return ids
