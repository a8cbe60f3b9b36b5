"""bf16 attention with a residual (kernels_attention.py).

Behaviours pinned here: TensorE ``nc_transpose`` of bf16 tiles into bf16 PSUM; matmuls writing
column slices of one PSUM score tile; ``tensor_reduce(negate=True)``; ``activation`` exp with a
float ``scale``, a (P, 1) ``bias`` and an add-reduce; ``activation(op=nl.reciprocal)``; PSUM
auto-accumulation over key blocks; ``scalar_tensor_tensor`` reading PSUM. Oracle fp64; baseline
PyTorch in bf16.
"""

import ml_dtypes
import numpy as np
import pytest
import torch

from nki_lib import simulator as sim
from nki_lib.numerics import assert_parity

BF16 = np.dtype(ml_dtypes.bfloat16)


def _attention_plus_q(q, k, v):
    scores = (q @ k.T) / q.shape[1] ** 0.5
    return torch.softmax(scores, dim=1) @ v + q


@pytest.mark.parametrize("key_block", [128, 64])
def test_attention_with_residual_bf16(kernel_module, rng, key_block):
    kernels = kernel_module("attention")
    q, k, v = (rng.standard_normal((n, 64)).astype(BF16) for n in (96, 256, 256))
    out = sim.simulate(kernels.attention_with_residual)(q, k, v, key_block)
    assert out.dtype == BF16 and out.shape == q.shape
    as_torch = [torch.from_numpy(a.astype(np.float32)) for a in (q, k, v)]
    oracle = _attention_plus_q(*(t.double() for t in as_torch))
    baseline = _attention_plus_q(*(t.bfloat16() for t in as_torch))
    assert_parity(torch.from_numpy(out.astype(np.float32)), oracle, baseline, kind="output",
                  dtype=torch.bfloat16, name="attention_with_residual")
    transposes = [e for e in sim.last_run().trace if e.opcode == "nc_transpose"]
    assert len(transposes) == 1 + 2 * (256 // key_block) and all(e.engine == "tensor" for e in transposes)
