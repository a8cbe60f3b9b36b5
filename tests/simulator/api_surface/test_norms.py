"""Row normalisations (kernels_norms.py).

Behaviours pinned here: ``activation_reduce``; ``activation`` with a (P, 1) tile ``scale`` and a
(P, 1) tile ``bias``; two-operand ``tensor_scalar`` with immediates and with tile operands;
``bn_stats`` on uneven chunks combined by ``bn_aggr``; a stride-0 partition broadcast of an HBM
row. Oracle fp64; baseline PyTorch fp32.
"""

import math

import numpy as np
import pytest
import torch

from nki_lib import simulator as sim
from nki_lib.numerics import assert_parity

EPS = 1e-5


@pytest.mark.parametrize("shape", [(100, 1000), (200, 64)], ids=["wide", "two-row-tiles"])
def test_rms_norm_with_gain(kernel_module, rng, shape):
    k = kernel_module("norms")
    x = rng.standard_normal(shape).astype(np.float32)
    gain = rng.uniform(0.5, 1.5, size=(1, shape[1])).astype(np.float32)
    out = sim.simulate(k.rms_norm_with_gain)(x, gain, EPS)
    x64, g64 = torch.from_numpy(x.astype(np.float64)), torch.from_numpy(gain.astype(np.float64))
    x32, g32 = torch.from_numpy(x), torch.from_numpy(gain)
    oracle = x64 * torch.rsqrt(x64.square().mean(dim=1, keepdim=True) + EPS) * g64
    baseline = x32 * torch.rsqrt(x32.square().mean(dim=1, keepdim=True) + EPS) * g32
    assert_parity(torch.from_numpy(out), oracle, baseline, kind="output", dtype=torch.float32,
                  name="rms_norm_with_gain")


@pytest.mark.parametrize("shape", [(100, 1000), (128, 64)], ids=["two-stat-chunks", "one-stat-chunk"])
def test_standardize_rows(kernel_module, rng, shape):
    k = kernel_module("norms")
    x = (2 * rng.standard_normal(shape) - 4).astype(np.float32)
    out = sim.simulate(k.standardize_rows)(x, EPS)
    x64 = x.astype(np.float64)
    oracle = (x64 - x64.mean(axis=1, keepdims=True)) / np.sqrt(x64.var(axis=1, keepdims=True) + EPS)
    baseline = torch.nn.functional.layer_norm(torch.from_numpy(x), (shape[1],), eps=EPS)
    assert_parity(torch.from_numpy(out), torch.from_numpy(oracle), baseline, kind="output",
                  dtype=torch.float32, name="standardize_rows")
    stats = sum(e.opcode == "bn_stats" for e in sim.last_run().trace)
    assert stats == (2 if shape[1] > sim.tile_size.bn_stats_fmax else 1) * math.ceil(shape[0] / sim.tile_size.pmax)
