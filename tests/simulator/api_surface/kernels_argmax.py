"""Row-wise maximum and its first position, chunk by chunk (written for this project).

``row_argmax(x, config)``: for x (R, V) fp32 returns ``values (1, R)`` fp32 (the row maxima) and
``positions (1, R)`` int32 (the first column holding that maximum), both as row vectors.
Dimension legend: R rows, V columns, W = ``config.chunk`` columns per step, n = programs (LNC).

Algorithm: program i owns rows [i * R / n, (i + 1) * R / n) (one partition each). For every chunk
of W columns the chunk is DMA'd through an explicit ``.ap()`` pattern (``dge_mode.hwdge`` when
``config.hardware_dge``); a narrower last chunk is padded by ``affine_select`` (columns past the
end become -FLT_MAX). ``max8`` finds the chunk maximum, ``nc_find_index8`` its first position;
a running (best value, best position) pair is updated with a strict ``greater`` test, so earlier
chunks win ties. Finally both (rows, 1) columns are turned into (1, rows) rows on the Tensor
engine in transpose mode (``is_transpose=True``) against an identity built with ``iota`` and an
``equal`` test. ``config`` is an ``ArgmaxConfig`` dataclass (``nl.NKIObject``) passed as a kernel
argument. Limits: R / n <= pmax, 8 <= W <= 16384, values finite, V < 2**24.

``reduce_middle_axis(x)`` is a deliberately wrong kernel: ``tensor_reduce(axis=1)`` on a 3-D tile
(the reduced axes must be the trailing free axes since NKI 0.3), which the simulator must refuse.
"""

from dataclasses import dataclass

import nki
import nki.isa as nisa
import nki.language as nl

LOWEST_FP32 = -3.4028234663852886e38


@dataclass
class ArgmaxConfig(nl.NKIObject):
    """Compile-time options of ``row_argmax``."""

    chunk: int = 512
    hardware_dge: bool = True


def _load_chunk(x, row0, rows, col0, width, config):
    """(rows, chunk) fp32 tile holding x[row0:row0 + rows, col0:col0 + width], padded with -FLT_MAX."""
    n_cols = x.shape[1]
    chunk_sb = nl.ndarray((rows, config.chunk), dtype=nl.float32, buffer=nl.sbuf)
    if width < config.chunk:
        nisa.memset(dst=chunk_sb, value=0.0)
    dge = nisa.dge_mode.hwdge if config.hardware_dge else nisa.dge_mode.unknown
    src = x.ap([[n_cols, rows], [1, width]], offset=row0 * n_cols + col0)
    nisa.dma_copy(dst=chunk_sb[:, 0:width], src=src, dge_mode=dge)
    if width < config.chunk:
        # keep column j while (width - 1) - j >= 0
        nisa.affine_select(dst=chunk_sb, pattern=[[-1, config.chunk]], channel_multiplier=0,
                           on_true_tile=chunk_sb, on_false_value=LOWEST_FP32, cmp_op=nl.greater_equal,
                           offset=width - 1)
    return chunk_sb


def _column_to_row(col_sb, eye_sb, dtype):
    """(rows, 1) fp32 column -> (1, rows) SBUF row of ``dtype`` via the transpose mode of TensorE."""
    rows = col_sb.shape[0]
    row_psum = nl.ndarray((1, rows), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=row_psum, stationary=col_sb, moving=eye_sb, is_transpose=True)
    row_sb = nl.ndarray((1, rows), dtype=dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=row_sb, src=row_psum)
    return row_sb


def _identity(rows):
    eye_sb = nl.ndarray((rows, rows), dtype=nl.float32, buffer=nl.sbuf)
    nisa.iota(dst=eye_sb, pattern=[[1, rows]], offset=0, channel_multiplier=-1)      # column - partition
    nisa.tensor_scalar(dst=eye_sb, data=eye_sb, op0=nl.equal, operand0=0.0)
    return eye_sb


@nki.jit
def row_argmax(x, config):
    n_rows, n_cols = x.shape
    n_prog = nl.num_programs(axes=0)
    rows = n_rows // n_prog
    row0 = nl.program_id(axis=0) * rows
    values = nl.ndarray((1, n_rows), dtype=nl.float32, buffer=nl.shared_hbm)
    positions = nl.ndarray((1, n_rows), dtype=nl.int32, buffer=nl.shared_hbm)

    best_sb = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    best_pos_sb = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=best_sb, value=LOWEST_FP32)
    nisa.memset(dst=best_pos_sb, value=0.0)
    for col0 in range(0, n_cols, config.chunk):
        chunk_sb = _load_chunk(x, row0, rows, col0, min(config.chunk, n_cols - col0), config)
        top_sb = nl.ndarray((rows, 8), dtype=nl.float32, buffer=nl.sbuf)
        nisa.max8(dst=top_sb, src=chunk_sb)
        where_sb = nl.ndarray((rows, 8), dtype=nl.uint32, buffer=nl.sbuf)
        nisa.nc_find_index8(dst=where_sb, data=chunk_sb, vals=top_sb)
        pos_sb = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=pos_sb, data=where_sb[:, 0:1], op0=nl.add, operand0=float(col0))
        wins_sb = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=wins_sb, data1=top_sb[:, 0:1], data2=best_sb, op=nl.greater)
        nisa.tensor_tensor(dst=best_sb, data1=best_sb, data2=top_sb[:, 0:1], op=nl.maximum)
        step_sb = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=step_sb, data1=pos_sb, data2=best_pos_sb, op=nl.subtract)
        nisa.tensor_tensor(dst=step_sb, data1=step_sb, data2=wins_sb, op=nl.multiply)
        nisa.tensor_tensor(dst=best_pos_sb, data1=best_pos_sb, data2=step_sb, op=nl.add)

    eye_sb = _identity(rows)
    nisa.dma_copy(dst=values[:, nl.ds(row0, rows)], src=_column_to_row(best_sb, eye_sb, nl.float32))
    nisa.dma_copy(dst=positions[:, nl.ds(row0, rows)], src=_column_to_row(best_pos_sb, eye_sb, nl.int32))
    return values, positions


@nki.jit
def reduce_middle_axis(x):
    rows, groups, width = x.shape
    x_sb = nl.ndarray((rows, groups, width), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=x_sb, src=x)
    red_sb = nl.ndarray((rows, width), dtype=x.dtype, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=red_sb, op=nl.maximum, data=x_sb, axis=1)  # rejected: not a trailing axis
    out = nl.ndarray((rows, width), dtype=x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=red_sb)
    return out
