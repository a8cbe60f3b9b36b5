"""The cost model on traces recorded by the simulator (end to end)."""

import numpy as np
import pytest

from nki_lib.simulator import isa as nisa
from nki_lib.simulator import jit, last_run, recording, simulate
from nki_lib.simulator import language as nl
from nki_lib.simulator.profile import OpCost, estimate

PMAX = nl.tile_size.pmax
NMAX = nl.tile_size.gemm_moving_fmax


def _matmul_kernel(a_t, b):
    """c[M, N] = a_t[K, M].T @ b[K, N] for K = M = 128, N = 512 * n_tiles: one load of a_t,
    then per N tile: load b, matmul into PSUM, evict on VectorE, store."""
    k, m = a_t.shape
    n = b.shape[1]
    out = nl.ndarray((m, n), dtype=nl.float32, buffer=nl.shared_hbm)
    a_sb = nl.ndarray((k, m), dtype=a_t.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=a_sb, src=a_t)
    for j in range(n // NMAX):
        b_sb = nl.ndarray((k, NMAX), dtype=b.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=b_sb, src=b[:, j * NMAX:(j + 1) * NMAX])
        c_psum = nl.ndarray((m, NMAX), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=c_psum, stationary=a_sb, moving=b_sb)
        c_sb = nl.ndarray((m, NMAX), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=c_sb, src=c_psum)
        nisa.dma_copy(dst=out[:, j * NMAX:(j + 1) * NMAX], src=c_sb)
    return out


MATMUL = jit(_matmul_kernel)


def _run(n_tiles):
    rng = np.random.default_rng(0)
    a_t = rng.standard_normal((PMAX, PMAX), dtype=np.float32)
    b = rng.standard_normal((PMAX, NMAX * n_tiles), dtype=np.float32)
    simulate(MATMUL)(a_t, b)
    return last_run()


@pytest.mark.parametrize("target", ["trn2", "trn3"])
def test_estimate_of_a_simulated_kernel(target):
    report = _run(4)
    est = estimate(report, target)
    assert sum(est.instructions.values()) == report.instructions
    assert est.instructions["tensor"] == 4 and est.instructions["dma"] == 1 + 4 * 2
    assert est.lower_bound_ns <= est.time_ns <= est.upper_bound_ns
    assert est.unmodelled == {}
    assert est.kernel == report.kernel and est.grid == 1
    # fp32 matmuls (4x rate) of 128x128x512 but 256 KiB of fp32 DMA per tile: DMA-bound
    assert est.critical_engine == "dma"
    cost = OpCost(flops=2.0 * PMAX * PMAX * NMAX * 4, hbm_bytes=4.0 * (PMAX * PMAX + 2 * PMAX * NMAX * 4),
                  pe_dtype="float32")
    assert 0 < est.roofline_fraction(cost) <= 1


def test_more_tiles_cost_more():
    small, big = _run(2), _run(4)
    assert estimate(big, "trn2").time_ns > estimate(small, "trn2").time_ns
    # 2 KiB rows sit at the per-chunk floor on both targets (docs/cost-model.md §2.6), so trn3 is not slower
    assert estimate(big, "trn3").busy_ns["dma"] <= estimate(big, "trn2").busy_ns["dma"]


def test_estimate_needs_the_trace():
    rng = np.random.default_rng(0)
    with recording(False):
        simulate(MATMUL)(rng.standard_normal((PMAX, PMAX), dtype=np.float32),
                         rng.standard_normal((PMAX, NMAX), dtype=np.float32))
    with pytest.raises(ValueError, match="trace"):
        estimate(last_run())


def _row_tiles_kernel(s, m, tiled):
    """Two independent 64-row matmuls (each over its own half of the partitions), on the two PE row
    tiles (``tiled``) or on the whole array; one eviction each and one store."""
    half = PMAX // 2
    s_sb = nl.ndarray(s.shape, dtype=s.dtype, buffer=nl.sbuf)
    m_sb = nl.ndarray(m.shape, dtype=m.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=s_sb, src=s)
    nisa.dma_copy(dst=m_sb, src=m)
    out = nl.ndarray((2, s.shape[1], m.shape[1]), dtype=nl.float32, buffer=nl.shared_hbm)
    for i in range(2):
        rows = slice(i * half, (i + 1) * half)
        tiling = dict(tile_position=(i * half, 0), tile_size=(half, PMAX)) if tiled else {}
        acc_psum = nl.ndarray((s.shape[1], m.shape[1]), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=acc_psum, stationary=s_sb[rows], moving=m_sb[rows], **tiling)
        acc_sb = nl.ndarray(acc_psum.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=acc_sb, src=acc_psum)
        nisa.dma_copy(dst=out[i], src=acc_sb)
    return out


def test_simulated_row_tiles_are_recorded_and_overlap():
    rng = np.random.default_rng(0)
    s = rng.standard_normal((PMAX, PMAX)).astype(nl.bfloat16)
    m = rng.standard_normal((PMAX, NMAX)).astype(nl.bfloat16)
    runs, outs = {}, {}
    for tiled in (False, True):
        outs[tiled] = np.asarray(simulate(jit(_row_tiles_kernel))(s, m, tiled))
        runs[tiled] = last_run()
    np.testing.assert_array_equal(outs[True], outs[False])
    tiles = [e.attrs.get("tile") for e in runs[True].trace if e.engine == "tensor"]
    assert tiles == [(0, PMAX // 2, 0, PMAX), (PMAX // 2, PMAX // 2, 0, PMAX)]
    assert all(e.attrs.get("tile") is None for e in runs[False].trace if e.engine == "tensor")
    whole, tiled = (estimate(runs[t], "trn2", keep_timeline=True) for t in (False, True))
    pe = {t: [(start, end) for _, engine, _, start, end, _ in est.timeline if engine == "tensor"]
          for t, est in ((False, whole), (True, tiled))}
    # on the row tiles the second matmul starts with the first (both wait for the same loads);
    # on the whole array it starts when the first ends
    assert pe[True][1][0] == pytest.approx(pe[True][0][0])
    assert pe[False][1][0] == pytest.approx(pe[False][0][1])
    assert tiled.busy_ns["tensor"] < 0.6 * whole.busy_ns["tensor"]   # half the array each
