"""Phase 0 of the flash-attention backward kernel: per-row statistics and dsinks.

Called from ``bwd.flash_bwd_kernel`` (plain NKI helper functions, inlined at trace time).

Per (head h, batch b), on all NT query tiles at once (``(pmax, NT)`` columns, row t * pmax + p
on partition p, column t):

* ``neg_delta = dlse - rowsum(dO * O)`` (= -delta): per query group (``per`` tiles in the
  row-group layout, one DMA for O and dO) one VectorE product and ``per`` ScalarE row sums
  (``activation_reduce``); then one subtract for the head. Stored negated so the main loop
  subtracts delta as the bias of its ScalarE PSUM eviction of dP.
* ``neg_lse = -lse``, and 0 where ``lse = -inf`` (rows with no visible key and no sink: their
  probabilities are masked to 0 anyway; the exp bias must stay finite): three VectorE ops.
* ``lo``, ``hi``: the visible-key interval of the row (causal, window and document masks, from
  ``tiles.row_bounds``, per tile; only with documents: causal/window masks need no per-row data)
* ``dsinks[h] = sum_{b,i} exp(sink_h - lse_i) * neg_delta_i``: ScalarE exp, VectorE product and
  row reduce into a per-partition accumulator, one ones-vector matmul on TensorE for the
  cross-partition sum. Without sinks, dsinks is zero-filled.

lse and dlse arrive per (h, b) as contiguous rows of up to pmax query tiles per DMA, put on
partitions by TensorE transposes. Rows past Sq hold 0 (zero rows of the row-group copies,
zero-filled lse/dlse columns). The main loop calls :func:`head_stats` for the query heads of a
kv head right before their pass (after issuing the pass's first loads), so the statistics stay
on chip and this work overlaps the start of the pass.

Output (SBUF, per (b, h)): stats (pmax, NT, NSTAT) fp32: [p, t, s] = statistic s of row
t * pmax + p.

Shapes: od_rows (B, Hq, NG, pmax, per, 2, D) (O and dO, ``bwd.row_groups``); lse, dlse (B, Hq, Sq)
fp32; sinks (Hq,) fp32; doc (2, Sq).
Dimension legend: B batch, Hq query heads, Sq query length, D head dim, NT = ceil(Sq / pmax),
NG query groups of ``per`` tiles, NSTAT statistics per row (2, or 4 with documents).
Limits: one pass over dO and O; SBUF (pmax, NT) fp32 columns (a few per head).
"""

from __future__ import annotations

import numpy as np

from nki_lib._nki import nl, nisa
from nki_lib.attention.kernels import tiles

FP32_MAX = float(np.finfo(np.float32).max)

# statistic channels of stats_hbm
NEG_LSE = 0
NEG_DELTA = 1
LO = 2
HI = 3


def num_stats(with_documents):
    return HI + 1 if with_documents else NEG_DELTA + 1


def _neg_delta(stats_sb, od_rows, dlse_cols, b, h):
    """stats_sb[:, :, NEG_DELTA] = dlse - rowsum(dO * O): per group one DMA (O and dO rows), one
    VectorE product and a ScalarE row sum per tile."""
    pmax = nl.tile_size.pmax
    _, _, num_groups, _, per, _, head_dim = od_rows.shape
    num_q_tiles = stats_sb.shape[1]
    rowsum_sb = nl.ndarray((pmax, num_groups * per), dtype=nl.float32, buffer=nl.sbuf)
    for g in nl.sequential_range(num_groups):
        od_grp = nl.ndarray((pmax, per, 2, head_dim), dtype=od_rows.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=od_grp, src=od_rows[b, h, g])
        prod_sb = nl.ndarray((pmax, per, head_dim), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=prod_sb, data1=od_grp[:, :, 1, :], data2=od_grp[:, :, 0, :], op=nl.multiply)
        for slot in range(per):  # the row sums on ScalarE (idle while phase 0 runs; VectorE is not)
            nisa.activation_reduce(dst=prod_sb[:, slot, :], op=nl.copy, data=prod_sb[:, slot, :], reduce_op=nl.add,
                                   reduce_res=rowsum_sb[:, g * per + slot:g * per + slot + 1])
    nisa.tensor_tensor(dst=stats_sb[:, :, NEG_DELTA], data1=dlse_cols, data2=rowsum_sb[:, :num_q_tiles],
                       op=nl.subtract)


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
        self.doc_rows = (None, None) if doc is None else (doc[0], doc[1])
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


def head_stats(prep, b, h):
    """The statistics of (batch b, query head h) as an SBUF tile ``(pmax, NT, NSTAT)`` (kept on
    chip for the main loop); adds the head's dsinks partial sums."""
    pmax = nl.tile_size.pmax
    seqlen_q = prep.lse.shape[2]
    num_q_tiles = (seqlen_q + pmax - 1) // pmax
    lse_cols = _columns(prep.lse[b, h], seqlen_q)
    dlse_cols = _columns(prep.dlse[b, h], seqlen_q)
    stats_sb = nl.ndarray((pmax, num_q_tiles, prep.num_stats), dtype=nl.float32, buffer=nl.sbuf)
    _neg_delta(stats_sb, prep.od_rows, dlse_cols, b, h)
    _neg_lse(stats_sb, lse_cols, prep.zeros_sb)
    if prep.num_stats > LO:
        if seqlen_q % pmax:
            nisa.memset(dst=stats_sb[:, num_q_tiles - 1, LO:], value=0.0)
        for t in nl.sequential_range(num_q_tiles):
            q0 = t * pmax
            rows = min(pmax, seqlen_q - q0)
            lo_sb, hi_sb = tiles.row_bounds(prep.mask, q0, rows, *prep.doc_rows)
            nisa.tensor_copy(dst=stats_sb[:rows, t, LO], src=lo_sb, engine=nisa.engine.vector)
            nisa.tensor_copy(dst=stats_sb[:rows, t, HI], src=hi_sb, engine=nisa.engine.vector)
    if prep.sinks is not None:
        sink_sb, acc_sb = prep.sink_acc[h]
        _dsink_partial(acc_sb, lse_cols, stats_sb, sink_sb)
    return stats_sb


def finish(prep, dsinks):
    """dsinks of this program's heads (with sinks), once every batch added its partial sums."""
    for h, (_, acc_sb) in prep.sink_acc.items():
        _store_dsink(dsinks, h, acc_sb, prep.ones_sb)
