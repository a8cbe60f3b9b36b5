"""The gather-plan search of nki_lib/bench/gather_bound.py (docs/perf-log.md §28): its plans keep every
(block, head) row covered, and its synthetic DMAs cost what the simulator's real gathers cost. No test
here asserts a time."""

import random

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from nki_lib.bench import gather_bound as gb
from nki_lib.simulator import isa as nisa
from nki_lib.simulator import jit, last_run, simulate
from nki_lib.simulator import language as nl
from nki_lib.simulator.profile import params
from nki_lib.simulator.profile.costs import instruction_cost

PMAX = nl.tile_size.pmax
BLOCKS, HEADS, ROW_BYTES = gb.problem()


def _rows(plan):
    return sum(rows * heads for _, rows, heads in plan)


def _valid(item):
    mode, rows, heads = item
    if mode == "hwdge":
        return rows == 1 and heads in gb.HEAD_RUNS
    return mode == "swdge" and rows % 8 == 0 and 0 < rows <= PMAX and heads in gb.HEAD_RUNS


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), share=st.sampled_from((0.0, 0.5, 0.9)), steps=st.integers(1, 30))
@example(seed=0, share=0.0, steps=1)
@example(seed=1, share=0.9, steps=30)
def test_plans_cover_every_row_once(seed, share, steps):
    rng = random.Random(seed)
    total = 2 * BLOCKS * HEADS
    plan = gb.random_plan(rng, total, share)
    assert _rows(plan) == total and all(map(_valid, plan))
    for _ in range(steps):
        plan = gb.neighbour(plan, rng)
        assert _rows(plan) == total and all(map(_valid, plan))
    for uniform in gb.uniform_plans(BLOCKS, HEADS):
        assert _rows(uniform) == total


def _gather_kernel(cache, ids, heads):
    """One software-DGE gather of whole blocks: partition p <- the first ``heads`` kv heads of cache row
    ids[p] (the kernel's shared-gather form, ``decode_attention_fwd_gathers.gather_chunk``); and the same
    heads of block ids[0] by one hardware-DGE DMA at that runtime offset."""
    width = heads * cache.shape[1] // HEADS
    ids_sb = nl.ndarray((PMAX, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=ids_sb, src=ids)
    out_sb = nl.ndarray((PMAX, width), dtype=cache.dtype, buffer=nl.sbuf)
    src = cache.ap([[cache.shape[1], PMAX], [1, width]], offset=0, vector_offset=ids_sb, indirect_dim=0)
    nisa.dma_copy(dst=out_sb, src=src, oob_mode=nisa.oob_mode.skip, dge_mode=nisa.dge_mode.swdge)
    block_sb = nl.ndarray((1, width), dtype=cache.dtype, buffer=nl.sbuf)    # one block at a runtime
    src = cache.ap([[cache.shape[1], 1], [1, width]], offset=0, scalar_offset=ids_sb[0:1, 0:1], indirect_dim=0)
    nisa.dma_copy(dst=block_sb, src=src, oob_mode=nisa.oob_mode.skip, dge_mode=nisa.dge_mode.hwdge)
    out = nl.ndarray((PMAX + 1, width), dtype=cache.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out[0:PMAX, :], src=out_sb)
    nisa.dma_copy(dst=out[PMAX:PMAX + 1, :], src=block_sb)
    return out


@pytest.mark.parametrize("heads", [1, 4, 8])
@pytest.mark.parametrize("form", ["vector", "scalar"])
def test_synthetic_dmas_cost_what_simulated_ones_cost(heads, form):
    """The search's ("swdge", 128, h) and ("hwdge", 1, h) entries and real simulated DMAs of the same
    form (a gather of 128 blocks x h heads; one block at a runtime offset) get the same service,
    engines, issue engine and issue time from the cost model."""
    elems = ROW_BYTES // 2
    cache = np.zeros((BLOCKS, HEADS * elems), dtype=nl.bfloat16)
    ids = np.random.default_rng(0).permutation(BLOCKS).astype(np.int32).reshape(PMAX, 1)
    simulate(jit(_gather_kernel))(cache, ids, heads)
    (real,) = [e for e in last_run().trace if e.attrs.get("indirect") == form]
    item = ("swdge", PMAX, heads) if form == "vector" else ("hwdge", 1, heads)
    synthetic = gb.plan_trace([item], BLOCKS, ROW_BYTES)[-1]
    hw = params("trn2")
    got, want = instruction_cost(synthetic, hw), instruction_cost(real, hw)
    assert (got.service_ns, got.dma_engines, got.issue_engine, got.issue_ns) == \
        (want.service_ns, want.dma_engines, want.issue_engine, want.issue_ns)
