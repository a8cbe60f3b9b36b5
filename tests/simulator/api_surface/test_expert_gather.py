"""Indexed row gather + transpose (kernels_expert_gather.py).

Behaviours pinned here: ``.ap(vector_offset=..., indirect_dim=0)`` gathers on an HBM source;
``oob_mode.skip`` leaves out-of-range rows untouched and ``oob_mode.error`` raises;
``nisa.get_nc_version()`` compared with ``nisa.nc_version``; ``nl.shared_identity_matrix`` as the
moving operand of ``nc_matmul(is_transpose=True)`` into bf16 PSUM; a bf16 ``tensor_scalar`` with
an fp32 (P, 1) operand. Expected values: the same bf16 product the kernel forms (one fp32
multiply rounded to bf16), compared exactly.
"""

import ml_dtypes
import numpy as np
import pytest

from nki_lib import simulator as sim

BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("skip_missing", [False, True], ids=["all-present", "some-missing"])
def test_gather_weighted_transposed(kernel_module, rng, any_target, skip_missing):
    k = kernel_module("expert_gather")
    n_tokens, hidden, n_slots = 300, 256, 256
    x = rng.standard_normal((n_tokens, hidden)).astype(BF16)
    ids = rng.integers(0, n_tokens, size=n_slots).astype(np.int32)
    if skip_missing:
        ids[3::5] = n_tokens + 11
    weights = rng.uniform(0.1, 1.0, size=(n_slots, 1)).astype(np.float32)
    out = sim.simulate(k.gather_weighted_transposed)(x, ids, weights, skip_missing)
    present = ids < n_tokens
    rows = x[np.where(present, ids, 0)].astype(np.float32) * weights
    expected = np.where(present[:, None], rows, 0.0).astype(BF16).T
    assert out.dtype == BF16
    np.testing.assert_array_equal(out.astype(np.float32), expected.astype(np.float32))
    transposes = [e for e in sim.last_run().trace if e.opcode == "nc_matmul"]
    assert len(transposes) == 4 and all(e.attrs["is_transpose"] for e in transposes)


def test_missing_token_without_skip_is_an_error(kernel_module, rng):
    k = kernel_module("expert_gather")
    x = rng.standard_normal((40, 128)).astype(BF16)
    ids = np.arange(128, dtype=np.int32)            # ids 40..127 are past the 40 tokens
    weights = np.ones((128, 1), dtype=np.float32)
    with pytest.raises(sim.NKIRuleError) as info:
        sim.simulate(k.gather_weighted_transposed)(x, ids, weights, False)
    assert info.value.instruction == "dma_copy"
