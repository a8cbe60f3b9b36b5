"""PE row / column tiles run in parallel (docs/cost-model.md §7.4 "PE tiling"; the nki.isa.nc_matmul
page, Tiling mode). Expected values are written out from the formulas and named constants."""

import pytest
from profile_tracegen import Trace, new_id, onchip

from nki_lib.simulator.profile import estimate, params
from nki_lib.simulator.profile.pe_array import ALL_CELLS, area, cells_of

HW = params("trn2")
NS = 1e9
TOP, BOTTOM = (0, 64, 0, 128), (64, 64, 0, 128)      # the two 64-row tiles of the array
N = 512                                              # moving columns: 512 PE cycles a matmul


def _matmul(t, tile=None, rows=64):
    t.matmul(onchip(new_id(), "sbuf", (rows, 128)), onchip(new_id(), "sbuf", (rows, N)),
             onchip(new_id(), "psum", (128, N), "float32"), tile=tile)


def _both(tiles):
    t = Trace()
    for tile in tiles:
        _matmul(t, tile, rows=128 if tile is None else tile[1])
    est = estimate(t.entries, "trn2")
    return est, est.dependency_bound_ns


def test_cells_of_tiles():
    assert cells_of(None) == ALL_CELLS
    assert len(cells_of(TOP)) == len(ALL_CELLS) // 2
    assert set(cells_of(TOP)).isdisjoint(cells_of(BOTTOM))
    assert set(cells_of(TOP)) | set(cells_of(BOTTOM)) == set(ALL_CELLS)
    quarter = cells_of((32, 32, 0, 128))                 # a 32-row tile (NC-v3+)
    assert area(quarter) == pytest.approx(0.25) and set(quarter) < set(cells_of(TOP))
    assert area(cells_of((0, 64, 64, 64))) == pytest.approx(0.25)   # row and column tiling together


def test_disjoint_row_tiles_run_together():
    est, dep = _both([TOP, BOTTOM])
    # both start at 0, inside the throttle ramp's first instant: each at the start rate
    service = N / HW.f_pe * NS / HW.pe_throttle_start_frac
    assert est.time_ns == pytest.approx(HW.kernel_launch_ns + service + HW.pe_result_latency_ns)
    assert dep == pytest.approx(est.time_ns)
    assert est.busy_ns["tensor"] == pytest.approx(service)   # two half-array services, by area


def test_same_tile_serialises_like_the_whole_array():
    tiled, tiled_dep = _both([TOP, TOP])
    whole, whole_dep = _both([None, None])
    assert tiled.time_ns == pytest.approx(whole.time_ns)
    assert tiled_dep == pytest.approx(whole_dep)
    assert tiled.busy_ns["tensor"] == pytest.approx(whole.busy_ns["tensor"] / 2)


def test_untiled_matmul_waits_for_every_tile():
    pair, _ = _both([TOP, BOTTOM])
    after, _ = _both([TOP, BOTTOM, None])
    single, _ = _both([None])
    stage = single.time_ns - HW.kernel_launch_ns - HW.pe_result_latency_ns   # first-instant service
    assert after.time_ns > pair.time_ns + 0.5 * stage                       # a second stage, not overlapped


def test_program_order_keeps_issue_order_the_dependency_bound_fills_the_tile():
    # TOP, then a whole-array matmul, then BOTTOM: in program order BOTTOM cannot start before the
    # whole-array one (issue order), so three stages; reordered, BOTTOM runs beside TOP: two stages.
    est, dep = _both([TOP, None, BOTTOM])
    two, _ = _both([TOP, None])
    assert est.time_ns > two.time_ns
    assert dep == pytest.approx(two.time_ns, rel=1e-6)
    assert est.lower_bound_ns <= dep <= est.time_ns
