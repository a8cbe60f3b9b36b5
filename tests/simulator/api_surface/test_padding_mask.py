"""Key-padding mask (kernels_padding_mask.py).

Behaviours pinned here: a stride-0 partition pattern on an HBM source (broadcast DMA); ``iota``
with a pattern step and a ``channel_multiplier``; ``tensor_scalar(op0=nl.less)`` with a (P, 1)
operand taken by ``.ap()`` out of a wider SBUF tile; an integer index on a free dim as a
destination; ``memset`` of a 5-D tile; a Scalar-engine ``tensor_copy`` from an ``.ap()`` view with
stride-0 dims; LNC2 programs covering consecutive key ranges. The mask is exact (0/1).
"""

import numpy as np
import pytest

from nki_lib import simulator as sim


def _expected(lengths, n_prog, n_cols, heads, queries, active, key_major):
    pmax = sim.tile_size.pmax
    p = np.arange(pmax)[:, None]
    c = np.arange(n_cols)[None, :]
    local = c * pmax + p if key_major else p * n_cols + c
    keys = np.arange(n_prog)[:, None, None] * pmax * n_cols + local[None]         # (n, P, C)
    keep = keys[..., None] < lengths[0][None, None, None, :]                     # (n, P, C, B)
    mask = np.broadcast_to(keep[..., None, None], keep.shape + (heads, queries)).copy()
    mask[..., active:] = False
    return mask.astype(np.float32)


@pytest.mark.parametrize("key_major", [False, True], ids=["partition-major", "key-major"])
@pytest.mark.parametrize("grid", [1, 2])
def test_key_padding_mask(kernel_module, grid, key_major):
    k = kernel_module("padding_mask")
    n_cols, heads, queries, active = 4, 2, 3, 2
    lengths = np.array([[0.0, 37.0, 512.0, 700.0, 1024.0]], dtype=np.float32)
    kernel = k.key_padding_mask if grid == 1 else k.key_padding_mask[grid]
    mask = sim.simulate(kernel)(lengths, n_cols, heads, queries, active, key_major)
    np.testing.assert_array_equal(mask, _expected(lengths, grid, n_cols, heads, queries, active, key_major))
    copies = [e for e in sim.last_run().trace if e.opcode == "tensor_copy"]
    assert len(copies) == grid and all(e.engine == "scalar" for e in copies)
