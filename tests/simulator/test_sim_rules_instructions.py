"""Per-instruction argument rules (docs/nki-semantics.md §5.3, §8.9–§8.28): each kernel body breaks one
documented constraint of one instruction and must raise NKIRuleError naming that instruction and
the offending operand, at the ``# VIOLATION`` line.
"""

import numpy as np
import pytest
from sim_helpers import check_rule_error

from nki_lib.simulator import NKIRuleError, jit, simulate
from nki_lib.simulator import isa as nisa
from nki_lib.simulator import language as nl

MARK = "# VIOLATION"


def reduce_partition_axis():
    a_sb = nl.zeros((8, 8), dtype=nl.float32)
    r_sb = nl.ndarray((1, 8), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=r_sb, op=nl.add, data=a_sb, axis=0)  # VIOLATION


def reduce_non_trailing_axis():
    a_sb = nl.zeros((8, 4, 6), dtype=nl.float32)
    r_sb = nl.ndarray((8, 6), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=r_sb, op=nl.add, data=a_sb, axis=1)  # VIOLATION


def iota_pattern_size():
    t_sb = nl.ndarray((8, 16), dtype=nl.int32, buffer=nl.sbuf)
    nisa.iota(t_sb, [[1, 12]], offset=0, channel_multiplier=0)  # VIOLATION


def activation_max_reduce():
    a_sb = nl.zeros((8, 8), dtype=nl.float32)
    r_sb = nl.ndarray((8, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=a_sb, op=nl.exp, data=a_sb, reduce_op=nl.maximum, reduce_res=r_sb,  # VIOLATION
                    reduce_cmd=nisa.reduce_cmd.reset_reduce)


def bitvec_on_floats():
    a_sb = nl.zeros((8, 8), dtype=nl.float32)
    nisa.tensor_tensor(dst=a_sb, data1=a_sb, data2=a_sb, op=nl.bitwise_and)  # VIOLATION


def core_barrier_cores():
    out = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.core_barrier(out, (0, 2))  # VIOLATION


def register_load_many():
    t_sb = nl.zeros((1, 2), dtype=nl.int32)
    reg = nisa.register_alloc(0)
    nisa.register_load(reg, t_sb)  # VIOLATION


def local_gather_elem_count():
    src_sb = nl.zeros((16, 32), dtype=nl.float32)
    idx_sb = nl.zeros((16, 1), dtype=nl.uint16)
    dst_sb = nl.ndarray((16, 6), dtype=nl.float32, buffer=nl.sbuf)
    nisa.local_gather(dst=dst_sb, src_buffer=src_sb, index=idx_sb, num_elem_per_idx=3,  # VIOLATION
                      num_valid_indices=2)


def nonzero_dst_dtype():
    src_sb = nl.zeros((16, 8), dtype=nl.float32)
    dst_sb = nl.ndarray((16, 9), dtype=nl.float32, buffer=nl.sbuf)
    nisa.nonzero_with_count(dst=dst_sb, src=src_sb)  # VIOLATION


def shuffle_mask_length():
    a_sb = nl.zeros((32, 8), dtype=nl.float32)
    nisa.nc_stream_shuffle(dst=a_sb, src=a_sb, shuffle_mask=list(range(16)))  # VIOLATION


def predicate_dtype():
    a_sb = nl.zeros((8, 8), dtype=nl.float32)
    p_sb = nl.zeros((8, 8), dtype=nl.float32)
    nisa.tensor_copy_predicated(dst=a_sb, src=a_sb, predicate=p_sb)  # VIOLATION


def find_index8_dst_dtype():
    a_sb = nl.zeros((8, 16), dtype=nl.float32)
    v_sb = nl.zeros((8, 8), dtype=nl.float32)
    i_sb = nl.ndarray((8, 8), dtype=nl.int32, buffer=nl.sbuf)
    nisa.nc_find_index8(dst=i_sb, data=a_sb, vals=v_sb)  # VIOLATION


def dma_transpose_dtype_mismatch():
    a_sb = nl.zeros((16, 8), dtype=nl.bfloat16)
    t_sb = nl.ndarray((8, 16), dtype=nl.float16, buffer=nl.sbuf)
    nisa.dma_transpose(dst=t_sb, src=a_sb)  # VIOLATION


def _indirect_source(shape, pattern, idx_dtype=nl.uint32, idx_shape=(128, 1)):
    """An HBM view gathered by SBUF indices (an indirect dma_transpose's source)."""
    cache = nl.ndarray((256, 4096), dtype=nl.bfloat16, buffer=nl.shared_hbm)
    idx_sb = nl.zeros(idx_shape, dtype=idx_dtype)
    return cache.ap(pattern, offset=0, vector_offset=idx_sb, indirect_dim=0)


def indirect_transpose_4d_both_inner_dims():
    src = _indirect_source((128, 4, 8, 64), [[4096, 128], [512, 4], [64, 8], [1, 64]])
    t_sb = nl.ndarray((64, 4, 8, 128), dtype=nl.bfloat16, buffer=nl.sbuf)
    nisa.dma_transpose(dst=t_sb, src=src)  # VIOLATION


def indirect_transpose_int32_indices():
    src = _indirect_source((128, 8, 64), [[4096, 128], [64, 8], [1, 64]], idx_dtype=nl.int32)
    t_sb = nl.ndarray((64, 8, 128), dtype=nl.bfloat16, buffer=nl.sbuf)
    nisa.dma_transpose(dst=t_sb, src=src)  # VIOLATION


def indirect_transpose_hwdge():
    src = _indirect_source((128, 8, 64), [[4096, 128], [64, 8], [1, 64]])
    t_sb = nl.ndarray((64, 8, 128), dtype=nl.bfloat16, buffer=nl.sbuf)
    nisa.dma_transpose(dst=t_sb, src=src, dge_mode=nisa.dge_mode.hwdge)  # VIOLATION


def indirect_transpose_rows_not_a_multiple_of_16():
    src = _indirect_source((24, 8, 64), [[4096, 24], [64, 8], [1, 64]])
    t_sb = nl.ndarray((64, 8, 24), dtype=nl.bfloat16, buffer=nl.sbuf)
    nisa.dma_transpose(dst=t_sb, src=src)  # VIOLATION


def _hwdge_transpose(src_shape):
    """A hardware-DGE dma_transpose of an SBUF source of ``src_shape`` into its permuted shape."""
    a_sb = nl.zeros(src_shape, dtype=nl.bfloat16)
    axes = {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}[len(src_shape)]
    t_sb = nl.ndarray(tuple(src_shape[a] for a in axes), dtype=nl.bfloat16, buffer=nl.sbuf)
    return t_sb, a_sb


def hwdge_transpose_2d_8_rows():
    t_sb, a_sb = _hwdge_transpose((8, 128))
    nisa.dma_transpose(dst=t_sb, src=a_sb, dge_mode=nisa.dge_mode.hwdge)  # VIOLATION


def hwdge_transpose_3d_8_rows():
    t_sb, a_sb = _hwdge_transpose((8, 2, 128))      # the old rule's rows * shape[-2] % 16 == 0
    nisa.dma_transpose(dst=t_sb, src=a_sb, dge_mode=nisa.dge_mode.hwdge)  # VIOLATION


def hwdge_transpose_4d_32_rows():
    t_sb, a_sb = _hwdge_transpose((32, 1, 2, 128))
    nisa.dma_transpose(dst=t_sb, src=a_sb, dge_mode=nisa.dge_mode.hwdge)  # VIOLATION


def hwdge_transpose_4d_last_64():
    t_sb, a_sb = _hwdge_transpose((16, 2, 8, 64))   # decode's multi-chunk K^T before round 10
    nisa.dma_transpose(dst=t_sb, src=a_sb, dge_mode=nisa.dge_mode.hwdge)  # VIOLATION


def hwdge_transpose_2d_last_64():
    t_sb, a_sb = _hwdge_transpose((16, 64))
    nisa.dma_transpose(dst=t_sb, src=a_sb, dge_mode=nisa.dge_mode.hwdge)  # VIOLATION


def transpose_mode_without_identity():
    s_sb = nl.zeros((32, 16), dtype=nl.bfloat16)
    m_sb = nl.ones((32, 32), dtype=nl.bfloat16)
    t_psum = nl.ndarray((16, 32), dtype=nl.bfloat16, buffer=nl.psum)
    nisa.nc_matmul(dst=t_psum, stationary=s_sb, moving=m_sb, is_transpose=True)  # VIOLATION


def tile_size_too_small():
    s_sb = nl.zeros((128, 64), dtype=nl.bfloat16)
    m_sb = nl.zeros((128, 64), dtype=nl.bfloat16)
    acc_psum = nl.ndarray((64, 64), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=acc_psum, stationary=s_sb, moving=m_sb, tile_position=(0, 0), tile_size=(64, 64))  # VIOLATION



def tile_position_without_tile_size():
    s_sb = nl.zeros((64, 64), dtype=nl.bfloat16)
    m_sb = nl.zeros((64, 64), dtype=nl.bfloat16)
    acc_psum = nl.ndarray((64, 64), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=acc_psum, stationary=s_sb, moving=m_sb, tile_position=(64, 0))  # VIOLATION


def row_position_not_a_multiple_of_the_row_size():
    s_sb = nl.zeros((64, 64), dtype=nl.bfloat16)
    m_sb = nl.zeros((64, 64), dtype=nl.bfloat16)
    acc_psum = nl.ndarray((64, 64), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=acc_psum, stationary=s_sb, moving=m_sb, tile_position=(32, 0), tile_size=(64, 128))  # VIOLATION


def stationary_wider_than_the_column_tile():
    s_sb = nl.zeros((64, 96), dtype=nl.bfloat16)
    m_sb = nl.zeros((64, 64), dtype=nl.bfloat16)
    acc_psum = nl.ndarray((96, 64), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=acc_psum, stationary=s_sb, moving=m_sb, tile_position=(0, 0), tile_size=(64, 64))  # VIOLATION


def double_row_with_column_tiling():
    s_sb = nl.zeros((128, 2, 64), dtype=nl.float8_e4m3)
    m_sb = nl.zeros((128, 2, 64), dtype=nl.float8_e4m3)
    acc_psum = nl.ndarray((64, 64), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=acc_psum, stationary=s_sb, moving=m_sb, perf_mode=nisa.matmul_perf_mode.double_row,  # VIOLATION
                   tile_position=(0, 0), tile_size=(128, 64))


CASES = [
    (reduce_partition_axis, "tensor_reduce", "axis"),
    (reduce_non_trailing_axis, "tensor_reduce", "axis"),
    (iota_pattern_size, "iota", None),
    (activation_max_reduce, "activation", "reduce_op"),
    (bitvec_on_floats, "tensor_tensor", None),
    (core_barrier_cores, "core_barrier", "cores"),
    (register_load_many, "register_load", "src"),
    (local_gather_elem_count, "local_gather", "num_elem_per_idx"),
    (nonzero_dst_dtype, "nonzero_with_count", "dst"),
    (shuffle_mask_length, "nc_stream_shuffle", "shuffle_mask"),
    (predicate_dtype, "tensor_copy_predicated", "predicate"),
    (find_index8_dst_dtype, "nc_find_index8", "dst"),
    (dma_transpose_dtype_mismatch, "dma_transpose", None),
    (indirect_transpose_4d_both_inner_dims, "dma_transpose", "src"),
    (indirect_transpose_int32_indices, "dma_transpose", "src"),
    (indirect_transpose_hwdge, "dma_transpose", "dge_mode"),
    (indirect_transpose_rows_not_a_multiple_of_16, "dma_transpose", "src"),
    (hwdge_transpose_2d_8_rows, "dma_transpose", "src"),
    (hwdge_transpose_3d_8_rows, "dma_transpose", "src"),
    (hwdge_transpose_4d_32_rows, "dma_transpose", "src"),
    (hwdge_transpose_4d_last_64, "dma_transpose", "src"),
    (hwdge_transpose_2d_last_64, "dma_transpose", "src"),
    (transpose_mode_without_identity, "nc_matmul", "moving"),
    (tile_size_too_small, "nc_matmul", None),
    (tile_position_without_tile_size, "nc_matmul", "tile_size"),
    (row_position_not_a_multiple_of_the_row_size, "nc_matmul", "tile_position"),
    (stationary_wider_than_the_column_tile, "nc_matmul", "stationary"),
    (double_row_with_column_tiling, "nc_matmul", "tile_size"),
]


@pytest.mark.parametrize(("body", "instruction", "operand"), CASES, ids=[c[0].__name__ for c in CASES])
def test_instruction_rule(body, instruction, operand):
    def kernel(x_hbm):
        body()
        return x_hbm

    kernel.__name__ = kernel.__qualname__ = body.__name__
    with pytest.raises(NKIRuleError) as info:
        simulate(jit(kernel))(np.zeros((1, 1), np.float32))
    check_rule_error(info.value, body, MARK, instruction=instruction, operand=operand)


def test_indirect_transpose_within_the_documented_limits_gathers_then_transposes():
    """A 3-d indirect dma_transpose: rows ``idx`` of the HBM source (128 of them, uint32), each
    (8, 64), land as dst[d, c, p] = src[idx[p], c, d]."""
    rows, c, d = 128, 8, 64

    @jit
    def kernel(x_hbm, idx_hbm):
        idx_sb = nl.ndarray((rows, 1), dtype=nl.uint32, buffer=nl.sbuf)
        nisa.dma_copy(dst=idx_sb, src=idx_hbm)
        t_sb = nl.ndarray((d, c, rows), dtype=nl.bfloat16, buffer=nl.sbuf)
        src = x_hbm.ap([[c * d, rows], [d, c], [1, d]], offset=0, vector_offset=idx_sb, indirect_dim=0)
        nisa.dma_transpose(dst=t_sb, src=src)
        out = nl.ndarray((d, c, rows), dtype=nl.bfloat16, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t_sb)
        return out

    import ml_dtypes

    x = np.random.default_rng(0).standard_normal((256, c * d)).astype(ml_dtypes.bfloat16)
    idx = np.random.default_rng(1).permutation(256)[:rows].astype(np.uint32).reshape(rows, 1)
    got = np.asarray(simulate(kernel)(x, idx))
    want = x.reshape(256, c, d)[idx[:, 0]].transpose(2, 1, 0)
    np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))


def test_hwdge_transpose_shape_predicate():
    """docs/nki-semantics.md §14.15: the hardware DGE takes sources of exactly 16 rows whose last dim
    is a multiple of 128 (a last dim of 192 or 256 cannot reach an instruction at all: it becomes the
    destination's partition dim, at most 128)."""
    from nki_lib.simulator.isa.dma import _hwdge_shape_ok

    assert _hwdge_shape_ok((16, 128)) and _hwdge_shape_ok((16, 3, 256)) and _hwdge_shape_ok((16, 1, 2, 128))
    for shape in ((16, 64), (16, 2, 192), (8, 128), (1, 16, 128), (32, 1, 1, 128)):
        assert not _hwdge_shape_ok(shape), shape


@pytest.mark.parametrize("shape", [(16, 128), (16, 3, 128), (16, 2, 3, 128)], ids=["2d", "3d", "4d"])
def test_hwdge_transpose_within_the_documented_limits(shape):
    """A hardware-DGE dma_transpose of 16 rows and a 128-element last dim from HBM: dst is
    src.transpose(axes), element by element."""
    import ml_dtypes

    axes = {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}[len(shape)]
    out_shape = tuple(shape[a] for a in axes)

    @jit
    def kernel(x_hbm):
        t_sb = nl.ndarray(out_shape, dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_transpose(dst=t_sb, src=x_hbm, dge_mode=nisa.dge_mode.hwdge)
        out = nl.ndarray(out_shape, dtype=nl.bfloat16, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t_sb)
        return out

    x = np.random.default_rng(0).standard_normal(shape).astype(ml_dtypes.bfloat16)
    got = np.asarray(simulate(kernel)(x))
    np.testing.assert_array_equal(got.astype(np.float32), x.transpose(axes).astype(np.float32))


def test_unknown_static_transpose_has_no_hwdge_shape_limit():
    """``dge_mode=unknown`` on a static transpose (the compiler may choose precomputed descriptors):
    8 rows of 64 elements are accepted, and the trace records that the shape is not the hardware
    DGE's."""
    import ml_dtypes

    from nki_lib.simulator import last_run

    @jit
    def kernel(x_hbm):
        t_sb = nl.ndarray((64, 8), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_transpose(dst=t_sb, src=x_hbm)
        out = nl.ndarray((64, 8), dtype=nl.bfloat16, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t_sb)
        return out

    x = np.random.default_rng(0).standard_normal((8, 64)).astype(ml_dtypes.bfloat16)
    got = np.asarray(simulate(kernel)(x))
    np.testing.assert_array_equal(got.astype(np.float32), x.T.astype(np.float32))
    entry = [e for e in last_run().trace if e.opcode == "dma_transpose"][0]
    assert entry.attrs["hwdge_shape"] is False and entry.attrs["dge_mode"] == "unknown"
