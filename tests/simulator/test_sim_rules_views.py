"""More rejected kernels (docs/nki-semantics.md §2.2, §2.5, §3.5, §3.7, §4.4, §8.0, §8.6, §8.8, §8.27, §14.23):
engine/memory rules, TensorE limits on trn3, access-pattern dims, stride-0 writes, DMA sizes,
tensor values used as Python values, list kernel arguments. Each raises NKIRuleError naming the
instruction, operand, rule and the ``# VIOLATION`` line.
"""

import numpy as np
import pytest
from sim_helpers import check_rule_error

from nki_lib.simulator import NKIRuleError, jit, simulate, tile_size
from nki_lib.simulator import isa as nisa
from nki_lib.simulator import language as nl

MARK = "# VIOLATION"
ONE = np.zeros((1, 1), np.float32)


def _raise(kernel_fn, *args):
    with pytest.raises(NKIRuleError) as info:
        simulate(jit(kernel_fn))(*args)
    return info.value


def test_matmul_operand_in_psum():
    def psum_moving(x_hbm):
        s_sb = nl.zeros((32, 16), dtype=nl.bfloat16)
        m_psum = nl.ndarray((32, 16), dtype=nl.bfloat16, buffer=nl.psum)
        nisa.memset(dst=m_psum, value=0.0)
        acc_psum = nl.ndarray((16, 16), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=acc_psum, stationary=s_sb, moving=m_psum)  # VIOLATION
        return x_hbm

    check_rule_error(_raise(psum_moving, ONE), psum_moving, MARK, instruction="nc_matmul", operand="moving",
                     rule_words=("psum",))


def test_matmul_moving_free_limit_on_trn3(trn3):
    n = tile_size.psum_num_banks * tile_size.psum_bank_fmax + 8  # fp32 result larger than all banks

    def too_wide(x_hbm):
        s_sb = nl.zeros((32, 8), dtype=nl.bfloat16)
        m_sb = nl.zeros((32, n), dtype=nl.bfloat16)
        acc_psum = nl.ndarray((8, n // 2), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=acc_psum.ap([[n // 2, 8], [1, n]], offset=0), stationary=s_sb, moving=m_sb)  # VIOLATION
        return x_hbm

    err = _raise(too_wide, ONE)
    check_rule_error(err, too_wide, MARK)


def test_gpsimd_copy_from_psum_and_memset_into_psum():
    def gpsimd_psum(x_hbm):
        acc_psum = nl.ndarray((16, 16), dtype=nl.float32, buffer=nl.psum)
        nisa.memset(dst=acc_psum, value=0.0, engine=nisa.gpsimd_engine)  # VIOLATION
        return x_hbm

    check_rule_error(_raise(gpsimd_psum, ONE), gpsimd_psum, MARK, instruction="memset", operand="dst",
                     rule_words=("psum",))

    def gpsimd_copy(x_hbm):
        acc_psum = nl.ndarray((16, 16), dtype=nl.float32, buffer=nl.psum)
        nisa.memset(dst=acc_psum, value=0.0)
        t_sb = nl.ndarray((16, 16), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=t_sb, src=acc_psum, engine=nisa.gpsimd_engine)  # VIOLATION
        return x_hbm

    check_rule_error(_raise(gpsimd_copy, ONE), gpsimd_copy, MARK, instruction="tensor_copy", operand="src")


def test_tensor_engine_transpose_limited_to_128():
    def wide(x_hbm):
        a_sb = nl.zeros((64, 200), dtype=nl.bfloat16)
        t_psum = nl.ndarray((200, 64), dtype=nl.bfloat16, buffer=nl.psum)  # VIOLATION
        nisa.nc_transpose(dst=t_psum, data=a_sb, engine=nisa.tensor_engine)
        return x_hbm

    err = _raise(wide, ONE)
    check_rule_error(err, wide, MARK, rule_words=("128",))


def test_max8_needs_eight_elements():
    def short(x_hbm):
        a_sb = nl.zeros((4, 6), dtype=nl.float32)
        m_sb = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.sbuf)
        nisa.max8(dst=m_sb, src=a_sb)  # VIOLATION
        return x_hbm

    check_rule_error(_raise(short, ONE), short, MARK, instruction="max8", operand="src")


def test_access_pattern_with_five_free_dims():
    def deep(x_hbm):
        a_sb = nl.zeros((4, 32), dtype=nl.float32)
        b_sb = nl.ndarray((4, 32), dtype=nl.float32, buffer=nl.sbuf)
        view = a_sb.ap([[32, 4], [16, 2], [8, 2], [4, 2], [2, 2], [1, 2]], offset=0)  # VIOLATION
        nisa.tensor_copy(dst=b_sb, src=view)
        return x_hbm

    err = _raise(deep, ONE)
    check_rule_error(err, deep, MARK)


def test_stride0_destination_last_write_wins():
    @jit
    def broadcast_write(x_hbm):
        a_sb = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=a_sb, src=x_hbm)
        b_sb = nl.zeros((4, 8), dtype=nl.float32)
        nisa.tensor_copy(dst=b_sb.ap([[8, 4], [0, 8]], offset=0), src=a_sb)   # every row onto b[:, 0]
        out = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=b_sb)
        return out

    x = np.arange(32, dtype=np.float32).reshape(4, 8)
    want = np.zeros_like(x)
    want[:, 0] = x[:, -1]
    np.testing.assert_array_equal(simulate(broadcast_write)(x), want)


def test_dma_element_count_mismatch():
    def mismatch(x_hbm):
        t_sb = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t_sb, src=x_hbm)  # VIOLATION
        return x_hbm

    check_rule_error(_raise(mismatch, np.zeros((4, 5), np.float32)), mismatch, MARK, instruction="dma_copy")


def test_tensor_values_are_not_python_values():
    def branch_on_tile(x_hbm):
        t_sb = nl.zeros((4, 4), dtype=nl.float32)
        if int(t_sb[0, 0]):  # tensor contents do not exist at trace time on hardware
            pass
        return x_hbm

    with pytest.raises((NKIRuleError, TypeError)):
        simulate(jit(branch_on_tile))(ONE)


def test_list_kernel_argument_rejected():
    def takes_list(x_hbm, sizes):
        return x_hbm

    with pytest.raises((NKIRuleError, TypeError), match="list|tuple"):
        simulate(jit(takes_list))(ONE, [1, 2])


def test_tensor_scalar_operand_tile_shape():
    def bad_operand(x_hbm):
        a_sb = nl.zeros((8, 8), dtype=nl.float32)
        s_sb = nl.zeros((8, 2), dtype=nl.float32)
        nisa.tensor_scalar(dst=a_sb, data=a_sb, op0=nl.add, operand0=s_sb)  # VIOLATION
        return x_hbm

    check_rule_error(_raise(bad_operand, ONE), bad_operand, MARK, instruction="tensor_scalar", operand="operand0")


def test_matmul_dst_shape_mismatch():
    def wrong_dst(x_hbm):
        s_sb = nl.zeros((32, 16), dtype=nl.bfloat16)
        m_sb = nl.zeros((32, 24), dtype=nl.bfloat16)
        acc_psum = nl.ndarray((16, 16), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=acc_psum, stationary=s_sb, moving=m_sb)  # VIOLATION
        return x_hbm

    check_rule_error(_raise(wrong_dst, ONE), wrong_dst, MARK, instruction="nc_matmul", operand="dst")


def test_matmul_fp32_with_fp8_operand():
    def fp32_with_fp8(x_hbm):
        s_sb = nl.zeros((32, 16), dtype=nl.float32)
        m_sb = nl.zeros((32, 16), dtype=nl.float8_e4m3)
        acc_psum = nl.ndarray((16, 16), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=acc_psum, stationary=s_sb, moving=m_sb)  # VIOLATION
        return x_hbm

    check_rule_error(_raise(fp32_with_fp8, ONE), fp32_with_fp8, MARK, instruction="nc_matmul")


SBUF_FREE_MAX = 64 * 1024   # Vector/Scalar free elements per partition for SBUF operands (§3.5)
PSUM_FREE_MAX = 4 * 1024    # ... and for PSUM operands


def test_compute_free_size_limits():
    def sbuf_too_long(x_hbm):
        a_sb = nl.ndarray((1, SBUF_FREE_MAX + 2), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.memset(dst=a_sb[:, 0:SBUF_FREE_MAX], value=0.0)
        nisa.memset(dst=a_sb, value=0.0)  # VIOLATION
        return x_hbm

    check_rule_error(_raise(sbuf_too_long, ONE), sbuf_too_long, MARK, instruction="memset", operand="dst")

    def psum_too_long(x_hbm):
        a_psum = nl.ndarray((1, PSUM_FREE_MAX + 2), dtype=nl.bfloat16, buffer=nl.psum)
        nisa.memset(dst=a_psum[:, 0:PSUM_FREE_MAX], value=0.0)
        nisa.memset(dst=a_psum, value=0.0)  # VIOLATION
        return x_hbm

    check_rule_error(_raise(psum_too_long, ONE), psum_too_long, MARK, instruction="memset", operand="dst")
