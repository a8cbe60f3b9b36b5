"""neuronx-distributed-inference's KV-cache write kernel (re-typed, kernels_nxdi_kv_cache.py):
dynamic ``scalar_offset`` DMA into HBM arguments, ``oob_mode.skip``, in-place outputs, LNC2
programs doing different work."""

import numpy as np
import pytest

from nki_lib import simulator as sim

B, H, S, S_PRIOR, D = 3, 2, 4, 8, 16


def _inputs(rng):
    k = rng.standard_normal((1, H, S, D)).astype(np.float32)
    v = rng.standard_normal((1, H, S, D)).astype(np.float32)
    k_prior = rng.standard_normal((B, H, S_PRIOR, D)).astype(np.float32)
    v_prior = rng.standard_normal((B, H, S_PRIOR, D)).astype(np.float32)
    return k, v, k_prior, v_prior


@pytest.mark.parametrize("grid", [1, 2])
@pytest.mark.parametrize("batch", [0, 2])
def test_write_kv_cache_at_batch(load_kernels, rng, grid, batch):
    k = load_kernels("kernels_nxdi_kv_cache")
    key, value, k_prior, v_prior = _inputs(rng)
    expected_k, expected_v = k_prior.copy(), v_prior.copy()
    expected_k[batch, :, :S] = key[0]
    expected_v[batch, :, :S] = value[0]
    kernel = k.write_kv_cache_at_batch_kernel if grid == 1 else k.write_kv_cache_at_batch_kernel[grid]
    out_k, out_v = sim.simulate(kernel)(key, value, k_prior, v_prior, np.array([batch], dtype=np.int32))
    np.testing.assert_array_equal(out_k, expected_k)
    np.testing.assert_array_equal(out_v, expected_v)
    np.testing.assert_array_equal(k_prior, expected_k)  # in-place HBM outputs written back
    np.testing.assert_array_equal(v_prior, expected_v)
    writes = [e for e in sim.last_run().trace if e.opcode == "dma_copy" and e.writes[0].memory != "sbuf"]
    assert sorted(e.program_id for e in writes) == ([0, 0] if grid == 1 else [0, 1])


def test_write_kv_cache_out_of_range_batch_is_skipped(load_kernels, rng):
    k = load_kernels("kernels_nxdi_kv_cache")
    key, value, k_prior, v_prior = _inputs(rng)
    before_k, before_v = k_prior.copy(), v_prior.copy()
    out_k, out_v = sim.simulate(k.write_kv_cache_at_batch_kernel)(key, value, k_prior, v_prior,
                                                                  np.array([B], dtype=np.int32))
    np.testing.assert_array_equal(out_k, before_k)
    np.testing.assert_array_equal(out_v, before_v)
