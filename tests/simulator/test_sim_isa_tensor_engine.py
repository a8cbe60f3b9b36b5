"""TensorE instructions against NumPy (docs/nki-semantics.md §6.5, §8.6, §8.8, §8.10): nc_matmul math per
input dtype, the overwrite/accumulate rules of §8.8 (accumulate=None/False/True, per-location
auto mode, fresh PSUM allocations), is_transpose, column tiling, nc_transpose on TensorE and
VectorE, dma_transpose, and bf16 PSUM results on trn3.

Matmul inputs are small integers, so every product and every fp32 partial sum is exact and the
expected values are exact too (no tolerance needed).
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from sim_helpers import BF16, FP8_E4M3, FP8_E5M2, FP16, FP32, bits, run_tiles

from nki_lib.simulator import isa as nisa
from nki_lib.simulator import jit, simulate
from nki_lib.simulator import language as nl


def _ints(rng, shape, dtype, lo=-8, hi=8):
    return rng.integers(lo, hi, size=shape, endpoint=True).astype(np.float32).astype(dtype)


def _product(s, m):
    return (s.astype(np.float64).T @ m.astype(np.float64)).astype(np.float32)


def _evict(acc_psum):
    out_sb = nl.ndarray(acc_psum.shape, dtype=acc_psum.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=out_sb, src=acc_psum)
    return out_sb


@pytest.mark.parametrize(
    ("s_dtype", "m_dtype"),
    [(BF16, BF16), (FP16, FP16), (FP32, FP32), (FP8_E4M3, BF16), (FP8_E5M2, FP8_E4M3), (BF16, FP16)],
    ids=str,
)
def test_nc_matmul_dtypes(rng, s_dtype, m_dtype):
    k, m, n = 128, 96, 200
    stationary = _ints(rng, (k, m), s_dtype, -4, 4)
    moving = _ints(rng, (k, n), m_dtype, -4, 4)

    def matmul(s_sb, m_sb):
        acc_psum = nl.ndarray((s_sb.shape[1], m_sb.shape[1]), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=acc_psum, stationary=s_sb, moving=m_sb)
        return _evict(acc_psum)

    out = run_tiles(matmul, stationary, moving)
    assert out.dtype == FP32
    np.testing.assert_array_equal(out, _product(stationary, moving))


def test_nc_matmul_positional_form_and_fp32_accumulation_of_fractions(rng):
    # bf16 products are exact in fp32; the sum is accumulated in fp32 (not rounded to bf16)
    k, m, n = 64, 32, 64
    stationary = (rng.integers(1, 128, size=(k, m)) / 128).astype(np.float32).astype(BF16)
    moving = np.ones((k, n), dtype=BF16)

    def matmul(s_sb, m_sb):
        acc_psum = nl.ndarray((m, n), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(acc_psum, s_sb, m_sb)
        return _evict(acc_psum)

    np.testing.assert_array_equal(run_tiles(matmul, stationary, moving), _product(stationary, moving))


@given(k=st.integers(1, 128), m=st.integers(1, 128), n=st.integers(1, 512), seed=st.integers(0, 2**16))
def test_nc_matmul_any_legal_shape(k, m, n, seed):
    rng = np.random.default_rng(seed)
    stationary = _ints(rng, (k, m), BF16)
    moving = _ints(rng, (k, n), BF16)

    def matmul(s_sb, m_sb):
        acc_psum = nl.ndarray((m, n), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=acc_psum, stationary=s_sb, moving=m_sb)
        return _evict(acc_psum)

    np.testing.assert_array_equal(run_tiles(matmul, stationary, moving), _product(stationary, moving))


# ---------------------------------------------------------------------------------------------
# accumulate rules (§8.8)


@pytest.fixture
def two_products(rng):
    a_s, a_m = _ints(rng, (128, 64), BF16), _ints(rng, (128, 256), BF16)
    b_s, b_m = _ints(rng, (128, 64), BF16), _ints(rng, (128, 256), BF16)
    return (a_s, a_m, b_s, b_m), _product(a_s, a_m), _product(b_s, b_m)


def test_accumulate_auto_first_write_overwrites_then_accumulates(two_products):
    arrays, pa, pb = two_products

    def auto(a_s, a_m, b_s, b_m):
        acc_psum = nl.ndarray((64, 256), dtype=nl.float32, buffer=nl.psum)  # NaN-filled when fresh
        nisa.nc_matmul(dst=acc_psum, stationary=a_s, moving=a_m)
        nisa.nc_matmul(dst=acc_psum, stationary=b_s, moving=b_m)
        return _evict(acc_psum)

    np.testing.assert_array_equal(run_tiles(auto, *arrays), pa + pb)


def test_accumulate_auto_fresh_allocation_starts_a_new_group(two_products):
    arrays, pa, pb = two_products

    def per_iteration(a_s, a_m, b_s, b_m):
        out_sb = nl.ndarray((64, 2 * 256), dtype=nl.float32, buffer=nl.sbuf)
        for i, (s_sb, m_sb) in enumerate(((a_s, a_m), (b_s, b_m))):
            acc_psum = nl.ndarray((64, 256), dtype=nl.float32, buffer=nl.psum)
            nisa.nc_matmul(dst=acc_psum, stationary=s_sb, moving=m_sb)
            nisa.tensor_copy(dst=out_sb[:, nl.ds(i * 256, 256)], src=acc_psum)
        return out_sb

    out = run_tiles(per_iteration, *arrays)
    np.testing.assert_array_equal(out[:, :256], pa)
    np.testing.assert_array_equal(out[:, 256:], pb)


def test_accumulate_false_overwrites_and_true_adds(two_products):
    arrays, pa, pb = two_products

    def explicit(a_s, a_m, b_s, b_m):
        acc_psum = nl.ndarray((64, 256), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=acc_psum, stationary=a_s, moving=a_m, accumulate=False)
        nisa.nc_matmul(dst=acc_psum, stationary=b_s, moving=b_m, accumulate=False)
        overwritten = _evict(acc_psum)
        nisa.nc_matmul(dst=acc_psum, stationary=a_s, moving=a_m, accumulate=True)
        return overwritten, _evict(acc_psum)

    overwritten, accumulated = run_tiles(explicit, *arrays)
    np.testing.assert_array_equal(overwritten, pb)
    np.testing.assert_array_equal(accumulated, pb + pa)


def test_accumulate_auto_is_tracked_per_psum_location(two_products):
    arrays, pa, pb = two_products

    def partial_then_full(a_s, a_m, b_s, b_m):
        acc_psum = nl.ndarray((64, 256), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=acc_psum[:, 0:128], stationary=a_s, moving=a_m[:, 0:128])
        nisa.nc_matmul(dst=acc_psum, stationary=b_s, moving=b_m)
        return _evict(acc_psum)

    out = run_tiles(partial_then_full, *arrays)
    np.testing.assert_array_equal(out[:, :128], pa[:, :128] + pb[:, :128])
    np.testing.assert_array_equal(out[:, 128:], pb[:, 128:])


def test_accumulate_auto_restarts_after_a_non_tensor_engine_write(two_products):
    # docs/nki-semantics.md §8.8 / §14.1: any non-TensorE write resets the auto flag of the locations
    arrays, pa, pb = two_products

    def rewrite(a_s, a_m, b_s, b_m):
        acc_psum = nl.ndarray((64, 256), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=acc_psum, stationary=a_s, moving=a_m)
        nisa.memset(dst=acc_psum, value=1000.0)
        nisa.nc_matmul(dst=acc_psum, stationary=b_s, moving=b_m)
        return _evict(acc_psum)

    np.testing.assert_array_equal(run_tiles(rewrite, *arrays), pb)


def test_k_tiled_accumulation_in_a_loop(rng):
    k_tiles, m, n = 3, 64, 128
    stationary = _ints(rng, (k_tiles * 128, m), BF16)
    moving = _ints(rng, (k_tiles * 128, n), BF16)

    # SBUF tiles hold at most 128 partitions: this kernel tiles K itself, straight from HBM
    @jit
    def k_accumulate(s_hbm, m_hbm):
        out_hbm = nl.ndarray((m, n), dtype=nl.float32, buffer=nl.shared_hbm)
        acc_psum = nl.ndarray((m, n), dtype=nl.float32, buffer=nl.psum)
        for kt in nl.affine_range(k_tiles):
            s_sb = nl.ndarray((128, m), dtype=s_hbm.dtype, buffer=nl.sbuf)
            m_sb = nl.ndarray((128, n), dtype=m_hbm.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=s_sb, src=s_hbm[nl.ds(kt * 128, 128), :])
            nisa.dma_copy(dst=m_sb, src=m_hbm[kt * 128:(kt + 1) * 128, :])
            nisa.nc_matmul(dst=acc_psum, stationary=s_sb, moving=m_sb)
        out_sb = _evict(acc_psum)
        nisa.dma_copy(dst=out_hbm, src=out_sb)
        return out_hbm

    np.testing.assert_array_equal(simulate(k_accumulate)(stationary, moving), _product(stationary, moving))


# ---------------------------------------------------------------------------------------------
# bf16 PSUM results and wide moving operands on trn3 (§3.5, §6.3, §8.8)


def test_bf16_psum_accumulation_rounds_each_write_on_trn3(trn3, rng):
    a_s, a_m = _ints(rng, (128, 32), BF16, 1, 8), _ints(rng, (128, 64), BF16, 1, 8)
    b_s, b_m = _ints(rng, (128, 32), BF16, 1, 8), _ints(rng, (128, 64), BF16, 1, 8)

    def bf16_acc(a_s_sb, a_m_sb, b_s_sb, b_m_sb):
        acc_psum = nl.ndarray((32, 64), dtype=nl.bfloat16, buffer=nl.psum)
        nisa.nc_matmul(dst=acc_psum, stationary=a_s_sb, moving=a_m_sb)
        first = _evict(acc_psum)
        nisa.nc_matmul(dst=acc_psum, stationary=b_s_sb, moving=b_m_sb)
        return first, _evict(acc_psum)

    first, second = run_tiles(bf16_acc, a_s, a_m, b_s, b_m)
    exp_first = _product(a_s, a_m).astype(BF16)
    exp_second = (exp_first.astype(np.float32) + _product(b_s, b_m)).astype(BF16)
    assert first.dtype == BF16
    np.testing.assert_array_equal(bits(first), bits(exp_first))
    np.testing.assert_array_equal(bits(second), bits(exp_second))
    assert not np.array_equal(second.astype(np.float32), _product(a_s, a_m) + _product(b_s, b_m))


def test_moving_free_1024_is_legal_on_trn3(trn3, rng):
    stationary, moving = _ints(rng, (128, 16), BF16), _ints(rng, (128, 1024), BF16)

    def wide(s_sb, m_sb):
        acc_psum = nl.ndarray((16, 1024), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=acc_psum, stationary=s_sb, moving=m_sb)
        return _evict(acc_psum)

    np.testing.assert_array_equal(run_tiles(wide, stationary, moving), _product(stationary, moving))


# ---------------------------------------------------------------------------------------------
# tiling mode, transposes


def test_column_tiling_writes_the_tile_position_rows(rng):
    stationary, moving = _ints(rng, (128, 64), BF16), _ints(rng, (128, 128), BF16)

    def column_tile(s_sb, m_sb):
        acc_psum = nl.ndarray((128, 128), dtype=nl.float32, buffer=nl.psum)
        nisa.memset(dst=acc_psum, value=0.0)
        nisa.nc_matmul(dst=acc_psum[nl.ds(64, 64), :], stationary=s_sb, moving=m_sb,
                       tile_position=(0, 64), tile_size=(128, 64))
        return _evict(acc_psum)

    out = run_tiles(column_tile, stationary, moving)
    np.testing.assert_array_equal(out[:64], np.zeros((64, 128), np.float32))
    np.testing.assert_array_equal(out[64:], _product(stationary, moving))



def _row_tile(s_sb, m_sb, parts, position):
    """One nc_matmul on the row tile at ``position`` (64 rows) over partitions ``parts`` of both operands."""
    acc_psum = nl.ndarray((s_sb.shape[1], m_sb.shape[1]), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=acc_psum, stationary=s_sb[parts], moving=m_sb[parts], tile_position=(position, 0),
                   tile_size=(64, nl.tile_size.pmax))
    return _evict(acc_psum)


def test_row_tiling_contracts_over_the_row_tile_partitions(rng):
    stationary, moving = _ints(rng, (128, 32), BF16), _ints(rng, (128, 96), BF16)
    out = run_tiles(lambda s_sb, m_sb: _row_tile(s_sb, m_sb, slice(64, 128), 64), stationary, moving)
    np.testing.assert_array_equal(out, _product(stationary[64:], moving[64:]))


def test_row_tiling_leaves_the_operand_start_partition_free(rng):
    """The docs constrain tile_position by the tile size and the array only, not where the operands
    start (nki_lib/simulator/README.md): operands on partitions 0..63 with the bottom row tile run."""
    stationary, moving = _ints(rng, (128, 32), BF16), _ints(rng, (128, 96), BF16)
    out = run_tiles(lambda s_sb, m_sb: _row_tile(s_sb, m_sb, slice(0, 64), 64), stationary, moving)
    np.testing.assert_array_equal(out, _product(stationary[:64], moving[:64]))


def test_double_row_combines_with_row_tiling(rng):
    """Only column tiling is excluded with double_row; a row tile of 64 partitions (K = 128) runs."""
    stationary, moving = _ints(rng, (64, 2, 16), FP8_E4M3, -2, 2), _ints(rng, (64, 2, 24), FP8_E4M3, -2, 2)

    def double_row_tile(s_sb, m_sb):
        acc_psum = nl.ndarray((16, 24), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=acc_psum, stationary=s_sb, moving=m_sb, perf_mode=nisa.matmul_perf_mode.double_row,
                       tile_position=(64, 0), tile_size=(64, nl.tile_size.pmax))
        return _evict(acc_psum)

    out = run_tiles(double_row_tile, stationary, moving)
    expected = sum(_product(stationary[:, j, :], moving[:, j, :]) for j in range(2))
    np.testing.assert_array_equal(out, expected)


def _special_values(rng, shape, dtype):
    x = rng.standard_normal(shape).astype(np.float32)
    x.flat[[0, 5, 17]] = [np.nan, np.inf, -np.inf]
    return x.astype(dtype)


@pytest.mark.parametrize("dtype", [BF16, FP32, FP16], ids=str)
def test_nc_transpose_tensor_engine_is_bit_exact(rng, dtype):
    x = _special_values(rng, (96, 80), dtype)

    def transpose(x_sb):
        t_psum = nl.ndarray((x_sb.shape[1], x_sb.shape[0]), dtype=x_sb.dtype, buffer=nl.psum)
        nisa.nc_transpose(dst=t_psum, data=x_sb, engine=nisa.tensor_engine)
        return _evict(t_psum)

    np.testing.assert_array_equal(bits(run_tiles(transpose, x)), bits(x.T))


def test_nc_transpose_vector_engine_and_multidim_free(rng):
    x = rng.standard_normal((24, 4 * 8)).astype(np.float32)

    def transpose(x_sb):
        x3_sb = nl.ndarray((24, 4, 8), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=x3_sb, src=x_sb)
        t_sb = nl.ndarray((32, 24), dtype=nl.float32, buffer=nl.sbuf)
        nisa.nc_transpose(t_sb, x3_sb, engine=nisa.engine.vector)  # (P, f1, f2) flattens to (P, F)
        return t_sb

    np.testing.assert_array_equal(run_tiles(transpose, x), x.T)


def test_nc_matmul_is_transpose_mode_is_exact_and_keeps_16_bit(rng):
    x = _special_values(rng, (64, 128), BF16)
    identity = np.eye(64, dtype=BF16)

    def transpose(x_sb, eye_sb):
        t_psum = nl.ndarray((128, 64), dtype=nl.bfloat16, buffer=nl.psum)
        nisa.nc_matmul(dst=t_psum, stationary=x_sb, moving=eye_sb, is_transpose=True)
        return _evict(t_psum)

    out = run_tiles(transpose, x, identity)
    assert out.dtype == BF16
    np.testing.assert_array_equal(bits(out), bits(x.T))


def test_nc_matmul_with_shared_identity_matrix(rng):
    x = _ints(rng, (48, 96), BF16)

    def transpose(x_sb):
        eye_sb = nl.shared_identity_matrix(48, dtype=nl.bfloat16)
        t_psum = nl.ndarray((96, 48), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=t_psum, stationary=x_sb, moving=eye_sb[0:48, 0:48])
        return _evict(t_psum)

    np.testing.assert_array_equal(run_tiles(transpose, x), x.T.astype(np.float32))


@pytest.mark.parametrize("dge_mode", [None, 3, 1], ids=["default", "none_by_value", "swdge_by_value"])
def test_dma_transpose_2d(rng, dge_mode):
    """Every dge_mode on a direct transpose (docs/nki-semantics.md §8.10: the public NKI Library
    passes none = 3 to direct static transposes, though the API page lists only unknown and hwdge)."""
    x = rng.standard_normal((16, 96)).astype(BF16)
    mode = {} if dge_mode is None else {"dge_mode": dge_mode}

    @jit
    def dma_t(x_hbm):
        t_sb = nl.ndarray((96, 16), dtype=x_hbm.dtype, buffer=nl.sbuf)
        nisa.dma_transpose(dst=t_sb, src=x_hbm, **mode)
        out_hbm = nl.ndarray((96, 16), dtype=x_hbm.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out_hbm, src=t_sb)
        return out_hbm

    np.testing.assert_array_equal(bits(simulate(dma_t)(x)), bits(x.T))


def test_accumulate_true_onto_a_fresh_psum_tile_reads_its_nan(rng):
    # accumulate=True needs an initialised PSUM location (§8.8); a fresh one holds NaN (§3.6)
    stationary, moving = _ints(rng, (32, 16), BF16), _ints(rng, (32, 24), BF16)

    def fresh(s_sb, m_sb):
        acc_psum = nl.ndarray((16, 24), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=acc_psum, stationary=s_sb, moving=m_sb, accumulate=True)
        return _evict(acc_psum)

    assert np.isnan(run_tiles(fresh, stationary, moving)).all()


_PSUM_COLS = 64
_column_range = st.tuples(st.integers(0, _PSUM_COLS - 1), st.integers(1, _PSUM_COLS)).map(
    lambda r: (min(r[0], r[1] - 1), max(r[0] + 1, r[1])))
_psum_step = st.one_of(
    st.tuples(st.just("matmul"), _column_range, st.sampled_from([None, True, False])),
    st.tuples(st.just("memset"), _column_range, st.integers(-3, 3)),
)


@given(steps=st.lists(_psum_step, min_size=1, max_size=6), seed=st.integers(0, 2**16))
def test_psum_write_sequences_follow_the_accumulate_model(steps, seed):
    # model of §8.8 / §14.1: per-location "written by a matmul" flag; auto mode overwrites where
    # unset and adds where set; any non-TensorE write clears the flag; fresh PSUM reads NaN
    rng = np.random.default_rng(seed)
    stationary = _ints(rng, (32, 16), BF16)
    moving = _ints(rng, (32, _PSUM_COLS), BF16)
    product = _product(stationary, moving)
    value = np.full((16, _PSUM_COLS), np.nan, np.float32)
    started = np.zeros((16, _PSUM_COLS), bool)
    for kind, (lo, hi), arg in steps:
        cols = slice(lo, hi)
        if kind == "memset":
            value[:, cols], started[:, cols] = arg, False
            continue
        if arg is None:
            value[:, cols] = np.where(started[:, cols], value[:, cols] + product[:, cols], product[:, cols])
        else:
            value[:, cols] = value[:, cols] + product[:, cols] if arg else product[:, cols]
        started[:, cols] = True

    def sequence(s_sb, m_sb):
        acc_psum = nl.ndarray((16, _PSUM_COLS), dtype=nl.float32, buffer=nl.psum)
        for kind, (lo, hi), arg in steps:
            if kind == "memset":
                nisa.memset(dst=acc_psum[:, lo:hi], value=float(arg))
            else:
                nisa.nc_matmul(dst=acc_psum[:, lo:hi], stationary=s_sb, moving=m_sb[:, lo:hi], accumulate=arg)
        return _evict(acc_psum)

    np.testing.assert_array_equal(run_tiles(sequence, stationary, moving), value)
