"""NC-v4 MX instructions of isa/extra.py (docs/nki-semantics.md §8.16, §8.19, §14.13) against loop-based
NumPy references: quantize_mx (group scales, saturation, x4 packing, quadrant scale layout) and
nc_matmul_mx (MXFP8 x MXFP4 dequantized product, accumulate), and their trn3-only gating.

Packed operands travel as integer arrays (uint32 for fp8 x4, uint16 for fp4 x4) and are
reinterpreted in the kernel with ``.view()``, as on hardware.
"""

import ml_dtypes
import numpy as np
import pytest
import torch
from sim_helpers import BF16, run_tiles

from nki_lib.numerics import assert_parity
from nki_lib.simulator import NKIRuleError
from nki_lib.simulator import isa as nisa
from nki_lib.simulator import language as nl

E4M3FN = np.dtype(ml_dtypes.float8_e4m3fn)
E2M1 = np.dtype(ml_dtypes.float4_e2m1fn)
GROUP_P, PACK, BIAS = 8, 4, 127


def _scale_partition(g):
    """Quadrant layout: group row g -> partition (g // 4) * 32 + g % 4 (§8.16)."""
    return (g // 4) * 32 + g % 4


def _reference_quantize(x, element, emax):
    """Loop-based MX quantization of x (P, F) fp32: element values and biased scales (P/8, F/4)."""
    p_count, f_count = x.shape
    q = np.empty((p_count, f_count), element)
    biased = np.empty((p_count // GROUP_P, f_count // PACK), np.uint8)
    limit = float(ml_dtypes.finfo(element).max)
    for g in range(p_count // GROUP_P):
        for j in range(f_count // PACK):
            block = x[g * GROUP_P:(g + 1) * GROUP_P, j * PACK:(j + 1) * PACK].astype(np.float64)
            amax = np.abs(block).max()
            e = -BIAS if amax == 0 else int(np.floor(np.log2(amax))) - (emax - 1)
            e = min(max(e, -BIAS), BIAS)
            biased[g, j] = e + BIAS
            q[g * GROUP_P:(g + 1) * GROUP_P, j * PACK:(j + 1) * PACK] = np.clip(block / 2.0 ** e, -limit, limit)
    return q, biased


def _pack8(q):
    """(P, 4F) fp8 -> (P, F) uint32, element 4j+k in byte k."""
    return np.ascontiguousarray(q).view(np.uint8).reshape(q.shape[0], -1, PACK).view("<u4")[..., 0]


def _pack4(q):
    """(P, 4F) fp4 -> (P, F) uint16, element 4j+k in nibble k."""
    nibbles = np.ascontiguousarray(q).view(np.uint8).astype(np.uint16).reshape(q.shape[0], -1, PACK) & 0xF
    return (nibbles << (np.arange(PACK, dtype=np.uint16) * 4)).sum(axis=2).astype(np.uint16)


def _scale_tile(biased, partitions):
    tile = np.zeros((partitions, biased.shape[1]), np.uint8)
    tile[[_scale_partition(g) for g in range(biased.shape[0])]] = biased
    return tile


def test_quantize_mx_e4m3fn(trn3, rng):
    magnitudes = np.exp2(rng.integers(-6, 6, size=(64, 1))).astype(np.float32)
    x = (rng.standard_normal((64, 32)) * magnitudes).astype(BF16)
    x[8:16, 4:8] = 0                                                   # an all-zero group

    def quantize(x_sb):
        q_sb = nl.ndarray((64, 8), dtype=nl.uint32, buffer=nl.sbuf)
        s_sb = nl.zeros((64, 8), dtype=nl.uint8)
        nisa.quantize_mx(dst=q_sb.view(nl.float8_e4m3fn_x4), src=x_sb, dst_scale=s_sb)
        return q_sb, s_sb

    packed, scales = run_tiles(quantize, x)
    q, biased = _reference_quantize(x.astype(np.float32), E4M3FN, emax=8)
    np.testing.assert_array_equal(packed, _pack8(q))
    np.testing.assert_array_equal(scales, _scale_tile(biased, 64))
    assert biased[1, 1] == 0                                           # zero group: 2**-127


def test_nc_matmul_mx_fp8_by_fp4_with_accumulate(trn3, rng):
    k, m, n = 64, 8, 16
    s_vals = rng.standard_normal((k, 4 * m)).astype(E4M3FN)
    v_vals = rng.choice([-6.0, -2.0, -0.5, 0.0, 0.5, 1.0, 1.5, 3.0, 4.0], size=(k, 4 * n)).astype(E2M1)
    s_biased = rng.integers(BIAS - 4, BIAS + 4, size=(k // GROUP_P, m)).astype(np.uint8)
    v_biased = rng.integers(BIAS - 4, BIAS + 4, size=(k // GROUP_P, n)).astype(np.uint8)

    def mx(s_raw, v_raw, s_scale, v_scale):
        acc_psum = nl.ndarray((m, n), dtype=nl.float32, buffer=nl.psum)
        for _ in range(2):
            nisa.nc_matmul_mx(dst=acc_psum, stationary=s_raw.view(nl.float8_e4m3fn_x4),
                              moving=v_raw.view(nl.float4_e2m1fn_x4), stationary_scale=s_scale, moving_scale=v_scale)
        out_sb = nl.ndarray((m, n), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=out_sb, src=acc_psum)
        return out_sb

    out = run_tiles(mx, _pack8(s_vals), _pack4(v_vals), _scale_tile(s_biased, k), _scale_tile(v_biased, k))

    def dequant(vals, biased):
        factor = np.repeat(np.exp2(biased.astype(np.float64) - BIAS), GROUP_P, axis=0)   # (K, free)
        return vals.astype(np.float64).reshape(k, -1, PACK) * factor[..., None]

    s_deq, v_deq = dequant(s_vals, s_biased), dequant(v_vals, v_biased)
    oracle = 2 * np.einsum("kmq,knq->mn", s_deq, v_deq)
    baseline = 2 * np.einsum("kmq,knq->mn", s_deq.astype(np.float32), v_deq.astype(np.float32))
    assert_parity(torch.from_numpy(out), torch.from_numpy(oracle), torch.from_numpy(baseline), kind="output",
                  dtype=torch.float32, name="nc_matmul_mx")


def test_mx_instructions_need_trn3(trn2):
    def quantize(x_sb):
        q_sb = nl.ndarray((32, 2), dtype=nl.uint32, buffer=nl.sbuf)
        s_sb = nl.zeros((32, 2), dtype=nl.uint8)
        nisa.quantize_mx(dst=q_sb.view(nl.float8_e4m3fn_x4), src=x_sb, dst_scale=s_sb)
        return q_sb

    with pytest.raises(NKIRuleError, match="NC-v4"):
        run_tiles(quantize, np.zeros((32, 8), BF16))
