"""Hardware rules (docs/nki-semantics.md §3, §6, §8, issue 2 "Per rule"): each kernel below breaks one rule
and must raise ``NKIRuleError`` naming the instruction, the operand, the rule and the kernel
source line (the line marked ``# VIOLATION``). Also: fresh SBUF/PSUM reads give NaN, loop-local
tiles do not accumulate toward the capacity limits (an allocation lives from its first to its last
use in program order, so the capacity kernels use every tile again at the end).
"""

import ml_dtypes
import numpy as np
import pytest
from sim_helpers import BF16, check_rule_error

from nki_lib.simulator import NKIRuleError, jit, simulate, tile_size
from nki_lib.simulator import isa as nisa
from nki_lib.simulator import language as nl

MARK = "# VIOLATION"


def _raise(kernel_fn, *args):
    """Run the plain kernel function ``kernel_fn`` under ``jit``; return the NKIRuleError."""
    with pytest.raises(NKIRuleError) as info:
        simulate(jit(kernel_fn))(*args)
    return info.value


def test_partition_dim_129(trn2):
    def too_many_partitions(x_hbm):
        x_sb = nl.ndarray((129, 4), dtype=nl.float32, buffer=nl.sbuf)  # VIOLATION
        nisa.dma_copy(dst=x_sb, src=x_hbm)
        return x_hbm

    err = _raise(too_many_partitions, np.zeros((129, 4), np.float32))
    check_rule_error(err, too_many_partitions, MARK, rule_words=("partition", "128"))


def test_instruction_operand_with_129_partitions(trn2):
    def wide_view(x_hbm):
        x_sb = nl.ndarray((128, 8), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=x_sb, src=x_hbm)
        y_sb = nl.ndarray((128, 8), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=y_sb, src=x_sb.ap([[8, 129], [1, 4]], offset=0))  # VIOLATION
        return x_hbm

    err = _raise(wide_view, np.zeros((128, 8), np.float32))
    check_rule_error(err, wide_view, MARK)


def test_psum_bank_overflow_result_crossing_a_bank(trn2):
    def crossing(s_hbm, m_hbm):
        s_sb = nl.ndarray((128, 64), dtype=nl.bfloat16, buffer=nl.sbuf)
        m_sb = nl.ndarray((128, 512), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=s_sb, src=s_hbm)
        nisa.dma_copy(dst=m_sb, src=m_hbm)
        acc_psum = nl.ndarray((64, 1024), dtype=nl.float32, buffer=nl.psum)  # two banks
        nisa.nc_matmul(dst=acc_psum[:, 256:768], stationary=s_sb, moving=m_sb)  # VIOLATION
        return s_hbm

    err = _raise(crossing, np.ones((128, 64), BF16), np.ones((128, 512), BF16))
    check_rule_error(err, crossing, MARK, instruction="nc_matmul", operand="dst", rule_words=("bank",))


def test_psum_matmul_result_larger_than_a_bank_trn2(trn2):
    def too_wide(s_hbm, m_hbm):
        s_sb = nl.ndarray((128, 64), dtype=nl.bfloat16, buffer=nl.sbuf)
        m_sb = nl.ndarray((128, 1024), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=s_sb, src=s_hbm)
        nisa.dma_copy(dst=m_sb, src=m_hbm)
        acc_psum = nl.ndarray((64, 1024), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=acc_psum, stationary=s_sb, moving=m_sb)  # VIOLATION
        return s_hbm

    err = _raise(too_wide, np.ones((128, 64), BF16), np.ones((128, 1024), BF16))
    check_rule_error(err, too_wide, MARK, instruction="nc_matmul")
    assert err.operand in ("moving", "dst")


def test_moving_free_above_512_trn2(trn2):
    def wide_moving(s_hbm, m_hbm):
        s_sb = nl.ndarray((128, 8), dtype=nl.bfloat16, buffer=nl.sbuf)
        m_sb = nl.ndarray((128, 2, 384), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=s_sb, src=s_hbm)
        nisa.dma_copy(dst=m_sb, src=m_hbm)
        acc_psum = nl.ndarray((8, 768), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=acc_psum, stationary=s_sb, moving=m_sb)  # VIOLATION
        return s_hbm

    # a (128, 2, 384) moving operand has free size 768 > gemm_moving_fmax
    err = _raise(wide_moving, np.ones((128, 8), BF16), np.ones((128, 768), BF16))
    check_rule_error(err, wide_moving, MARK, instruction="nc_matmul")
    assert err.operand in ("moving", "dst")


def test_stationary_free_above_128(any_target):
    def wide_stationary(s_hbm, m_hbm):
        s_sb = nl.ndarray((64, 256), dtype=nl.bfloat16, buffer=nl.sbuf)
        m_sb = nl.ndarray((64, 32), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=s_sb, src=s_hbm)
        nisa.dma_copy(dst=m_sb, src=m_hbm)
        acc_psum = nl.ndarray((128, 2, 32), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=acc_psum, stationary=s_sb, moving=m_sb)  # VIOLATION
        return s_hbm

    err = _raise(wide_stationary, np.ones((64, 256), BF16), np.ones((64, 32), BF16))
    check_rule_error(err, wide_stationary, MARK, instruction="nc_matmul", operand="stationary",
                     rule_words=("128",))


def test_contraction_mismatch(trn2):
    def mismatch(s_hbm, m_hbm):
        s_sb = nl.ndarray((64, 16), dtype=nl.bfloat16, buffer=nl.sbuf)
        m_sb = nl.ndarray((32, 16), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=s_sb, src=s_hbm)
        nisa.dma_copy(dst=m_sb, src=m_hbm)
        acc_psum = nl.ndarray((16, 16), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=acc_psum, stationary=s_sb, moving=m_sb)  # VIOLATION
        return s_hbm

    err = _raise(mismatch, np.ones((64, 16), BF16), np.ones((32, 16), BF16))
    check_rule_error(err, mismatch, MARK, instruction="nc_matmul")


def test_too_many_psum_buffers(trn2):
    def nine_banks(x_hbm):
        live = []
        for _ in range(tile_size.psum_num_banks):
            live.append(nl.ndarray((128, tile_size.psum_fmax), dtype=nl.float32, buffer=nl.psum))
            nisa.memset(dst=live[-1], value=0.0)
        live.append(nl.ndarray((128, tile_size.psum_fmax), dtype=nl.float32, buffer=nl.psum))  # VIOLATION
        nisa.memset(dst=live[-1], value=0.0)
        for t_psum in live:                    # every tile used again here: nine live together
            nisa.memset(dst=t_psum, value=1.0)
        return x_hbm

    err = _raise(nine_banks, np.zeros((1, 1), np.float32))
    check_rule_error(err, nine_banks, MARK, rule_words=("psum",))


def test_psum_tile_larger_than_psum(trn2):
    def huge_psum(x_hbm):
        cols = tile_size.psum_num_banks * tile_size.psum_fmax + 1
        _acc_psum = nl.ndarray((128, cols), dtype=nl.float32, buffer=nl.psum)  # VIOLATION
        return x_hbm

    err = _raise(huge_psum, np.zeros((1, 1), np.float32))
    check_rule_error(err, huge_psum, MARK, rule_words=("psum",))


def _sbuf_cols(fraction):
    """fp32 columns of a tile that takes ``fraction`` of the usable SBUF bytes per partition."""
    return int(tile_size.total_available_sbuf_size * fraction) // 4


def test_sbuf_overflow_of_live_tiles(trn2):
    cols = _sbuf_cols(0.45)

    def overflow(x_hbm):
        a_sb = nl.ndarray((128, cols), dtype=nl.float32, buffer=nl.sbuf)
        b_sb = nl.ndarray((128, cols), dtype=nl.float32, buffer=nl.sbuf)
        c_sb = nl.ndarray((128, cols), dtype=nl.float32, buffer=nl.sbuf)  # VIOLATION
        nisa.memset(dst=a_sb, value=0.0)
        nisa.memset(dst=b_sb, value=0.0)
        nisa.memset(dst=c_sb, value=0.0)
        for t_sb in (a_sb, b_sb):               # a and b used after c's first use: all three live
            nisa.memset(dst=t_sb, value=1.0)
        return x_hbm

    err = _raise(overflow, np.zeros((1, 1), np.float32))
    check_rule_error(err, overflow, MARK, rule_words=("sbuf",))


def test_sbuf_single_tile_over_capacity(trn2):
    cols = _sbuf_cols(1.0) + 1

    def too_big(x_hbm):
        _a_sb = nl.ndarray((1, cols), dtype=nl.float32, buffer=nl.sbuf)  # VIOLATION
        return x_hbm

    check_rule_error(_raise(too_big, np.zeros((1, 1), np.float32)), too_big, MARK, rule_words=("sbuf",))


def test_loop_local_tiles_do_not_accumulate(trn2):
    # each iteration's tile dies with the iteration: 2 fit at once, 10 in total would not
    cols = _sbuf_cols(0.45)

    def loop(x_hbm):
        out_hbm = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.shared_hbm)
        for _ in range(10):
            t_sb = nl.ndarray((128, cols), dtype=nl.float32, buffer=nl.sbuf)
            nisa.memset(dst=t_sb, value=1.0)
            nisa.dma_copy(dst=out_hbm, src=t_sb[0:1, 0:1])
        for _ in range(20):
            acc_psum = nl.ndarray((128, tile_size.psum_fmax), dtype=nl.float32, buffer=nl.psum)
            nisa.memset(dst=acc_psum, value=0.0)
        return out_hbm

    np.testing.assert_array_equal(simulate(jit(loop))(np.zeros((1, 1), np.float32)), [[1.0]])


def test_dma_into_psum():
    def dma_psum(x_hbm):
        acc_psum = nl.ndarray((16, 16), dtype=nl.float32, buffer=nl.psum)
        nisa.dma_copy(dst=acc_psum, src=x_hbm)  # VIOLATION
        return x_hbm

    err = _raise(dma_psum, np.zeros((16, 16), np.float32))
    check_rule_error(err, dma_psum, MARK, instruction="dma_copy", operand="dst", rule_words=("psum",))


def test_dma_from_psum():
    def dma_psum(x_hbm):
        acc_psum = nl.ndarray((16, 16), dtype=nl.float32, buffer=nl.psum)
        nisa.memset(dst=acc_psum, value=0.0)
        out_hbm = nl.ndarray((16, 16), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out_hbm, src=acc_psum)  # VIOLATION
        return out_hbm

    err = _raise(dma_psum, np.zeros((16, 16), np.float32))
    check_rule_error(err, dma_psum, MARK, instruction="dma_copy", operand="src", rule_words=("psum",))


def test_float64_kernel_argument_rejected():
    def identity(x_hbm):
        return x_hbm

    with pytest.raises(NKIRuleError, match="float64"):
        simulate(jit(identity))(np.zeros((4, 4), np.float64))


def test_float64_allocation_rejected():
    def f64(x_hbm):
        _t_sb = nl.ndarray((4, 4), dtype=np.float64, buffer=nl.sbuf)  # VIOLATION
        return x_hbm

    with pytest.raises((NKIRuleError, TypeError), match="float64"):
        simulate(jit(f64))(np.zeros((4, 4), np.float32))


def test_matmul_into_bf16_psum_on_trn2(trn2):
    def bf16_dst(s_hbm, m_hbm):
        s_sb = nl.ndarray((32, 16), dtype=nl.bfloat16, buffer=nl.sbuf)
        m_sb = nl.ndarray((32, 16), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=s_sb, src=s_hbm)
        nisa.dma_copy(dst=m_sb, src=m_hbm)
        acc_psum = nl.ndarray((16, 16), dtype=nl.bfloat16, buffer=nl.psum)
        nisa.nc_matmul(dst=acc_psum, stationary=s_sb, moving=m_sb)  # VIOLATION
        return s_hbm

    err = _raise(bf16_dst, np.ones((32, 16), BF16), np.ones((32, 16), BF16))
    check_rule_error(err, bf16_dst, MARK, instruction="nc_matmul", operand="dst")


def test_matmul_into_sbuf():
    def sbuf_dst(s_hbm, m_hbm):
        s_sb = nl.ndarray((32, 16), dtype=nl.bfloat16, buffer=nl.sbuf)
        m_sb = nl.ndarray((32, 16), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=s_sb, src=s_hbm)
        nisa.dma_copy(dst=m_sb, src=m_hbm)
        acc_sb = nl.ndarray((16, 16), dtype=nl.float32, buffer=nl.sbuf)
        nisa.nc_matmul(dst=acc_sb, stationary=s_sb, moving=m_sb)  # VIOLATION
        return s_hbm

    err = _raise(sbuf_dst, np.ones((32, 16), BF16), np.ones((32, 16), BF16))
    check_rule_error(err, sbuf_dst, MARK, instruction="nc_matmul", operand="dst")


def test_matmul_fp32_with_bf16_operand():
    def mixed(s_hbm, m_hbm):
        s_sb = nl.ndarray((32, 16), dtype=nl.float32, buffer=nl.sbuf)
        m_sb = nl.ndarray((32, 16), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=s_sb, src=s_hbm)
        nisa.dma_copy(dst=m_sb, src=m_hbm)
        acc_psum = nl.ndarray((16, 16), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=acc_psum, stationary=s_sb, moving=m_sb)  # VIOLATION
        return s_hbm

    err = _raise(mixed, np.ones((32, 16), np.float32), np.ones((32, 16), BF16))
    check_rule_error(err, mixed, MARK, instruction="nc_matmul")


def test_e4m3fn_matmul_needs_trn3(trn2):
    def fn8(s_hbm, m_hbm):
        s_sb = nl.ndarray((32, 16), dtype=nl.float8_e4m3fn, buffer=nl.sbuf)
        m_sb = nl.ndarray((32, 16), dtype=nl.float8_e4m3fn, buffer=nl.sbuf)
        nisa.dma_copy(dst=s_sb, src=s_hbm)
        nisa.dma_copy(dst=m_sb, src=m_hbm)
        acc_psum = nl.ndarray((16, 16), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=acc_psum, stationary=s_sb, moving=m_sb)  # VIOLATION
        return s_hbm

    ones = np.ones((32, 16), ml_dtypes.float8_e4m3fn)
    check_rule_error(_raise(fn8, ones, ones), fn8, MARK, instruction="nc_matmul")


def test_gpsimd_cannot_touch_psum():
    def iota_psum(x_hbm):
        idx_psum = nl.ndarray((16, 16), dtype=nl.float32, buffer=nl.psum)
        nisa.iota(idx_psum, [[1, 16]], offset=0, channel_multiplier=0)  # VIOLATION
        return x_hbm

    err = _raise(iota_psum, np.zeros((1, 1), np.float32))
    check_rule_error(err, iota_psum, MARK, instruction="iota", operand="dst", rule_words=("psum",))


def test_tensor_tensor_two_psum_inputs():
    def both_psum(x_hbm):
        a_psum = nl.ndarray((16, 16), dtype=nl.float32, buffer=nl.psum)
        b_psum = nl.ndarray((16, 16), dtype=nl.float32, buffer=nl.psum)
        nisa.memset(dst=a_psum, value=1.0)
        nisa.memset(dst=b_psum, value=1.0)
        c_sb = nl.ndarray((16, 16), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=c_sb, data1=a_psum, data2=b_psum, op=nl.add)  # VIOLATION
        return x_hbm

    err = _raise(both_psum, np.zeros((1, 1), np.float32))
    check_rule_error(err, both_psum, MARK, instruction="tensor_tensor", rule_words=("psum",))


def test_tensor_tensor_shape_mismatch():
    def mismatch(x_hbm):
        a_sb = nl.ndarray((16, 16), dtype=nl.float32, buffer=nl.sbuf)
        b_sb = nl.ndarray((16, 8), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=a_sb, value=1.0)
        nisa.memset(dst=b_sb, value=1.0)
        nisa.tensor_tensor(dst=a_sb, data1=a_sb, data2=b_sb, op=nl.add)  # VIOLATION
        return x_hbm

    err = _raise(mismatch, np.zeros((1, 1), np.float32))
    check_rule_error(err, mismatch, MARK, instruction="tensor_tensor", operand="data2")


def test_vector_transpose_limited_to_32():
    def big_vector_transpose(x_hbm):
        a_sb = nl.ndarray((64, 16), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=a_sb, value=1.0)
        t_sb = nl.ndarray((16, 64), dtype=nl.float32, buffer=nl.sbuf)
        nisa.nc_transpose(dst=t_sb, data=a_sb, engine=nisa.vector_engine)  # VIOLATION
        return x_hbm

    err = _raise(big_vector_transpose, np.zeros((1, 1), np.float32))
    check_rule_error(err, big_vector_transpose, MARK, instruction="nc_transpose")


def test_memset_int_tile_with_float_value():
    def kind_mismatch(x_hbm):
        a_sb = nl.ndarray((4, 4), dtype=nl.int32, buffer=nl.sbuf)
        nisa.memset(dst=a_sb, value=1.5)  # VIOLATION
        return x_hbm

    err = _raise(kind_mismatch, np.zeros((1, 1), np.float32))
    check_rule_error(err, kind_mismatch, MARK, instruction="memset", operand="value")


def test_kernel_output_must_be_shared_hbm():
    def private_out(x_hbm):
        out_hbm = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.hbm)
        nisa.dma_copy(dst=out_hbm, src=x_hbm)
        return out_hbm

    with pytest.raises(NKIRuleError, match="shared_hbm"):
        simulate(jit(private_out))(np.zeros((4, 4), np.float32))


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=str)
def test_unwritten_sbuf_and_psum_read_as_nan(dtype):
    def read_fresh(x_hbm):
        a_sb = nl.ndarray((8, 16), dtype=x_hbm.dtype, buffer=nl.sbuf)
        nisa.memset(dst=a_sb[:, 0:4], value=0.0)
        acc_psum = nl.ndarray((8, 16), dtype=nl.float32, buffer=nl.psum)
        b_sb = nl.ndarray((8, 16), dtype=x_hbm.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=b_sb, src=acc_psum)
        out_a = nl.ndarray((8, 16), dtype=x_hbm.dtype, buffer=nl.shared_hbm)
        out_b = nl.ndarray((8, 16), dtype=x_hbm.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out_a, src=a_sb)
        nisa.dma_copy(dst=out_b, src=b_sb)
        return out_a, out_b

    a, b = simulate(jit(read_fresh))(np.zeros((1, 1), dtype))
    a32, b32 = a.astype(np.float32), b.astype(np.float32)
    assert (a32[:, :4] == 0).all()
    assert np.isnan(a32[:, 4:]).all()
    assert np.isnan(b32).all()


def test_rule_error_in_one_lnc2_program_does_not_deadlock_the_other():
    import threading

    def one_bad_program(x_hbm):
        out = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.shared_hbm)
        if nl.program_id(axis=0) == 1:
            acc_psum = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.psum)
            nisa.dma_copy(dst=acc_psum, src=x_hbm)  # VIOLATION
        nisa.core_barrier(out, (0, 1))  # program 0 waits here for program 1
        return out

    outcome = {}

    def launch():
        try:
            simulate(jit(one_bad_program)[2])(np.zeros((4, 4), np.float32))
        except NKIRuleError as err:
            outcome["err"] = err

    runner = threading.Thread(target=launch, daemon=True)
    runner.start()
    runner.join(timeout=60)
    assert not runner.is_alive(), "LNC2 run deadlocked after a rule error in one program"
    check_rule_error(outcome["err"], one_bad_program, MARK, instruction="dma_copy", operand="dst")
