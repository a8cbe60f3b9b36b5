"""Descriptor generation (DGE) of dynamic DMAs (issue 10, cost model 2; docs/cost-model.md "DGE").

The trace records each DMA's form (``attrs["indirect"]``: ``"vector"`` for per-partition
``vector_offset`` gathers/scatters, ``"scalar"`` for one runtime ``scalar_offset``, None for a
static pattern) and the cost model charges descriptor generation by the documented rule, the
same whether or not the kernel names ``dge_mode``:

* ``vector_offset`` -> software DGE on GpSimd (the only mode that serves it; ``unknown``
  resolves to ``swdge``): ``dma_issue_swdge_ns + dma_issue_swdge_per_descriptor_ns x descriptors``;
* ``scalar_offset`` with ``unknown`` -> hardware DGE on the sync engine (dynamic addresses rule
  out precomputed descriptors; trn2/trn3 have hardware DGE): ``dma_issue_hwdge_ns``;
* ``scalar_offset`` with ``unknown`` on a ``dma_transpose`` whose source the hardware DGE cannot take
  (not 16 rows, or a last dim not a multiple of 128; ``attrs["hwdge_shape"]``) -> software DGE;
* a named mode is charged as named.

The accounting (which engine pays, how many descriptors) is checked, never a time.
"""

import numpy as np
import pytest

from nki_lib.simulator import isa as nisa
from nki_lib.simulator import jit, last_run, simulate
from nki_lib.simulator import language as nl
from nki_lib.simulator.profile import estimate, instruction_cost, params
from nki_lib.simulator.profile.costs import dge_mode_of

PMAX = nl.tile_size.pmax
COLS = 64
HW = params("trn2")
MODES = {"unknown": nisa.dge_mode.unknown, "swdge": nisa.dge_mode.swdge}


def _gather(table, ids, mode_name):
    """rows_sb[p] = table[ids[p]] by one vector_offset DMA, then stored."""
    out = nl.ndarray((PMAX, COLS), dtype=table.dtype, buffer=nl.shared_hbm)
    ids_sb = nl.ndarray((PMAX, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=ids_sb, src=ids)
    rows_sb = nl.ndarray((PMAX, COLS), dtype=table.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=rows_sb, src=table.ap([[COLS, PMAX], [1, COLS]], offset=0, vector_offset=ids_sb,
                                            indirect_dim=0), dge_mode=MODES[mode_name])
    nisa.dma_copy(dst=out, src=rows_sb)
    return out


GATHER = jit(_gather)


def _run_gather(mode_name):
    rng = np.random.default_rng(0)
    table = rng.standard_normal((4 * PMAX, COLS)).astype(np.float32)
    ids = rng.integers(0, 4 * PMAX, size=(PMAX, 1)).astype(np.int32)
    out = simulate(GATHER)(table, ids, mode_name)
    np.testing.assert_array_equal(np.asarray(out), table[ids[:, 0]])
    return last_run()


def _gather_entry(report):
    return [e for e in report.trace if e.opcode == "dma_copy"][1]


@pytest.mark.parametrize("mode_name", sorted(MODES))
def test_vector_offset_dma_is_recorded_indirect(mode_name):
    entry = _gather_entry(_run_gather(mode_name))
    assert entry.attrs["indirect"] == "vector"
    # the index tile is an input of the gather (the DMA waits for it)
    assert any(a.memory == "sbuf" and a.dtype == "int32" for a in entry.reads)


@pytest.mark.parametrize("mode_name", sorted(MODES))
def test_vector_offset_dma_pays_software_dge(mode_name):
    """One descriptor per gathered row (each row one contiguous run): GpSimd pays for them."""
    entry = _gather_entry(_run_gather(mode_name))
    cost = instruction_cost(entry, HW)
    assert cost.issue_engine == "gpsimd"
    assert cost.issue_ns == pytest.approx(HW.dma_issue_swdge_ns + HW.dma_issue_swdge_per_descriptor_ns * PMAX)


def test_naming_swdge_changes_nothing():
    """The same gather costs the same with and without ``dge_mode=swdge``."""
    ests = {m: estimate(_run_gather(m), "trn2") for m in MODES}
    assert ests["unknown"].busy_ns == ests["swdge"].busy_ns
    assert ests["unknown"].busy_ns["gpsimd"] > 0


def _scalar_offset_load(table, row, mode_name):
    """rows_sb = table[row : row + PMAX] with the row read at run time (a register)."""
    out = nl.ndarray((PMAX, COLS), dtype=table.dtype, buffer=nl.shared_hbm)
    row_sb = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=row_sb, src=row)
    row_reg = nisa.register_alloc()
    nisa.register_load(row_reg, row_sb)
    rows_sb = nl.ndarray((PMAX, COLS), dtype=table.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=rows_sb, src=table.ap([[COLS, PMAX], [1, COLS]], offset=0, scalar_offset=row_reg,
                                            indirect_dim=0), dge_mode=MODES[mode_name])
    nisa.dma_copy(dst=out, src=rows_sb)
    return out


SCALAR = jit(_scalar_offset_load)


def test_scalar_offset_dma_is_recorded_and_pays_hardware_dge():
    rng = np.random.default_rng(0)
    table = rng.standard_normal((4 * PMAX, COLS)).astype(np.float32)
    simulate(SCALAR)(table, np.array([[1]], dtype=np.int32), "unknown")
    entry = [e for e in last_run().trace if e.opcode == "dma_copy"][1]
    assert entry.attrs["indirect"] == "scalar"
    cost = instruction_cost(entry, HW)
    assert cost.issue_engine == "sync"
    assert cost.issue_ns == pytest.approx(HW.dma_issue_hwdge_ns)


def test_static_dma_is_recorded_direct():
    report = _run_gather("unknown")
    first = [e for e in report.trace if e.opcode == "dma_copy"][0]
    assert first.attrs["indirect"] is None
    assert instruction_cost(first, HW).issue_engine is None


def _scalar_offset_transpose(x, row, last, hardware):
    """K^T-style transpose at a runtime row offset: 16 rows of ``last`` elements from row ``row`` of
    ``x`` viewed as (16, n, w), w = min(last, 128), landing as (w, n, 16); ``hardware``: with
    ``dge_mode.hwdge``, else ``unknown``."""
    rows, width = 16, min(last, PMAX)
    n = last // width
    out = nl.ndarray((width, n, rows), dtype=x.dtype, buffer=nl.shared_hbm)
    row_sb = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=row_sb, src=row)
    row_reg = nisa.register_alloc()
    nisa.register_load(row_reg, row_sb)
    t_sb = nl.ndarray((width, n, rows), dtype=x.dtype, buffer=nl.sbuf)
    mode = nisa.dge_mode.hwdge if hardware else nisa.dge_mode.unknown
    nisa.dma_transpose(dst=t_sb, src=x.ap([[last, rows], [width, n], [1, width]], offset=0, scalar_offset=row_reg,
                                          indirect_dim=0), dge_mode=mode)
    nisa.dma_copy(dst=out, src=t_sb)
    return out


TRANSPOSE = jit(_scalar_offset_transpose)


@pytest.mark.parametrize(("last", "hardware", "engine"), [
    (128, False, "sync"),      # the hardware DGE's shape: unknown resolves to hwdge
    (256, True, "sync"),       # named hwdge
    (64, False, "gpsimd"),     # a last dim the hardware DGE cannot take: only software DGE
])
def test_scalar_offset_transpose_dge_follows_the_hardware_shape(last, hardware, engine):
    """docs/cost-model.md "DGE rule": a runtime-offset dma_transpose with ``unknown`` is hardware DGE
    when its source has the hardware DGE's shape (16 rows, last dim a multiple of 128), else software
    DGE (GpSimd pays the descriptors); the values are the transposed rows either way."""
    import ml_dtypes

    x = np.random.default_rng(0).standard_normal((64, last)).astype(ml_dtypes.bfloat16)
    got = np.asarray(simulate(TRANSPOSE)(x, np.array([[3]], dtype=np.int32), last, hardware))
    width = min(last, PMAX)
    want = x[3:19].reshape(16, last // width, width).transpose(2, 1, 0)
    np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))
    entry = [e for e in last_run().trace if e.opcode == "dma_transpose"][0]
    assert entry.attrs["indirect"] == "scalar" and entry.attrs["hwdge_shape"] == (last % 128 == 0)
    assert instruction_cost(entry, HW).issue_engine == engine
    assert dge_mode_of(entry.attrs) == ("hwdge" if engine == "sync" else "swdge")


def test_static_unknown_transpose_stays_precomputed():
    """A static dma_transpose with ``unknown`` of a shape the hardware DGE cannot take: ``none``."""
    assert dge_mode_of({"dge_mode": "unknown", "indirect": None, "hwdge_shape": False}) == "none"
