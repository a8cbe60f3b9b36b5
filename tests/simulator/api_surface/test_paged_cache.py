"""Run-time slot writes into HBM arguments (kernels_paged_cache.py).

Behaviours pinned here: ``.ap(scalar_offset=..., indirect_dim=0)`` on a DMA destination in an HBM
argument; ``oob_mode.skip`` drops a write whose slot is out of range; HBM arguments modified in
place are written back to the caller's arrays and may be returned; LNC2 programs doing different
work. Exact.
"""

import numpy as np
import pytest

from nki_lib import simulator as sim

N_SLOTS, WIDTH = 10, 24


@pytest.mark.parametrize("grid", [1, 2])
def test_write_to_slots(kernel_module, rng, grid):
    k = kernel_module("paged_cache")
    slots = np.array([7, 0, N_SLOTS, 3, N_SLOTS + 4], dtype=np.int32)   # two padding tokens
    k_new, v_new = (rng.standard_normal((len(slots), WIDTH)).astype(np.float32) for _ in range(2))
    k_cache, v_cache = (rng.standard_normal((N_SLOTS, WIDTH)).astype(np.float32) for _ in range(2))
    expected_k, expected_v = k_cache.copy(), v_cache.copy()
    for t, slot in enumerate(slots):
        if slot < N_SLOTS:
            expected_k[slot], expected_v[slot] = k_new[t], v_new[t]
    kernel = k.write_to_slots if grid == 1 else k.write_to_slots[grid]
    out_k, out_v = sim.simulate(kernel)(k_new, v_new, k_cache, v_cache, slots)
    for result in (out_k, k_cache):
        np.testing.assert_array_equal(result, expected_k)
    for result in (out_v, v_cache):
        np.testing.assert_array_equal(result, expected_v)
    writes = [e for e in sim.last_run().trace if e.opcode == "dma_copy" and e.writes[0].memory != "sbuf"]
    assert len(writes) == 2 * len(slots)  # padding writes are issued and dropped (data checked above)
    per_program = [sum(e.program_id == p for e in writes) for p in range(grid)]
    assert per_program == ([2 * len(slots)] if grid == 1 else [len(slots), len(slots)])
