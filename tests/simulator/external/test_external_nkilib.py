"""AWS NKI Library kernels (re-typed, see each kernels_nkilib_*.py) on the simulator."""

import ml_dtypes
import numpy as np
import pytest
import torch

from nki_lib import simulator as sim
from nki_lib.numerics import assert_parity

BF16 = np.dtype(ml_dtypes.bfloat16)


# ---- cumsum (tensor_tensor_scan, sequential_range, HBM reshape, NKIObject tiles) -------------

@pytest.mark.parametrize("shape", [(8, 300), (130, 40), (2, 3, 2100)], ids=["2d", "two-p-tiles", "3d-two-f-tiles"])
def test_cumsum(load_kernels, rng, shape):
    k = load_kernels("kernels_nkilib_cumsum")
    x = rng.standard_normal(shape).astype(np.float32)
    y = sim.simulate(k.cumsum)(x)
    oracle = torch.from_numpy(np.cumsum(x.astype(np.float64), axis=-1))
    # baseline: a sequential fp32 running sum (NumPy's float32 cumsum); torch's CPU cumsum
    # accumulates float32 in double and is not "the same thing in the same precision"
    baseline = torch.from_numpy(np.cumsum(x, axis=-1, dtype=np.float32))
    assert_parity(torch.from_numpy(y), oracle, baseline, kind="output", dtype=torch.float32, name="cumsum")


# ---- cascaded_max (NKIObject dataclass config, .ap(), nc_find_index8, affine_select, iota,
#      nc_matmul is_transpose, dge_mode, LNC2 program_id + shared_hbm) ------------------------

def _distinct_rows(rng, rows, cols):
    """Rows with a unique maximum each (argmax well defined)."""
    return np.stack([rng.permutation(cols) for _ in range(rows)]).astype(np.float32) / cols


@pytest.mark.parametrize("grid", [1, 2])
@pytest.mark.parametrize("vocab", [1024, 1000], ids=["fold-fast-path", "fold-padded-path"])
def test_cascaded_max_axis2(load_kernels, rng, grid, vocab):
    k = load_kernels("kernels_nkilib_cascaded_max")
    x = _distinct_rows(rng, 4, vocab)
    kernel = k.cascaded_max_axis2 if grid == 1 else k.cascaded_max_axis2[grid]
    values, indices = sim.simulate(kernel)(x)
    assert values.shape == (4, 1) and indices.shape == (4, 1)
    np.testing.assert_array_equal(values[:, 0], x.max(axis=1))
    np.testing.assert_array_equal(indices[:, 0], x.argmax(axis=1))
    assert sim.last_run().grid == grid


def test_cascaded_max_library_axis_is_rejected(load_kernels, rng):
    """The library's ``tensor_reduce(..., axis=1)`` on a 3-D [b, fold, elts] tile is the NKI 0.2
    reading; since 0.3 the reduced axes must be the trailing free dims (nki-api.md §8.11)."""
    k = load_kernels("kernels_nkilib_cascaded_max")
    x = _distinct_rows(rng, 4, 1024)
    with pytest.raises(sim.NKIRuleError) as info:
        sim.simulate(k.cascaded_max)(x)
    err = info.value
    assert (err.instruction, err.operand) == ("tensor_reduce", "axis")
    assert err.source.startswith("kernels_nkilib_cascaded_max.py:")
