"""AWS NKI tutorial kernels (matmul, tensor add) run unchanged on the simulator.

Parity: each result is judged against an fp64 NumPy oracle with the tolerance table of
``nki_lib.numerics`` (baseline = PyTorch computing the same thing in the output dtype).
"""

import ml_dtypes
import numpy as np
import pytest
import torch

from nki_lib import simulator as sim
from nki_lib.numerics import assert_parity

BF16 = np.dtype(ml_dtypes.bfloat16)
TORCH_OF = {np.dtype(np.float32): torch.float32, BF16: torch.bfloat16}


def _matmul_parity(result, lhsT, rhs, name):
    out_dtype = TORCH_OF[np.dtype(lhsT.dtype)]
    oracle = torch.from_numpy(lhsT.astype(np.float64).T @ rhs.astype(np.float64))
    baseline = (torch.from_numpy(lhsT.astype(np.float32)).to(out_dtype).T
                @ torch.from_numpy(rhs.astype(np.float32)).to(out_dtype))
    actual = torch.from_numpy(np.asarray(result).astype(np.float64))
    assert result.shape == oracle.shape
    assert_parity(actual, oracle, baseline, kind="output", dtype=out_dtype, name=name)


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["fp32", "bf16"])
def test_matmul_basic(load_kernels, rng, dtype):
    k = load_kernels("kernels_tutorial_matmul")
    lhsT = rng.standard_normal((128, 64)).astype(dtype)
    rhs = rng.standard_normal((128, 512)).astype(dtype)
    result = sim.simulate(k.nki_matmul_basic_)(lhsT, rhs)
    _matmul_parity(result, lhsT, rhs, "nki_matmul_basic_")
    assert sim.last_run().instructions == 5  # 2 loads, 1 matmul, 1 copy, 1 store


@pytest.mark.parametrize("kernel", ["nki_matmul_tiled_", "nki_matmul_hoist_load_"])
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["fp32", "bf16"])
def test_matmul_tiled_accumulates_over_k(load_kernels, rng, kernel, dtype):
    k = load_kernels("kernels_tutorial_matmul")
    tile_k, tile_m, tile_n = (sim.tile_size.pmax, sim.tile_size.gemm_stationary_fmax,
                              sim.tile_size.gemm_moving_fmax)
    lhsT = rng.standard_normal((2 * tile_k, 2 * tile_m)).astype(dtype)
    rhs = rng.standard_normal((2 * tile_k, 2 * tile_n)).astype(dtype)
    result = sim.simulate(getattr(k, kernel))(lhsT, rhs)
    _matmul_parity(result, lhsT, rhs, kernel)
    matmuls = [e for e in sim.last_run().trace if e.opcode == "nc_matmul"]
    assert len(matmuls) == 8  # 2 (m) x 2 (n) x 2 (k)
    assert all(e.attrs["K"] == tile_k for e in matmuls)


def test_simulate_quick_start_add(load_kernels, rng):
    k = load_kernels("kernels_tensor_add")
    a = rng.random((128, 512)).astype(np.float32)
    b = rng.random((128, 512)).astype(np.float32)
    result = sim.simulate(k.add_kernel)(a, b)
    oracle = torch.from_numpy(a.astype(np.float64) + b.astype(np.float64))
    baseline = torch.from_numpy(a) + torch.from_numpy(b)
    assert_parity(torch.from_numpy(result), oracle, baseline, kind="output", dtype=torch.float32,
                  name="add_kernel")


def test_jit_docstring_add_returning_hbm_is_rejected(load_kernels, rng):
    """The ``nki.jit`` docstring example returns an ``nl.hbm`` tensor: NKI 0.3+ refuses that
    (returned tensors must be ``nl.shared_hbm``), so the simulator must refuse it as well."""
    k = load_kernels("kernels_tensor_add")
    a = rng.random((4, 3)).astype(np.float16)
    with pytest.raises(ValueError, match="shared_hbm"):
        sim.simulate(k.nki_tensor_add_kernel)(a, a)
