"""Reductions, index generation, selection and cross-partition instructions against NumPy
(docs/nki-semantics.md §8.11, §8.13, §8.15, §8.20–§8.28) including the self-test vectors of §13.7.
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from sim_helpers import BF16, bits, run_tiles

from nki_lib.simulator import isa as nisa
from nki_lib.simulator import jit, simulate
from nki_lib.simulator import language as nl

FP32_MIN = float(np.finfo(np.float32).min)


def _int_valued(rng, shape, lo=-50, hi=50):
    return rng.integers(lo, hi, size=shape, endpoint=True).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# tensor_reduce


@pytest.mark.parametrize(
    ("op", "np_fn"),
    [(nl.add, np.sum), (nl.maximum, np.max), (nl.minimum, np.min), (nl.multiply, np.prod)],
)
def test_tensor_reduce_last_axis_into_p_by_1(rng, op, np_fn):
    x = _int_valued(rng, (64, 12), -3, 3)

    def reduce(x_sb):
        r_sb = nl.ndarray((64, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=r_sb, op=op, data=x_sb, axis=1)
        return r_sb

    np.testing.assert_array_equal(run_tiles(reduce, x), np_fn(x, axis=1, keepdims=True))


def test_tensor_reduce_negate_positional_and_bf16_rounding(rng):
    x = rng.standard_normal((32, 100)).astype(np.float32)

    def reduce(x_sb):
        r_sb = nl.ndarray((32, 1), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.tensor_reduce(r_sb, nl.maximum, x_sb, 1, negate=True)
        return r_sb

    out = run_tiles(reduce, x)
    np.testing.assert_array_equal(bits(out), bits((-x.max(axis=1, keepdims=True)).astype(BF16)))


def test_tensor_reduce_trailing_axes_of_3d_tile(rng):
    x = _int_valued(rng, (16, 6 * 5))

    def reduce(x_sb):
        x3_sb = nl.ndarray((16, 6, 5), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=x3_sb, src=x_sb)
        both_sb = nl.ndarray((16, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=both_sb, op=nl.add, data=x3_sb, axis=(1, 2))
        last_sb = nl.ndarray((16, 6), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=last_sb, op=nl.add, data=x3_sb, axis=2)
        keep_sb = nl.ndarray((16, 6, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=keep_sb, op=nl.maximum, data=x3_sb, axis=(2,), keepdims=True)
        return both_sb, last_sb, keep_sb

    both, last, keep = run_tiles(reduce, x)
    x3 = x.reshape(16, 6, 5)
    np.testing.assert_array_equal(both, x3.sum(axis=(1, 2))[:, None])
    np.testing.assert_array_equal(last, x3.sum(axis=2))
    np.testing.assert_array_equal(keep, x3.max(axis=2, keepdims=True))


def test_tensor_scalar_reduce(rng):
    x = rng.standard_normal((64, 40)).astype(np.float32)

    def scaled_max(x_sb):
        y_sb = nl.ndarray(x_sb.shape, dtype=nl.float32, buffer=nl.sbuf)
        m_sb = nl.ndarray((64, 4), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=m_sb, value=0.0)
        nisa.tensor_scalar_reduce(y_sb, data=x_sb, op0=nl.multiply, operand0=0.125, reduce_op=nl.maximum,
                                  reduce_res=m_sb[:, 2])
        return y_sb, m_sb

    y, m = run_tiles(scaled_max, x)
    scaled = x * np.float32(0.125)
    np.testing.assert_array_equal(y, scaled)
    np.testing.assert_array_equal(m[:, 2], scaled.max(axis=1))
    np.testing.assert_array_equal(m[:, [0, 1, 3]], np.zeros((64, 3), np.float32))


def test_tensor_partition_reduce_13_7(rng):
    x = _int_valued(rng, (128, 32 * 4))

    def part_reduce(x_sb):
        x3_sb = nl.ndarray((128, 32, 4), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=x3_sb, src=x_sb)
        results = []
        for op in (nl.add, nl.maximum, nl.average):
            r_sb = nl.ndarray((1, 32, 4), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_partition_reduce(r_sb, op, x3_sb)
            results.append(r_sb)
        return tuple(results)

    total, biggest, mean = run_tiles(part_reduce, x)
    x3 = x.reshape(128, 32, 4)
    np.testing.assert_array_equal(total, x3.sum(axis=0, keepdims=True))
    np.testing.assert_array_equal(biggest, x3.max(axis=0, keepdims=True))
    np.testing.assert_array_equal(mean, x3.sum(axis=0, keepdims=True) / 128)


# ---------------------------------------------------------------------------------------------
# max8 / nc_find_index8


def test_max8_descending_top8(rng):
    x = rng.permutation(64 * 50).reshape(64, 50).astype(np.float32) - 1000

    def top8(x_sb):
        m_sb = nl.ndarray((64, 8), dtype=nl.float32, buffer=nl.sbuf)
        nisa.max8(dst=m_sb, src=x_sb)
        return m_sb

    np.testing.assert_array_equal(run_tiles(top8, x), -np.sort(-x, axis=1)[:, :8])


def test_find_index8_pairs_duplicates_in_ascending_order_13_7():
    data = np.array([[1, 2, 3, 4, 8, 8, 8, 8, 8, 8, 8]], dtype=np.float32).repeat(4, axis=0)
    vals = np.array([[3, 8, 8, 8, 8, 8, 8, 8]], dtype=np.float32).repeat(4, axis=0)

    def find(data_sb, vals_sb):
        idx_sb = nl.ndarray((4, 8), dtype=nl.uint32, buffer=nl.sbuf)
        nisa.nc_find_index8(dst=idx_sb, data=data_sb, vals=vals_sb)
        return idx_sb

    out = run_tiles(find, data, vals)
    assert out.dtype == np.uint32
    np.testing.assert_array_equal(out, np.array([[2, 4, 5, 6, 7, 8, 9, 10]] * 4, dtype=np.uint32))


def test_max8_then_find_index8_gives_argsort_and_sentinel(rng):
    x = rng.permutation(32 * 20).reshape(32, 20).astype(np.float32)
    absent = np.full((32, 8), -1.0, np.float32)

    def topk(x_sb, absent_sb):
        m_sb = nl.ndarray((32, 8), dtype=nl.float32, buffer=nl.sbuf)
        nisa.max8(dst=m_sb, src=x_sb)
        idx_sb = nl.ndarray((32, 8), dtype=nl.uint32, buffer=nl.sbuf)
        nisa.nc_find_index8(dst=idx_sb, data=x_sb, vals=m_sb)
        miss_sb = nl.ndarray((32, 8), dtype=nl.uint16, buffer=nl.sbuf)
        nisa.nc_find_index8(dst=miss_sb, data=x_sb, vals=absent_sb)
        return idx_sb, miss_sb

    idx, miss = run_tiles(topk, x, absent)
    np.testing.assert_array_equal(idx, np.argsort(-x, axis=1, kind="stable")[:, :8].astype(np.uint32))
    np.testing.assert_array_equal(miss, np.full((32, 8), 0xFFFF, np.uint16))


# ---------------------------------------------------------------------------------------------
# iota / affine_select (§8.13, §8.20, §13.7)


def _run_no_input(body):
    @jit
    def kernel():
        res_sb = body()
        out_hbm = nl.ndarray(res_sb.shape, dtype=res_sb.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out_hbm, src=res_sb)
        return out_hbm

    return simulate(kernel)()


def test_iota_13_7_partition_plus_free():
    def body():
        t_sb = nl.ndarray((128, 512), dtype=nl.int32, buffer=nl.sbuf)
        nisa.iota(t_sb, [[1, 512]], offset=0, channel_multiplier=1)
        return t_sb

    p, f = np.meshgrid(np.arange(128), np.arange(512), indexing="ij")
    np.testing.assert_array_equal(_run_no_input(body), (p + f).astype(np.int32))


def test_iota_13_7_column_and_float_dst():
    def body():
        t_sb = nl.ndarray((128, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.iota(dst=t_sb, pattern=[[1, 1]], offset=5, channel_multiplier=2)
        return t_sb

    np.testing.assert_array_equal(_run_no_input(body), (5 + 2 * np.arange(128, dtype=np.float32))[:, None])


def test_iota_multidim_pattern_negative_step_relative_partition():
    def body():
        t_sb = nl.ndarray((64, 24), dtype=nl.int32, buffer=nl.sbuf)
        nisa.memset(dst=t_sb, value=0)
        nisa.iota(dst=t_sb[32:48, :], pattern=[[10, 2], [-1, 3], [100, 4]], offset=7, channel_multiplier=3)
        return t_sb

    c, w, y, x = np.meshgrid(np.arange(16), np.arange(2), np.arange(3), np.arange(4), indexing="ij")
    values = (7 + 3 * c + 10 * w - y + 100 * x).reshape(16, 24)
    expected = np.zeros((64, 24), np.int32)
    expected[32:48] = values
    np.testing.assert_array_equal(_run_no_input(body), expected)


def test_affine_select_causal_mask_13_7(rng):
    a = rng.standard_normal((128, 128)).astype(np.float32)

    def causal(a_sb):
        m_sb = nl.ndarray(a_sb.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.affine_select(m_sb, pattern=[[-1, 128]], channel_multiplier=1, on_true_tile=a_sb,
                           on_false_value=FP32_MIN, cmp_op=nl.greater_equal, offset=0)
        return m_sb

    p, f = np.meshgrid(np.arange(128), np.arange(128), indexing="ij")
    np.testing.assert_array_equal(run_tiles(causal, a), np.where(p >= f, a, np.float32(FP32_MIN)))


def test_affine_select_in_place_with_offset_and_bf16(rng):
    a = rng.standard_normal((64, 96)).astype(BF16)
    q0, k0 = 32, 48

    def shifted(a_sb):
        nisa.affine_select(a_sb, pattern=[[-1, 96]], channel_multiplier=1, on_true_tile=a_sb,
                           on_false_value=-30000.0, cmp_op=nl.greater_equal, offset=q0 - k0)
        return a_sb

    p, f = np.meshgrid(np.arange(64), np.arange(96), indexing="ij")
    expected = np.where(q0 + p >= k0 + f, a, np.float32(-30000.0).astype(BF16))
    np.testing.assert_array_equal(bits(run_tiles(shifted, a)), bits(expected))


# ---------------------------------------------------------------------------------------------
# nc_stream_shuffle, nonzero_with_count, local_gather, range_select, dma_compute


def test_nc_stream_shuffle_rotates_each_quadrant_13_7(rng):
    x = rng.standard_normal((128, 16)).astype(np.float32)
    mask = [(i - 1) % 32 for i in range(32)]

    def rotate(a_sb):
        nisa.nc_stream_shuffle(dst=a_sb, src=a_sb, shuffle_mask=mask)
        return a_sb

    expected = np.empty_like(x)
    for q in range(4):
        for i in range(32):
            expected[q * 32 + i] = x[q * 32 + (i - 1) % 32]
    np.testing.assert_array_equal(run_tiles(rotate, x), expected)


def test_nc_stream_shuffle_255_keeps_dst_and_broadcast_idiom(rng):
    x = rng.standard_normal((32, 8)).astype(np.float32)
    y = np.zeros((64, 8), np.float32)
    mask = [0] * 16 + [255] * 16

    def broadcast(x_sb, y_sb):
        nisa.nc_stream_shuffle(dst=y_sb[32:64, :], src=x_sb[0:1, :], shuffle_mask=mask)
        return y_sb

    expected = y.copy()
    expected[32:48] = x[0]
    np.testing.assert_array_equal(run_tiles(broadcast, x, y), expected)


def test_nonzero_with_count_13_7():
    row = np.array([0, 1, 1, 0, 0, 1, 0, 0], dtype=np.float32)
    src = np.tile(row, (128, 1))

    def nonzero(src_sb):
        idx_sb = nl.ndarray((128, 9), dtype=nl.int32, buffer=nl.sbuf)
        nisa.memset(dst=idx_sb, value=7)
        nisa.nonzero_with_count(src=src_sb, dst=idx_sb, index_offset=16, padding_val=-1)
        return idx_sb

    expected = np.full((128, 9), 7, np.int32)
    expected[0::16] = [17, 18, 21, -1, -1, -1, -1, -1, 3]
    np.testing.assert_array_equal(run_tiles(nonzero, src), expected)


def test_local_gather_golden_8_28(rng):
    n_part, n_free, per_idx, n_valid = 32, 40, 2, 10
    src = rng.standard_normal((n_part, n_free)).astype(np.float32)
    index = rng.integers(0, n_free - per_idx, size=(n_part, 1)).astype(np.uint16)

    def gather(src_sb, index_sb):
        dst_sb = nl.ndarray((n_part, n_valid * per_idx), dtype=nl.float32, buffer=nl.sbuf)
        nisa.local_gather(dst=dst_sb, src_buffer=src_sb, index=index_sb, num_elem_per_idx=per_idx,
                          num_valid_indices=n_valid)
        return dst_sb

    expected = np.empty((n_part, n_valid * per_idx), np.float32)
    for g in range(n_part // 16):
        idx = index[g * 16:(g + 1) * 16, :].flatten(order="F")[:n_valid].astype(np.int64)
        for p in range(g * 16, (g + 1) * 16):
            for v in range(n_valid):
                expected[p, v * per_idx:(v + 1) * per_idx] = src[p, idx[v]:idx[v] + per_idx]
    np.testing.assert_array_equal(run_tiles(gather, src, index), expected)


def test_range_select_window_and_row_max(rng):
    x = rng.standard_normal((64, 50)).astype(np.float32)
    lo = rng.integers(0, 20, size=(64, 1)).astype(np.float32)
    hi = lo + rng.integers(1, 20, size=(64, 1)).astype(np.float32)

    def window(x_sb, lo_sb, hi_sb):
        y_sb = nl.ndarray(x_sb.shape, dtype=nl.float32, buffer=nl.sbuf)
        m_sb = nl.ndarray((64, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.range_select(dst=y_sb, on_true_tile=x_sb, comp_op0=nl.greater_equal, comp_op1=nl.less,
                          bound0=lo_sb, bound1=hi_sb, reduce_cmd=nisa.reduce_cmd.reset_reduce,
                          reduce_res=m_sb, reduce_op=nl.maximum, range_start=0, on_false_value=FP32_MIN)
        return y_sb, m_sb

    y, m = run_tiles(window, x, lo, hi)
    j = np.arange(50)[None, :]
    expected = np.where((j >= lo) & (j < hi), x, np.float32(FP32_MIN))
    np.testing.assert_array_equal(y, expected)
    np.testing.assert_array_equal(m, expected.max(axis=1, keepdims=True))


def test_dma_compute_sums_hbm_sources(rng):
    a = rng.standard_normal((8, 64)).astype(np.float32)
    b = rng.standard_normal((8, 64)).astype(np.float32)

    @jit
    def add_hbm(a_hbm, b_hbm):
        out_hbm = nl.ndarray(a_hbm.shape, dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_compute(dst=out_hbm, srcs=[a_hbm, b_hbm], scales=[1.0, 1.0], reduce_op=nl.add)
        return out_hbm

    np.testing.assert_array_equal(simulate(add_hbm)(a, b), a + b)


_REDUCERS = {"add": np.add, "maximum": np.maximum, "minimum": np.minimum, "multiply": np.multiply}


@given(
    p=st.integers(1, 128), free=st.lists(st.integers(1, 6), min_size=1, max_size=3),
    reduced=st.integers(1, 3), op=st.sampled_from(sorted(_REDUCERS)), negate=st.booleans(),
    out_dtype=st.sampled_from([np.dtype(np.float32), BF16]), seed=st.integers(0, 2**16),
)
def test_tensor_reduce_matches_the_fp32_model(p, free, reduced, op, negate, out_dtype, seed):
    reduced = min(reduced, len(free))
    axes = tuple(range(1 + len(free) - reduced, 1 + len(free)))      # trailing free axes
    shape = (p, *free)
    bound = 1 if op == "multiply" else 3          # products stay finite whatever the order
    x = np.random.default_rng(seed).integers(-bound, bound, size=shape, endpoint=True).astype(np.float32)
    kept = shape[:1 + len(free) - reduced]

    def body(x_sb):
        x_nd = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=x_nd, src=x_sb)
        r_sb = nl.ndarray(kept if len(kept) > 1 else (p, 1), dtype=out_dtype, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=r_sb, op=getattr(nl, op), data=x_nd, axis=axes, negate=negate)
        return r_sb

    expected = _REDUCERS[op].reduce(x.reshape(*kept, -1), axis=-1)
    expected = (-expected if negate else expected).astype(np.float32).astype(out_dtype)
    out = run_tiles(body, x.reshape(p, -1))
    np.testing.assert_array_equal(bits(out.reshape(expected.shape)), bits(expected))


def test_dma_compute_scatter_rmw_adds_rows_and_skips_padding(rng):
    """nki.isa.dma_compute "Scatter RMW": dst(HBM)[indices] += src(SBUF), fp32 inside the DMA;
    index -1 rows are skipped with oob_mode.skip."""
    acc = rng.standard_normal((6, 8)).astype(np.float32)
    rows = rng.standard_normal((4, 8)).astype(np.float32)
    ids = np.array([[4], [-1], [0], [2]], dtype=np.int32)

    @jit
    def scatter_add(acc_in, rows_in, ids_in):
        acc_hbm = nl.ndarray(acc_in.shape, dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=acc_hbm, src=acc_in)
        rows_sb = nl.ndarray(rows_in.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=rows_sb, src=rows_in)
        ids_sb = nl.ndarray(ids_in.shape, dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=ids_sb, src=ids_in)
        view = acc_hbm.ap([[8, 4], [1, 8]], offset=0, vector_offset=ids_sb, indirect_dim=0)
        nisa.dma_compute(dst=view, srcs=[view, rows_sb], reduce_op=nl.add, oob_mode=nisa.oob_mode.skip)
        return acc_hbm

    expected = acc.copy()
    for p, t in enumerate(ids[:, 0]):
        if t >= 0:
            expected[t] += rows[p]
    np.testing.assert_array_equal(simulate(scatter_add)(acc, rows, ids), expected)
