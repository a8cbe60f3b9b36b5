"""Engine accumulator registers (docs/nki-semantics.md §8.0.1, §8.7, §8.21, §8.23, §14.12, §14.27): the
Scalar-engine register shared by activation instructions, the Vector-engine register shared by
tensor_scalar_reduce / range_select, reduce_cmd semantics (reset, reduce, load_reduce, idle),
negated read-out, lanes relative to the operand's first partition, immediate bias (NC-v3+).
"""

import numpy as np
from sim_helpers import run_tiles

from nki_lib.simulator import isa as nisa
from nki_lib.simulator import language as nl

P, F = 32, 16
FP32_MIN = float(np.finfo(np.float32).min)


def _ints(rng, shape, lo=-9, hi=9):
    return rng.integers(lo, hi, size=shape, endpoint=True).astype(np.float32)


def _col(rows=P):
    return nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)


def test_activation_idle_reads_out_the_stale_register(rng):
    x = _ints(rng, (P, F))

    def chained(x_sb):
        y_sb = nl.ndarray(x_sb.shape, dtype=nl.float32, buffer=nl.sbuf)
        first, stale = _col(), _col()
        nisa.activation(dst=y_sb, op=nl.copy, data=x_sb, reduce_op=nl.add, reduce_res=first,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)
        nisa.activation(dst=y_sb, op=nl.copy, data=x_sb, scale=3.0, reduce_op=nl.add, reduce_res=stale,
                        reduce_cmd=nisa.reduce_cmd.idle)
        return y_sb, first, stale

    y, first, stale = run_tiles(chained, x)
    np.testing.assert_array_equal(y, 3 * x)
    np.testing.assert_array_equal(first, x.sum(axis=1, keepdims=True))
    np.testing.assert_array_equal(stale, first)


def test_activation_immediate_bias_on_trn2(trn2, rng):
    x = _ints(rng, (P, F))

    def biased(x_sb):
        y_sb = nl.ndarray(x_sb.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=y_sb, op=nl.relu, data=x_sb, bias=-2.0, scale=0.5)
        return y_sb

    np.testing.assert_array_equal(run_tiles(biased, x), np.maximum(x * np.float32(0.5) - 2, 0))


def test_tensor_scalar_reduce_load_reduce_and_negated_readout(rng):
    x = _ints(rng, (P, F))

    def loaded(x_sb):
        y_sb = nl.ndarray(x_sb.shape, dtype=nl.float32, buffer=nl.sbuf)
        neg_sum = _col()
        nisa.tensor_scalar_reduce(dst=y_sb, data=x_sb, op0=nl.add, operand0=1.0, reduce_op=nl.add,
                                  reduce_res=neg_sum, reduce_cmd=nisa.reduce_cmd.load_reduce, reduce_init=100.0,
                                  reduce_res_negate=True)
        again = _col()
        # the register itself is not negated: continue accumulating on it
        nisa.tensor_scalar_reduce(dst=y_sb, data=x_sb, op0=nl.multiply, operand0=0.0, reduce_op=nl.add,
                                  reduce_res=again, reduce_cmd=nisa.reduce_cmd.reduce)
        return neg_sum, again

    neg_sum, again = run_tiles(loaded, x)
    total = 100 + (x + 1).sum(axis=1, keepdims=True)
    np.testing.assert_array_equal(neg_sum, -total)
    np.testing.assert_array_equal(again, total)


def test_vector_register_is_shared_by_tensor_scalar_reduce_and_range_select(rng):
    x = _ints(rng, (P, F))
    lo = np.zeros((P, 1), np.float32)
    hi = np.full((P, 1), 4, np.float32)

    def shared(x_sb, lo_sb, hi_sb):
        y_sb = nl.ndarray(x_sb.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar_reduce(dst=y_sb, data=x_sb, op0=nl.multiply, operand0=-1.0, reduce_op=nl.maximum,
                                  reduce_cmd=nisa.reduce_cmd.reset_reduce)
        both = _col()
        nisa.range_select(dst=y_sb, on_true_tile=x_sb, comp_op0=nl.greater_equal, comp_op1=nl.less, bound0=lo_sb,
                          bound1=hi_sb, reduce_cmd=nisa.reduce_cmd.reduce, reduce_res=both, reduce_op=nl.maximum,
                          on_false_value=FP32_MIN)
        return both

    both = run_tiles(shared, x, lo, hi)
    expected = np.maximum((-x).max(axis=1), x[:, :4].max(axis=1))[:, None]
    np.testing.assert_array_equal(both, expected)


def test_accumulator_lanes_follow_the_operand_partitions(rng):
    x = _ints(rng, (64, F))

    def upper_half(x_sb):
        y_sb = nl.ndarray((32, F), dtype=nl.float32, buffer=nl.sbuf)
        sums = _col(32)
        nisa.activation(dst=y_sb, op=nl.copy, data=x_sb[32:64, :], reduce_op=nl.add, reduce_res=sums,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)
        return sums

    np.testing.assert_array_equal(run_tiles(upper_half, x), x[32:].sum(axis=1, keepdims=True))
