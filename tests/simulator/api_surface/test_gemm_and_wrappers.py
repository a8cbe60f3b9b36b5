"""Tensor-engine products and ``nl`` wrapper kernels (kernels_gemm.py, kernels_wrappers.py).

Behaviours pinned here: positional ``nc_matmul`` operands; a PSUM tile allocated inside a loop
body starts a fresh auto-accumulation; explicit ``accumulate=False/True`` restarts/extends the sum
in a reused PSUM tile; Python lists of SBUF tiles reused across loop iterations; ``nl.tile_size``;
``nl.load``/``nl.store`` and the tile-returning arithmetic wrappers with scalar operands; a
returned ``nl.hbm`` tensor is refused. Results are judged against fp64 NumPy with the parity
table of ``nki_lib.numerics`` (baseline: PyTorch in the input dtype).
"""

import ml_dtypes
import numpy as np
import pytest
import torch

from nki_lib import simulator as sim
from nki_lib.numerics import assert_parity

BF16 = np.dtype(ml_dtypes.bfloat16)
TORCH_DTYPE = {np.dtype(np.float32): torch.float32, BF16: torch.bfloat16}


def _check_product(out, lhs_t, rhs, name):
    dtype = TORCH_DTYPE[np.dtype(lhs_t.dtype)]
    oracle = torch.from_numpy(lhs_t.astype(np.float64).T @ rhs.astype(np.float64))
    lhs_torch = torch.from_numpy(lhs_t.astype(np.float32)).to(dtype)
    rhs_torch = torch.from_numpy(rhs.astype(np.float32)).to(dtype)
    assert out.shape == tuple(oracle.shape)
    assert_parity(torch.from_numpy(out.astype(np.float64)), oracle, lhs_torch.T @ rhs_torch,
                  kind="output", dtype=dtype, name=name)


def _matmuls():
    return [e for e in sim.last_run().trace if e.opcode == "nc_matmul"]


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["fp32", "bf16"])
def test_one_tile_product_with_positional_matmul(kernel_module, rng, dtype):
    k = kernel_module("gemm")
    lhs_t = rng.standard_normal((96, 80)).astype(dtype)
    rhs = rng.standard_normal((96, 300)).astype(dtype)
    out = sim.simulate(k.one_tile_product)(lhs_t, rhs)
    _check_product(out, lhs_t, rhs, "one_tile_product")
    assert sim.last_run().instructions == 5


@pytest.mark.parametrize("kernel", ["column_panel_product", "flagged_accumulate_product"])
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["fp32", "bf16"])
def test_tiled_products_sum_over_k(kernel_module, rng, kernel, dtype):
    k = kernel_module("gemm")
    tk, tm, tn = sim.tile_size.pmax, sim.tile_size.gemm_stationary_fmax, sim.tile_size.gemm_moving_fmax
    lhs_t = rng.standard_normal((3 * tk, 2 * tm)).astype(dtype)
    rhs = rng.standard_normal((3 * tk, 2 * tn)).astype(dtype)
    out = sim.simulate(getattr(k, kernel))(lhs_t, rhs)
    _check_product(out, lhs_t, rhs, kernel)
    matmuls = _matmuls()
    assert len(matmuls) == 2 * 2 * 3 and all(e.attrs["K"] == tk for e in matmuls)


def test_panel_product_loads_each_rhs_panel_once(kernel_module, rng):
    k = kernel_module("gemm")
    tk, tm, tn = sim.tile_size.pmax, sim.tile_size.gemm_stationary_fmax, sim.tile_size.gemm_moving_fmax
    lhs_t = rng.standard_normal((2 * tk, 3 * tm)).astype(np.float32)
    rhs = rng.standard_normal((2 * tk, tn)).astype(np.float32)
    sim.simulate(k.column_panel_product)(lhs_t, rhs)
    loads = [e for e in sim.last_run().trace if e.opcode == "dma_copy" and e.writes[0].memory == "sbuf"]
    assert len(loads) == 2 + 3 * 2  # rhs panels once per column block; lhs tiles per (m, k)


def test_axpby_with_nl_wrappers(kernel_module, rng):
    k = kernel_module("wrappers")
    x = rng.standard_normal((200, 48)).astype(np.float32)
    y = rng.standard_normal((200, 48)).astype(np.float32)
    out = sim.simulate(k.axpby)(x, y, 0.5, -3.0)
    oracle = torch.from_numpy(0.5 * x.astype(np.float64) - 3.0 * y.astype(np.float64))
    baseline = 0.5 * torch.from_numpy(x) - 3.0 * torch.from_numpy(y)
    assert_parity(torch.from_numpy(out), oracle, baseline, kind="output", dtype=torch.float32, name="axpby")


def test_returning_a_private_hbm_tensor_is_refused(kernel_module, rng):
    k = kernel_module("wrappers")
    with pytest.raises(ValueError, match="shared_hbm"):
        sim.simulate(k.private_result)(rng.standard_normal((4, 6)).astype(np.float16))
