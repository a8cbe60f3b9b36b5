"""End-to-end NKI-style kernels (tests/simulator/nki_style_kernels.py, run through the ``nki``
module aliases) against NumPy: tiled matmul with K accumulation, row softmax, TensorE transpose,
cumulative sum, and LNC2 kernels that split work on program_id (shared_hbm outputs,
core_barrier, sendrecv).
"""

import numpy as np
import torch
from sim_helpers import BF16, bits

from nki_lib.numerics import assert_parity
from nki_lib.simulator import last_run


def _ints(rng, shape, dtype, lo=-8, hi=8):
    return rng.integers(lo, hi, size=shape, endpoint=True).astype(np.float32).astype(dtype)


def test_tiled_matmul_k_accumulation_exact(nki_modules, nki_style_kernels, rng):
    nki, _, _ = nki_modules
    a_t = _ints(rng, (3 * 128, 256), BF16)
    b = _ints(rng, (3 * 128, 1024), BF16)
    out = nki.simulate(nki_style_kernels.tiled_matmul)(a_t, b)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, (a_t.astype(np.float64).T @ b.astype(np.float64)).astype(np.float32))
    report = last_run()
    assert report.kernel == "tiled_matmul"
    matmuls = [e for e in report.trace if e.opcode == "nc_matmul"]
    assert len(matmuls) == 2 * 2 * 3


def test_tiled_matmul_random_bf16_parity(nki_modules, nki_style_kernels, rng):
    nki, _, _ = nki_modules
    a_t = torch.randn(256, 128, dtype=torch.bfloat16)
    b = torch.randn(256, 512, dtype=torch.bfloat16)
    out = nki.simulate(nki_style_kernels.tiled_matmul)(a_t, b)  # torch in -> torch out
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    oracle = a_t.double().T @ b.double()
    baseline = a_t.float().T @ b.float()
    assert_parity(out, oracle, baseline, kind="output", dtype=torch.float32, name="tiled_matmul")


def test_row_softmax(nki_modules, nki_style_kernels, rng):
    nki, _, _ = nki_modules
    x = (rng.standard_normal((200, 96)) * 4).astype(np.float32)  # 128 + 72 rows: a partial tile
    out = nki.simulate(nki_style_kernels.row_softmax)(x)
    xt = torch.from_numpy(x)
    oracle = torch.softmax(xt.double(), dim=-1)
    baseline = torch.softmax(xt, dim=-1)
    assert_parity(torch.from_numpy(out), oracle, baseline, kind="output", dtype=torch.float32, name="softmax")
    np.testing.assert_array_equal(np.argmax(out, axis=1), np.argmax(x, axis=1))


def test_blocked_transpose_through_tensor_engine(nki_modules, nki_style_kernels, rng):
    nki, _, _ = nki_modules
    x = rng.standard_normal((256, 384)).astype(BF16)
    out = nki.simulate(nki_style_kernels.blocked_transpose)(x)
    np.testing.assert_array_equal(bits(out), bits(x.T))
    engines = {e.engine for e in last_run().trace if e.opcode == "nc_transpose"}
    assert engines == {"tensor"}


def test_cumsum_rows(nki_modules, nki_style_kernels, rng):
    nki, _, _ = nki_modules
    x = _ints(rng, (3 * 128, 40), BF16)
    out = nki.simulate(nki_style_kernels.cumsum_rows)(x)
    np.testing.assert_array_equal(out, np.cumsum(x.astype(np.float64), axis=0).astype(np.float32))


def test_lnc2_split_on_program_id(nki_modules, nki_style_kernels, rng):
    nki, _, _ = nki_modules
    x = rng.standard_normal((192, 64)).astype(np.float32)
    doubled, swapped = nki.simulate(nki_style_kernels.lnc_split_rows[2])(x)
    np.testing.assert_array_equal(doubled, 2 * x)
    np.testing.assert_array_equal(swapped, np.concatenate([2 * x[96:], 2 * x[:96]]))
    report = last_run()
    assert report.grid == 2
    assert {e.program_id for e in report.trace} == {0, 1}
    assert sum(e.opcode == "core_barrier" for e in report.trace) == 2


def test_lnc2_bracket_after_simulate_and_lnc1_run(nki_modules, nki_style_kernels, rng):
    nki, _, _ = nki_modules
    x = rng.standard_normal((64, 16)).astype(np.float32)
    doubled, swapped = nki.simulate(nki_style_kernels.lnc_split_rows)[2](x)
    np.testing.assert_array_equal(swapped, np.concatenate([2 * x[32:], 2 * x[:32]]))
    doubled1, swapped1 = nki.simulate(nki_style_kernels.lnc_split_rows)(x)  # one program: peer == self
    np.testing.assert_array_equal(doubled1, 2 * x)
    np.testing.assert_array_equal(swapped1, 2 * x)
    assert last_run().grid == 1


def test_lnc2_sendrecv_exchange(nki_modules, nki_style_kernels, rng):
    nki, _, _ = nki_modules
    x = rng.standard_normal((2, 32, 8)).astype(np.float32)
    out = nki.simulate(nki_style_kernels.lnc_exchange[2])(x)
    np.testing.assert_array_equal(out, np.concatenate([x[1], x[0]]))


def test_attention_tile_online_softmax(nki_modules, nki_style_kernels, rng):
    nki, _, _ = nki_modules
    q = rng.standard_normal((128, 64)).astype(np.float32)
    k = rng.standard_normal((384, 64)).astype(np.float32)
    v = rng.standard_normal((384, 64)).astype(np.float32)
    out = nki.simulate(nki_style_kernels.attention_tile)(q, k, v)
    qt, kt, vt = (torch.from_numpy(a) for a in (q, k, v))

    def reference(q_, k_, v_):
        return torch.softmax(q_ @ k_.T / q_.shape[-1] ** 0.5, dim=-1) @ v_

    assert_parity(torch.from_numpy(out), reference(qt.double(), kt.double(), vt.double()), reference(qt, kt, vt),
                  kind="output", dtype=torch.float32, name="attention_tile")
