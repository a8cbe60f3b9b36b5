"""Phase 0 of the flash-attention backward kernel: per-row statistics and dsinks.

Called from ``bwd.flash_bwd_kernel`` (plain NKI helper functions, inlined at trace time).

Per (head h, batch b, query tile t of R <= pmax rows):

* ``delta = rowsum(dO * O) - dlse``                      VectorE (multiply, reduce, subtract)
* ``neg_lse = -lse``, and 0 where ``lse = -inf``         VectorE (rows with no visible key and no
  sink: their probabilities are masked to 0 anyway; the exp bias must stay finite)
* ``lo``, ``hi``: the visible-key interval of the row (causal, window and document masks, from
  ``tiles.row_bounds``; only with documents: causal/window masks need no per-row data)
* ``dsinks[h] = -sum_{b,i} exp(sink_h - lse_i) * delta_i``: per-partition partial sums on
  ScalarE (exp) and VectorE (fused multiply-add), one ones-vector matmul on TensorE for the
  cross-partition sum. Without sinks, dsinks is zero-filled.

DMAs: O and dO per query tile; lse and dlse per (h, b) as contiguous rows of up to pmax query
tiles, put on partitions by TensorE transposes; the statistics leave once per (h, b).

Output layout (private HBM scratch, read by the main loop):
  stats_hbm (B, Hq, pmax, NT, NSTAT) fp32: [b, h, p, t, s] = statistic s of row t * pmax + p
  (rows past Sq hold 0), so the main loop loads all statistics of a head with one DMA.

Shapes: dout, out (B, Hq, Sq, D); lse, dlse (B, Hq, Sq) fp32; sinks (Hq,) fp32; doc (2, Sq).
Dimension legend: B batch, Hq query heads, Sq query length, D head dim, NT = ceil(Sq / pmax),
R rows of the current query tile, NSTAT statistics per row (2, or 4 with documents).
Limits: one pass over dO and O; the per-row work is tiny next to the main loop.
"""

from __future__ import annotations

import numpy as np

from nki_lib._nki import nl, nisa
from nki_lib.attention.kernels import tiles

FP32_MAX = float(np.finfo(np.float32).max)

# statistic channels of stats_hbm
NEG_LSE = 0
DELTA = 1
LO = 2
HI = 3


def num_stats(with_documents):
    return HI + 1 if with_documents else DELTA + 1


def _row_stats(stat_sb, o_sb, do_sb, lse_sb, dlse_sb, zero_col, rows, head_dim):
    """stat_sb[:R, NEG_LSE] and stat_sb[:R, DELTA] from one query tile."""
    prod_sb = nl.ndarray(o_sb.shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=prod_sb[:rows, :head_dim], data1=do_sb[:rows, :head_dim],
                       data2=o_sb[:rows, :head_dim], op=nl.multiply)
    rowsum_sb = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=rowsum_sb, op=nl.add, data=prod_sb[:rows, :head_dim], axis=1)
    nisa.tensor_tensor(dst=stat_sb[:rows, DELTA], data1=rowsum_sb, data2=dlse_sb[:rows, :], op=nl.subtract)
    nisa.tensor_scalar(dst=stat_sb[:rows, NEG_LSE], data=lse_sb[:rows, :], op0=nl.multiply, operand0=-1.0)
    empty_row = nl.ndarray((rows, 1), dtype=nl.uint8, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=empty_row, data=lse_sb[:rows, :], op0=nl.less, operand0=-FP32_MAX)
    nisa.tensor_copy_predicated(dst=stat_sb[:rows, NEG_LSE], src=zero_col[:rows, :], predicate=empty_row)


def _dsink_partial(acc_sb, lse_sb, stat_sb, sink_sb, rows):
    """acc_sb[:R] += exp(sink - lse) * delta  (ScalarE exp, VectorE fused multiply-add)."""
    p_sink = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=p_sink, op=nl.exp, data=lse_sb[:rows, :], scale=-1.0, bias=sink_sb[:rows, :])
    nisa.scalar_tensor_tensor(dst=acc_sb[:rows, :], data=p_sink, op0=nl.multiply,
                              operand0=stat_sb[:rows, DELTA], op1=nl.add, operand1=acc_sb[:rows, :])


def _store_dsink(dsinks, h, acc_sb, ones_sb):
    """dsinks[h] = -sum over partitions of acc_sb (ones-vector matmul on TensorE)."""
    total_psum = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=total_psum, stationary=acc_sb, moving=ones_sb, accumulate=False)
    total_sb = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=total_sb, op=nl.copy, data=total_psum, scale=-1.0)
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


def prepare(dout, dlse, out, lse, sinks, doc, mask, dsinks, stats_hbm, heads, zero_dsinks):
    """Fill stats_hbm and dsinks for the query ``heads`` of this program (all of them under LNC1);
    ``zero_dsinks``: write the whole dsinks with zeros (no sinks; one program does it)."""
    batch, num_heads, seqlen_q, head_dim = out.shape
    pmax = nl.tile_size.pmax
    num_q_tiles = (seqlen_q + pmax - 1) // pmax
    nstat = stats_hbm.shape[-1]

    zero_col = nl.ndarray((pmax, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=zero_col, value=0.0)
    ones_sb = nl.ndarray((pmax, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=ones_sb, value=1.0)
    if zero_dsinks:
        zeros_sb = nl.ndarray((1, num_heads), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=zeros_sb, value=0.0)
        nisa.dma_copy(dst=dsinks, src=zeros_sb)

    doc_rows = (None, None) if doc is None else (doc[0], doc[1])
    for h in heads:
        if sinks is not None:
            sink_sb = nl.ndarray((pmax, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=sink_sb, src=sinks.ap([[0, pmax], [1, 1]], offset=h))
            acc_sb = nl.ndarray((pmax, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.memset(dst=acc_sb, value=0.0)
        for b in nl.sequential_range(batch):
            lse_cols = _columns(lse[b, h], seqlen_q)
            dlse_cols = _columns(dlse[b, h], seqlen_q)
            stats_sb = nl.ndarray((pmax, num_q_tiles, nstat), dtype=nl.float32, buffer=nl.sbuf)
            if seqlen_q % pmax:
                nisa.memset(dst=stats_sb, value=0.0)
            for t in nl.sequential_range(num_q_tiles):
                q0 = t * pmax
                rows = min(pmax, seqlen_q - q0)
                o_sb = nl.ndarray((pmax, head_dim), dtype=out.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=o_sb[:rows, :], src=out[b, h, q0:q0 + rows, :])
                do_sb = nl.ndarray((pmax, head_dim), dtype=dout.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=do_sb[:rows, :], src=dout[b, h, q0:q0 + rows, :])
                stat_sb = stats_sb[:, t, :]
                lse_col, dlse_col = lse_cols[:, t:t + 1], dlse_cols[:, t:t + 1]
                _row_stats(stat_sb, o_sb, do_sb, lse_col, dlse_col, zero_col, rows, head_dim)
                if nstat > LO:
                    lo_sb, hi_sb = tiles.row_bounds(mask, q0, rows, *doc_rows)
                    nisa.tensor_copy(dst=stat_sb[:rows, LO], src=lo_sb, engine=nisa.engine.vector)
                    nisa.tensor_copy(dst=stat_sb[:rows, HI], src=hi_sb, engine=nisa.engine.vector)
                if sinks is not None:
                    _dsink_partial(acc_sb, lse_col, stat_sb, sink_sb, rows)
            nisa.dma_copy(dst=stats_hbm[b, h], src=stats_sb)
        if sinks is not None:
            _store_dsink(dsinks, h, acc_sb, ones_sb)
