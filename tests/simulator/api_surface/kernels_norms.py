"""Row normalisations on the Scalar and Vector engines (written for this project).

Dimension legend: R rows (tiles of up to P = pmax on partitions), F features (free axis).

* ``rms_norm_with_gain(x, gain, eps)``: y = x / sqrt(mean(x**2) + eps) * gain for x (R, F),
  gain (1, F). Sum of squares by ``activation_reduce`` (square, add-reduce); mean + eps in one
  two-operand ``tensor_scalar``; rsqrt on ScalarE; the scaling is ``activation(op=nl.copy)`` with
  the (rows, 1) rstd tile as ``scale``; the gain row is DMA'd to every partition once (stride-0
  partition pattern) and applied with ``tensor_tensor``. Limits: F * 4 bytes * 4 tiles fit SBUF.
* ``standardize_rows(x, eps)``: y = (x - mean) / sqrt(var + eps) (population variance). Each row
  tile's statistics come from ``bn_stats`` over chunks of ``bn_stats_fmax`` columns combined by
  ``bn_aggr``; rstd is ``activation(op=nl.rsqrt)`` with a (rows, 1) bias tile holding eps; the
  centring and scaling are one two-operand ``tensor_scalar`` with tile operands on VectorE.
"""

import nki
import nki.isa as nisa
import nki.language as nl


def _column(rows):
    return nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)


def _row_tiles(x):
    """(first row, row count) of each tile of up to pmax rows."""
    n_rows = x.shape[0]
    pmax = nl.tile_size.pmax
    return [(r0, min(pmax, n_rows - r0)) for r0 in range(0, n_rows, pmax)]


def _load_rows(x, r0, rows):
    x_sb = nl.ndarray((rows, x.shape[1]), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=x_sb, src=x[nl.ds(r0, rows), :])
    return x_sb


@nki.jit
def rms_norm_with_gain(x, gain, eps):
    n_rows, n_feat = x.shape
    out = nl.ndarray((n_rows, n_feat), dtype=x.dtype, buffer=nl.shared_hbm)
    tiles = _row_tiles(x)
    gain_sb = nl.ndarray((tiles[0][1], n_feat), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=gain_sb, src=gain.ap([[0, tiles[0][1]], [1, n_feat]], offset=0))
    for r0, rows in tiles:
        x_sb = _load_rows(x, r0, rows)
        squares_sb = nl.ndarray((rows, n_feat), dtype=nl.float32, buffer=nl.sbuf)
        total_sb = _column(rows)
        nisa.activation_reduce(dst=squares_sb, op=nl.square, data=x_sb, reduce_op=nl.add, reduce_res=total_sb)
        nisa.tensor_scalar(dst=total_sb, data=total_sb, op0=nl.multiply, operand0=1.0 / n_feat,
                           op1=nl.add, operand1=eps)
        rstd_sb = _column(rows)
        nisa.activation(dst=rstd_sb, op=nl.rsqrt, data=total_sb)
        y_sb = nl.ndarray((rows, n_feat), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=y_sb, op=nl.copy, data=x_sb, scale=rstd_sb)
        nisa.tensor_tensor(dst=y_sb, data1=y_sb, data2=gain_sb[0:rows, :], op=nl.multiply)
        nisa.dma_copy(dst=out[nl.ds(r0, rows), :], src=y_sb)
    return out


def _mean_and_variance(x_sb):
    """(rows, 2) fp32 [mean, variance] of each row via bn_stats chunks and bn_aggr."""
    rows, n_feat = x_sb.shape
    fmax = nl.tile_size.bn_stats_fmax
    starts = list(range(0, n_feat, fmax))
    stats_sb = nl.ndarray((rows, 6 * len(starts)), dtype=nl.float32, buffer=nl.sbuf)
    for j, c0 in enumerate(starts):
        nisa.bn_stats(dst=stats_sb[:, nl.ds(6 * j, 6)], data=x_sb[:, nl.ds(c0, min(fmax, n_feat - c0))])
    moments_sb = nl.ndarray((rows, 2), dtype=nl.float32, buffer=nl.sbuf)
    nisa.bn_aggr(dst=moments_sb, data=stats_sb)
    return moments_sb


@nki.jit
def standardize_rows(x, eps):
    n_rows, n_feat = x.shape
    out = nl.ndarray((n_rows, n_feat), dtype=x.dtype, buffer=nl.shared_hbm)
    for r0, rows in _row_tiles(x):
        x_sb = _load_rows(x, r0, rows)
        moments_sb = _mean_and_variance(x_sb)
        eps_sb = _column(rows)
        nisa.memset(dst=eps_sb, value=eps)
        rstd_sb = _column(rows)
        nisa.activation(dst=rstd_sb, op=nl.rsqrt, data=moments_sb[:, 1:2], bias=eps_sb)
        y_sb = nl.ndarray((rows, n_feat), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=y_sb, data=x_sb, op0=nl.subtract, operand0=moments_sb[:, 0:1],
                           op1=nl.multiply, operand1=rstd_sb, engine=nisa.vector_engine)
        nisa.dma_copy(dst=out[nl.ds(r0, rows), :], src=y_sb)
    return out
