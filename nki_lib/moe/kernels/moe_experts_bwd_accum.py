"""Weight-gradient accumulation of the expert-MLP backward: block modes, fp32 accumulators, idle experts.

Algorithm: the plan keeps an expert's blocks consecutive, so VectorE compares each block's expert
with its neighbours' to mark it its expert's only / first / middle / last block
(:func:`accumulation_modes`); each mode flag goes into a register per block
(:func:`mode_registers`). A weight-gradient row piece (PSUM tiles side by side) is then written by
mode under dynamic loops of 0/1 trips (:func:`accumulate_rows`): only -> the gradient in the
weights' dtype; first -> the fp32 accumulator; middle -> accumulator read-modify-write; last ->
accumulator + piece cast to the gradient. Experts owning no block get zero gradients
(:func:`zero_idle_experts`: a VectorE count of the plan per expert, a 0/1 dynamic loop each).

Loop structure: idle experts: expert tiles of 128 (static) > experts (dynamic 0/1 guard) >
outputs > row tiles > column tiles. accumulate_rows: four mode guards (dynamic), one DMA per
direction each.

Shapes (dimension legend): NB blocks (groups), E experts, rs <= 128 rows and cn columns of a row
piece. block_expert (NB,) int32; modes (1, 4, NB) int32; accumulators fp32 and gradients (E, R, C)
in HBM (R, C the weight's rows and columns).

Limits: the expert index comes from a register (scalar_offset, indirect_dim=0); dynamic loops
nested in the block guard (NKI >= 0.6); an expert with one block never touches its fp32 accumulator.
"""

from __future__ import annotations

from nki_lib._nki import nisa, nl
from nki_lib.sizes import spans

ACC_MODES = ("only", "first", "middle", "last")          # a block's place among its expert's blocks


def accumulation_modes(expert_sb):
    """(1, 4, NB) int32 flags per block, one of them 1 for a used block: the block is its expert's
    only / first / middle / last block (the plan keeps an expert's blocks consecutive)."""
    n_blocks = expert_sb.shape[1]
    edges_sb = nl.ndarray((1, 4, n_blocks), dtype=nl.int32, buffer=nl.sbuf)   # first, last, not f., not l.
    nisa.memset(dst=edges_sb[:, 0, 0:1], value=1)
    nisa.memset(dst=edges_sb[:, 1, n_blocks - 1:n_blocks], value=1)
    if n_blocks > 1:
        nisa.tensor_tensor(dst=edges_sb[:, 0, 1:], data1=expert_sb[:, 1:], data2=expert_sb[:, :n_blocks - 1],
                           op=nl.not_equal)
        nisa.tensor_tensor(dst=edges_sb[:, 1, :n_blocks - 1], data1=expert_sb[:, :n_blocks - 1],
                           data2=expert_sb[:, 1:], op=nl.not_equal)
    for i in (0, 1):
        nisa.tensor_scalar(dst=edges_sb[:, 2 + i, :], data=edges_sb[:, i, :], op0=nl.multiply, operand0=-1,
                           op1=nl.add, operand1=1)
    modes_sb = nl.ndarray((1, len(ACC_MODES), n_blocks), dtype=nl.int32, buffer=nl.sbuf)
    for m, (a, b) in enumerate(((0, 1), (0, 3), (2, 3), (2, 1))):   # only, first, middle, last
        nisa.tensor_tensor(dst=modes_sb[:, m, :], data1=edges_sb[:, a, :], data2=edges_sb[:, b, :],
                           op=nl.multiply)
    return modes_sb


def mode_registers(modes_sb, b):
    regs = []
    for m in range(len(ACC_MODES)):
        reg = nisa.register_alloc()
        nisa.register_load(reg, modes_sb[0:1, m, b:b + 1])
        regs.append(reg)
    return regs


def _store(dst_view, parts, dtype):
    """dst = the parts side by side (PSUM pieces evicted into one SBUF row tile, one DMA)."""
    out_sb = nl.ndarray((parts[0].shape[0], sum(p.shape[1] for p in parts)), dtype=dtype, buffer=nl.sbuf)
    c0 = 0
    for part_psum in parts:
        nisa.tensor_copy(dst=out_sb[:, c0:c0 + part_psum.shape[1]], src=part_psum)
        c0 += part_psum.shape[1]
    nisa.dma_copy(dst=dst_view, src=out_sb)


def _add_store(dst_view, acc_view, parts, dtype):
    """dst = acc + the parts side by side (one load of acc, one store)."""
    shape = (parts[0].shape[0], sum(p.shape[1] for p in parts))
    old_sb = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=old_sb, src=acc_view)
    out_sb = nl.ndarray(shape, dtype=dtype, buffer=nl.sbuf)
    c0 = 0
    for part_psum in parts:
        cn = part_psum.shape[1]
        nisa.tensor_tensor(dst=out_sb[:, c0:c0 + cn], data1=old_sb[:, c0:c0 + cn], data2=part_psum, op=nl.add)
        c0 += cn
    nisa.dma_copy(dst=dst_view, src=out_sb)


def accumulate_rows(acc, out, mode_regs, expert_reg, r0, c0, parts, row_step=1):
    """Add the parts (PSUM tiles (rs, cn_j), side by side: (rs, cn) in all) into the expert's
    gradient rows [r0 : r0 + rs, c0 : c0 + cn], by the block's mode (dynamic loops of 0/1
    trips): only -> out = part; first -> acc = part; middle -> acc += part; last -> out = acc +
    part (acc fp32 in HBM, out in the weights' dtype). One DMA per direction for the whole row
    piece (long contiguous runs). An expert with one block never touches the fp32 accumulator.
    ``row_step`` > 1: partition p holds the whole rows r0 + row_step p ... + row_step - 1 side by
    side (c0 = 0, cn = row_step x the rows' length: one contiguous run per partition)."""
    rs, cn = parts[0].shape[0], sum(p.shape[1] for p in parts)
    cols = acc.shape[2]
    assert row_step == 1 or (c0 == 0 and cn == row_step * cols), "row_step: whole rows only"

    def rows(t):
        return t.ap([[row_step * cols, rs], [1, cn]], offset=r0 * cols + c0, scalar_offset=expert_reg,
                    indirect_dim=0)

    only_reg, first_reg, middle_reg, last_reg = mode_regs
    for _ in nl.dynamic_range(0, only_reg):
        _store(rows(out), parts, out.dtype)
    for _ in nl.dynamic_range(0, first_reg):
        _store(rows(acc), parts, nl.float32)
    for _ in nl.dynamic_range(0, middle_reg):
        _add_store(rows(acc), rows(acc), parts, nl.float32)
    for _ in nl.dynamic_range(0, last_reg):
        _add_store(rows(out), rows(acc), parts, out.dtype)


def zero_idle_experts(block_expert, outs):
    """outs[i][e] = 0 for every expert e that owns no block (dynamic loops of 0/1 trips)."""
    pmax, fmax = nl.tile_size.pmax, nl.tile_size.gemm_moving_fmax
    n_blocks = block_expert.shape[0]
    experts = outs[0].shape[0]
    for e0, et in spans(experts, pmax):
        be_sb = nl.ndarray((et, n_blocks), dtype=nl.int32, buffer=nl.sbuf)   # block experts, per partition
        nisa.dma_copy(dst=be_sb, src=block_expert.ap([[0, et], [1, n_blocks]], offset=0))
        ids_sb = nl.ndarray((et, 1), dtype=nl.float32, buffer=nl.sbuf)        # fp32 per-partition operand
        nisa.iota(dst=ids_sb, pattern=[[0, 1]], offset=e0, channel_multiplier=1)
        hits_sb = nl.ndarray((et, n_blocks), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=hits_sb, data=be_sb, op0=nl.equal, operand0=ids_sb)
        count_sb = nl.ndarray((et, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=count_sb, op=nl.add, data=hits_sb, axis=1)
        idle_sb = nl.ndarray((et, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=idle_sb, data=count_sb, op0=nl.equal, operand0=0.0)
        for e in range(e0, e0 + et):
            idle_reg = nisa.register_alloc()
            nisa.register_load(idle_reg, idle_sb[e - e0:e - e0 + 1, 0:1])
            for _ in nl.dynamic_range(0, idle_reg):
                for out in outs:
                    rows, cols = out.shape[1], out.shape[2]
                    zero_sb = nl.ndarray((pmax, min(cols, fmax)), dtype=out.dtype, buffer=nl.sbuf)
                    nisa.memset(dst=zero_sb, value=0.0)
                    for r0, rs in spans(rows, pmax):
                        for c0, cn in spans(cols, fmax):
                            nisa.dma_copy(dst=out[e, r0:r0 + rs, c0:c0 + cn], src=zero_sb[:rs, :cn])
