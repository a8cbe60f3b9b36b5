"""Decode-attention NKI kernel, on-chip steps of one chunk: K^T blocks, scores, the grouped mask,
the online-softmax update, P @ V, the merge of a row tile's split states with the sink, and the lse
store. ``decode_attention_fwd`` (the kernel, its streams and its single-chunk path) drives them.

Algorithm per softmax step of ``n`` key slots (keys on partitions, rows on the free axis; see
``decode_attention_fwd`` for the whole kernel)::

    K^T blocks   PE transposes of nk slots, KT_LOOKAHEAD blocks ahead of their score matmuls, across
                 the steps of every unit of a wave (KtPipeline); at D <= 64 on the paged shared-gather path
                 128/D slots per transpose (decode_attention_fwd_pairs)
    s            = scale * q @ k^T (softcap: softcap * tanh(s / softcap)), evicted from PSUM
    mask, rowmax one range_select per position of a row group (rows sharing a position)
    m_new, p     = max(m, rowmax), exp(s - m_new)      (per-row exps when a row has >= MIN_II_ELEMS slots)
    l, acc       = alpha * l + rowsum(p), alpha * acc + p @ v   (a direct step of >= PV_TILES_MIN_SLOTS
                 slots and <= 32 rows: slot j on PE column tile j % 4, four partials added by one
                 matmul with a 0/1 selection matrix, ``_pv_column_tiles``)
    merge        splits and the sink through their maxima and sums: out (rn, D), lse = M + log L

Each ``*_phases`` function is a generator whose yields separate dependent instruction groups, so
``lockstep`` can interleave several chains (row tiles x head-dim chunks) in program order.

Shapes (SBUF): scores (128, R, n) fp32 or (128, Sq, U, n, G) grouped (U units packed, usually 1); q^T (dc, rn); K chunk (128, M, D);
V chunk (128, M, D); state neg_m / l (rn, 1) fp32, acc (rn, D) fp32.
Dimension legend: R = G * Sq rows, rn rows of a row tile (<= 128), G query heads per kv head,
Sq new tokens, D head dim, dc head-dim chunk (<= 128), M keys per partition of a chunk, n slots of a
step, nk slots of a K^T block (one PSUM bank).

Limits: those of ``decode_attention_fwd`` (D <= 256, bf16/fp16/fp32, positions < 2**24).
"""

from __future__ import annotations

from functools import partial

from nki_lib._nki import nisa, nl
from nki_lib.attention.kernels.decode_attention_fwd_io import slot_cols, slot_dim
from nki_lib.attention.kernels.decode_attention_fwd_pairs import packed_keys_transposed
from nki_lib.attention.kernels.tiles import STAT_INIT, inf_max_rows
from nki_lib.sizes import spans

MIN_II_ELEMS = 64                 # an instruction costs at least ~64 engine cycles (MIN_II): per-row
                                  # instructions pay off only when a row has this many slots
PE_MIN_COLUMNS = 64               # a matmul streams at least min(64, M) columns: r x max(min(64, M), N)
                                  # cycles (docs/cost-model.md, TensorE row)
KT_LOOKAHEAD = 3                  # K^T blocks transposed ahead of their score matmuls
DVE_TRANSPOSE_MAX = 32            # VectorE nc_transpose handles tiles of up to 32 x 32 (nki.isa.nc_transpose docs)
PV_TILE_COLUMNS = 32              # the smallest PE column tile (nki.isa.nc_matmul tiling mode, NC-v3+)
PV_TILES_MIN_SLOTS = 32           # fewer slots in a step: one accumulator (the tiles' PSUM copy and sum
                                  # matmul cost more than the P @ V time they save; docs/perf-log.md §26.3)


def _block_keys_transposed(k_chunk, block, d_spans, m, dtype, engine):
    """K^T chunks (dc, 128 * n) of one K^T block (slots c0 .. c0 + n): column j*128 + p is key
    p*M + c0 + j of the chunk (evicted from PSUM by VectorE)."""
    pmax = nl.tile_size.pmax
    c0, n = block
    d = slot_dim(k_chunk, m)
    k_t = []
    for d0, dn in d_spans:
        k_t_psum = nl.ndarray((dn, n * pmax), dtype=dtype, buffer=nl.psum)
        for j in range(n):
            c = c0 + j
            nisa.nc_transpose(dst=k_t_psum[:, j * pmax:(j + 1) * pmax],
                              data=slot_cols(k_chunk, d, c, d0=d0, dn=dn))
        k_t_sb = nl.ndarray((dn, n * pmax), dtype=dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=k_t_sb, src=k_t_psum, engine=engine)
        k_t.append(k_t_sb)
    return k_t


def _evict_scores(s_view, s_psum, scale, softcap):
    """S^T block PSUM -> SBUF with the scale (and softcap) applied (ScalarE)."""
    if softcap > 0:
        nisa.activation(dst=s_view, op=nl.tanh, data=s_psum, scale=scale / softcap)
        nisa.tensor_scalar(dst=s_view, data=s_view, op0=nl.multiply, operand0=softcap)
    else:
        nisa.activation(dst=s_view, op=nl.copy, data=s_psum, scale=scale)


def _kt_spans(n, plan):
    """(first slot, slots) of the K^T blocks of a softmax step of ``n`` slots, in matmul order
    (score blocks of ``plan[1]`` slots, each cut into K^T blocks of ``plan[2]``)."""
    _, blk_slots, kt_slots = plan
    return tuple((b0 + k0, kn) for b0, bn in spans(n, blk_slots) for k0, kn in spans(bn, kt_slots))


class KtPipeline:
    """The K^T blocks of several softmax steps (all items of a wave, in the order their score
    matmuls are issued), transposed ``KT_LOOKAHEAD`` blocks ahead of their matmuls *across* the
    steps: TensorE transposes the next unit's keys while the current unit's K^T evictions are
    still in flight, instead of waiting for each unit's eviction in turn."""

    def __init__(self):
        self.thunks = []
        self.issued = []
        self.taken = 0

    def add(self, k_chunk, step, plan, d_spans, m, kv_dtype, rota=None, pack=1):
        """Queue the K^T blocks of one step (slots ``step`` of ``k_chunk``). A 4-d ``k_chunk`` is K^T
        already (``dma_transpose``), (f*D, 128/pg, M/f, pg): slot c of the key on partition g*pg + j
        is element [(c % f)*D + d, g, c // f, j] (f = 1, or f > 1 slots folded onto the partitions,
        ``decode_attention_fwd.k_t_fold``); its blocks are (K^T tile, first slot, D), no transposes.
        ``pack`` > 1: a (128, M*D) chunk whose blocks are PE-transposed ``pack`` slots at a time into
        that folded form (``decode_attention_fwd_pairs.packed_keys_transposed``)."""
        c0, n = step
        if len(k_chunk.shape) == 4:
            d = d_spans[-1][0] + d_spans[-1][1]
            for k0, _ in _kt_spans(n, plan):
                self.thunks.append(lambda c=c0 + k0: [(k_chunk, c, d)])
            return
        if pack > 1:
            transpose = partial(packed_keys_transposed, k_chunk, d=slot_dim(k_chunk, m), pack=pack, dtype=kv_dtype)
        else:
            transpose = partial(_block_keys_transposed, k_chunk, d_spans=d_spans, m=m, dtype=kv_dtype)
        for k0, kn in _kt_spans(n, plan):
            engine = None if rota is not None else nisa.engine.vector
            self.thunks.append(lambda blk=(c0 + k0, kn), eng=engine:
                               transpose(blk, engine=eng if eng is not None else rota.next()))

    def take(self):
        """The next K^T block, after issuing the transposes up to ``KT_LOOKAHEAD`` blocks beyond it."""
        while len(self.issued) < len(self.thunks) and len(self.issued) <= self.taken + KT_LOOKAHEAD:
            self.issued.append(self.thunks[len(self.issued)]())
        k_t = self.issued[self.taken]
        self.taken += 1
        return k_t


def kt_slot(k_t, j):
    """Slot j (D, 128 keys) of a K^T block and its partitions (start, D), or None for partitions 0..:
    columns j*128 .. of a PE-transposed block (dc, nk*128), or, of a DMA-transposed one (its tile
    (f*D, 128/pg, M/f, pg), first slot c0, D), slot c = c0 + j: the view [r0:r0 + D, :, c // f, :],
    r0 = (c % f)*D (partitions r0 .. r0 + D; None when f = 1)."""
    pmax = nl.tile_size.pmax
    if isinstance(k_t, tuple):
        tile, c0, d = k_t
        fold = tile.shape[0] // d
        c = c0 + j
        r0 = (c % fold) * d
        return tile[r0:r0 + d, :, c // fold, :], ((r0, d) if fold > 1 else None)
    return k_t[:, j * pmax:(j + 1) * pmax], None


def _slot_operands(k_t, j, q_t):
    """(stationary, moving, tiling) of the score matmul of slot j: K^T of a slot folded onto
    partitions r0 .. r0 + D meets q^T on the same partitions (``q_t`` holds f copies, one per fold),
    on the PE row tile there (``tile_position=(r0, 0)``, ``tile_size=(D, 128)``: row tiles of 32 or 64
    rows, nki.isa.nc_matmul "Tiling mode")."""
    stationary, rows = kt_slot(k_t, j)
    if rows is None:
        return stationary, q_t, {}
    r0, d = rows
    return stationary, q_t[r0:r0 + d], dict(tile_position=(r0, 0), tile_size=(d, nl.tile_size.pmax))


def step_scores(s_sb, q_t, step, plan, kt, scale, softcap, fused=False):
    """S^T (128, rn, n) of every row tile for the slots of one softmax step: element [p, r, j] is
    the score of row r with key p*M + c0 + j (rows outermost, so each row's slots are one
    contiguous run for its range_select). One matmul per slot and head-dim chunk
    (stationary K^T slot (dc, 128), moving q^T (dc, rn)) into a score block's PSUM tile, evicted
    with the scale when the block is complete -- or, ``fused`` (one block, no softcap), left in PSUM
    for the mask to read (returned: per row tile the (128, rn, n) view). The K^T blocks come from
    ``kt`` (a :class:`KtPipeline` holding this step's blocks, software-pipelined ``KT_LOOKAHEAD``
    blocks deep, hiding the PE -> eviction -> PE latency)."""
    pmax = nl.tile_size.pmax
    _, n = step
    blk_slots = plan[1]
    s_psum = None
    for k0, kn in _kt_spans(n, plan):
        k_t = kt.take()
        b0 = k0 - k0 % blk_slots
        bn = min(blk_slots, n - b0)
        if k0 == b0:
            s_psum = [nl.ndarray((pmax, bn, q[0].shape[1]), dtype=nl.float32, buffer=nl.psum) for q in q_t]
        for t in range(len(s_sb)):
            for j in range(kn):
                for h in range(len(q_t[t])):
                    stationary, moving, tiling = _slot_operands(k_t[h], j, q_t[t][h])
                    nisa.nc_matmul(dst=s_psum[t][:, k0 - b0 + j, :], stationary=stationary,
                                   moving=moving, accumulate=(h > 0), **tiling)
        if k0 + kn == b0 + bn and not fused:
            for t in range(len(s_sb)):
                _evict_scores(*_score_views(s_sb[t], s_psum[t], b0, bn), scale, softcap)
    return [p.permute((0, 2, 1)) for p in s_psum] if fused else s_sb


def step_scores_columns(s_sb, q_t, k_t, step, pack, scale, softcap):
    """S^T of a column-tiled pack (grouped (128, Sq, 1, n, G)) for the slots of one softmax step:
    unit u's keys sit on partitions [u*P, (u+1)*P) (P = 128/U) and only its rows are computed there.
    Per slot c and unit u one matmul on a column tile of the PE array (``tile_position=(0, u*P)``,
    ``tile_size=(128, P)``, the ``nki.isa.nc_matmul`` tiling mode): stationary K^T[:, c, u*P:(u+1)*P]
    (D, P), moving that unit's q^T (D, R) -> PSUM partitions u*P .. (u+1)*P; one score block (one
    PSUM bank: n*R fp32 per partition), evicted by ScalarE with the scale. ``k_t`` (D, U*M, 128): the
    pack's K^T, column p of slot c the key on partition p (``dma_transpose`` of the chunk)."""
    pmax = nl.tile_size.pmax
    c0, n = step
    part = pmax // pack
    rows = q_t[0].shape[1] // pack
    s_psum = nl.ndarray((pmax, n, rows), dtype=nl.float32, buffer=nl.psum)
    for j in range(n):
        for u in range(pack):
            ps = slice(u * part, (u + 1) * part)
            nisa.nc_matmul(dst=s_psum[ps, j, :], stationary=k_t[:, c0 + j, ps], moving=q_t[0][:, u * rows:(u + 1) * rows],
                           tile_position=(0, u * part), tile_size=(pmax, part))
    pmax_, sq, _, _, group = s_sb.shape          # token-major columns r' = t*G + g -> [t, 0, c, g]
    _evict_scores(s_sb.reshape((pmax_, sq, n, group)).permute((0, 2, 1, 3)), s_psum.reshape((pmax, n, sq, group)),
                  scale, softcap)


def _score_views(s_sb, s_psum, b0, bn):
    """(SBUF destination, PSUM source) views of one score block's eviction, element for element:
    the block is (128, bn, rn) slot-major; S^T is rows outermost (128, rn, n), or for grouped rows
    (128, Sq, U, n, G) (row r = (u*G + g)*Sq + t at [t, u, c, g]; U units packed on the partitions)."""
    if len(s_sb.shape) == 3:
        return s_sb[:, :, b0:b0 + bn].permute((0, 2, 1)), s_psum
    pmax, sq, pack, _, group = s_sb.shape
    return (s_sb[:, :, :, b0:b0 + bn, :].permute((0, 3, 2, 4, 1)),
            s_psum.reshape((pmax, bn, pack, group, sq)))


def _mask_grouped(state, s_sb, c0, part_max):
    """Mask and per-partition row max of grouped short-row scores S^T (128, Sq, U, n, G): rows of one
    t share their bounds, so one range_select per t covers its G rows (free index c*G + g, visible
    iff lo*G <= c*G + g < (hi + 1)*G) -- of all U packed units: partition p holds keys of one unit u
    only, and its bounds are shifted by u*n*G, so the other units' columns fall outside its range --
    then one max over the slots of every row."""
    pmax, sq, pack, n, group = s_sb.shape
    g_bounds = state.g_bounds
    for t in range(sq):
        nisa.range_select(dst=s_sb[:, t], on_true_tile=s_sb[:, t], comp_op0=nl.greater_equal, comp_op1=nl.less,
                          bound0=g_bounds[:, t, 0:1], bound1=g_bounds[:, t, 1:2], range_start=c0 * group)
    part_max_view = (part_max.reshape((pmax, sq, pack, group)) if state.columns        # token-major rows
                     else part_max.reshape((pmax, pack, group, sq)).permute((0, 3, 1, 2)))
    nisa.tensor_reduce(dst=part_max_view, op=nl.maximum, data=s_sb.permute((0, 1, 2, 4, 3)), axis=4)


def lockstep(phases):
    """Run phase generators round-robin, one phase of each in turn, so that the instructions of
    independent chains interleave in program order (each hop's latency is waited for once per
    round, not once per chain); returns their return values."""
    results = [None] * len(phases)
    live = list(range(len(phases)))
    while live:
        still = []
        for i in live:
            try:
                next(phases[i])
                still.append(i)
            except StopIteration as done:
                results[i] = done.value
        live = still
    return results


def lockstep_batched(phases, width):
    """``lockstep`` over consecutive batches of at most ``width`` chains (their PSUM tiles are live
    together)."""
    return [r for i in range(0, len(phases), width) for r in lockstep(phases[i:i + width])]


def step_probs_phases(state, s_sb, c0, neg_m_prev, dtype, s_src=None, score_scale=1.0, fresh=False):
    """P^T (128, rn, n) = exp(S^T - m_new) of the scores S^T (128, rn, n) of slots c0 .. c0 + n, and
    -m_new (rn, 1), with ``m_new = max(m_prev, rowmax)``: ``neg_m_prev`` is -m after the previous
    step, whose state update may not be issued yet (its P @ V is deferred).

    mask + per-partition row max: one range_select per row r over its n slots (slot c of
      partition p is key p*M + c: visible iff lo_r - p*M <= c <= hi_r - p*M)
    row max across partitions: PE transpose (128, rn) -> (rn, 128), VectorE max
    -m broadcast to the partitions: PE transpose of a stride-0 (rn, 128) view -> (128, rn)
    P^T = exp(S^T - m) in the input dtype: one ScalarE exp per row r with the per-partition bias
      -m_r (column r of the broadcast) when a row has >= MIN_II_ELEMS slots, else one VectorE add of
      the broadcast and a single exp

    ``s_src``: the unscaled scores in PSUM (fused step, long rows only): the range_select evicts
    them into ``s_sb``, and ``score_scale`` goes into -m and the exp (one ScalarE eviction and its
    PE -> ScalarE -> VectorE hop less per step)"""
    pmax = nl.tile_size.pmax
    s_src = s_sb if s_src is None else s_src
    rn, d = state.acc.shape
    grouped = len(s_sb.shape) == 5
    part_max = nl.ndarray((pmax, rn), dtype=nl.float32, buffer=nl.sbuf)
    if grouped:
        _mask_grouped(state, s_sb, c0, part_max)
    for r in range(0 if grouped else rn):
        nisa.range_select(dst=s_sb[:, r, :], on_true_tile=s_src[:, r, :], comp_op0=nl.greater_equal,
                          comp_op1=nl.less_equal, bound0=state.bounds[:, r, 0:1], bound1=state.bounds[:, r, 1:2],
                          reduce_cmd=nisa.reduce_cmd.reset_reduce, reduce_res=part_max[:, r:r + 1],
                          reduce_op=nl.maximum, range_start=c0)
    yield
    if state.pack > 1:                          # packed units: each unit's rows on partitions 0 .. R
        if state.columns:
            neg_m_cols, neg_m_new = yield from _column_row_max(part_max, state.pack, state.unit_sinks)
        else:
            neg_m_cols, neg_m_new = yield from _packed_row_max(part_max, state.pack)
        return (yield from _exp_phase(s_sb, neg_m_cols, score_scale, dtype, state.columns)), neg_m_new
    folded = fresh and state.folded and state.neg_sink is not None   # the sink is a key of this step:
    column = folded and score_scale == 1.0      # m = max(rowmax, sink); the sink as a 129th column
    part_max_t = nl.ndarray((rn, pmax + 1 if column else pmax), dtype=nl.float32, buffer=nl.psum)
    if column:
        nisa.tensor_copy(dst=part_max_t[:, pmax:pmax + 1], src=state.sink, engine=nisa.engine.scalar)
    nisa.nc_transpose(dst=part_max_t[:, 0:pmax], data=part_max)
    yield
    neg_m_new = nl.ndarray((rn, 1), dtype=nl.float32, buffer=nl.sbuf)
    if folded:
        if column:
            nisa.tensor_reduce(dst=neg_m_new, op=nl.maximum, data=part_max_t, axis=1, negate=True)
        else:
            rowmax = nl.ndarray((rn, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_reduce(dst=rowmax, op=nl.maximum, data=part_max_t, axis=1)
            nisa.tensor_scalar(dst=neg_m_new, data=rowmax, op0=nl.multiply, operand0=-score_scale,
                               op1=nl.minimum, operand1=state.neg_sink)
        nisa.activation(dst=state.sink_term, op=nl.exp, data=state.sink, bias=neg_m_new)
    elif fresh and score_scale == 1.0:            # a fresh state's -STAT_INIT is above every -rowmax of
        nisa.tensor_reduce(dst=neg_m_new, op=nl.maximum, data=part_max_t, axis=1, negate=True)  # a visible key
    else:
        rowmax = nl.ndarray((rn, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=rowmax, op=nl.maximum, data=part_max_t, axis=1)
        nisa.tensor_scalar(dst=neg_m_new, data=rowmax, op0=nl.multiply, operand0=-score_scale,
                           op1=nl.minimum, operand1=-STAT_INIT if fresh else neg_m_prev)
    yield
    neg_m_cols = nl.ndarray((pmax, rn), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_transpose(dst=neg_m_cols, data=neg_m_new.broadcast(1, pmax))
    yield
    return (yield from _exp_phase(s_sb, neg_m_cols, score_scale, dtype)), neg_m_new


def _packed_row_max(part_max, pack):
    """-rowmax of U packed units' rows from their per-partition maxima (128, U*R) (fresh states):
    per unit a PE transpose into one PSUM bank (R, U*128), one max over it for all units -> (R, U),
    column u is unit u's -m_new with its rows on partitions 0 .. R (as its state holds them); the
    broadcast back to the partitions per unit (a PE transpose of a stride-0 view)."""
    pmax = nl.tile_size.pmax
    rn = part_max.shape[1]
    rows = rn // pack
    part_max_t = nl.ndarray((rows, pack * pmax), dtype=nl.float32, buffer=nl.psum)
    for u in range(pack):
        nisa.nc_transpose(dst=part_max_t[:, u * pmax:(u + 1) * pmax], data=part_max[:, u * rows:(u + 1) * rows])
    yield
    neg_m_units = nl.ndarray((rows, pack), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=neg_m_units, op=nl.maximum, data=part_max_t.reshape((rows, pack, pmax)), axis=2,
                       negate=True)
    yield
    neg_m_cols = nl.ndarray((pmax, rn), dtype=nl.float32, buffer=nl.psum)
    for u in range(pack):
        nisa.nc_transpose(dst=neg_m_cols[:, u * rows:(u + 1) * rows], data=neg_m_units[:, u:u + 1].broadcast(1, pmax))
    yield
    return neg_m_cols, [neg_m_units[:, u:u + 1] for u in range(pack)]


def _column_row_max(part_max, pack, sinks=None):
    """-m of a column-tiled pack (fresh states) from its per-partition maxima (128, R), partition p
    holding unit p // P's rows: PE transposes -> (R, U, P) (one per unit, with ``sinks`` (per unit
    (R, 1)) a column P after each unit's maxima: the sink folds into the max), one max over each
    unit's columns -> (R, U) (column u is unit u's -m, rows on partitions 0 .. R), and one PE
    transpose of a stride-0 view (R, U, P) back to (128, R): partition p gets its own unit's -m."""
    pmax = nl.tile_size.pmax
    rows = part_max.shape[1]
    part = pmax // pack
    width = part + (sinks is not None)
    part_max_t = nl.ndarray((rows, pack * width), dtype=nl.float32, buffer=nl.psum)
    if sinks is None:
        nisa.nc_transpose(dst=part_max_t, data=part_max)
    else:
        for u in range(pack):
            nisa.tensor_copy(dst=part_max_t[:, u * width + part:(u + 1) * width], src=sinks[u],
                             engine=nisa.engine.scalar)
            nisa.nc_transpose(dst=part_max_t[:, u * width:u * width + part], data=part_max[u * part:(u + 1) * part])
    yield
    neg_m_units = nl.ndarray((rows, pack), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=neg_m_units, op=nl.maximum, data=part_max_t.reshape((rows, pack, width)), axis=2,
                       negate=True)
    yield
    neg_m_cols = nl.ndarray((pmax, rows), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_transpose(dst=neg_m_cols, data=neg_m_units.expand_dim(2).broadcast(2, part))
    yield
    return neg_m_cols, neg_m_units


def _exp_phase(s_sb, neg_m_cols, score_scale, dtype, token_major=False):
    """P^T (128, rn, n) = exp(S^T - m) in the input dtype from the -m broadcast (128, rn) (see
    ``step_probs_phases``)."""
    pmax = nl.tile_size.pmax
    grouped = len(s_sb.shape) == 5
    n = s_sb.shape[3] if grouped else s_sb.shape[2]
    rn = neg_m_cols.shape[1]
    p_t = nl.ndarray((pmax, rn, n), dtype=dtype, buffer=nl.sbuf)
    if n >= MIN_II_ELEMS:                       # one exp per row, bias -m_r = column r of the broadcast
        neg_m_bias = nl.ndarray((pmax, rn), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=neg_m_bias, src=neg_m_cols, engine=nisa.engine.scalar)
        for r in range(rn):
            nisa.activation(dst=p_t[:, r, :], op=nl.exp, data=s_sb[:, r, :], bias=neg_m_bias[:, r:r + 1],
                            scale=score_scale)
    elif grouped:                               # grouped short rows: shift and exp in S^T's layout
        _, sq, pack, _, group = s_sb.shape
        if token_major:                         # column-tiled packs: rows r' = t*G + g
            neg_m_tg = neg_m_cols.reshape((pmax, sq, pack, group)).expand_dim(3).broadcast(3, n)
            p_view = p_t.reshape((pmax, sq, pack, group, n)).permute((0, 1, 2, 4, 3))
        else:
            neg_m_tg = neg_m_cols.reshape((pmax, pack, group, sq)).permute((0, 3, 1, 2)).expand_dim(3).broadcast(3, n)
            p_view = p_t.reshape((pmax, pack, group, sq, n)).permute((0, 3, 1, 4, 2))
        nisa.tensor_tensor(dst=s_sb, data1=s_sb, data2=neg_m_tg, op=nl.add)
        nisa.activation(dst=p_view, op=nl.exp, data=s_sb)
    else:                                       # short rows: one VectorE shift, one exp for all rows
        nisa.tensor_tensor(dst=s_sb, data1=s_sb, data2=neg_m_cols.expand_dim(2).broadcast(2, n), op=nl.add)
        nisa.activation(dst=p_t, op=nl.exp, data=s_sb)
    return p_t
    yield  # unreachable: makes this a generator (``yield from``) like the other phases


def pv_direct(rn, d):
    """Whether P @ V of a row tile of ``rn`` rows takes the direct form (``step_pv_phases``): when
    its matmul (M = rn, N = D) costs TensorE no more cycles than the transposed one (M = dc, N = rn);
    else the transposed form, whose eviction and transpose hops are cheaper than the extra TensorE
    time (B=4 Sq=1 D=128: rn = 8 would stream 128 columns a slot instead of 64)."""
    dc = min(d, nl.tile_size.pmax)
    return max(min(PE_MIN_COLUMNS, rn), d) <= max(min(PE_MIN_COLUMNS, dc), rn)


def pv_column_tiles(rn, n, direct):
    """How many PE column tiles P @ V of a step spreads its slots over (1: one accumulator). A direct
    P @ V matmul's stationary P^T slot (128, rn) has rn <= 32 columns, so it fits a 32-column tile,
    and matmuls on the four column tiles run in parallel (nki.isa.nc_matmul, Tiling mode)."""
    if not direct or rn > PV_TILE_COLUMNS or n < PV_TILES_MIN_SLOTS:
        return 1
    return nl.tile_size.pmax // PV_TILE_COLUMNS


class PvTileSum:
    """The fp32 selection matrix that adds the column tiles' partial [O | rowsum] tiles: sel (128, rn)
    with sel[t * 32 + r, r] = 1 -- the shared identity's column blocks [t*32, t*32 + rn) added by one
    VectorE reduce over a (128, rn, tiles) view, made once per row count and shared by the steps of
    a wave."""

    def __init__(self):
        self._by_rows = {}

    def get(self, rn):
        if rn not in self._by_rows:
            pmax, cols = nl.tile_size.pmax, PV_TILE_COLUMNS
            ident = nl.shared_identity_matrix(pmax, dtype=nl.float32)
            blocks = ident.ap(pattern=[[pmax, pmax], [1, rn], [cols, pmax // cols]], offset=0)
            sel = nl.ndarray((pmax, rn), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_reduce(dst=sel, op=nl.add, data=blocks, axis=2)
            self._by_rows[rn] = sel
        return self._by_rows[rn]


def _pv_column_tiles(o_l, p_t, v_chunk, c0, ones_col, tiles, row_span, tile_sum):
    """[O | rowsum] of the step's slots on ``tiles`` PE column tiles: slot j accumulates on tile
    j % tiles into its own partial (rows t*32 .. t*32 + rn of one zeroed PSUM tile (128, D + 1)), the
    P @ V matmuls of a group of ``tiles`` slots issued together and then their row-sum matmuls (so no
    matmul waits in TensorE's issue order for the tile the one before it holds); the partials are
    copied to SBUF and added by one matmul with ``tile_sum`` into ``o_l`` (rn, D + 1). ``row_span``
    (start, size): the PE rows (partitions) the slots contract over."""
    pmax, cols = nl.tile_size.pmax, PV_TILE_COLUMNS
    rn, d = o_l.shape[0], o_l.shape[1] - 1
    n = p_t.shape[2]
    row0, rows = row_span
    part_psum = nl.ndarray((pmax, d + 1), dtype=nl.float32, buffer=nl.psum)
    nisa.memset(dst=part_psum, value=0.0)          # rows no tile writes stay 0 for the sum
    for g in range(0, n, tiles):
        group = range(g, min(n, g + tiles))
        for moving, lo, hi in (("v", 0, d), ("ones", d, d + 1)):
            for j in group:
                t = j % tiles
                c = c0 + j
                nisa.nc_matmul(dst=part_psum[t * cols:t * cols + rn, lo:hi], stationary=p_t[:, :, j],
                               moving=slot_cols(v_chunk, d, c) if moving == "v" else ones_col,
                               accumulate=True, tile_position=(row0, t * cols), tile_size=(rows, cols))
    yield
    part_sb = nl.ndarray((pmax, d + 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=part_sb, src=part_psum)
    yield
    nisa.nc_matmul(dst=o_l, stationary=tile_sum.get(rn), moving=part_sb)


def step_pv_phases(state, p_t, neg_m_new, v_chunk, c0, ones_col, d_spans, direct, fresh=False, parts=None,
                   in_place=False, tile_sum=None):
    """[O | rowsum] (rn, D + 1) of the slots c0 .. c0 + n into one PSUM tile, then the
    online-softmax update of ``state`` (acc | l in one instruction). The row sums are
    matmul(P^T slot j (128, rn), ones (128, 1)) (TensorE has room, VectorE does not). O:

    * ``direct``: matmul(stationary P^T slot j (128, rn), moving V slot j (128, D)) -- O comes out
      with the rows on partitions, as the state holds it (TensorE: max(min(64, rn), D) cycles a slot);
    * else per head-dim chunk matmul(stationary V slot j (128, dc), moving P^T slot j (128, rn)) =
      O^T (dc, rn) (max(min(64, dc), rn) cycles a slot), evicted and PE-transposed back into the tile
      (two more hops and one VectorE copy a step).

    ``parts`` (start, size): one packed unit, whose keys are on those partitions only: its P^T
    columns and V slots contract over them (a row-tiled matmul), so another unit's keys never meet
    its zero probabilities (0 * inf would be NaN). ``in_place`` (fresh, folded with a sink: the state's
    only step, merged right after): the state's acc | l and -m become views of the PSUM result and of
    -m_new, so no copies sit between P @ V and the merge (without a sink the merge copies l on GpSimd,
    which cannot read PSUM, so the copies stay). ``tile_sum`` (a :class:`PvTileSum`): a direct step of
    at least ``PV_TILES_MIN_SLOTS`` slots and rn <= 32 rows runs its matmuls on the PE column tiles
    (``_pv_column_tiles``); without it, one accumulator."""
    rn, d = state.acc.shape
    n = p_t.shape[2]
    tiling = {}
    if parts is not None:
        p0, pn = parts
        p_t, v_chunk, ones_col = p_t[p0:p0 + pn], v_chunk[p0:p0 + pn], ones_col[p0:p0 + pn]
        tiling = dict(tile_position=(p0, 0), tile_size=(pn, nl.tile_size.pmax))
    tiles = pv_column_tiles(rn, n, direct) if tile_sum is not None else 1
    o_l = nl.ndarray((rn, d + 1), dtype=nl.float32, buffer=nl.psum)
    o_t = [] if direct else [nl.ndarray((dn, rn), dtype=nl.float32, buffer=nl.psum) for _, dn in d_spans]
    if tiles > 1:
        yield from _pv_column_tiles(o_l, p_t, v_chunk, c0, ones_col, tiles, parts or (0, nl.tile_size.pmax),
                                    tile_sum)
    for j in range(n if tiles == 1 else 0):
        c = c0 + j
        if direct:
            nisa.nc_matmul(dst=o_l[:, 0:d], stationary=p_t[:, :, j], moving=slot_cols(v_chunk, d, c),
                           accumulate=(j > 0), **tiling)
        for h, (d0, dn) in enumerate(d_spans if not direct else ()):
            nisa.nc_matmul(dst=o_t[h], stationary=slot_cols(v_chunk, d, c, d0=d0, dn=dn), moving=p_t[:, :, j],
                           accumulate=(j > 0), **tiling)
        nisa.nc_matmul(dst=o_l[:, d:d + 1], stationary=p_t[:, :, j], moving=ones_col, accumulate=(j > 0), **tiling)
    yield
    if not direct:
        o_t_sb = []
        for h, (d0, dn) in enumerate(d_spans):
            o_t_sb.append(nl.ndarray((dn, rn), dtype=nl.float32, buffer=nl.sbuf))
            nisa.tensor_copy(dst=o_t_sb[h], src=o_t[h])
        yield
        for h, (d0, dn) in enumerate(d_spans):
            nisa.nc_transpose(dst=o_l[:, d0:d0 + dn], data=o_t_sb[h])
        yield
    if in_place and fresh and state.folded and state.sink_term is not None:   # the state's only step: its
        state.acc_l, state.acc, state.l = o_l, o_l[:, 0:d], o_l[:, d:d + 1]   # merge (L = l + sink term on
        # VectorE, which reads PSUM) takes [O | rowsum] and -m where they are: no copies
        state.neg_m = neg_m_new
        return
    if fresh:                                   # alpha = exp(-STAT_INIT - m_new) = 0: plain copies
        nisa.tensor_copy(dst=state.acc_l, src=o_l)
        nisa.tensor_copy(dst=state.neg_m, src=neg_m_new)
        return
    alpha = nl.ndarray((rn, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=alpha, op=nl.exp, data=state.neg_m, bias=neg_m_new, scale=-1.0)
    nisa.scalar_tensor_tensor(dst=state.acc_l, data=state.acc_l, op0=nl.multiply, operand0=alpha,
                              op1=nl.add, operand1=o_l)
    nisa.tensor_copy(dst=state.neg_m, src=neg_m_new)


def merge_phases(states, sink_sb, neg_big, total, dtype, copy_engine=nisa.engine.gpsimd):
    """Merge the split states of one row tile (and the sink): out (rn, D) in ``dtype``; ``neg_big``
    (-M) and ``total`` (L) are written into the (rn, 1) views given (columns of the batch's lse
    tiles, whose log runs once for all units: one ScalarE table switch, not one per unit).
    ``copy_engine``: of a folded state's copies of -M and L (GpSimd, unless it generates gather
    descriptors: an in-order GpSimd would hold the next gathers behind the merges)."""
    rn, d = states[0].acc.shape
    if len(states) == 1:
        return (yield from _merge_one(states[0], sink_sb, neg_big, total, dtype, copy_engine))
    nisa.tensor_copy(dst=neg_big, src=states[0].neg_m)
    for st in states[1:]:
        nisa.tensor_tensor(dst=neg_big, data1=neg_big, data2=st.neg_m, op=nl.minimum)
    if sink_sb is not None:
        nisa.tensor_scalar(dst=neg_big, data=sink_sb, op0=nl.multiply, operand0=-1.0,
                           op1=nl.minimum, operand1=neg_big)
    yield
    o_sum = nl.ndarray((rn, d), dtype=nl.float32, buffer=nl.sbuf)
    weights = []
    for st in states:
        weights.append(nl.ndarray((rn, 1), dtype=nl.float32, buffer=nl.sbuf))  # exp(m_s - M)
        nisa.activation(dst=weights[-1], op=nl.exp, data=st.neg_m, bias=neg_big, scale=-1.0)
    sink_term = None
    if sink_sb is not None:
        sink_term = nl.ndarray((rn, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=sink_term, op=nl.exp, data=sink_sb, bias=neg_big)
    yield
    for i, (st, weight) in enumerate(zip(states, weights)):
        if i == 0:
            nisa.tensor_scalar(dst=total, data=st.l, op0=nl.multiply, operand0=weight)
            nisa.tensor_scalar(dst=o_sum, data=st.acc, op0=nl.multiply, operand0=weight)
        else:
            nisa.scalar_tensor_tensor(dst=total, data=st.l, op0=nl.multiply, operand0=weight,
                                      op1=nl.add, operand1=total)
            nisa.scalar_tensor_tensor(dst=o_sum, data=st.acc, op0=nl.multiply, operand0=weight,
                                      op1=nl.add, operand1=o_sum)
    if sink_term is not None:
        nisa.tensor_tensor(dst=total, data1=total, data2=sink_term, op=nl.add)
    yield
    inv_total = nl.ndarray((rn, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.reciprocal(dst=inv_total, data=total)
    yield
    out_sb = nl.ndarray((rn, d), dtype=dtype, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=out_sb, data=o_sum, op0=nl.multiply, operand0=inv_total)
    return out_sb


def _merge_one(st, sink_sb, neg_big, total, dtype, copy_engine=nisa.engine.gpsimd):
    """``merge_phases`` for one split: -M = min(-m, -sink), w = exp(m - M), L = w*l + exp(sink - M),
    out = acc * (1/L) * w (one pass over the (rn, D) rows)."""
    rn, d = st.acc.shape
    if st.folded:                               # -m already includes the sink: M = m, w = 1
        return (yield from _merge_folded(st, neg_big, total, dtype, copy_engine))
    if sink_sb is not None:
        nisa.tensor_scalar(dst=neg_big, data=sink_sb, op0=nl.multiply, operand0=-1.0,
                           op1=nl.minimum, operand1=st.neg_m)
    else:
        nisa.tensor_copy(dst=neg_big, src=st.neg_m)
    yield
    weight = nl.ndarray((rn, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=weight, op=nl.exp, data=st.neg_m, bias=neg_big, scale=-1.0)
    sink_term = None
    if sink_sb is not None:
        sink_term = nl.ndarray((rn, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=sink_term, op=nl.exp, data=sink_sb, bias=neg_big)
    yield
    if sink_term is not None:
        nisa.scalar_tensor_tensor(dst=total, data=st.l, op0=nl.multiply, operand0=weight,
                                  op1=nl.add, operand1=sink_term)
    else:
        nisa.tensor_scalar(dst=total, data=st.l, op0=nl.multiply, operand0=weight)
    yield
    inv_total = nl.ndarray((rn, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.reciprocal(dst=inv_total, data=total)
    yield
    out_sb = nl.ndarray((rn, d), dtype=dtype, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=out_sb, data=st.acc, op0=nl.multiply, operand0=inv_total,
                       op1=nl.multiply, operand1=weight)
    return out_sb


def _merge_folded(st, neg_big, total, dtype, copy_engine=nisa.engine.gpsimd):
    """``_merge_one`` for a state whose only step folded the sink in (its -m is -M, its sink term
    exp(sink - M) is in ``st.sink_term``): -M copied (``copy_engine``), L = l + sink term, out = acc / L --
    no exp, so the log of the lse needs no table switch after the merges."""
    rn, d = st.acc.shape
    nisa.tensor_copy(dst=neg_big, src=st.neg_m, engine=copy_engine)
    if st.sink_term is not None:
        nisa.tensor_tensor(dst=total, data1=st.l, data2=st.sink_term, op=nl.add)
    else:
        nisa.tensor_copy(dst=total, src=st.l, engine=copy_engine)
    yield
    inv_total = nl.ndarray((rn, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.reciprocal(dst=inv_total, data=total)
    yield
    out_sb = nl.ndarray((rn, d), dtype=dtype, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=out_sb, data=st.acc, op0=nl.multiply, operand0=inv_total)
    return out_sb


class LseTile(nl.NKIObject):
    """-M and L of one row tile (rows r0 .. r0 + rn) of every unit this core stores: column k is
    unit ``first + k * stride`` (flattened (b, hk)), whose rows start at ``unit * R`` of lse."""
    neg_big: object    # (rn, U) float32
    total: object      # (rn, U) float32
    r0: int
    first: int
    stride: int


def store_lse(tile, lse, rows, token_major=None):
    """lse = -neg_big + log(total) (+inf where the max is +inf) for every unit of the tile at once,
    transposed to (U, rn) so each unit's rows are one contiguous run of the store: on VectorE (SBUF
    to SBUF, no PE result latency, no eviction) when both sides fit ``DVE_TRANSPOSE_MAX``, else on
    TensorE. The subtraction runs on GpSimd (SBUF operands), so the chain does not queue behind the
    merges' VectorE work. ``token_major`` (Sq): the tile's rows are token-major (column-tiled packs),
    put back in row order by one GpSimd copy before the store."""
    pmax = nl.tile_size.pmax
    rn, n_units = tile.total.shape
    lse_sb = nl.ndarray((rn, n_units), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=lse_sb, op=nl.log, data=tile.total)
    nisa.tensor_tensor(dst=lse_sb, data1=lse_sb, data2=tile.neg_big, op=nl.subtract, engine=nisa.engine.gpsimd)
    inf_max_rows(lse_sb, tile.neg_big)
    for k0, kn in spans(n_units, pmax):
        lse_t_sb = nl.ndarray((kn, rn), dtype=nl.float32, buffer=nl.sbuf)
        if kn <= DVE_TRANSPOSE_MAX and rn <= DVE_TRANSPOSE_MAX:
            nisa.nc_transpose(dst=lse_t_sb, data=lse_sb[:, k0:k0 + kn], engine=nisa.engine.vector)
        else:
            lse_t_psum = nl.ndarray((kn, rn), dtype=nl.float32, buffer=nl.psum)
            nisa.nc_transpose(dst=lse_t_psum, data=lse_sb[:, k0:k0 + kn])
            nisa.tensor_copy(dst=lse_t_sb, src=lse_t_psum)
        if token_major is not None:             # columns (t, g) -> row order (g, t): one GpSimd copy
            sq = token_major
            lse_r_sb = nl.ndarray((kn, rn), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_copy(dst=lse_r_sb.reshape((kn, rn // sq, sq)),
                             src=lse_t_sb.reshape((kn, sq, rn // sq)).permute((0, 2, 1)), engine=nisa.engine.gpsimd)
            lse_t_sb = lse_r_sb
        unit0 = tile.first + k0 * tile.stride
        nisa.dma_copy(dst=lse.ap([[tile.stride * rows, kn], [1, rn]], offset=unit0 * rows + tile.r0), src=lse_t_sb)
