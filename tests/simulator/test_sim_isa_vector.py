"""Vector/Scalar/GpSimd elementwise instructions against NumPy (docs/nki-semantics.md §6.3, §8.2–§8.5, §8.7,
§8.12, §8.17, §8.22): fp32 math, round-to-nearest-even on write, operand order and reverse flags,
per-partition scalar operands, activation scale/bias/reduce, copies and casts per dtype.

Expected values are computed the way the spec defines the instruction: inputs converted to fp32,
the op evaluated in fp32 by NumPy, the result cast to the destination dtype with ml_dtypes (RNE).
For IEEE add/sub/mul/max/min/compare this is bit-exact, so these tests compare bits.
"""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from sim_helpers import BF16, FLOAT_DTYPES, FP32, INT_DTYPES, bits, run_tiles

from nki_lib.simulator import isa as nisa
from nki_lib.simulator import language as nl

P, F = 64, 48


def _rand(rng, shape, dtype, lo=-4.0, hi=4.0):
    return rng.uniform(lo, hi, size=shape).astype(np.float32).astype(dtype)


def _out(like, dtype=None):
    return nl.ndarray(like.shape, dtype=dtype or like.dtype, buffer=nl.sbuf)


# ---------------------------------------------------------------------------------------------
# copies, casts, rounding


@pytest.mark.parametrize("dtype", FLOAT_DTYPES + INT_DTYPES, ids=str)
def test_dma_roundtrip_is_bit_exact(rng, dtype):
    if dtype.kind == "f" or dtype in FLOAT_DTYPES:
        x = _rand(rng, (P, F), dtype)
    else:
        info = np.iinfo(dtype)
        x = rng.integers(info.min, info.max, size=(P, F), dtype=dtype, endpoint=True)

    def copy_only(x_sb):
        return x_sb

    y = run_tiles(copy_only, x)
    assert y.dtype == x.dtype and y.shape == x.shape
    np.testing.assert_array_equal(bits(y), bits(x))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("engine", ["vector", "scalar", "gpsimd"])
def test_tensor_copy_fp32_to_dtype_rounds_to_nearest_even(dtype, engine):
    # values exactly halfway between two representable neighbours of every narrow type, plus
    # values above/below the halfway point: RNE differs from truncation and from round-half-up
    one = np.float32(1.0)
    mantissa_bits = ml_dtypes.finfo(dtype).nmant
    ulp = np.float32(2.0 ** -mantissa_bits)
    row = np.array(
        [one + ulp / 2, one + 3 * ulp / 2, one + ulp / 4, one + 3 * ulp / 4, -(one + ulp / 2), 3.0, -0.0, 0.1],
        dtype=np.float32,
    )
    x = np.tile(row, (4, 2))

    def cast_copy(x_sb):
        y_sb = _out(x_sb, dtype)
        nisa.tensor_copy(dst=y_sb, src=x_sb, engine=getattr(nisa.engine, engine))
        return y_sb

    y = run_tiles(cast_copy, x)
    expected = x.astype(dtype)
    assert y.dtype == dtype
    np.testing.assert_array_equal(bits(y), bits(expected))
    if dtype != FP32:  # the vectors really distinguish RNE from truncation
        truncated = (x.view(np.uint32) & np.uint32(~((1 << (23 - mantissa_bits)) - 1) & 0xFFFFFFFF)).view(np.float32)
        assert not np.array_equal(bits(expected), bits(truncated.astype(dtype)))


def test_tensor_copy_same_dtype_is_bit_exact_for_int32_beyond_fp32():
    x = np.array([[2**24 + 1, -(2**31), 2**31 - 1, 123456789]], dtype=np.int32).repeat(8, axis=0)

    def copy_int(x_sb):
        y_sb = _out(x_sb)
        nisa.tensor_copy(dst=y_sb, src=x_sb, engine=nisa.vector_engine)
        return y_sb

    np.testing.assert_array_equal(run_tiles(copy_int, x), x)


def test_tensor_copy_float_to_int_of_integral_values(rng):
    x = rng.integers(-1000, 1000, size=(P, F)).astype(np.float32)

    def to_int(x_sb):
        y_sb = _out(x_sb, nl.int32)
        nisa.tensor_copy(dst=y_sb, src=x_sb)
        return y_sb

    y = run_tiles(to_int, x)
    assert y.dtype == np.int32
    np.testing.assert_array_equal(y, x.astype(np.int32))


def test_tensor_copy_through_psum(rng):
    x = _rand(rng, (P, F), BF16)

    def via_psum(x_sb):
        acc_psum = nl.ndarray(x_sb.shape, dtype=nl.float32, buffer=nl.psum)
        nisa.tensor_copy(dst=acc_psum, src=x_sb)
        y_sb = _out(x_sb)
        nisa.tensor_copy(dst=y_sb, src=acc_psum)
        return y_sb

    np.testing.assert_array_equal(bits(run_tiles(via_psum, x)), bits(x))


def test_tensor_copy_multidim_free_views_stream_row_major(rng):
    # a (P, A, B) source feeding a (P, A*B) destination: element order is row-major (§4.3)
    x = _rand(rng, (16, 6 * 5), FP32)

    def reshape_copy(x_sb):
        y_sb = nl.ndarray((16, 6, 5), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=y_sb, src=x_sb)
        z_sb = nl.ndarray((16, 30), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=z_sb, src=y_sb)
        return y_sb, z_sb

    y, z = run_tiles(reshape_copy, x)
    np.testing.assert_array_equal(y, x.reshape(16, 6, 5))
    np.testing.assert_array_equal(z, x)


# ---------------------------------------------------------------------------------------------
# memset


@pytest.mark.parametrize(
    ("dtype", "value"),
    [(FP32, -1.5), (FP32, -np.inf), (BF16, 0.1), (np.dtype(np.float16), 1.0 / 3.0), (np.dtype(np.int32), -7),
     (np.dtype(np.uint8), 200)],
    ids=str,
)
def test_memset_fills_view_with_cast_value(dtype, value):
    x = np.zeros((8, 16), dtype=dtype)

    def fill(x_sb):
        nisa.memset(dst=x_sb[:, 4:12], value=value)
        return x_sb

    y = run_tiles(fill, x)
    expected = x.copy()
    expected[:, 4:12] = np.array(value, dtype=np.float32 if isinstance(value, float) else np.int64).astype(dtype)
    np.testing.assert_array_equal(bits(y), bits(expected))


def test_memset_positional_dst_and_value_keyword():
    x = np.zeros((4, 8), dtype=np.float32)

    def fill(x_sb):
        nisa.memset(x_sb, value=2.0)
        return x_sb

    np.testing.assert_array_equal(run_tiles(fill, x), np.full((4, 8), 2.0, np.float32))


# ---------------------------------------------------------------------------------------------
# tensor_tensor

_TT_OPS = {
    "add": (nl.add, np.add),
    "subtract": (nl.subtract, np.subtract),
    "multiply": (nl.multiply, np.multiply),
    "maximum": (nl.maximum, np.maximum),
    "minimum": (nl.minimum, np.minimum),
    "equal": (nl.equal, lambda a, b: (a == b).astype(np.float32)),
    "greater": (nl.greater, lambda a, b: (a > b).astype(np.float32)),
    "less_equal": (nl.less_equal, lambda a, b: (a <= b).astype(np.float32)),
    "logical_and": (nl.logical_and, lambda a, b: ((a != 0) & (b != 0)).astype(np.float32)),
}


@pytest.mark.parametrize("op_name", sorted(_TT_OPS))
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_tensor_tensor_ops(rng, op_name, dtype):
    nl_op, np_op = _TT_OPS[op_name]
    a = rng.integers(-3, 4, size=(P, F)).astype(np.float32).astype(dtype) if op_name in ("equal", "logical_and") \
        else _rand(rng, (P, F), dtype)
    b = rng.integers(-3, 4, size=(P, F)).astype(np.float32).astype(dtype) if op_name in ("equal", "logical_and") \
        else _rand(rng, (P, F), dtype)

    def binary(a_sb, b_sb):
        c_sb = _out(a_sb)
        nisa.tensor_tensor(dst=c_sb, data1=a_sb, data2=b_sb, op=nl_op)
        return c_sb

    expected = np_op(a.astype(np.float32), b.astype(np.float32)).astype(np.float32).astype(dtype)
    np.testing.assert_array_equal(bits(run_tiles(binary, a, b)), bits(expected))


def test_tensor_tensor_mixed_dtypes_and_psum_operand(rng):
    a = _rand(rng, (P, F), BF16)
    b = _rand(rng, (P, F), FP32)

    def mixed(a_sb, b_sb):
        b_psum = nl.ndarray(b_sb.shape, dtype=nl.float32, buffer=nl.psum)
        nisa.tensor_copy(dst=b_psum, src=b_sb)
        c_sb = _out(a_sb, nl.float16)
        nisa.tensor_tensor(c_sb, a_sb, b_psum, nl.subtract)  # positional form (dst, data1, data2, op)
        return c_sb

    expected = (a.astype(np.float32) - b).astype(np.float16)
    np.testing.assert_array_equal(bits(run_tiles(mixed, a, b)), bits(expected))


@pytest.mark.parametrize("dtype", [np.dtype(np.int8), np.dtype(np.int16), np.dtype(np.uint8), np.dtype(np.uint16)],
                         ids=str)
def test_narrow_int_arithmetic_goes_through_fp32_and_saturates(rng, dtype):
    # Vector engine: fp32 math, then round-half-even and saturate into the integer dst (§6.3, §14.2)
    info = np.iinfo(dtype)
    a = rng.integers(info.min, info.max, size=(P, F), endpoint=True).astype(dtype)
    b = rng.integers(info.min, info.max, size=(P, F), endpoint=True).astype(dtype)

    def int_ops(a_sb, b_sb):
        s_sb = _out(a_sb)
        nisa.tensor_tensor(dst=s_sb, data1=a_sb, data2=b_sb, op=nl.add)
        h_sb = _out(a_sb)
        nisa.tensor_scalar(dst=h_sb, data=a_sb, op0=nl.multiply, operand0=0.5)
        return s_sb, h_sb

    total, half = run_tiles(int_ops, a, b)
    wide = a.astype(np.float64) + b.astype(np.float64)
    np.testing.assert_array_equal(total, np.clip(wide, info.min, info.max).astype(dtype))
    np.testing.assert_array_equal(half, np.clip(np.rint(a.astype(np.float64) * 0.5), info.min, info.max).astype(dtype))


def test_tensor_tensor_int32_is_exact_beyond_2_pow_24():
    # all-int32 operands outside PSUM run on GpSimd with native integer math (§6.3, §8.4)
    a = np.full((4, 8), 2**24 + 1, dtype=np.int32)
    b = np.full((4, 8), 2, dtype=np.int32)

    def int_add(a_sb, b_sb):
        c_sb = _out(a_sb)
        nisa.tensor_tensor(dst=c_sb, data1=a_sb, data2=b_sb, op=nl.add)
        return c_sb

    np.testing.assert_array_equal(run_tiles(int_add, a, b), a + b)


@pytest.mark.parametrize(("op", "np_op"), [(nl.bitwise_and, np.bitwise_and), (nl.bitwise_xor, np.bitwise_xor),
                                           (nl.bitwise_or, np.bitwise_or)])
def test_tensor_tensor_bitvec_ops_on_raw_bits(rng, op, np_op):
    a = rng.integers(0, 2**32, size=(8, 16), dtype=np.uint32)
    b = rng.integers(0, 2**32, size=(8, 16), dtype=np.uint32)

    def bitvec(a_sb, b_sb):
        c_sb = _out(a_sb)
        nisa.tensor_tensor(dst=c_sb, data1=a_sb, data2=b_sb, op=op)
        return c_sb

    np.testing.assert_array_equal(run_tiles(bitvec, a, b), np_op(a, b))


def test_tensor_tensor_in_place(rng):
    a = _rand(rng, (P, F), FP32)
    b = _rand(rng, (P, F), FP32)

    def in_place(a_sb, b_sb):
        nisa.tensor_tensor(dst=a_sb, data1=a_sb, data2=b_sb, op=nl.multiply)
        return a_sb

    np.testing.assert_array_equal(run_tiles(in_place, a, b), a * b)


# ---------------------------------------------------------------------------------------------
# tensor_scalar / scalar_tensor_tensor / reciprocal


def test_tensor_scalar_two_ops_with_immediates(rng):
    x = _rand(rng, (P, F), FP32)

    def clamp(x_sb):
        y_sb = _out(x_sb, nl.bfloat16)
        nisa.tensor_scalar(dst=y_sb, data=x_sb, op0=nl.minimum, operand0=1.25, op1=nl.maximum, operand1=-0.5)
        return y_sb

    expected = np.maximum(np.minimum(x, np.float32(1.25)), np.float32(-0.5)).astype(BF16)
    np.testing.assert_array_equal(bits(run_tiles(clamp, x)), bits(expected))


def test_tensor_scalar_reverse_flags(rng):
    x = _rand(rng, (P, F), FP32, 0.5, 4.0)

    def reversed_ops(x_sb):
        y_sb = _out(x_sb)
        # y = 3 - x, then y = 2 - y  (reverse1 swaps op1's operands as well)
        nisa.tensor_scalar(dst=y_sb, data=x_sb, op0=nl.subtract, operand0=3.0, reverse0=True,
                           op1=nl.subtract, operand1=2.0, reverse1=True)
        return y_sb

    expected = np.float32(2.0) - (np.float32(3.0) - x)
    np.testing.assert_array_equal(run_tiles(reversed_ops, x), expected)


def test_tensor_scalar_per_partition_tile_operands(rng):
    x = _rand(rng, (P, F), BF16)
    scale = _rand(rng, (P, 1), FP32)
    shift = _rand(rng, (P, 1), BF16)

    def affine(x_sb, scale_sb, shift_sb):
        y_sb = _out(x_sb, nl.float32)
        nisa.tensor_scalar(y_sb, x_sb, nl.multiply, scale_sb, op1=nl.add, operand1=shift_sb)
        return y_sb

    expected = x.astype(np.float32) * scale + shift.astype(np.float32)
    np.testing.assert_array_equal(run_tiles(affine, x, scale, shift), expected)


def test_tensor_scalar_comparison_into_uint8_mask(rng):
    x = _rand(rng, (P, F), FP32)
    limit = _rand(rng, (P, 1), FP32)

    def mask(x_sb, limit_sb):
        m_sb = _out(x_sb, nl.uint8)
        nisa.tensor_scalar(dst=m_sb, data=x_sb, op0=nl.less, operand0=limit_sb)
        return m_sb

    np.testing.assert_array_equal(run_tiles(mask, x, limit), (x < limit).astype(np.uint8))


def test_scalar_tensor_tensor(rng):
    x = _rand(rng, (P, F), FP32)
    s = _rand(rng, (P, 1), FP32)
    y = _rand(rng, (P, F), BF16)

    def fused(x_sb, s_sb, y_sb):
        out_sb = _out(x_sb)
        nisa.scalar_tensor_tensor(dst=out_sb, data=x_sb, op0=nl.multiply, operand0=s_sb, op1=nl.subtract,
                                  operand1=y_sb)
        rev_sb = _out(x_sb)
        nisa.scalar_tensor_tensor(dst=rev_sb, data=x_sb, op0=nl.add, operand0=0.5, op1=nl.subtract,
                                  operand1=y_sb, reverse1=True)
        return out_sb, rev_sb

    out, rev = run_tiles(fused, x, s, y)
    yf = y.astype(np.float32)
    np.testing.assert_array_equal(out, x * s - yf)
    np.testing.assert_array_equal(rev, yf - (x + np.float32(0.5)))


def test_reciprocal(rng):
    x = _rand(rng, (P, F), FP32, 0.25, 8.0) * np.where(rng.random((P, F)) < 0.5, -1, 1).astype(np.float32)

    def recip(x_sb):
        y_sb = _out(x_sb)
        nisa.reciprocal(dst=y_sb, data=x_sb)
        return y_sb

    np.testing.assert_array_equal(run_tiles(recip, x), np.float32(1.0) / x)


def test_tensor_copy_predicated(rng):
    src = _rand(rng, (P, F), FP32)
    dst0 = _rand(rng, (P, F), FP32)
    pred = rng.integers(0, 2, size=(P, F)).astype(np.uint8)

    def predicated(src_sb, dst_sb, pred_sb):
        nisa.tensor_copy_predicated(dst=dst_sb, src=src_sb, predicate=pred_sb)
        return dst_sb

    np.testing.assert_array_equal(run_tiles(predicated, src, dst0, pred), np.where(pred != 0, src, dst0))


# ---------------------------------------------------------------------------------------------
# activation (Scalar engine)


def test_activation_copy_with_scale_and_bias_is_exact(rng):
    x = _rand(rng, (P, F), BF16)
    bias = _rand(rng, (P, 1), FP32)

    def scaled(x_sb, bias_sb):
        y_sb = _out(x_sb, nl.float32)
        nisa.activation(dst=y_sb, op=nl.copy, data=x_sb, scale=0.375, bias=bias_sb)
        return y_sb

    expected = x.astype(np.float32) * np.float32(0.375) + bias
    np.testing.assert_array_equal(run_tiles(scaled, x, bias), expected)


def test_activation_tile_scale_positional_dst(rng):
    x = _rand(rng, (P, F), FP32)
    scale = _rand(rng, (P, 1), FP32)

    def scaled(x_sb, scale_sb):
        y_sb = _out(x_sb)
        nisa.activation(y_sb, op=nl.copy, data=x_sb, scale=scale_sb)
        return y_sb

    np.testing.assert_array_equal(run_tiles(scaled, x, scale), x * scale)


@pytest.mark.parametrize(
    ("op", "np_fn"),
    [
        (nl.relu, lambda v: np.maximum(v, 0.0)),
        (nl.square, np.square),
        (nl.abs, np.abs),
        (nl.sign, np.sign),
    ],
)
def test_activation_exact_functions(rng, op, np_fn):
    x = _rand(rng, (P, F), FP32)

    def act(x_sb):
        y_sb = _out(x_sb)
        nisa.activation(dst=y_sb, op=op, data=x_sb)
        return y_sb

    np.testing.assert_array_equal(run_tiles(act, x), np_fn(x).astype(np.float32))


def test_activation_add_reduce_sums_fp32_values_before_the_cast(rng):
    # reduce spans all free dims and accumulates the fp32 results before the dst cast (§8.0.1);
    # nl.copy keeps the expected values exact
    x = rng.integers(-8, 8, size=(P, F)).astype(np.float32) + np.float32(1 / 1024)

    def act_reduce(x_sb):
        y_sb = _out(x_sb, nl.bfloat16)
        sum_sb = nl.ndarray((x_sb.shape[0], 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=y_sb, op=nl.copy, data=x_sb, reduce_op=nl.add, reduce_res=sum_sb,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)
        return y_sb, sum_sb

    y, row_sum = run_tiles(act_reduce, x)
    np.testing.assert_array_equal(bits(y), bits(x.astype(BF16)))
    np.testing.assert_array_equal(row_sum, x.sum(axis=1, keepdims=True, dtype=np.float64).astype(np.float32))
    assert not np.array_equal(row_sum[:, 0], x.astype(BF16).astype(np.float32).sum(axis=1))


def test_activation_reduce_accumulates_across_instructions():
    # reset_reduce then reduce: the Scalar-engine register keeps the running sum (§8.0.1)
    x = np.arange(P * F, dtype=np.float32).reshape(P, F) % 7

    def chained(x_sb):
        y_sb = _out(x_sb)
        acc_sb = nl.ndarray((x_sb.shape[0], 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=y_sb, op=nl.copy, data=x_sb, reduce_op=nl.add,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)
        nisa.activation(dst=y_sb, op=nl.copy, data=x_sb, scale=2.0, reduce_op=nl.add, reduce_res=acc_sb,
                        reduce_cmd=nisa.reduce_cmd.reduce)
        return acc_sb

    np.testing.assert_array_equal(run_tiles(chained, x), 3 * x.sum(axis=1, keepdims=True))


def test_activation_reduce_legacy_form(rng):
    x = rng.integers(-8, 8, size=(P, F)).astype(np.float32)

    def act_reduce(x_sb):
        y_sb = _out(x_sb)
        sum_sb = nl.ndarray((x_sb.shape[0], 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation_reduce(dst=y_sb, op=nl.square, data=x_sb, reduce_op=nl.add, reduce_res=sum_sb)
        return y_sb, sum_sb

    y, row_sum = run_tiles(act_reduce, x)
    np.testing.assert_array_equal(y, x * x)
    np.testing.assert_array_equal(row_sum, (x * x).sum(axis=1, keepdims=True))


_ALU = {"add": np.add, "subtract": np.subtract, "multiply": np.multiply, "maximum": np.maximum,
        "minimum": np.minimum}


@given(
    p=st.integers(1, 128), f=st.integers(1, 200),
    op0=st.sampled_from(sorted(_ALU)), op1=st.sampled_from([None] + sorted(_ALU)),
    reverse0=st.booleans(), reverse1=st.booleans(),
    in_dtype=st.sampled_from(FLOAT_DTYPES), out_dtype=st.sampled_from(FLOAT_DTYPES),
    tile_operand=st.booleans(), seed=st.integers(0, 2**16),
)
def test_tensor_scalar_matches_the_fp32_model(p, f, op0, op1, reverse0, reverse1, in_dtype, out_dtype, tile_operand,
                                              seed):
    rng = np.random.default_rng(seed)
    x = _rand(rng, (p, f), in_dtype)
    s0 = _rand(rng, (p, 1), FP32) if tile_operand else np.float32(rng.uniform(-2, 2))
    s1 = np.float32(rng.uniform(-2, 2))

    def body(x_sb, *operands):
        y_sb = _out(x_sb, out_dtype)
        operand0 = operands[0] if tile_operand else float(s0)
        nisa.tensor_scalar(dst=y_sb, data=x_sb, op0=getattr(nl, op0), operand0=operand0, reverse0=reverse0,
                           op1=getattr(nl, op1) if op1 else None, operand1=float(s1) if op1 else None,
                           reverse1=reverse1)
        return y_sb

    t = x.astype(np.float32)
    t = _ALU[op0](s0, t) if reverse0 else _ALU[op0](t, s0)
    if op1:
        t = _ALU[op1](s1, t) if reverse1 else _ALU[op1](t, s1)
    expected = t.astype(np.float32).astype(out_dtype)
    args = (x, s0) if tile_operand else (x,)
    np.testing.assert_array_equal(bits(run_tiles(body, *args)), bits(expected))
