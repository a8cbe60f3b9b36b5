"""MoE routing plan (``moe_plan``) as one NKI kernel: counts, ranks, block layout, slot scatter.

Algorithm (docs/contract.md §4.2; assignment ``a = t * k + j``, N = T * k, B = block_size, E experts,
NB = ceil(N / B) + E - 1):
  Pass 1, per tile of pmax assignments on partitions (ids as fp32, exact below 2^24):
    * ``onehot[a, e] = (iota_e == id_a)``.
    * rank of each assignment within its expert = number of earlier assignments of that expert:
      ``prefix = U^T @ onehot`` with the strictly-upper 0/1 matrix ``U[a', a] = (a > a')`` on
      TensorE, plus the running per-expert count of the earlier tiles added by a K=1 matmul of
      a ones row with the count row into the same PSUM tile; ``rank_a = prefix[a, id_a]``
      (``range_select`` keeps column ``id_a`` and max-reduces).
    * running counts: ``counts += ones^T @ onehot`` (fp32 PSUM accumulation over tiles).
  Block layout on one partition (row of E): ``blocks = (count + B - 1) >> log2(B)`` (int32,
  exact), ``block_end = cumsum(blocks)`` (``tensor_scalar_cumulative``), ``block_start =
  block_end - blocks``; both rows are broadcast to all partitions by K=1 matmuls.
  Pass 2, per assignment tile: ``slot = block_start[id] * B + rank`` (``range_select`` gather),
  then one indirect DMA scatters the assignment numbers into ``slot_assignment`` (filled with -1
  first). ``block_expert[b] = #{e : block_end[e] <= b}``, or -1 when that is E (unused block).

Loop structure: constants; pass 1 over assignment tiles; block rows; fill -1; pass 2 over
assignment tiles (scatter); block_expert over block tiles.

Shapes: topk_ids flattened to (N, 1) int32 -> block_expert (NB,) int32, slot_assignment
(NB * B,) int32, tokens_per_expert (E,) int32.

Limits (the launcher raises ``Unsupported`` otherwise): int32 ids; E <= gemm_moving_fmax (one
PSUM bank row of counts); B a power of two (the block count is a shift); N < 2^24. Ids must lie
in [0, E) (the op checks that before launching).
"""

from __future__ import annotations

from nki_lib._nki import nisa, nki, nl
from nki_lib.dispatch import KernelLaunch, Unsupported
from nki_lib.moe.kernels import moe_router_steps as rc
from nki_lib.sizes import ceil_div

FILL_CHUNK = 4096          # elements per DMA of the -1 fill of slot_assignment
EXACT_INT_LIMIT = 1 << 24  # integers exact in fp32


@nki.jit
def moe_plan_fwd_kernel(ids, num_experts, block_size):
    num_assign = ids.shape[0]
    pmax = nl.tile_size.pmax
    e = num_experts
    num_blocks = ceil_div(num_assign, block_size) + e - 1
    num_slots = num_blocks * block_size
    n_tiles = ceil_div(num_assign, pmax)
    shift = block_size.bit_length() - 1

    block_expert = nl.ndarray((num_blocks,), dtype=nl.int32, buffer=nl.shared_hbm)
    slot_assignment = nl.ndarray((num_slots,), dtype=nl.int32, buffer=nl.shared_hbm)
    tokens_per_expert = nl.ndarray((e,), dtype=nl.int32, buffer=nl.shared_hbm)

    # constants: expert iota, strictly-upper U[a', a] = (a > a'), ones column / row
    iota_e = rc.expert_iota(pmax, e)
    upper = nl.ndarray((pmax, pmax), dtype=nl.float32, buffer=nl.sbuf)
    nisa.iota(dst=upper, pattern=[[1, pmax]], offset=0, channel_multiplier=-1)        # a - a'
    nisa.tensor_scalar(dst=upper, data=upper, op0=nl.greater, operand0=0.0)
    ones_col = nl.ndarray((pmax, 1), dtype=nl.float32, buffer=nl.sbuf)
    ones_row = nl.ndarray((1, pmax), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=ones_col, value=1.0)
    nisa.memset(dst=ones_row, value=1.0)

    # pass 1: ids, ranks, running counts
    ids_all = nl.ndarray((pmax, n_tiles), dtype=nl.float32, buffer=nl.sbuf)
    rank_all = nl.ndarray((pmax, n_tiles), dtype=nl.float32, buffer=nl.sbuf)
    counts_row = nl.ndarray((1, e), dtype=nl.float32, buffer=nl.sbuf)
    counts_psum = nl.ndarray((1, e), dtype=nl.float32, buffer=nl.psum)
    nisa.memset(dst=counts_row, value=0.0)
    for ti in range(n_tiles):
        a0 = ti * pmax
        rows = min(pmax, num_assign - a0)
        ids_i = nl.ndarray((pmax, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=ids_i[:rows, :], src=ids[a0:a0 + rows, :])
        id_col = ids_all[:rows, nl.ds(ti, 1)]
        nisa.tensor_copy(dst=id_col, src=ids_i[:rows, :])
        onehot = nl.ndarray((pmax, e), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=onehot[:rows, :], data=iota_e[:rows, :], op0=nl.equal, operand0=id_col)

        prefix_psum = nl.ndarray((pmax, e), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=prefix_psum[:rows, :], stationary=upper[:rows, :rows], moving=onehot[:rows, :],
                       accumulate=False)
        nisa.nc_matmul(dst=prefix_psum[:rows, :], stationary=ones_row[:, :rows], moving=counts_row,
                       accumulate=True)
        scratch = nl.ndarray((pmax, e), dtype=nl.float32, buffer=nl.sbuf)
        nisa.range_select(dst=scratch[:rows, :], on_true_tile=prefix_psum[:rows, :], comp_op0=nl.greater_equal,
                          comp_op1=nl.less_equal, bound0=id_col, bound1=id_col,
                          reduce_cmd=nisa.reduce_cmd.reset_reduce, reduce_res=rank_all[:rows, nl.ds(ti, 1)],
                          reduce_op=nl.maximum, range_start=0, on_false_value=rc.NEG_BIG)

        nisa.nc_matmul(dst=counts_psum, stationary=ones_col[:rows, :], moving=onehot[:rows, :],
                       accumulate=(ti > 0))
        nisa.tensor_copy(dst=counts_row, src=counts_psum)

    # block layout rows (one partition): blocks, block_end, block_start
    counts_i = nl.ndarray((1, e), dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=counts_i, src=counts_row)
    nisa.dma_copy(dst=tokens_per_expert, src=counts_i)
    blocks_i = nl.ndarray((1, e), dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=blocks_i, data=counts_i, op0=nl.add, operand0=float(block_size - 1))
    nisa.tensor_scalar(dst=blocks_i, data=blocks_i, op0=nl.right_shift, operand0=shift)
    blocks_f = nl.ndarray((1, e), dtype=nl.float32, buffer=nl.sbuf)
    bend_row = nl.ndarray((1, e), dtype=nl.float32, buffer=nl.sbuf)
    bstart_row = nl.ndarray((1, e), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=blocks_f, src=blocks_i)
    nisa.tensor_scalar_cumulative(dst=bend_row, src=blocks_f, op0=nl.add, op1=nl.add, imm0=0.0)
    nisa.tensor_tensor(dst=bstart_row, data1=bend_row, data2=blocks_f, op=nl.subtract)
    bend_all = _broadcast_row(bend_row, ones_row, e)
    bstart_all = _broadcast_row(bstart_row, ones_row, e)

    # slot_assignment = -1, then scatter each assignment to its slot
    fill = nl.ndarray((1, FILL_CHUNK), dtype=nl.int32, buffer=nl.sbuf)
    nisa.memset(dst=fill, value=-1)
    for f0 in range(0, num_slots, FILL_CHUNK):
        n = min(FILL_CHUNK, num_slots - f0)
        nisa.dma_copy(dst=slot_assignment[f0:f0 + n], src=fill[:, :n])
    for ti in range(n_tiles):
        a0 = ti * pmax
        rows = min(pmax, num_assign - a0)
        id_col = ids_all[:rows, nl.ds(ti, 1)]
        start_col = nl.ndarray((pmax, 1), dtype=nl.float32, buffer=nl.sbuf)
        scratch = nl.ndarray((pmax, e), dtype=nl.float32, buffer=nl.sbuf)
        nisa.range_select(dst=scratch[:rows, :], on_true_tile=bstart_all[:rows, :], comp_op0=nl.greater_equal,
                          comp_op1=nl.less_equal, bound0=id_col, bound1=id_col,
                          reduce_cmd=nisa.reduce_cmd.reset_reduce, reduce_res=start_col[:rows, :],
                          reduce_op=nl.maximum, range_start=0, on_false_value=rc.NEG_BIG)
        slot_i = nl.ndarray((pmax, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=slot_i[:rows, :], data=start_col[:rows, :], op0=nl.multiply,
                           operand0=float(block_size), op1=nl.add, operand1=rank_all[:rows, nl.ds(ti, 1)])
        assign_i = nl.ndarray((pmax, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.iota(dst=assign_i[:rows, :], pattern=[[0, 1]], offset=a0, channel_multiplier=1)
        nisa.dma_copy(dst=slot_assignment.ap([[1, rows], [1, 1]], offset=0, vector_offset=slot_i[:rows, :],
                                             indirect_dim=0),
                      src=assign_i[:rows, :], dge_mode=nisa.dge_mode.swdge)

    # block_expert[b] = #{e : block_end[e] <= b}, -1 where that is E
    for bi in range(ceil_div(num_blocks, pmax)):
        b0 = bi * pmax
        rows = min(pmax, num_blocks - b0)
        b_col = nl.ndarray((pmax, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.iota(dst=b_col[:rows, :], pattern=[[0, 1]], offset=b0, channel_multiplier=1)
        ended = nl.ndarray((pmax, e), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=ended[:rows, :], data=bend_all[:rows, :], op0=nl.less_equal, operand0=b_col[:rows, :])
        owner = nl.ndarray((pmax, 1), dtype=nl.float32, buffer=nl.sbuf)
        unused = nl.ndarray((pmax, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=owner[:rows, :], op=nl.add, data=ended[:rows, :], axis=1)
        nisa.tensor_scalar(dst=unused[:rows, :], data=owner[:rows, :], op0=nl.equal, operand0=float(e),
                           op1=nl.multiply, operand1=-float(e + 1))
        owner_i = nl.ndarray((pmax, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=owner_i[:rows, :], data1=owner[:rows, :], data2=unused[:rows, :], op=nl.add)
        nisa.dma_copy(dst=block_expert[b0:b0 + rows], src=owner_i[:rows, :])
    return block_expert, slot_assignment, tokens_per_expert


def _broadcast_row(row_sb, ones_row, cols):
    """(1, cols) fp32 row -> (pmax, cols) SBUF copy on every partition (K=1 TensorE outer product)."""
    pmax = nl.tile_size.pmax
    row_psum = nl.ndarray((pmax, cols), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=row_psum, stationary=ones_row, moving=row_sb, accumulate=False)
    row_all = nl.ndarray((pmax, cols), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=row_all, src=row_psum, engine=nisa.engine.scalar)
    return row_all


def check_supported(topk_ids, num_experts, block_size):
    if topk_ids.dtype.itemsize != 4 or topk_ids.dtype.is_floating_point:
        raise Unsupported(f"the plan kernel reads int32 ids, got {topk_ids.dtype}")
    if num_experts > nl.tile_size.gemm_moving_fmax:
        raise Unsupported(f"E={num_experts} exceeds one PSUM bank row ({nl.tile_size.gemm_moving_fmax})")
    if block_size & (block_size - 1):
        raise Unsupported(f"block_size={block_size} is not a power of two (the block count is a shift)")
    if topk_ids.numel() + num_experts * block_size >= EXACT_INT_LIMIT:
        raise Unsupported("slot numbers would exceed the exact fp32 integer range (2^24)")


def launch_moe_plan_fwd(topk_ids, *, num_experts, block_size):
    """The launch of the plan kernel; it returns ``(block_expert, slot_assignment, tokens_per_expert)``."""
    check_supported(topk_ids, num_experts, block_size)
    return KernelLaunch(moe_plan_fwd_kernel, (topk_ids.reshape(-1, 1).contiguous(), num_experts, block_size))
