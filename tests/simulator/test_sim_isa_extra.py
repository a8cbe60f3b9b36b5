"""The long-tail instructions of nki_lib/simulator/isa/extra.py against NumPy (docs/nki-semantics.md §8.29,
§13.7 and the AWS ISA pages for tensor_scalar_cumulative, tensor_tensor_scan, select_reduce,
bn_stats/bn_aggr, nc_match_replace8, exponential, activate2, nc_n_gather).
"""

import numpy as np
import pytest
import torch
from sim_helpers import BF16, bits, run_tiles

from nki_lib.numerics import assert_parity
from nki_lib.simulator import NKIRuleError
from nki_lib.simulator import isa as nisa
from nki_lib.simulator import language as nl

P, F = 32, 24


def _ints(rng, shape, lo=-5, hi=5):
    return rng.integers(lo, hi, size=shape, endpoint=True).astype(np.float32)


def _scan(t, init, op):
    """Reference scan in fp32, one element at a time: reg = op(t_i, reg)."""
    reg = np.full((t.shape[0],), init, np.float32)
    out = np.empty_like(t)
    for i in range(t.shape[1]):
        reg = op(t[:, i], reg).astype(np.float32)
        out[:, i] = reg
    return out


def test_tensor_scalar_cumulative_add_reset_then_continue(rng):
    x = _ints(rng, (P, F))

    def cumsum(x_sb):
        first_sb = nl.ndarray(x_sb.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar_cumulative(dst=first_sb, src=x_sb, op0=nl.multiply, op1=nl.add, imm0=2.0,
                                      reduce_cmd=nisa.reduce_cmd.reset_reduce)
        more_sb = nl.ndarray(x_sb.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar_cumulative(dst=more_sb, src=x_sb, op0=nl.add, op1=nl.add, imm0=0.0,
                                      reduce_cmd=nisa.reduce_cmd.reduce)
        return first_sb, more_sb

    first, more = run_tiles(cumsum, x)
    np.testing.assert_array_equal(first, np.cumsum(2 * x, axis=1))
    np.testing.assert_array_equal(more, first[:, -1:] + np.cumsum(x, axis=1))


@pytest.mark.parametrize(("op", "np_op", "cmd", "start"), [
    (nl.maximum, np.maximum, "reset_reduce", -np.inf),   # reset: the identity of op1
    (nl.multiply, np.multiply, "load_reduce", 3.0),      # load: imm1
    (nl.subtract, np.subtract, "reset_reduce", 0.0),     # reg = t_i - reg
    (nl.minimum, np.minimum, "load_reduce", 3.0),
])
def test_tensor_scalar_cumulative_ops(rng, op, np_op, cmd, start):
    x = rng.uniform(0.5, 1.5, size=(P, F)).astype(np.float32)
    init = 3.0

    def scan(x_sb):
        y_sb = nl.ndarray(x_sb.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar_cumulative(dst=y_sb, src=x_sb, op0=nl.subtract, op1=op, imm0=0.25, imm1=init,
                                      reduce_cmd=getattr(nisa.reduce_cmd, cmd))
        return y_sb

    expected = _scan(x - np.float32(0.25), start, np_op)
    np.testing.assert_array_equal(run_tiles(scan, x), expected)


def test_tensor_scalar_cumulative_rejects_int32():
    def scan(x_sb):
        nisa.tensor_scalar_cumulative(dst=x_sb, src=x_sb, op0=nl.add, op1=nl.add, imm0=0.0)
        return x_sb

    with pytest.raises(NKIRuleError):
        run_tiles(scan, np.zeros((4, 8), np.int32))


def test_tensor_tensor_scan_linear_recurrence(rng):
    a = rng.uniform(0.5, 1.0, size=(P, F)).astype(np.float32)
    b = rng.standard_normal((P, F)).astype(np.float32)
    r0 = rng.standard_normal((P, 1)).astype(np.float32)

    def recurrence(a_sb, b_sb, r0_sb):
        r_sb = nl.ndarray(a_sb.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor_scan(dst=r_sb, data0=a_sb, data1=b_sb, initial=r0_sb, op0=nl.multiply, op1=nl.add)
        return r_sb

    expected = np.empty_like(a)
    r = r0[:, 0]
    for i in range(F):
        r = a[:, i] * r + b[:, i]
        expected[:, i] = r
    np.testing.assert_array_equal(run_tiles(recurrence, a, b, r0), expected)


def test_select_reduce(rng):
    x = rng.standard_normal((P, F)).astype(np.float32)
    pred = rng.integers(0, 2, size=(P, F)).astype(np.uint8)
    pred[:, 0] = 1

    def select(x_sb, pred_sb):
        y_sb = nl.ndarray(x_sb.shape, dtype=nl.bfloat16, buffer=nl.sbuf)
        m_sb = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.select_reduce(dst=y_sb, predicate=pred_sb, on_true=x_sb, on_false=-100.0, reduce_res=m_sb,
                           reduce_cmd=nisa.reduce_cmd.reset_reduce, reduce_op=nl.maximum)
        inv_sb = nl.ndarray(x_sb.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.select_reduce(dst=inv_sb, predicate=pred_sb, on_true=x_sb, on_false=-100.0, reverse_pred=True)
        return y_sb, m_sb, inv_sb

    y, m, inv = run_tiles(select, x, pred)
    selected = np.where(pred != 0, x, np.float32(-100.0))
    np.testing.assert_array_equal(bits(y), bits(selected.astype(BF16)))
    np.testing.assert_array_equal(m, selected.max(axis=1, keepdims=True))
    np.testing.assert_array_equal(inv, np.where(pred == 0, x, np.float32(-100.0)))


def test_bn_stats_and_bn_aggr_give_mean_and_variance(rng):
    x = (rng.standard_normal((P, 300)) * 3 + 1).astype(np.float32)

    def stats(x_sb):
        s_sb = nl.ndarray((P, 12), dtype=nl.float32, buffer=nl.sbuf)
        nisa.bn_stats(dst=s_sb[:, 0:6], data=x_sb[:, 0:150])
        nisa.bn_stats(dst=s_sb[:, 6:12], data=x_sb[:, 150:300])
        mv_sb = nl.ndarray((P, 2), dtype=nl.float32, buffer=nl.sbuf)
        nisa.bn_aggr(dst=mv_sb, data=s_sb)
        return s_sb, mv_sb

    s, mv = run_tiles(stats, x)
    even = x[:, 0:150:2].astype(np.float64)
    np.testing.assert_array_equal(s[:, 0], np.full(P, 75, np.float32))
    xt = torch.from_numpy(x)
    for col, oracle, baseline in (
        (0, xt.double().mean(dim=1), xt.mean(dim=1)),
        (1, xt.double().var(dim=1, unbiased=False), xt.var(dim=1, unbiased=False)),
    ):
        assert_parity(torch.from_numpy(mv[:, col].copy()), oracle, baseline, kind="output", dtype=torch.float32)
    assert_parity(torch.from_numpy(s[:, 1].copy()), torch.from_numpy(even.mean(axis=1)),
                  torch.from_numpy(x[:, 0:150:2]).mean(dim=1), kind="output", dtype=torch.float32)


def test_bn_stats_free_size_limit():
    def too_long(x_sb):
        s_sb = nl.ndarray((4, 6), dtype=nl.float32, buffer=nl.sbuf)
        nisa.bn_stats(dst=s_sb, data=x_sb)
        return s_sb

    with pytest.raises(NKIRuleError):
        run_tiles(too_long, np.zeros((4, nl.tile_size.bn_stats_fmax + 1), np.float32))


def test_nc_match_replace8_13_7():
    data = np.array([[1, 2, 3, 4, 8, 8, 8, 8, 8, 8, 8]], dtype=np.float32).repeat(4, axis=0)
    vals = np.array([[3, 8, 8, 8, 8, 8, 8, 8]], dtype=np.float32).repeat(4, axis=0)

    def replace(data_sb, vals_sb):
        out_sb = nl.ndarray(data_sb.shape, dtype=nl.float32, buffer=nl.sbuf)
        idx_sb = nl.ndarray((4, 8), dtype=nl.uint32, buffer=nl.sbuf)
        nisa.nc_match_replace8(dst=out_sb, data=data_sb, vals=vals_sb, imm=-1.0, dst_idx=idx_sb)
        return out_sb, idx_sb

    out, idx = run_tiles(replace, data, vals)
    np.testing.assert_array_equal(idx, np.array([[2, 10, 9, 8, 7, 6, 5, 4]] * 4, np.uint32))
    np.testing.assert_array_equal(out, np.array([[1, 2, -1, 4] + [-1] * 7] * 4, np.float32))


def test_exponential_with_running_sum_on_trn3(trn3, rng):
    x = rng.standard_normal((P, F)).astype(np.float32)
    m = x.max(axis=1, keepdims=True)

    def exp_sum(x_sb, m_sb):
        e_sb = nl.ndarray(x_sb.shape, dtype=nl.float32, buffer=nl.sbuf)
        s_sb = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.exponential(dst=e_sb, src=x_sb, max_value=m_sb, reduce_res=s_sb,
                         reduce_cmd=nisa.reduce_cmd.reset_reduce)
        return e_sb, s_sb

    e, s = run_tiles(exp_sum, x, m)
    xt, mt = torch.from_numpy(x), torch.from_numpy(m)
    assert_parity(torch.from_numpy(e), torch.exp(xt.double() - mt.double()), torch.exp(xt - mt),
                  kind="output", dtype=torch.float32)
    assert_parity(torch.from_numpy(s), torch.exp(xt.double() - mt.double()).sum(1, keepdim=True),
                  torch.exp(xt - mt).sum(1, keepdim=True), kind="output", dtype=torch.float32)


def test_exponential_and_activate2_need_trn3(trn2):
    def v4_only(x_sb):
        nisa.exponential(dst=x_sb, src=x_sb)
        return x_sb

    with pytest.raises(NKIRuleError):
        run_tiles(v4_only, np.zeros((4, 8), np.float32))


def test_activate2_affine_relu_prelu_and_abs_max_reduce(trn3, rng):
    x = rng.standard_normal((P, F)).astype(np.float32)

    def act2(x_sb):
        relu_sb = nl.ndarray(x_sb.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.activate2(dst=relu_sb, op=nl.relu, data=x_sb, imm0=2.0, imm1=1.0, op0=nl.multiply, op1=nl.subtract)
        prelu_sb = nl.ndarray(x_sb.shape, dtype=nl.float32, buffer=nl.sbuf)
        amax_sb = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activate2(dst=prelu_sb, op=nl.prelu, data=x_sb, relu_param=0.125, reduce_op=nl.abs_max,
                       reduce_res=amax_sb, reduce_cmd=nisa.reduce_cmd.reset_reduce)
        return relu_sb, prelu_sb, amax_sb

    relu, prelu, amax = run_tiles(act2, x)
    np.testing.assert_array_equal(relu, np.maximum(x * np.float32(2) - np.float32(1), 0))
    expected_prelu = np.where(x >= 0, x, np.float32(0.125) * x)
    np.testing.assert_array_equal(prelu, expected_prelu)
    pick = np.argmax(np.abs(expected_prelu), axis=1)
    np.testing.assert_array_equal(amax[:, 0], expected_prelu[np.arange(P), pick])


def test_nc_n_gather(rng):
    data = rng.standard_normal((P, F)).astype(np.float32)
    idx = rng.integers(0, F, size=(P, 10)).astype(np.uint32)

    def gather(data_sb, idx_sb):
        out_sb = nl.ndarray((P, 10), dtype=nl.float32, buffer=nl.sbuf)
        nisa.nc_n_gather(dst=out_sb, data=data_sb, indices=idx_sb)
        return out_sb

    np.testing.assert_array_equal(run_tiles(gather, data, idx), np.take_along_axis(data, idx.astype(np.int64), 1))
