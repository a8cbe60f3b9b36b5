"""Views and access patterns (docs/nki-semantics.md §4): indexing rules, ``nl.ds``, ``get_pattern``, exact
``.ap()`` semantics (non-composable, offset inheritance, stride-0 reads, dtype reinterpretation,
partition-stride rule, scalar/vector dynamic offsets with oob_mode), ``.view(dtype)`` and
``reshape``, and a hypothesis sweep over tile shapes.
"""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from sim_helpers import BF16, FLOAT_DTYPES, INT_DTYPES, bits, run_tiles

from nki_lib.simulator import NKIRuleError, jit, simulate
from nki_lib.simulator import isa as nisa
from nki_lib.simulator import language as nl


def _hbm_kernel(body):
    """Kernel whose body gets the HBM arguments and returns one SBUF or HBM tensor."""

    @jit
    def kernel(*inputs):
        res = body(*inputs)
        if res.buffer == nl.shared_hbm:
            return res
        out_hbm = nl.ndarray(res.shape, dtype=res.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out_hbm, src=res)
        return out_hbm

    return simulate(kernel)


# ---------------------------------------------------------------------------------------------
# indexing (§4.2)


def test_indexing_shapes_on_chip_and_hbm():
    shapes = {}

    def probe(x_hbm):
        t3 = nl.ndarray((16, 6, 5), dtype=nl.float32, buffer=nl.sbuf)
        t2 = nl.ndarray((16, 7), dtype=nl.float32, buffer=nl.sbuf)
        shapes["partition_int"] = tuple(t3[0, :, :].shape)
        shapes["free_int_3d"] = tuple(t3[:, 0, :].shape)
        shapes["two_free_ints"] = tuple(t3[:, 0, 4].shape)
        shapes["last_int_2d"] = tuple(t2[:, 3].shape)
        shapes["ds"] = tuple(t2[nl.ds(2, 4), nl.ds(1, 3)].shape)
        shapes["ellipsis"] = tuple(t3[..., 1:3].shape)
        shapes["step"] = tuple(t2[:, 0:7:2].shape)
        shapes["hbm_int"] = tuple(x_hbm[1].shape)
        shapes["hbm_two_ints"] = tuple(x_hbm[1, :, 2].shape)
        shapes["pattern"] = [list(p) for p in t3.get_pattern()]
        shapes["slice_pattern"] = [list(p) for p in t3[2:10, 1, 1:4].get_pattern()]
        nisa.memset(dst=t2, value=0.0)
        return t2

    _hbm_kernel(probe)(np.zeros((3, 4, 5), np.float32))
    assert shapes["partition_int"] == (1, 6, 5)
    assert shapes["free_int_3d"] == (16, 5)
    assert shapes["two_free_ints"] == (16, 1)
    assert shapes["last_int_2d"] == (16, 1)
    assert shapes["ds"] == (4, 3)
    assert shapes["ellipsis"] == (16, 6, 2)
    assert shapes["step"] == (16, 4)
    assert shapes["hbm_int"] == (4, 5)
    assert shapes["hbm_two_ints"] == (4,)
    assert shapes["pattern"] == [[30, 16], [5, 6], [1, 5]]
    assert shapes["slice_pattern"] == [[30, 8], [1, 3]]


def test_slices_and_ds_address_the_same_elements(rng):
    x = rng.standard_normal((32, 64)).astype(np.float32)

    def pick(x_sb):
        a_sb = nl.ndarray((8, 3, 5), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=a_sb, src=x_sb[nl.ds(4, 8), 10:25].ap([[64, 8], [5, 3], [1, 5]], offset=None))
        b_sb = nl.ndarray((8, 8), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=b_sb, src=x_sb[4:12, 3:64:8])
        return a_sb, b_sb

    a, b = run_tiles(pick, x)
    np.testing.assert_array_equal(a, x[4:12, 10:25].reshape(8, 3, 5))
    np.testing.assert_array_equal(b, x[4:12, 3:64:8])


def test_out_of_range_slice_is_rejected():
    def bad(x_hbm):
        t = nl.ndarray((16, 8), dtype=nl.float32, buffer=nl.sbuf)
        return t[:, 4:12]

    with pytest.raises((NKIRuleError, IndexError)):
        _hbm_kernel(bad)(np.zeros((2, 2), np.float32))


# ---------------------------------------------------------------------------------------------
# .ap() (§4.4)


def test_ap_on_hbm_reads_a_transposed_pattern(rng):
    x = rng.standard_normal((3, 4)).astype(np.float32)

    def transposed(x_hbm):
        t_sb = nl.ndarray((4, 3), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t_sb, src=x_hbm.ap([[1, 4], [4, 3]], offset=0))
        return t_sb

    np.testing.assert_array_equal(_hbm_kernel(transposed)(x), x.T)


def test_ap_is_not_composable_but_offset_none_inherits_the_view_offset():
    x = np.arange(16, dtype=np.float32)

    def views(x_hbm):
        out_sb = nl.ndarray((1, 6), dtype=nl.float32, buffer=nl.sbuf)
        tail = x_hbm[4:16]
        nisa.dma_copy(dst=out_sb[:, 0:2], src=tail.ap([[1, 2]]))              # inherits offset 4
        nisa.dma_copy(dst=out_sb[:, 2:4], src=tail.ap([[1, 2]], offset=0))    # absolute from storage start
        nisa.dma_copy(dst=out_sb[:, 4:6], src=tail.ap([[3, 2]], offset=1))    # elements 1 and 4
        return out_sb

    np.testing.assert_array_equal(_hbm_kernel(views)(x), [[4, 5, 0, 1, 1, 4]])


def test_ap_on_chip_partition_offset_and_stride0_broadcast(rng):
    x = rng.standard_normal((16, 10)).astype(np.float32)

    def broadcast(x_sb):
        y_sb = nl.ndarray((8, 4, 3), dtype=nl.float32, buffer=nl.sbuf)
        # partitions 4..11, free element 2 read 4 times, then elements 2,3,4 along the last dim
        nisa.tensor_copy(dst=y_sb, src=x_sb.ap([[10, 8], [0, 4], [1, 3]], offset=4 * 10 + 2))
        return y_sb

    expected = np.broadcast_to(x[4:12, None, 2:5], (8, 4, 3))
    np.testing.assert_array_equal(run_tiles(broadcast, x), expected)


def test_ap_on_chip_swaps_free_dims(rng):
    x = rng.standard_normal((8, 6 * 5)).astype(np.float32)

    def swap(x_sb):
        y_sb = nl.ndarray((8, 5, 6), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=y_sb, src=x_sb.ap([[30, 8], [1, 5], [5, 6]], offset=0))
        return y_sb

    np.testing.assert_array_equal(run_tiles(swap, x), x.reshape(8, 6, 5).transpose(0, 2, 1))


def test_ap_on_chip_partition_stride_must_equal_storage_row():
    def every_other_partition(x_sb):
        y_sb = nl.ndarray((4, 10), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=y_sb, src=x_sb.ap([[20, 4], [1, 10]], offset=0))
        return y_sb

    with pytest.raises(NKIRuleError):
        run_tiles(every_other_partition, np.zeros((8, 10), np.float32))


def test_ap_dtype_reinterprets_storage_bits(rng):
    x = rng.integers(-(2**31), 2**31 - 1, size=(16, 4), dtype=np.int32)

    def as_bf16(x_sb):
        y_sb = nl.ndarray((16, 8), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.tensor_copy(dst=y_sb, src=x_sb.ap([[8, 16], [1, 8]], offset=0, dtype=nl.bfloat16))
        return y_sb

    out = run_tiles(as_bf16, x)
    np.testing.assert_array_equal(bits(out), bits(x.view(BF16)))


def test_view_dtype_and_reshape(rng):
    x = rng.standard_normal((8, 6)).astype(np.float32)

    def views(x_hbm):
        raw_sb = nl.ndarray((8, 12), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=raw_sb.view(nl.float32), src=x_hbm)
        flat_sb = nl.ndarray((1, 48), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=flat_sb, src=x_hbm.reshape((48,)))
        return raw_sb, flat_sb

    @jit
    def kernel(x_hbm):
        raw_sb, flat_sb = views(x_hbm)
        a = nl.ndarray(raw_sb.shape, dtype=raw_sb.dtype, buffer=nl.shared_hbm)
        b = nl.ndarray(flat_sb.shape, dtype=flat_sb.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=a, src=raw_sb)
        nisa.dma_copy(dst=b, src=flat_sb)
        return a, b

    raw, flat = simulate(kernel)(x)
    np.testing.assert_array_equal(bits(raw), bits(x.view(BF16)))
    np.testing.assert_array_equal(flat, x.reshape(1, 48))


# ---------------------------------------------------------------------------------------------
# dynamic offsets (§4.4, §5.3, §8.1)


def test_scalar_offset_from_sbuf_and_register(rng):
    table = rng.standard_normal((10, 6)).astype(np.float32)
    row = np.array([[7]], dtype=np.int32)

    def pick(table_hbm, row_hbm):
        row_sb = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=row_sb, src=row_hbm)
        out_sb = nl.ndarray((2, 6), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=out_sb[0:1, :], src=table_hbm.ap([[6, 1], [1, 6]], offset=0, scalar_offset=row_sb,
                                                            indirect_dim=0))
        reg = nisa.register_alloc(0)
        nisa.register_load(reg, row_sb)
        nisa.dma_copy(dst=out_sb[1:2, :], src=table_hbm.ap([[6, 1], [1, 6]], offset=6, scalar_offset=reg,
                                                            indirect_dim=0))
        return out_sb

    out = _hbm_kernel(pick)(table, row)
    np.testing.assert_array_equal(out, table[[7, 8]])


def test_vector_offset_gather_rows_and_oob_skip(rng):
    table = rng.standard_normal((20, 8)).astype(np.float32)
    idx = np.array([[3], [19], [25], [0]], dtype=np.int32)  # 25 is out of bounds

    def gather(table_hbm, idx_hbm):
        idx_sb = nl.ndarray((4, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=idx_sb, src=idx_hbm)
        rows_sb = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=rows_sb, value=-1.0)
        nisa.dma_copy(dst=rows_sb, src=table_hbm.ap([[8, 4], [1, 8]], offset=0, vector_offset=idx_sb,
                                                    indirect_dim=0),
                      oob_mode=nisa.oob_mode.skip, dge_mode=nisa.dge_mode.swdge)
        return rows_sb

    out = _hbm_kernel(gather)(table, idx)
    expected = np.full((4, 8), -1.0, np.float32)
    expected[[0, 1, 3]] = table[[3, 19, 0]]
    np.testing.assert_array_equal(out, expected)


def test_vector_offset_oob_error_mode_raises(rng):
    table = rng.standard_normal((20, 8)).astype(np.float32)
    idx = np.array([[3], [25]], dtype=np.int32)

    def gather(table_hbm, idx_hbm):
        idx_sb = nl.ndarray((2, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=idx_sb, src=idx_hbm)
        rows_sb = nl.ndarray((2, 8), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=rows_sb, src=table_hbm.ap([[8, 2], [1, 8]], offset=0, vector_offset=idx_sb,
                                                    indirect_dim=0), oob_mode=nisa.oob_mode.error)
        return rows_sb

    with pytest.raises(NKIRuleError):
        _hbm_kernel(gather)(table, idx)


def test_vector_offset_scatter_into_hbm(rng):
    src = rng.standard_normal((3, 5)).astype(np.float32)
    idx = np.array([[4], [0], [2]], dtype=np.int32)

    @jit
    def scatter(src_hbm, idx_hbm):
        out_hbm = nl.ndarray((6, 5), dtype=nl.float32, buffer=nl.shared_hbm)
        zero_sb = nl.ndarray((6, 5), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=zero_sb, value=0.0)
        nisa.dma_copy(dst=out_hbm, src=zero_sb)
        idx_sb = nl.ndarray((3, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=idx_sb, src=idx_hbm)
        src_sb = nl.ndarray((3, 5), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=src_sb, src=src_hbm)
        nisa.dma_copy(dst=out_hbm.ap([[5, 3], [1, 5]], offset=0, vector_offset=idx_sb, indirect_dim=0),
                      src=src_sb, dge_mode=nisa.dge_mode.swdge)
        return out_hbm

    expected = np.zeros((6, 5), np.float32)
    expected[[4, 0, 2]] = src
    np.testing.assert_array_equal(simulate(scatter)(src, idx), expected)


# ---------------------------------------------------------------------------------------------
# DMA element order and casts


def test_dma_copy_flattens_row_major_and_casts_via_fp32(rng):
    x = rng.standard_normal((4, 6, 8)).astype(np.float32)

    def reshape_cast(x_hbm):
        y_sb = nl.ndarray((24, 8), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(y_sb, x_hbm)  # positional (dst, src); shapes differ, sizes match
        return y_sb

    np.testing.assert_array_equal(bits(_hbm_kernel(reshape_cast)(x)), bits(x.reshape(24, 8).astype(BF16)))


@given(
    p=st.integers(1, 128),
    f=st.integers(1, 700),
    start=st.integers(0, 3),
    dtype=st.sampled_from([np.dtype(np.float32), BF16, np.dtype(ml_dtypes.float8_e4m3), np.dtype(np.int16)]),
)
def test_tile_shapes_roundtrip_and_add(p, f, start, dtype):
    rng = np.random.default_rng(p * 1000 + f)
    x = rng.integers(-8, 8, size=(p, f + start)).astype(np.float32).astype(dtype)

    def shifted_double(x_sb):
        y_sb = nl.ndarray((x_sb.shape[0], f), dtype=x_sb.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=y_sb, data1=x_sb[:, start:start + f], data2=x_sb[:, nl.ds(start, f)], op=nl.add)
        return y_sb

    out = run_tiles(shifted_double, x)
    expected = (x[:, start:].astype(np.float32) * 2).astype(dtype)
    np.testing.assert_array_equal(bits(out), bits(expected))


@st.composite
def _onchip_patterns(draw):
    """(alloc (P, F), pattern, offset) of an in-bounds on-chip .ap() with 1-3 free dims."""
    p_alloc = draw(st.integers(1, 128))
    f_alloc = draw(st.integers(1, 300))
    p0 = draw(st.integers(0, p_alloc - 1))
    parts = draw(st.integers(1, p_alloc - p0))
    f0 = draw(st.integers(0, f_alloc - 1))
    free = []
    room = f_alloc - 1 - f0                      # largest free displacement still in the row
    for _ in range(draw(st.integers(1, 3))):
        count = draw(st.integers(1, 6))
        stride = draw(st.integers(0, room // (count - 1))) if count > 1 else draw(st.integers(0, 3))
        room -= stride * (count - 1)
        free.append([stride, count])
    return (p_alloc, f_alloc), [[f_alloc, parts]] + free, p0 * f_alloc + f0


@given(case=_onchip_patterns())
def test_onchip_ap_matches_the_flat_storage_model(case):
    (p_alloc, f_alloc), pattern, offset = case
    storage = np.arange(p_alloc * f_alloc, dtype=np.float32).reshape(p_alloc, f_alloc)
    shape = tuple(count for _, count in pattern)

    def read_pattern(s_sb):
        out_sb = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=out_sb, src=s_sb.ap(pattern, offset=offset))
        return out_sb

    grids = np.meshgrid(*[np.arange(c) for c in shape], indexing="ij")
    index = offset + sum(stride * g for (stride, _), g in zip(pattern, grids))
    np.testing.assert_array_equal(run_tiles(read_pattern, storage), storage.reshape(-1)[index])


@st.composite
def _hbm_patterns(draw):
    """(HBM length, pattern, offset) of an in-bounds HBM .ap() with 1-4 dims."""
    length = draw(st.integers(1, 2000))
    offset = draw(st.integers(0, length - 1))
    room = length - 1 - offset
    pattern = []
    for _ in range(draw(st.integers(1, 4))):
        count = draw(st.integers(1, 8))
        stride = draw(st.integers(0, room // (count - 1))) if count > 1 else draw(st.integers(0, 5))
        room -= stride * (count - 1)
        pattern.append([stride, count])
    return length, pattern, offset


@given(case=_hbm_patterns())
def test_hbm_ap_matches_the_flat_storage_model(case):
    length, pattern, offset = case
    storage = np.arange(length, dtype=np.float32)
    count = int(np.prod([c for _, c in pattern]))

    def read_pattern(x_hbm):
        out_sb = nl.ndarray((1, count), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=out_sb, src=x_hbm.ap(pattern, offset=offset))
        return out_sb

    grids = np.meshgrid(*[np.arange(c) for _, c in pattern], indexing="ij")
    index = offset + sum(stride * g for (stride, _), g in zip(pattern, grids))
    np.testing.assert_array_equal(_hbm_kernel(read_pattern)(storage), storage[index].reshape(1, count))


def _via_fp32(values, dst_dtype):
    """Spec model of a copy (§6.3, §8.1, §14.2): equal dtypes move bits; otherwise src -> fp32 ->
    dst, RNE for floats, round-half-even then saturate for integers."""
    if values.dtype == dst_dtype:
        return values
    f32 = values.astype(np.float32)
    if dst_dtype.kind in "iu":
        info = np.iinfo(dst_dtype)
        return np.clip(np.rint(f32.astype(np.float64)), info.min, info.max).astype(dst_dtype)
    return f32.astype(dst_dtype)


_ALL_DTYPES = FLOAT_DTYPES + INT_DTYPES


@given(src_dtype=st.sampled_from(_ALL_DTYPES), dst_dtype=st.sampled_from(_ALL_DTYPES), seed=st.integers(0, 2**16))
def test_dma_copy_converts_through_fp32(src_dtype, dst_dtype, seed):
    rng = np.random.default_rng(seed)
    if src_dtype.kind in "iu":
        info = np.iinfo(src_dtype)
        x = rng.integers(info.min, info.max, size=(8, 16), endpoint=True).astype(src_dtype)
    else:
        x = (rng.standard_normal((8, 16)) * 300).astype(np.float32).astype(src_dtype)

    def convert(x_hbm):
        y_sb = nl.ndarray((8, 16), dtype=dst_dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=y_sb, src=x_hbm)
        return y_sb

    np.testing.assert_array_equal(bits(_hbm_kernel(convert)(x)), bits(_via_fp32(x, dst_dtype)))
