"""Rotary embedding on interleaved pairs (kernels_rotary.py) and ``nki.tensor`` constants.

Behaviours pinned here: ``import nki.tensor``; ``nki.tensor.identity`` as trace-time data handed
to ``nl.shared_constant``; stride-2 ``.ap()`` reads and writes of HBM tensors; a stride-0
``.ap()`` dim on an HBM source; a negative-stride ``.ap()`` read of an SBUF tile; a TensorE
``nc_transpose`` into PSUM and ``activation(op=nl.copy)`` evictions; a permutation matmul; LNC2
token sharding. Oracle fp64, baseline PyTorch fp32 (same formula).
"""

import ml_dtypes
import numpy as np
import pytest
import torch

from nki_lib import simulator as sim
from nki_lib.numerics import assert_parity


def _rotary(x, cos, sin):
    """out with out[:, 0::2] = e c - o s and out[:, 1::2] = o c + e s (torch, any dtype)."""
    even, odd = x[:, 0::2], x[:, 1::2]
    out = torch.empty_like(x)
    out[:, 0::2] = even * cos - odd * sin
    out[:, 1::2] = odd * cos + even * sin
    return out


@pytest.mark.parametrize("relayout_by_matmul", [False, True], ids=["dma-relayout", "matmul-relayout"])
@pytest.mark.parametrize("grid", [1, 2])
def test_rotary_embedding(kernel_module, rng, relayout_by_matmul, grid):
    k = kernel_module("rotary")
    tokens, dim = 200, 64
    x = rng.standard_normal((tokens, dim)).astype(np.float32)
    angle = rng.uniform(-np.pi, np.pi, size=(tokens, dim // 2))
    cos, sin = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
    kernel = k.rotary_embedding if grid == 1 else k.rotary_embedding[grid]
    out = sim.simulate(kernel)(x, cos, sin, relayout_by_matmul)
    tx, tc, ts = (torch.from_numpy(a) for a in (x, cos, sin))
    assert_parity(torch.from_numpy(out), _rotary(tx.double(), tc.double(), ts.double()), _rotary(tx, tc, ts),
                  kind="output", dtype=torch.float32, name="rotary_embedding")
    matmuls = sum(e.opcode == "nc_matmul" for e in sim.last_run().trace)
    token_tiles = 2  # 128 + 72 tokens on one program, or 100 tokens on each of two
    assert matmuls == (token_tiles if relayout_by_matmul else 0)


def test_nki_tensor_constants(nki_modules):
    import nki.tensor as ntensor

    _, nl, _ = nki_modules
    eye = ntensor.identity(3, dtype=nl.bfloat16)
    assert eye.dtype == np.dtype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(eye.astype(np.float32), np.eye(3, dtype=np.float32))
    blank = ntensor.zeros((2, 5), nl.int32)
    assert blank.dtype == np.int32 and blank.shape == (2, 5) and not blank.any()
    with pytest.raises(ValueError, match="n must be"):
        ntensor.identity(-1, nl.float32)
