"""Phase 0 of the flash-attention backward kernel: per-row statistics and dsinks.

Called from ``flash_attention_bwd.flash_attention_bwd_kernel`` (:func:`start`, :func:`finish`) and from
``flash_attention_bwd_pipeline.kv_pass`` (:func:`head_start`, :func:`prefetch_group`, :func:`group_stats`,
:func:`head_finish`); plain NKI helper functions, inlined at trace time.

Per (head h, batch b), started by :func:`head_start` when the main loop's pass over the kv
head begins (``(pmax, NT)`` columns: row t * pmax + p on partition p, column t):

* ``neg_lse = -lse``, and 0 where ``lse = -inf`` (rows with no visible key and no sink: their
  probabilities are masked to 0 anyway; the exp bias must stay finite): three VectorE ops on
  all columns at once.
* ``neg_delta = dlse - rowsum(dO * O)`` (= -delta), per query group (``per`` tiles) by
  :func:`group_stats` when the pass first loads the group (its O and dO rows, one DMA in the
  row-group layout, prefetched by :func:`prefetch_group`): VectorE product, row sums and
  subtract -- one engine, so no other in-order engine queue of the pipeline waits on the chain.
  Without dlse (None: no gradient reaches lse) the row sums are negated in the reduce itself.
  Stored negated so the main loop subtracts delta as the bias of its ScalarE eviction of dP.
* ``lo``, ``hi``: the visible-key interval of the row (the host's per-row key bounds: causal,
  window, documents and key padding together), one DMA per (b, h) from the partition-major
  layout ``tiles.bounds_layout`` by :func:`head_start`; only with those bounds: causal/window
  masks alone need no per-row data
* ``dsinks[h] = sum_{b,i} exp(sink_h - lse_i) * neg_delta_i`` (:func:`head_finish`, after the
  groups no pair needed): ScalarE exp, VectorE product and row reduce into a per-partition
  accumulator; :func:`finish` sums across partitions with a ones-vector matmul on TensorE.
  Without sinks, dsinks is zero-filled (:func:`start`).

lse and dlse (when given) arrive per (h, b) as contiguous rows of up to pmax query tiles per DMA, put on
partitions by TensorE transposes. Rows past Sq hold 0 (zero rows of the row-group copies,
zero-filled lse/dlse columns). The statistics never leave SBUF.

Output (SBUF, per (b, h)): stats (pmax, NT, NSTAT) fp32: [p, t, s] = statistic s of row
t * pmax + p.

Shapes: od_rows (B, Hq, NG, pmax, 3, per, D) (Q, dO and O rows, ``flash_attention_bwd.query_rows``; phase 0
reads dO and O, the main loop takes Q and dO from the same tile), or (.., 2, per, D) (dO and O:
loaded into channels 1 and 2 of the same (pmax, 3, per, D) tile, whose channel 0 the main loop
fills with TensorE transposes of Q^T, ``flash_attention_bwd_groups.fill_q_rows``); lse (B, Hq, Sq) fp32, dlse
the same or None; sinks (Hq,) fp32; doc (B, pmax, NT, 2) fp32 per-row key bounds [lo, hi]
(``tiles.bounds_layout``) or None.
Dimension legend: B batch, Hq query heads, Sq query length, D head dim, NT = ceil(Sq / pmax),
NG query groups of ``per`` tiles, NSTAT statistics per row (2, or 4 with key bounds).
Limits: one pass over dO and O; SBUF (pmax, NT) fp32 columns (a few per head).
"""

from __future__ import annotations

import numpy as np

from nki_lib._nki import nisa, nl

FP32_MAX = float(np.finfo(np.float32).max)

# statistic channels of stats_hbm
NEG_LSE = 0
NEG_DELTA = 1
LO = 2
HI = 3


def num_stats(with_documents):
    return HI + 1 if with_documents else NEG_DELTA + 1


def _group_neg_delta(prep, hs, gid):
    """stats[:, group tiles, NEG_DELTA] = dlse - rowsum(dO * O) of one query group: its O and dO
    rows (one DMA, prefetched), then three VectorE ops (product, row sums, subtract) -- one
    engine, so no other engine's in-order queue waits on this chain inside the pipeline."""
    pmax = nl.tile_size.pmax
    per, head_dim = prep.od_rows.shape[5], prep.od_rows.shape[6]
    t0, t1 = gid * per, min(hs.stats_sb.shape[1], (gid + 1) * per)
    prefetch_group(prep, hs, gid)
    od_grp = hs.od.pop(gid)
    prod_sb = nl.ndarray((pmax, per, head_dim), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=prod_sb, data1=od_grp[:, 2, :, :], data2=od_grp[:, 1, :, :], op=nl.multiply)
    if hs.dlse_cols is None:   # no gradient through lse: -rowsum in one negated reduce
        nisa.tensor_reduce(dst=hs.stats_sb[:, t0:t1, NEG_DELTA], op=nl.add, data=prod_sb[:, :t1 - t0, :], axis=2,
                           negate=True)
        return
    rowsum_sb = nl.ndarray((pmax, per), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=rowsum_sb, op=nl.add, data=prod_sb, axis=2)
    nisa.tensor_tensor(dst=hs.stats_sb[:, t0:t1, NEG_DELTA], data1=hs.dlse_cols[:, t0:t1],
                       data2=rowsum_sb[:, :t1 - t0], op=nl.subtract)


def _neg_lse(stats_sb, lse_cols, zeros_sb):
    """stats_sb[:, :, NEG_LSE] = -lse, 0 where lse = -inf."""
    pmax = nl.tile_size.pmax
    num_q_tiles = stats_sb.shape[1]
    nisa.tensor_scalar(dst=stats_sb[:, :, NEG_LSE], data=lse_cols, op0=nl.multiply, operand0=-1.0)
    empty_sb = nl.ndarray((pmax, num_q_tiles), dtype=nl.uint8, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=empty_sb, data=lse_cols, op0=nl.less, operand0=-FP32_MAX)
    nisa.tensor_copy_predicated(dst=stats_sb[:, :, NEG_LSE], src=zeros_sb, predicate=empty_sb)


def _dsink_partial(acc_sb, lse_cols, stats_sb, sink_sb):
    """acc_sb += rowsum(exp(sink - lse) * neg_delta) over the head's columns (ScalarE exp, VectorE
    product and reduce, VectorE add)."""
    pmax = nl.tile_size.pmax
    num_q_tiles = stats_sb.shape[1]
    p_sink = nl.ndarray((pmax, num_q_tiles), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=p_sink, op=nl.exp, data=lse_cols, scale=-1.0, bias=sink_sb)
    weighted = nl.ndarray((pmax, num_q_tiles), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=weighted, data1=p_sink, data2=stats_sb[:, :, NEG_DELTA], op=nl.multiply)
    part_sb = nl.ndarray((pmax, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=part_sb, op=nl.add, data=weighted, axis=1)
    nisa.tensor_tensor(dst=acc_sb, data1=acc_sb, data2=part_sb, op=nl.add)


def _store_dsink(dsinks, h, acc_sb, ones_sb):
    """dsinks[h] = sum over partitions of acc_sb (ones-vector matmul on TensorE)."""
    total_psum = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=total_psum, stationary=acc_sb, moving=ones_sb, accumulate=False)
    total_sb = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=total_sb, src=total_psum, engine=nisa.engine.scalar)
    nisa.dma_copy(dst=dsinks[h:h + 1], src=total_sb)


def _columns(vec, seqlen_q):
    """``(pmax, NT)`` fp32 with ``[p, t] = vec[t * pmax + p]`` (0 past the end), from contiguous
    row loads of up to pmax query tiles per DMA turned around by TensorE transposes."""
    pmax = nl.tile_size.pmax
    num_tiles = (seqlen_q + pmax - 1) // pmax
    cols_sb = nl.ndarray((pmax, num_tiles), dtype=nl.float32, buffer=nl.sbuf)
    for c0 in range(0, num_tiles, pmax):
        cn = min(pmax, num_tiles - c0)
        nfull = min(cn, seqlen_q // pmax - c0)
        rows_sb = nl.ndarray((pmax, pmax), dtype=nl.float32, buffer=nl.sbuf)
        if nfull < cn:
            nisa.memset(dst=rows_sb[:cn, :], value=0.0)
        if nfull > 0:
            nisa.dma_copy(dst=rows_sb[:nfull, :], src=vec[c0 * pmax:(c0 + nfull) * pmax])
        if nfull < cn:
            tail = seqlen_q - (c0 + nfull) * pmax
            nisa.dma_copy(dst=rows_sb[nfull:cn, :tail], src=vec[(c0 + nfull) * pmax:seqlen_q])
        t_psum = nl.ndarray((pmax, pmax), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_transpose(dst=t_psum[:, :cn], data=rows_sb[:cn, :], engine=nisa.engine.tensor)
        nisa.tensor_copy(dst=cols_sb[:, c0:c0 + cn], src=t_psum[:, :cn], engine=nisa.engine.vector)
    return cols_sb


class Prep(nl.NKIObject):
    """Phase-0 context of one kernel launch: constant tiles and, with sinks, the per-head sink value
    and dsinks partial sums (summed over the batch, stored by :func:`finish`)."""

    def __init__(self, od_rows, dlse, lse, sinks, doc, mask, num_stats):
        self.od_rows = od_rows
        self.dlse = dlse
        self.lse = lse
        self.sinks = sinks
        self.key_bounds = doc
        self.mask = mask
        self.num_stats = num_stats
        self.zeros_sb = None
        self.ones_sb = None
        self.sink_acc = {}


def start(prep, dsinks, heads, zero_dsinks):
    """Constant tiles and dsinks accumulators for the query ``heads`` of this program;
    ``zero_dsinks``: write the whole dsinks with zeros (no sinks; one program does it)."""
    pmax = nl.tile_size.pmax
    num_heads, seqlen_q = prep.lse.shape[1], prep.lse.shape[2]
    prep.zeros_sb = nl.ndarray((pmax, (seqlen_q + pmax - 1) // pmax), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=prep.zeros_sb, value=0.0)
    if zero_dsinks:
        zero_row = nl.ndarray((1, num_heads), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=zero_row, value=0.0)
        nisa.dma_copy(dst=dsinks, src=zero_row)
    if prep.sinks is not None:
        prep.ones_sb = nl.ndarray((pmax, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=prep.ones_sb, value=1.0)
        for h in heads:
            sink_sb = nl.ndarray((pmax, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=sink_sb, src=prep.sinks.ap([[0, pmax], [1, 1]], offset=h))
            acc_sb = nl.ndarray((pmax, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.memset(dst=acc_sb, value=0.0)
            prep.sink_acc[h] = (sink_sb, acc_sb)


class HeadStats(nl.NKIObject):
    """Statistics of one (batch b, query head h): ``stats_sb`` (pmax, NT, NSTAT) fp32 in SBUF, the
    lse/dlse columns, the query groups whose rows are done and the O/dO rows in flight."""

    def __init__(self, b: int, h: int, stats_sb, lse_cols, dlse_cols):
        self.b = b
        self.h = h
        self.stats_sb = stats_sb
        self.lse_cols = lse_cols
        self.dlse_cols = dlse_cols
        self.done = set()
        self.od = {}


def head_start(prep, b, h):
    """Start the statistics of (b, h): the lse/dlse columns and -lse of every row; the per-group
    rows follow on demand (:func:`group_stats`)."""
    pmax = nl.tile_size.pmax
    seqlen_q = prep.lse.shape[2]
    num_q_tiles = (seqlen_q + pmax - 1) // pmax
    stats_sb = nl.ndarray((pmax, num_q_tiles, prep.num_stats), dtype=nl.float32, buffer=nl.sbuf)
    if prep.num_stats > LO:   # per-row key bounds of every row (rows past Sq see none): one DMA
        bounds_sb = nl.ndarray((pmax, num_q_tiles, 2), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=bounds_sb, src=prep.key_bounds[b])     # (contiguous: one run per partition)
        nisa.tensor_copy(dst=stats_sb[:, :, LO:HI + 1], src=bounds_sb, engine=nisa.engine.gpsimd)
    lse_cols = _columns(prep.lse[b, h], seqlen_q)
    dlse_cols = None if prep.dlse is None else _columns(prep.dlse[b, h], seqlen_q)
    _neg_lse(stats_sb, lse_cols, prep.zeros_sb)
    return HeadStats(b, h, stats_sb, lse_cols, dlse_cols)


def prefetch_group(prep, hs, gid):
    """Issue the DMA of query group ``gid``'s Q, dO and O rows (once), ahead of
    :func:`group_stats`; returns the rows tile ``(pmax, 3, per, D)`` while the group's statistics
    are pending (the main loop takes its Q and dO rows from it), else None."""
    if gid in hs.done:
        return None
    if gid not in hs.od:
        per, head_dim = prep.od_rows.shape[5], prep.od_rows.shape[6]
        rows_sb = nl.ndarray((nl.tile_size.pmax, 3, per, head_dim), dtype=prep.od_rows.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=rows_sb[:, 3 - prep.od_rows.shape[4]:, :, :], src=prep.od_rows[hs.b, hs.h, gid])
        hs.od[gid] = rows_sb
    return hs.od[gid]


def group_stats(prep, hs, gid):
    """The per-row statistics of query group ``gid`` of ``hs`` (once): -delta. The main loop calls
    it when it loads the group's rows, so phase 0 runs interleaved with the pass, ahead of the
    pairs that need it."""
    if gid in hs.done:
        return
    _group_neg_delta(prep, hs, gid)
    hs.done.add(gid)


def head_finish(prep, hs):
    """The groups no pair needed (dsinks still counts their rows), then the head's dsinks partial
    sums."""
    for gid in range(prep.od_rows.shape[2]):
        group_stats(prep, hs, gid)
    if prep.sinks is not None:
        sink_sb, acc_sb = prep.sink_acc[hs.h]
        _dsink_partial(acc_sb, hs.lse_cols, hs.stats_sb, sink_sb)


def finish(prep, dsinks):
    """dsinks of this program's heads (with sinks), once every batch added its partial sums."""
    for h, (_, acc_sb) in prep.sink_acc.items():
        _store_dsink(dsinks, h, acc_sb, prep.ones_sb)
