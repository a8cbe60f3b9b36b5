"""Decode-attention kernel, packed single-chunk path: short contiguous caches, several units per chunk.

Algorithm. When the single-chunk path's chunk rows are short (M*D elements per partition below
``Q_LOAD_ROW_BYTES``, each DMA row paying the per-descriptor floor more than its bytes; contiguous
cache, LNC1; ``pack_size``), U consecutive (b, hk) units (2 or 4, U*M*R <= MIN_II_ELEMS) share one
chunk: unit u on partitions [u*128/U, (u+1)*128/U), U*M slots each, so K and V of the pack are one
contiguous HBM run per partition (units are back to back in the cache: U-fold longer rows, U-fold
fewer descriptors), and one score tile of U*R rows. The scores, the grouped mask (each unit's bounds
clamped to the partition's slots and shifted to its own columns, so a partition only sees its own
unit's rows), the row max and the exp run once per pack (``run_chunks``); P @ V runs per unit,
contracting over its own partitions only (a PE row tile: an inf in one unit's visible V cannot
reach another unit's rows through 0 * inf), into its own state; each unit merges with its sink as
in the single-chunk path (``merge_phases``), and lse = M + log(L) is stored for all units at the end.

Column-tiled packs (``column_pack_size``: 2-byte K/V, D <= 128, where a shared tile's U*M*R would
exceed MIN_II_ELEMS): the same chunk layout (long DMA rows), but K is loaded as K^T (D, U*M, 128) by
one ``dma_transpose`` per pack (column p of slot c = the key on partition p; no PE transposes, no
evictions), and each unit's scores are column-tiled matmuls onto its own partitions
(``step_scores_columns``), so the score tile has R rows, the mask bounds are not shifted, the row
max reduces each unit's P columns of one transposed tile (the sink folded in as one more column)
and P @ V takes all R rows of P^T. Their rows are token-major (r' = t*G + g), so P @ V, the merge and
the out rows run per pack in ``decode_attention_fwd_columns``: one out tile (U*G, Sq*D) and one
store DMA per pack (Sq rows a partition).

Loop structure (program order)::

    for group of packs (as many as K/V buffer pairs fit CHUNK_BUFFER_BUDGET):
      per pack: q^T of its U*R rows (one load), its state and grouped bounds, unit registers, sinks
      per pack: K (one contiguous run per partition, DIRECT_PIECE_SLOTS slots per DMA; column-tiled:
                K^T by one dma_transpose)
      per pack: V, then per unit and edge range a device loop of 0 or 1 trips zeroing its V rows
                outside [first, L_b)
      the packs' compute in waves (scores, mask, exp per pack; P @ V per unit)
      one merge per unit (lockstep); out stores trail by OUT_STORE_LAG (column-tiled: one merge and
      one out store per pack)
    log table warmed; remaining out stores; lse of every unit

Shapes: q (B, Hq, Sq, D); k_units/v_units (B*Hkv*seq_units, u*D) -- the contiguous cache, a
unit's capacity exactly one chunk (128*M keys), units back to back; a pack's K/V chunk (128,
U*M*D) (column-tiled: K^T (D, U*M, 128)); its score tile (128, Sq, U, U*M, G) (grouped layout;
column-tiled (128, Sq, 1, U*M, G)); per unit a state (R, D + 2); out
(B, Hq, Sq, D); lse (B, Hq, Sq). Dimension legend as in ``decode_attention_fwd``, plus U units per
pack and P = 128/U partitions per unit.

Limits: contiguous caches, one split, LNC1, U*R <= 128 and U*M < MIN_II_ELEMS slots (short-row
steps), U <= ``PACK_MAX``; those of ``decode_attention_fwd`` otherwise.
"""

from __future__ import annotations

from nki_lib._nki import nisa, nl
from nki_lib.attention.kernels.decode_attention_fwd_chunks import chunk_plan, run_chunks, state_views
from nki_lib.attention.kernels.decode_attention_fwd_columns import (
    load_q_t_token_major,
    load_sink_token_major,
    q_load_units,
    store_out_pack,
)
from nki_lib.attention.kernels.decode_attention_fwd_io import (
    CHUNK_BUFFER_BUDGET,
    DIRECT_PIECE_SLOTS,
    OUT_STORE_LAG,
    Q_LOAD_ROW_BYTES,
    load_q_t,
    load_sink,
    store_out,
    stream_setup,
    unit_table_width,
    zero_invisible_rows,
)
from nki_lib.attention.kernels.decode_attention_fwd_steps import (
    MIN_II_ELEMS,
    LseTile,
    lockstep,
    merge_phases,
    store_lse,
)
from nki_lib.sizes import spans

__all__ = ["column_pack_size", "pack_size", "packed_path", "PACK_MAX"]

PACK_MAX = 4                      # units per packed chunk: unit u's P @ V contracts over its 128/U
                                  # partitions, a row tile of the PE array (32 at least, docs/nki-semantics.md §8.8)
MIN_COLUMN_TILE = 64              # column-tiled packs: each unit's scores on a column tile of at least 64
                                  # partitions (the tile sizes of every NeuronCore generation, nc_matmul docs)



def pack_size(n_units, rows, m, d, itemsize, lnc):
    """Units per packed chunk (single-chunk path, contiguous cache; 1: no packing). A unit's chunk
    rows are M*D elements per partition; below ``Q_LOAD_ROW_BYTES`` each pays the per-descriptor
    floor more than its bytes, so U consecutive units share one chunk of 128 partitions (unit u on
    partitions [u*128/U, (u+1)*128/U), U*M slots each: one contiguous HBM run per partition) and
    one row tile of U*R rows. A packed step computes every unit's scores on every partition (U x
    the elements, (U-1)/U of them masked), so it pays only while they still fit one instruction's
    minimum cost, U*M*R <= MIN_II_ELEMS: VectorE's work per step stays at its per-instruction
    floor while its instructions and hops, the DMA descriptors and the merges drop U-fold. U: a
    power of two dividing the units, U*R <= 128, rows of at most ``Q_LOAD_ROW_BYTES``, short-row
    softmax steps (U*M < MIN_II_ELEMS slots), at most ``PACK_MAX``; LNC1 only."""
    pack = 1
    while (lnc == 1 and 2 * pack <= PACK_MAX and n_units % (2 * pack) == 0 and 2 * pack * rows <= nl.tile_size.pmax
           and pack * m * d * itemsize < Q_LOAD_ROW_BYTES and 2 * pack * m < MIN_II_ELEMS
           and 2 * pack * m * rows <= MIN_II_ELEMS):
        pack *= 2
    return pack


def column_pack_size(n_units, rows, sq, m, d, itemsize, lnc):
    """Units per column-tiled pack (1: none). Where a shared packed tile would compute too many
    scores (U*M*R > MIN_II_ELEMS) but a unit's chunk rows are still short (M*D elements per
    partition below ``Q_LOAD_ROW_BYTES``), U units still share one chunk for its long DMA rows
    (unit u on partitions [u*P, (u+1)*P), P = 128/U, U*M slots each, rows of at most
    ``Q_LOAD_ROW_BYTES``), but each unit's scores are computed on its own partitions only (column
    tiles of the PE array, ``step_scores_columns``): the score tile has R rows, as an unpacked one.
    K arrives as K^T by ``dma_transpose`` (2-byte dtypes), so no PE transposes and evictions.
    Needs D <= 128 (one head-dim chunk), U*R <= 128 (one q load), column tiles of at least
    ``MIN_COLUMN_TILE`` partitions, short-row steps (U*M < MIN_II_ELEMS), one PSUM bank for a
    step's fp32 scores (U*M*R) and for a pack's out tile (Sq rows of D per partition); LNC1 only."""
    bank = nl.tile_size.psum_bank_fmax_bytes
    pack = 1
    if sq * d * itemsize > bank:
        return pack
    while (lnc == 1 and itemsize == 2 and d <= nl.tile_size.pmax and n_units % (2 * pack) == 0
           and 2 * pack * m * rows * 4 <= bank
           and 2 * pack * rows <= nl.tile_size.pmax and nl.tile_size.pmax // (2 * pack) >= MIN_COLUMN_TILE
           and 2 * pack * m * d * itemsize <= Q_LOAD_ROW_BYTES and 2 * pack * m < MIN_II_ELEMS):
        pack *= 2
    return pack


def _packed_state(meta, unit_ws, pack_keys, rows, d, slots, engine, columns=False):
    """The state of a packed chunk: the scores' tile of U*R rows (rows u*R .. (u+1)*R of unit u,
    window column pair ``unit_ws[u]``), one state per unit (``units``) and the grouped bounds on
    unit u's partitions ps (``slots`` = U*M per partition): slot c of
    partition p holds key (p - u*P)*U*M + c of unit u (P = 128/U), so relative to p*U*M its window
    moves by +u*cap; the grouped index of unit u's columns starts at u*n*G (one step of n = U*M
    slots). Per unit, on ``engine`` (SBUF only): the shifted window (also the V cleaning's), hi, lo,
    both clamped to the partition's slots and shifted to the unit's columns (``columns``: not shifted,
    each partition's tile columns are its own unit's rows); then one multiply by G for all.
    ``pack_keys`` (128, 1): p*U*M."""
    pmax = nl.tile_size.pmax
    pack, sq = len(unit_ws), meta.sq
    part = pmax // pack
    cap = part * slots
    group = rows // sq
    units = [state_views(nl.ndarray((rows, d + 2), dtype=nl.float32, buffer=nl.sbuf)) for _ in range(pack)]
    tile_rows = rows if columns else pack * rows
    state = state_views(nl.ndarray((tile_rows, d + 2), dtype=nl.float32, buffer=nl.sbuf),   # shapes only
                         nl.ndarray((pmax, sq, 2), dtype=nl.float32, buffer=nl.sbuf), sq,
                         nl.ndarray((pmax, sq, 2), dtype=nl.float32, buffer=nl.sbuf), pack, units, columns=columns)
    window_pm = nl.ndarray((pmax, 2), dtype=nl.float32, buffer=nl.sbuf)   # [first, L_b) - p*U*M + u*cap
    for u, ws in enumerate(unit_ws):
        ps = slice(u * part, (u + 1) * part)
        nisa.tensor_scalar(dst=window_pm[ps], data=meta.window[ps, 2 * ws:2 * ws + 2], op0=nl.subtract,
                           operand0=pack_keys[ps], op1=nl.add, operand1=float(u * cap), engine=engine)
        hi, lo = state.bounds[ps, :, 1], state.bounds[ps, :, 0]
        nisa.tensor_scalar(dst=hi, data=meta.row_pos[ps, 0:sq], op0=nl.add, operand0=window_pm[ps, 1:2],
                           engine=engine)
        nisa.tensor_scalar(dst=lo, data=hi, op0=nl.add, operand0=-meta.reach, op1=nl.maximum,
                           operand1=window_pm[ps, 0:1], engine=engine)
        # clamped to the partition's slots (else a range would reach a neighbour unit's columns), then
        # shifted to unit u's columns: [lo + u*n, hi + 1 + u*n) in slots
        shift = 0 if columns else u * slots
        nisa.tensor_scalar(dst=hi, data=hi, op0=nl.minimum, operand0=float(slots - 1), op1=nl.add,
                           operand1=float(shift + 1), engine=engine)
        nisa.tensor_scalar(dst=lo, data=lo, op0=nl.maximum, operand0=0.0, op1=nl.add, operand1=float(shift),
                           engine=engine)
    nisa.tensor_scalar(dst=state.g_bounds, data=state.bounds, op0=nl.multiply, operand0=float(group), engine=engine)
    return state, window_pm


def _load_packed_chunk(cache_units, chunk_sb, base, slots):
    """A packed chunk: one contiguous HBM run of ``slots`` keys per partition, ``DIRECT_PIECE_SLOTS``
    at a time (precomputed descriptors; keys past each unit's L_b give masked scores, their V rows
    are zeroed)."""
    d = chunk_sb.shape[1] // slots
    for c0, n in spans(slots, DIRECT_PIECE_SLOTS):
        nisa.dma_copy(dst=chunk_sb[:, c0 * d:(c0 + n) * d],
                      src=cache_units.ap([[slots * d, nl.tile_size.pmax], [1, n * d]], offset=base + c0 * d))


def _load_packed_k_t(k_units, k_t, base, slots):
    """A column-tiled pack's K^T (D, U*M, 128) by one ``dma_transpose`` (the 3-d form, permutation
    (2, 1, 0)) of its keys viewed as (128 partitions, U*M slots, D): element [d, c, p] is key p*U*M + c
    of the pack, the same key-to-partition layout as the V chunk (one contiguous HBM source)."""
    d = k_t.shape[0]
    nisa.dma_transpose(dst=k_t, src=k_units.ap([[slots * d, nl.tile_size.pmax], [d, slots], [1, d]], offset=base))


def packed_path(q, k_units, v_units, sink_rows, out, lse, meta, pack, cfg, columns=False):
    """The single-chunk path with ``pack`` consecutive units per chunk (``pack_size``): per group of
    packs (as many as buffer pairs fit): q^T and states of each pack, K of every pack, V of every
    pack (each unit's V rows outside its [first, L_b) zeroed in device loops of 0 or 1 trips over
    its edge ranges), the packs' compute in waves (``run_chunks``: scores, mask and exp per pack, P @ V
    per unit over its own partitions), one merge per unit."""
    n_kv_heads, m, unit_keys, d_spans, ones_col, scale, softcap = cfg
    pmax = nl.tile_size.pmax
    _, _, _, d = q.shape
    dtype = q.dtype
    rows = meta.row_pos.shape[1]
    prow, slots = pack * rows, pack * m
    n_units = q.shape[0] * n_kv_heads
    unit_stride = m * pmax * d                      # a unit's capacity is one chunk: units back to back
    part = pmax // pack
    tile_rows = rows if columns else prow
    plan = chunk_plan(slots, tile_rows, tile_rows, k_units.itemsize)
    pack_keys = nl.ndarray((pmax, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.iota(dst=pack_keys, pattern=[[0, 1]], offset=0, channel_multiplier=slots)
    slot_index = nl.ndarray((pmax, slots), dtype=nl.float32, buffer=nl.sbuf)   # [p, c] = c
    nisa.iota(dst=slot_index, pattern=[[1, slots]], offset=0, channel_multiplier=0)
    pair_bytes = slots * d * (k_units.itemsize + v_units.itemsize)
    n_pairs = max(1, min(n_units // pack, CHUNK_BUFFER_BUDGET // pair_bytes))
    k_shape = (d, slots, pmax) if columns else (pmax, slots * d)
    bufs = [(nl.ndarray(k_shape, dtype=k_units.dtype, buffer=nl.sbuf),
             nl.ndarray((pmax, slots * d), dtype=v_units.dtype, buffer=nl.sbuf)) for _ in range(n_pairs)]
    tile = LseTile(neg_big=nl.ndarray((rows, n_units), dtype=nl.float32, buffer=nl.sbuf),
                   total=nl.ndarray((rows, n_units), dtype=nl.float32, buffer=nl.sbuf), r0=0, first=0, stride=1)
    sinks = {}
    width = unit_table_width(m, unit_keys)
    pending_out = []
    q_loads = {}                                    # column-tiled: token-major q^T per load of units
    sq = meta.sq

    def pack_q_t(k):
        if not columns:
            return load_q_t(q, k * prow, prow, d_spans, dtype)
        per_load = q_load_units(n_units, pack, rows // sq, sq, d, q.itemsize)
        first = k * pack // per_load * per_load
        if first not in q_loads:
            q_loads[first] = load_q_t_token_major(q, first, min(per_load, n_units - first), rows, sq, dtype)
        j = (k * pack - first) * rows
        return [q_loads[first][:, j:j + prow]]

    for g0 in range(0, n_units // pack, n_pairs):
        group = list(range(g0, min(n_units // pack, g0 + n_pairs)))
        works = []
        for k in group:
            ws = [(k * pack + u) // n_kv_heads for u in range(pack)]
            state, window_pm = _packed_state(meta, ws, pack_keys, rows, d, slots, nisa.engine.gpsimd, columns)
            works.append((pack_q_t(k), state, window_pm, [stream_setup(meta, w, True, width).edges for w in ws]))
            for u in range(pack):
                hk = (k * pack + u) % n_kv_heads
                if sink_rows is not None and hk not in sinks:
                    sinks[hk] = (load_sink_token_major(sink_rows, hk, sq) if columns
                                 else load_sink(sink_rows, hk, 0, rows, sq))
            if columns:                             # the sinks fold into the max; -M and L go to the lse tile
                state.unit_sinks = None if sink_rows is None else [sinks[(k * pack + u) % n_kv_heads]
                                                                   for u in range(pack)]
                state.lse_cols = (tile.neg_big[:, k * pack:(k + 1) * pack], tile.total[:, k * pack:(k + 1) * pack])
        for i, k in enumerate(group):
            load_k = _load_packed_k_t if columns else _load_packed_chunk
            load_k(k_units, bufs[i][0], k * pack * unit_stride, slots)
        for i, k in enumerate(group):
            v_chunk = bufs[i][1]
            _load_packed_chunk(v_units, v_chunk, k * pack * unit_stride, slots)
            window_pm, edges = works[i][2], works[i][3]
            for u in range(pack):
                ps = slice(u * part, (u + 1) * part)
                for start, stop, step in edges[u]:          # the unit's edge ranges
                    for _ in nl.dynamic_range(start, stop, step):
                        zero_invisible_rows(v_chunk[ps], slot_index[ps], window_pm[ps])
        run_chunks([([work[1]], [work[0]]) + bufs[i] for i, work in enumerate(works)], plan, d_spans, slots,
                ones_col, k_units.dtype, scale, softcap, dtype, fresh=True)
        if columns:                                 # merged per pack inside run_chunks
            for k, work in zip(group, works):
                store_out_pack(out, work[1].out_tile, k * prow)
            continue
        merges, rows0 = [], []
        for k, work in zip(group, works):
            for u, ust in enumerate(work[1].units):
                unit = k * pack + u
                merges.append(merge_phases([ust], sinks.get(unit % n_kv_heads), tile.neg_big[:, unit:unit + 1],
                                           tile.total[:, unit:unit + 1], dtype))
                rows0.append(unit * rows)
        pending_out.extend(zip(lockstep(merges), rows0))
        while len(pending_out) > OUT_STORE_LAG:         # stores trail the loads they would block
            store_out(out, *pending_out.pop(0))
    warm = nl.ndarray((pmax, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=warm, op=nl.log, data=ones_col)   # the log table loads behind the last merges
    for out_sb, row0 in pending_out:
        store_out(out, out_sb, row0)
    store_lse(tile, lse, rows, sq if columns else None)
