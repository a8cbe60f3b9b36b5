"""HBM passes of a DMA (docs/cost-model.md §7.3): the core's HBM share is divided by the number of
HBM-side reads and writes of a DMA, since HBM bandwidth is total traffic (the host ops' rule of
§7.10 too). A load or a store crosses HBM once; an HBM-to-HBM copy and a read-modify-write of
HBM (``dma_compute``'s "Scatter RMW") twice. The accounting is checked, never a time."""

import numpy as np
import pytest

from nki_lib.simulator import isa as nisa
from nki_lib.simulator import jit, last_run, simulate
from nki_lib.simulator import language as nl
from nki_lib.simulator.profile import instruction_cost, params

PMAX = nl.tile_size.pmax
COLS = 2048                      # 8 KiB fp32 rows: above the chunk floor, so bandwidth decides
HW = params("trn2")


def _moves(x, ids):
    """A load, an HBM-to-HBM copy, a scatter read-modify-write of HBM, a store (in that order)."""
    copy = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    rows_sb = nl.ndarray((PMAX, COLS), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=rows_sb, src=x)
    nisa.dma_copy(dst=copy, src=x)
    ids_sb = nl.ndarray((PMAX, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=ids_sb, src=ids)
    acc_rows = copy.ap([[COLS, PMAX], [1, COLS]], offset=0, vector_offset=ids_sb, indirect_dim=0)
    nisa.dma_compute(dst=acc_rows, srcs=[acc_rows, rows_sb], reduce_op=nl.add)
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=rows_sb)
    return copy, out


MOVES = jit(_moves)


def _entries():
    x = np.random.default_rng(0).standard_normal((PMAX, COLS)).astype(np.float32)
    ids = np.arange(PMAX, dtype=np.int32)[::-1].reshape(PMAX, 1).copy()
    copy, out = simulate(MOVES)(x, ids)
    np.testing.assert_array_equal(np.asarray(copy), x + x[::-1])
    np.testing.assert_array_equal(np.asarray(out), x)
    dmas = [e for e in last_run().trace if e.opcode in ("dma_copy", "dma_compute")]
    load, hbm_copy, _ids, rmw, store = dmas
    return load, hbm_copy, rmw, store


def test_hbm_bandwidth_bounds_these_moves():
    """The case is bandwidth-bound on the HBM share, so the passes show in the service time."""
    assert HW.hbm_bw_share / HW.dma_engines <= HW.dma_bw_per_engine


@pytest.mark.parametrize("which", ["hbm_copy", "rmw"])
def test_two_hbm_passes_take_twice_a_load(which):
    load, hbm_copy, rmw, store = _entries()
    one = instruction_cost(load, HW).service_ns
    assert instruction_cost(store, HW).service_ns == pytest.approx(one)
    assert instruction_cost({"hbm_copy": hbm_copy, "rmw": rmw}[which], HW).service_ns == pytest.approx(2 * one)
