"""``core_barrier`` as the NKI Library's blockwise MoE matmul calls it (kernels_nkilib_barrier.py).

Under LNC2 the barrier orders both shards' writes of the shared output before either reads the
other's half. Under LNC1 the library calls ``core_barrier(output, (0))``; the AWS docs of
``nki.isa.core_barrier`` say only ``cores=(0, 1)`` is supported (at LNC degree 1 and 2), so the
simulator rejects ``(0)`` - with an ``NKIRuleError`` naming ``cores`` (it used to fail with a bare
``TypeError: 'int' object is not iterable`` from inside the simulator).
"""

import numpy as np
import pytest

from nki_lib import simulator as sim

BLOCK, N_BLOCKS, H = 32, 3, 16


def test_lnc2_barrier_orders_shared_writes(load_kernels, rng):
    k = load_kernels("kernels_nkilib_barrier")
    x = rng.standard_normal((N_BLOCKS * BLOCK, H)).astype(np.float32)
    out, peer = sim.simulate(k.sharded_blocks_with_barrier[2])(x, BLOCK)
    np.testing.assert_array_equal(out, x)
    np.testing.assert_array_equal(peer, x[:, H // 2:])  # shard 0 read shard 1's half after the barrier
    barriers = [e for e in sim.last_run().trace if e.opcode == "core_barrier"]
    assert len(barriers) == 2 * N_BLOCKS


def test_lnc1_library_barrier_on_core_0_is_rejected(load_kernels, rng):
    k = load_kernels("kernels_nkilib_barrier")
    x = rng.standard_normal((N_BLOCKS * BLOCK, H)).astype(np.float32)
    with pytest.raises(sim.NKIRuleError) as info:
        sim.simulate(k.sharded_blocks_with_barrier)(x, BLOCK)
    assert (info.value.instruction, info.value.operand) == ("core_barrier", "cores")
    assert info.value.source.startswith("kernels_nkilib_barrier.py:")
