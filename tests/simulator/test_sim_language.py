"""``nki.language`` beyond raw instructions (docs/nki-semantics.md §3.6, §5, §6.3, §9, §17): the 0.3+
convenience wrappers, creation functions, dynamic loops and registers, manual placement rules,
float->int conversion, DMA dtype rules, engine restrictions, integer sentinels.
"""

import numpy as np
import pytest
import torch
from sim_helpers import BF16, bits, run_tiles

from nki_lib.numerics import assert_parity
from nki_lib.simulator import NKIRuleError, jit, simulate, tile_size
from nki_lib.simulator import isa as nisa
from nki_lib.simulator import language as nl


def _ints(rng, shape, dtype=np.float32, lo=-8, hi=8):
    return rng.integers(lo, hi, size=shape, endpoint=True).astype(np.float32).astype(dtype)


# ---------------------------------------------------------------------------------------------
# convenience wrappers (§9.2-§9.4)


def test_load_matmul_transpose_store(rng):
    x = _ints(rng, (64, 32), BF16)
    y = _ints(rng, (64, 96), BF16)

    @jit
    def wrappers(x_hbm, y_hbm):
        x_sb = nl.load(x_hbm)
        y_sb = nl.load(y_hbm)
        xty_psum = nl.matmul(x_sb, y_sb, transpose_x=True)         # x.T @ y  (32, 96)
        xt_psum = nl.transpose(x_sb)                               # (32, 64)
        prod = nl.ndarray((32, 96), dtype=nl.float32, buffer=nl.shared_hbm)
        xt = nl.ndarray((32, 64), dtype=x_hbm.dtype, buffer=nl.shared_hbm)
        nl.store(prod, nl.copy(xty_psum))
        nl.store(xt, nl.copy(xt_psum, dtype=x_hbm.dtype))
        return prod, xt

    prod, xt = simulate(wrappers)(x, y)
    np.testing.assert_array_equal(prod, (x.astype(np.float64).T @ y.astype(np.float64)).astype(np.float32))
    np.testing.assert_array_equal(bits(xt), bits(x.T))


def test_elementwise_and_reduction_wrappers(rng):
    x = rng.standard_normal((16, 40)).astype(np.float32)
    col = rng.standard_normal((16, 1)).astype(np.float32)

    def math(x_sb, col_sb):
        shifted = nl.add(x_sb, col_sb)               # (P, 1) broadcast along the free dim
        scaled = nl.multiply(shifted, 0.5)
        total = nl.sum(scaled, axis=1)
        biggest = nl.max(x_sb, axis=[1], keepdims=True)
        mask = nl.greater(x_sb, 0.0)
        picked = nl.where(mask, x_sb, nl.negative(x_sb))
        return scaled, total, biggest, picked

    scaled, total, biggest, picked = run_tiles(math, x, col)
    expected_scaled = (x + col) * np.float32(0.5)
    np.testing.assert_array_equal(scaled, expected_scaled)
    assert_parity(torch.from_numpy(total.reshape(-1)), torch.from_numpy(expected_scaled).double().sum(1),
                  torch.from_numpy(expected_scaled).sum(1), kind="output", dtype=torch.float32)
    np.testing.assert_array_equal(biggest, x.max(axis=1, keepdims=True))
    np.testing.assert_array_equal(picked, np.abs(x))


def test_softmax_and_exp_wrappers(rng):
    x = (rng.standard_normal((32, 64)) * 3).astype(np.float32)

    def soft(x_sb):
        return nl.softmax(x_sb, axis=-1), nl.exp(x_sb)

    soft_out, exp_out = run_tiles(soft, x)
    xt = torch.from_numpy(x)
    assert_parity(torch.from_numpy(soft_out), torch.softmax(xt.double(), -1), torch.softmax(xt, -1),
                  kind="output", dtype=torch.float32)
    assert_parity(torch.from_numpy(exp_out), torch.exp(xt.double()), torch.exp(xt), kind="output",
                  dtype=torch.float32)


# ---------------------------------------------------------------------------------------------
# creation functions (§9.1)


def test_creation_functions():
    const = np.arange(12, dtype=np.float32).reshape(3, 4)

    @jit
    def create(x_hbm):
        z = nl.zeros((4, 6), dtype=nl.float32)
        o = nl.ones((4, 6), dtype=nl.bfloat16)
        f = nl.full((4, 6), 2.5, dtype=nl.float32)
        zl = nl.zeros_like(f, dtype=nl.int32)
        c_hbm = nl.shared_constant(const)
        c_sb = nl.ndarray((3, 4), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=c_sb, src=c_hbm)
        outs = []
        for t in (z, o, f, zl, c_sb):
            out = nl.ndarray(t.shape, dtype=t.dtype, buffer=nl.shared_hbm)
            nisa.dma_copy(dst=out, src=t)
            outs.append(out)
        return tuple(outs)

    z, o, f, zl, c = simulate(create)(np.zeros((1, 1), np.float32))
    np.testing.assert_array_equal(z, np.zeros((4, 6), np.float32))
    assert o.dtype == BF16 and (o.astype(np.float32) == 1).all()
    np.testing.assert_array_equal(f, np.full((4, 6), 2.5, np.float32))
    assert zl.dtype == np.int32 and (zl == 0).all()
    np.testing.assert_array_equal(c, const)


def test_program_ndim_with_and_without_grid():
    seen = []

    def probe(x_hbm):
        seen.append((nl.program_ndim(), nl.num_programs(axes=0), nl.program_id(axis=0)))
        return x_hbm

    kernel = jit(probe)
    x = np.zeros((1, 1), np.float32)
    simulate(kernel)(x)
    assert seen == [(0, 1, 0)]
    seen.clear()
    simulate(kernel[2])(x)
    assert sorted(seen) == [(1, 2, 0), (1, 2, 1)]


# ---------------------------------------------------------------------------------------------
# dynamic loops and registers (§5)


def test_dynamic_range_bound_from_register_and_scalar_offset(rng):
    table = rng.standard_normal((8, 5)).astype(np.float32)
    count = np.array([[3]], dtype=np.int32)

    @jit
    def copy_prefix(table_hbm, count_hbm):
        out = nl.ndarray((8, 5), dtype=nl.float32, buffer=nl.shared_hbm)
        zeros_sb = nl.zeros((8, 5), dtype=nl.float32)
        nisa.dma_copy(dst=out, src=zeros_sb)
        count_sb = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=count_sb, src=count_hbm)
        n_reg = nisa.register_alloc()
        nisa.register_load(n_reg, count_sb)
        for i in nl.dynamic_range(0, n_reg):
            row_sb = nl.ndarray((1, 5), dtype=nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=row_sb, src=table_hbm.ap([[5, 1], [1, 5]], offset=0, scalar_offset=i, indirect_dim=0))
            nisa.dma_copy(dst=out.ap([[5, 1], [1, 5]], offset=0, scalar_offset=i, indirect_dim=0), src=row_sb)
        return out

    expected = np.zeros_like(table)
    expected[:3] = table[:3]
    np.testing.assert_array_equal(simulate(copy_prefix)(table, count), expected)


def test_fori_loop_and_register_store():
    @jit
    def count_up(x_hbm):
        acc_sb = nl.zeros((1, 4), dtype=nl.int32)
        idx_sb = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)

        def body(i):
            nisa.register_store(idx_sb, i)
            nisa.tensor_scalar(dst=acc_sb, data=acc_sb, op0=nl.add, operand0=1)
            nisa.tensor_copy(dst=acc_sb[:, 3:4], src=idx_sb)

        nl.fori_loop(2, 7, body)
        out = nl.ndarray((1, 4), dtype=nl.int32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=acc_sb)
        return out

    np.testing.assert_array_equal(simulate(count_up)(np.zeros((1, 1), np.float32)), [[5, 5, 5, 6]])


# ---------------------------------------------------------------------------------------------
# placement, conversions, DMA and engine rules


def test_manual_placement_in_sbuf_and_psum(rng):
    x = _ints(rng, (16, 32), BF16)

    @jit
    def placed(x_hbm):
        x_sb = nl.ndarray((16, 32), dtype=nl.bfloat16, buffer=nl.sbuf, address=(0, 0))
        nisa.dma_copy(dst=x_sb, src=x_hbm)
        acc_psum = nl.ndarray((32, 32), dtype=nl.float32, buffer=nl.psum,
                              address=(0, 2 * tile_size.psum_bank_fmax_bytes))
        nisa.nc_matmul(dst=acc_psum, stationary=x_sb, moving=x_sb)
        out = nl.ndarray((32, 32), dtype=nl.float32, buffer=nl.shared_hbm)
        out_sb = nl.ndarray((32, 32), dtype=nl.float32, buffer=nl.sbuf, address=(32, 64))
        nisa.tensor_copy(dst=out_sb, src=acc_psum)
        nisa.dma_copy(dst=out, src=out_sb)
        return out

    expected = (x.astype(np.float64).T @ x.astype(np.float64)).astype(np.float32)
    np.testing.assert_array_equal(simulate(placed)(x), expected)


def test_psum_manual_placement_must_start_at_a_bank():
    @jit
    def misplaced(x_hbm):
        _acc_psum = nl.ndarray((16, 16), dtype=nl.float32, buffer=nl.psum, address=(0, 1024))
        return x_hbm

    with pytest.raises(NKIRuleError):
        simulate(misplaced)(np.zeros((1, 1), np.float32))


def test_sbuf_manual_placement_must_fit():
    @jit
    def beyond(x_hbm):
        _t_sb = nl.ndarray((16, 16), dtype=nl.float32, buffer=nl.sbuf,
                          address=(0, tile_size.total_available_sbuf_size - 32))
        return x_hbm

    with pytest.raises(NKIRuleError):
        simulate(beyond)(np.zeros((1, 1), np.float32))


def test_float_to_int_rounds_half_to_even_and_saturates():
    # docs/nki-semantics.md §6.3 / §14.2: round half to even, then saturate to the integer range
    x = np.array([[0.5, 1.5, 2.5, -2.5, 3.7, -3.7, 1e10, -1e10]], dtype=np.float32)

    def to_int(x_sb):
        i32 = nl.ndarray(x_sb.shape, dtype=nl.int32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=i32, src=x_sb)
        u8 = nl.ndarray(x_sb.shape, dtype=nl.uint8, buffer=nl.sbuf)
        nisa.tensor_copy(dst=u8, src=x_sb)
        return i32, u8

    i32, u8 = run_tiles(to_int, x)
    info = np.iinfo(np.int32)
    np.testing.assert_array_equal(i32, [[0, 2, 2, -2, 4, -4, info.max, info.min]])
    np.testing.assert_array_equal(u8, [[0, 2, 2, 0, 4, 0, 255, 0]])


def test_hwdge_dma_needs_equal_dtypes():
    @jit
    def cast_on_hwdge(x_hbm):
        t_sb = nl.ndarray((4, 4), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=t_sb, src=x_hbm, dge_mode=nisa.dge_mode.hwdge)
        return x_hbm

    with pytest.raises(NKIRuleError):
        simulate(cast_on_hwdge)(np.zeros((4, 4), np.float32))


def test_scalar_engine_tensor_scalar_pairs_on_trn2(trn2, rng):
    x = rng.standard_normal((8, 8)).astype(np.float32)

    def allowed(x_sb):
        y_sb = nl.ndarray(x_sb.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=y_sb, data=x_sb, op0=nl.multiply, operand0=2.0, op1=nl.add, operand1=1.0,
                           engine=nisa.scalar_engine)
        return y_sb

    np.testing.assert_array_equal(run_tiles(allowed, x), x * np.float32(2) + np.float32(1))

    def not_on_v3(x_sb):
        nisa.tensor_scalar(dst=x_sb, data=x_sb, op0=nl.maximum, operand0=0.0, engine=nisa.scalar_engine)
        return x_sb

    with pytest.raises(NKIRuleError):
        run_tiles(not_on_v3, x)


def test_unwritten_int_tile_reads_the_sentinel():
    @jit
    def fresh_int(x_hbm):
        t_sb = nl.ndarray((4, 4), dtype=nl.int32, buffer=nl.sbuf)
        out = nl.ndarray((4, 4), dtype=nl.int32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t_sb)
        return out

    np.testing.assert_array_equal(simulate(fresh_int)(np.zeros((1, 1), np.float32)), np.full((4, 4), 4))


def test_dma_transpose_3d(rng):
    x = rng.standard_normal((2, 4, 16)).astype(BF16)

    @jit
    def dma_t3(x_hbm):
        t_sb = nl.ndarray((16, 4, 2), dtype=x_hbm.dtype, buffer=nl.sbuf)
        nisa.dma_transpose(dst=t_sb, src=x_hbm, axes=(2, 1, 0))
        out = nl.ndarray((16, 4, 2), dtype=x_hbm.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t_sb)
        return out

    np.testing.assert_array_equal(bits(simulate(dma_t3)(x)), bits(x.transpose(2, 1, 0)))
