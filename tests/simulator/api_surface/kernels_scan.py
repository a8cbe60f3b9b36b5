"""Discounted running sum along the last axis (written for this project).

``discounted_running_sum(x, decay, chunk)``: for x (..., L), out[..., i] = x[..., i] + decay *
out[..., i - 1] (out[..., 0] = x[..., 0]); decay = 1.0 is the plain cumulative sum.
Dimension legend: R = prod(leading dims) rows, L scanned length, P = pmax rows per tile,
W = chunk columns per scan instruction.

Algorithm: the HBM input and output are viewed as (R, L) with ``.reshape``. Per row tile of up to
P rows (Python loop), the L axis is walked in chunks of W columns (``nl.sequential_range``: each
chunk depends on the previous one). One ``tensor_tensor_scan`` per chunk computes
r_i = (decay_i * r_{i-1}) + x_i, seeded with the carry of the previous chunk (zero for the first).
The carry, its row count and the decay tile travel together in a ``ScanState`` (an
``nl.NKIObject`` built by keyword, holding tiles). Limits: x float, L >= 1, W <= L is not required
(the last chunk is narrower).
"""

import nki
import nki.isa as nisa
import nki.language as nl


class ScanState(nl.NKIObject):
    """Per row tile: (rows, 1) fp32 carry, its row count, and the (rows, W) decay coefficients."""

    rows: int
    carry_sb: object
    decay_sb: object


def _fresh_state(rows, width, decay):
    carry_sb = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=carry_sb, value=0.0)
    decay_sb = nl.ndarray((rows, width), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=decay_sb, value=decay)
    return ScanState(rows=rows, carry_sb=carry_sb, decay_sb=decay_sb)


def _scan_chunk(state, x_flat, out_flat, row0, col0, width):
    """Scan columns [col0, col0 + width) of one row tile and advance the carry."""
    rows = state.rows
    x_sb = nl.ndarray((rows, width), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=x_sb, src=x_flat[nl.ds(row0, rows), nl.ds(col0, width)])
    run_sb = nl.ndarray((rows, width), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor_scan(dst=run_sb, data0=state.decay_sb[:, 0:width], data1=x_sb,
                            initial=state.carry_sb, op0=nl.multiply, op1=nl.add)
    nisa.tensor_copy(dst=state.carry_sb, src=run_sb[:, width - 1:width])
    res_sb = nl.ndarray((rows, width), dtype=out_flat.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=res_sb, src=run_sb)
    nisa.dma_copy(dst=out_flat[nl.ds(row0, rows), nl.ds(col0, width)], src=res_sb)


@nki.jit
def discounted_running_sum(x, decay, chunk):
    length = x.shape[-1]
    n_rows = x.size // length
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    x_flat = x.reshape((n_rows, length))
    out_flat = out.reshape((n_rows, length))
    pmax = nl.tile_size.pmax
    width = min(chunk, length)
    n_chunks = (length + width - 1) // width
    for row0 in range(0, n_rows, pmax):
        state = _fresh_state(min(pmax, n_rows - row0), width, decay)
        for c in nl.sequential_range(n_chunks):
            col0 = c * width
            _scan_chunk(state, x_flat, out_flat, row0, col0, min(width, length - col0))
    return out
