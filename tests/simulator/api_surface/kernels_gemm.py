"""Matrix products on the Tensor engine, three ways (written for this project).

All kernels compute ``out (M, N) = lhs_t.T @ rhs`` with the contraction K on the partition axis.
Dimension legend: K contraction, M output rows, N output columns; TK = pmax, TM =
gemm_stationary_fmax, TN = gemm_moving_fmax (all from ``nl.tile_size``).

* ``one_tile_product``: one TK x TM stationary, one TK x TN moving, one PSUM tile. The matmul is
  called with positional operands ``nc_matmul(dst, stationary, moving)``. Limits: K <= TK,
  M <= TM, N <= TN. Instructions: 2 loads, 1 matmul, 1 PSUM eviction, 1 store.
* ``column_panel_product``: loop N blocks (outer, ``affine_range``); the K panels of ``rhs`` for
  that column block are loaded once into a Python list of tiles and reused by every M block
  (inner). Each (n, m) output tile is a PSUM allocation made inside the loop body, so the
  default ``accumulate=None`` overwrites on the first K step and adds afterwards.
  Limits: K % TK == 0, M % TM == 0, N % TN == 0.
* ``flagged_accumulate_product``: one PSUM tile allocated before all loops and reused by every
  output tile; the first K step passes ``accumulate=False`` (restart the sum), later steps
  ``accumulate=True``. Same limits as above.
"""

import nki
import nki.isa as nisa
import nki.language as nl


def _load_block(src, row_blk, col_blk, rows, cols):
    """SBUF copy of block (row_blk, col_blk) of shape (rows, cols) of an HBM matrix."""
    block_sb = nl.ndarray((rows, cols), dtype=src.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=block_sb, src=src[nl.ds(row_blk * rows, rows), nl.ds(col_blk * cols, cols)])
    return block_sb


def _evict_and_store(out, acc_psum, row0, col0):
    """PSUM -> SBUF (fp32) -> out[row0:, col0:] for one output tile."""
    rows, cols = acc_psum.shape
    res_sb = nl.ndarray((rows, cols), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=res_sb, src=acc_psum)
    nisa.dma_copy(dst=out[nl.ds(row0, rows), nl.ds(col0, cols)], src=res_sb)


@nki.jit
def one_tile_product(lhs_t, rhs):
    k_dim, m_dim = lhs_t.shape
    _, n_dim = rhs.shape
    out = nl.ndarray((m_dim, n_dim), dtype=nl.float32, buffer=nl.shared_hbm)
    lhs_sb = nl.ndarray((k_dim, m_dim), dtype=lhs_t.dtype, buffer=nl.sbuf)
    rhs_sb = nl.ndarray((k_dim, n_dim), dtype=rhs.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=lhs_sb, src=lhs_t)
    nisa.dma_copy(dst=rhs_sb, src=rhs)
    acc_psum = nl.ndarray((m_dim, n_dim), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(acc_psum, lhs_sb, rhs_sb)
    _evict_and_store(out, acc_psum, 0, 0)
    return out


@nki.jit
def column_panel_product(lhs_t, rhs):
    k_dim, m_dim = lhs_t.shape
    _, n_dim = rhs.shape
    tk, tm, tn = nl.tile_size.pmax, nl.tile_size.gemm_stationary_fmax, nl.tile_size.gemm_moving_fmax
    out = nl.ndarray((m_dim, n_dim), dtype=nl.float32, buffer=nl.shared_hbm)
    for n_blk in nl.affine_range(n_dim // tn):
        rhs_panels = []
        for k_blk in nl.affine_range(k_dim // tk):
            rhs_panels.append(_load_block(rhs, k_blk, n_blk, tk, tn))
        for m_blk in nl.affine_range(m_dim // tm):
            acc_psum = nl.ndarray((tm, tn), dtype=nl.float32, buffer=nl.psum)
            for k_blk, panel_sb in enumerate(rhs_panels):
                nisa.nc_matmul(acc_psum, _load_block(lhs_t, k_blk, m_blk, tk, tm), panel_sb)
            _evict_and_store(out, acc_psum, m_blk * tm, n_blk * tn)
    return out


@nki.jit
def flagged_accumulate_product(lhs_t, rhs):
    k_dim, m_dim = lhs_t.shape
    _, n_dim = rhs.shape
    tk, tm, tn = nl.tile_size.pmax, nl.tile_size.gemm_stationary_fmax, nl.tile_size.gemm_moving_fmax
    out = nl.ndarray((m_dim, n_dim), dtype=nl.float32, buffer=nl.shared_hbm)
    acc_psum = nl.ndarray((tm, tn), dtype=nl.float32, buffer=nl.psum)
    for m_blk in nl.affine_range(m_dim // tm):
        for n_blk in nl.affine_range(n_dim // tn):
            for k_blk in nl.sequential_range(k_dim // tk):
                nisa.nc_matmul(dst=acc_psum, stationary=_load_block(lhs_t, k_blk, m_blk, tk, tm),
                               moving=_load_block(rhs, k_blk, n_blk, tk, tn), accumulate=k_blk > 0)
            _evict_and_store(out, acc_psum, m_blk * tm, n_blk * tn)
    return out
