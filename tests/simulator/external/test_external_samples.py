"""AWS nki-samples kernels (structure re-typed, see kernels_samples_*.py) on the simulator."""

import ml_dtypes
import numpy as np
import pytest
import torch

from nki_lib import simulator as sim
from nki_lib.numerics import assert_parity

BF16 = np.dtype(ml_dtypes.bfloat16)


def _attention_oracle(q, k, v):
    q64, k64, v64 = (t.astype(np.float64) for t in (q, k, v))
    s = q64 @ k64.T / np.sqrt(q.shape[1])
    p = np.exp(s - s.max(axis=1, keepdims=True))
    return (p / p.sum(axis=1, keepdims=True)) @ v64


@pytest.mark.parametrize("deterministic", [True, False], ids=["kv128", "kv64"])
def test_batch_invariant_attention_bf16(load_kernels, rng, deterministic):
    k = load_kernels("kernels_samples_attention")
    tile = sim.tile_size.pmax
    q, kk, v = (rng.standard_normal((n, tile)).astype(BF16) for n in (tile, 2 * tile, 2 * tile))
    out = sim.simulate(k.nki_attention_kernel_isa)(q, kk, v, deterministic=deterministic)
    oracle = torch.from_numpy(_attention_oracle(q, kk, v))
    tq, tk, tv = (torch.from_numpy(t.astype(np.float32)).to(torch.bfloat16) for t in (q, kk, v))
    baseline = torch.softmax((tq @ tk.T) * tile ** -0.5, dim=1) @ tv
    actual = torch.from_numpy(out.astype(np.float32))
    assert_parity(actual, oracle, baseline, kind="output", dtype=torch.bfloat16, name="attention_isa")
    transposes = [e for e in sim.last_run().trace if e.opcode == "nc_transpose"]
    assert transposes and all(e.engine == "tensor" for e in transposes)

