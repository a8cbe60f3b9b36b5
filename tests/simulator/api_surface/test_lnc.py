"""LNC2 synchronisation (kernels_lnc.py).

Behaviours pinned here: ``core_barrier(t, (0, 1))`` orders writes and reads of a ``shared_hbm``
tensor between the two programs, and is a no-op at LNC1; ``core_barrier`` with ``cores=0`` is an
``NKIRuleError`` naming ``cores`` and the kernel line; ``sendrecv`` on
``dma_engine.gpsimd_dma`` exchanges (P, 1) tiles; ``activation`` with an immediate ``bias`` and a
float ``scale``; ``activation_reduce``. Exact for the swap; parity (fp64 oracle, PyTorch fp32
baseline) for the norm.
"""

import numpy as np
import pytest
import torch

from nki_lib import simulator as sim
from nki_lib.numerics import assert_parity

EPS = 1e-5


def _swapped(x):
    half = x.shape[1] // 2
    return np.concatenate([x[:, half:], x[:, :half]], axis=1)


@pytest.mark.parametrize("grid", [1, 2])
def test_swap_column_halves(kernel_module, rng, grid):
    k = kernel_module("lnc")
    block, n_blocks = 16, 3
    x = rng.standard_normal((n_blocks * block, 10)).astype(np.float32)
    kernel = k.swap_column_halves if grid == 1 else k.swap_column_halves[grid]
    np.testing.assert_array_equal(sim.simulate(kernel)(x, block), _swapped(x))
    barriers = [e for e in sim.last_run().trace if e.opcode == "core_barrier"]
    assert len(barriers) == grid * 2 * n_blocks


def test_barrier_with_an_int_cores_argument_is_refused(kernel_module, rng):
    k = kernel_module("lnc")
    with pytest.raises(sim.NKIRuleError) as info:
        sim.simulate(k.barrier_on_one_core)(rng.standard_normal((4, 4)).astype(np.float32))
    assert (info.value.instruction, info.value.operand) == ("core_barrier", "cores")
    assert info.value.source.startswith("kernels_lnc.py:")


@pytest.mark.parametrize("grid", [1, 2])
def test_rms_normalize_split_hidden(kernel_module, rng, trn2, grid):
    k = kernel_module("lnc")
    x = rng.standard_normal((150, 256)).astype(np.float32)
    kernel = k.rms_normalize_split_hidden if grid == 1 else k.rms_normalize_split_hidden[grid]
    out = sim.simulate(kernel)(x, EPS)
    x64 = torch.from_numpy(x.astype(np.float64))
    x32 = torch.from_numpy(x)
    oracle = x64 * torch.rsqrt(x64.square().mean(dim=1, keepdim=True) + EPS)
    baseline = x32 * torch.rsqrt(x32.square().mean(dim=1, keepdim=True) + EPS)
    assert_parity(torch.from_numpy(out), oracle, baseline, kind="output", dtype=torch.float32,
                  name="rms_normalize_split_hidden")
    exchanges = [e for e in sim.last_run().trace if e.opcode == "sendrecv"]
    assert len(exchanges) == (0 if grid == 1 else 2 * 2)  # two token tiles on each core
