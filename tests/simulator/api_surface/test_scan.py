"""``tensor_tensor_scan`` in a chunked running sum (kernels_scan.py).

Behaviours pinned here: an ``nl.NKIObject`` subclass constructed by keyword carries tiles between
helpers; ``.reshape`` of HBM arguments and outputs; ``nl.sequential_range``; the scan's
``initial`` (P, 1) seed chains chunks. Baseline: the same recurrence in fp32 (NumPy's sequential
float32 cumsum for decay 1; an fp32 loop otherwise); oracle: fp64.
"""

import math

import numpy as np
import pytest
import torch

from nki_lib import simulator as sim
from nki_lib.numerics import assert_parity


def _recurrence(x, decay, dtype):
    x = x.astype(dtype)
    out = np.empty_like(x)
    run = np.zeros(x.shape[:-1], dtype=dtype)
    for i in range(x.shape[-1]):
        run = dtype(decay) * run + x[..., i]
        out[..., i] = run
    return out


@pytest.mark.parametrize("shape, chunk", [((8, 300), 128), ((130, 40), 512), ((2, 3, 700), 256)],
                         ids=["2d-chunks", "two-row-tiles", "3d-tail-chunk"])
@pytest.mark.parametrize("decay", [1.0, 0.875])
def test_discounted_running_sum(kernel_module, rng, shape, chunk, decay):
    k = kernel_module("scan")
    x = rng.standard_normal(shape).astype(np.float32)
    out = sim.simulate(k.discounted_running_sum)(x, decay, chunk)
    oracle = _recurrence(x, decay, np.float64)
    baseline = np.cumsum(x, axis=-1, dtype=np.float32) if decay == 1.0 else _recurrence(x, decay, np.float32)
    assert out.shape == x.shape
    assert_parity(torch.from_numpy(out), torch.from_numpy(oracle), torch.from_numpy(baseline), kind="output",
                  dtype=torch.float32, name="discounted_running_sum")
    scans = [e for e in sim.last_run().trace if e.opcode == "tensor_tensor_scan"]
    rows = int(np.prod(shape[:-1]))
    assert len(scans) == math.ceil(rows / sim.tile_size.pmax) * math.ceil(shape[-1] / min(chunk, shape[-1]))
