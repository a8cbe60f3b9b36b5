"""Cost-model memory rules on simulated kernels: placed PSUM banks, aliasing of placed tiles.

* A PSUM tile placed with ``address=`` occupies the banks its byte range covers, nothing more
  (issue 10, cost model 1).
* Tiles placed at the same address share physical memory: a write to those bytes waits for the
  earlier reads (WAR) and writes (WAW) of the other tile; disjoint placements do not wait
  (issue 10, cost model 3).

Each test reads the per-instruction schedule (``keep_timeline=True``: ``(index, engine, opcode,
start, end, done)``) and checks an ordering, never a time.
"""

import numpy as np
import pytest

from nki_lib.simulator import isa as nisa
from nki_lib.simulator import jit, last_run, simulate
from nki_lib.simulator import language as nl
from nki_lib.simulator.profile import estimate, params

PMAX = nl.tile_size.pmax
NMAX = nl.tile_size.gemm_moving_fmax
BANK = params("trn2").psum_bank_bytes


def _two_placed_psum_tiles(a_t, b, bank_a, bank_b):
    """Two matmuls into PSUM tiles placed at banks ``bank_a`` and ``bank_b``, then both evicted."""
    out = nl.ndarray((2 * PMAX, NMAX), dtype=nl.float32, buffer=nl.shared_hbm)
    a_sb = nl.ndarray((PMAX, PMAX), dtype=a_t.dtype, buffer=nl.sbuf)
    b_sb = nl.ndarray((PMAX, NMAX), dtype=b.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=a_sb, src=a_t)
    nisa.dma_copy(dst=b_sb, src=b)
    acc_psums = [nl.ndarray((PMAX, NMAX), dtype=nl.float32, buffer=nl.psum, address=(0, bank * BANK))
                 for bank in (bank_a, bank_b)]
    for acc_psum in acc_psums:
        nisa.nc_matmul(dst=acc_psum, stationary=a_sb, moving=b_sb)
    for i, acc_psum in enumerate(acc_psums):
        c_sb = nl.ndarray((PMAX, NMAX), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=c_sb, src=acc_psum)
        nisa.dma_copy(dst=out[i * PMAX:(i + 1) * PMAX, :], src=c_sb)
    return out


TWO_PSUM = jit(_two_placed_psum_tiles)


def _timeline(report):
    return estimate(report, "trn2", keep_timeline=True).timeline


def _run_psum(bank_a, bank_b):
    rng = np.random.default_rng(0)
    a_t = rng.standard_normal((PMAX, PMAX)).astype(np.float32)
    b = rng.standard_normal((PMAX, NMAX)).astype(np.float32)
    simulate(TWO_PSUM)(a_t, b, bank_a, bank_b)
    return last_run()


@pytest.mark.parametrize("banks", [(6, 7), (0, 7), (3, 5)])
def test_placed_psum_tile_claims_only_its_banks(banks):
    """Two tiles on different banks: the second matmul starts when the first leaves TensorE
    (no bank conflict), not after the first tile's result is visible or evicted."""
    matmuls = [row for row in _timeline(_run_psum(*banks)) if row[2] == "nc_matmul"]
    assert len(matmuls) == 2
    first_end, second_start = matmuls[0][4], matmuls[1][3]
    assert second_start == pytest.approx(first_end)


def test_psum_tiles_placed_on_one_bank_alias():
    """Control: the same two tiles placed on ONE bank are the same bytes; the first eviction
    (after both matmuls in program order) reads what the second matmul wrote, so it waits for
    that result (RAW through the alias)."""
    rows = _timeline(_run_psum(7, 7))
    matmuls = [row for row in rows if row[2] == "nc_matmul"]
    evict_first = next(row for row in rows if row[2] == "tensor_copy")
    assert evict_first[3] >= matmuls[1][5] - 1e-6


def _aliased_sbuf(x, y, offset_b):
    """Load x into tile A placed at byte 0, copy A to C; then load y into tile B placed at byte
    ``offset_b`` and store B. With ``offset_b == 0`` A and B are the same physical bytes."""
    out_c = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    out_b = nl.ndarray(y.shape, dtype=y.dtype, buffer=nl.shared_hbm)
    tile_a = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf, address=(0, 0))
    nisa.dma_copy(dst=tile_a, src=x)
    tile_c = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=tile_c, src=tile_a)
    tile_b = nl.ndarray(y.shape, dtype=y.dtype, buffer=nl.sbuf, address=(0, offset_b))
    nisa.dma_copy(dst=tile_b, src=y)
    nisa.dma_copy(dst=out_c, src=tile_c)
    nisa.dma_copy(dst=out_b, src=tile_b)
    return out_c, out_b


ALIASED = jit(_aliased_sbuf)
ROWS = 8  # one DMA engine's partitions: the two loads could run side by side on two engines


def _run_alias(offset_b):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((ROWS, 256)).astype(np.float32)
    y = rng.standard_normal((ROWS, 256)).astype(np.float32)
    simulate(ALIASED)(x, y, offset_b)
    return _timeline(last_run())


def test_write_to_aliased_tile_waits_for_earlier_read():
    """WAR across allocations: loading y into B (same bytes as A) waits for the copy reading A."""
    rows = _run_alias(0)
    copy = next(r for r in rows if r[2] == "tensor_copy")
    load_b = [r for r in rows if r[2] == "dma_copy"][1]
    assert load_b[3] >= copy[5] - 1e-6


def test_write_to_aliased_tile_waits_for_earlier_write():
    """WAW across allocations: the second load starts after the first load completed."""
    rows = _run_alias(0)
    load_a, load_b = [r for r in rows if r[2] == "dma_copy"][:2]
    assert load_b[3] >= load_a[5] - 1e-6


def test_disjoint_placements_do_not_wait():
    """Control: B placed after A's bytes (256 fp32 = 1 KiB per partition) shares nothing, so
    its load overlaps the load of A and does not wait for the copy of A."""
    rows = _run_alias(256 * 4)
    copy = next(r for r in rows if r[2] == "tensor_copy")
    load_a, load_b = [r for r in rows if r[2] == "dma_copy"][:2]
    assert load_b[3] < load_a[4]
    assert load_b[3] < copy[3]
