"""Fused MoE expert MLP backward over a block plan (NKI kernel + launcher).

Per assignment a = (t, j) on expert e, with g/u the gate/up projections of x_t, h = act(g) * u,
w_a = topk_weights[t, j] and dy_t the output gradient (moe_experts_reference.moe_experts_backward):
  dhy = dy_t @ W_down[e]             d topk_weights[a] = <dhy, h> (= <dy_t, h @ W_down[e]^T>)
  dh = w_a * dhy                     dg = dh * u * act'(g),  du = dh * act(g)
  dx_t += dg @ W_gate[e] + du @ W_up[e]
  dW_gate[e] += dg^T x_t,  dW_up[e] += du^T x_t,  dW_down[e] += (w_a dy_t)^T h
h is recomputed from x (the op saves only its inputs): one extra gate/up projection per block,
no activation memory.

Algorithm (one launch): on the host (index metadata, :mod:`.moe_experts_groups`), up to G
consecutive blocks of one expert are merged into a group of S = G*B <= 512 slots (the largest
whose SBUF estimate fits), as in the forward: every weight tile is loaded once per group and the
weight gradients are contracted over all S slots in PSUM, so an expert with <= 512 assignments
writes its gradients once, without the fp32 scratch. Below, "block" means such a group. In the
kernel: zero the weight gradients of experts that own no block (per expert, a
dynamic loop whose 0/1 trip count comes from a VectorE count of the plan); load the plan's slot
ids, block flags and each slot tile's live flag as in the forward, and each block's accumulation
mode (its expert's only, first, middle or last block: the plan keeps an expert's blocks
consecutive); for each block b (static loop, guarded by a dynamic loop of 0/1 trips as in the
forward; every slot tile but the first under its own 0/1 live guard, so padding tiles cost no
gather, matmul or write -- the first tile is always computed, its padding rows are zero):
  1. per slot tile (<= 128): gather x and dy rows (indirect DMA, padding slots skipped -> zero),
     routing weights — issued during block b - 1, before its scatters of step 3 (GpSimd issues
     DMAs in program order), into rows allocated after block b - 1's I chunks; do = w_a * dy
     rows; PE-transpose x and dy into xT / dyT (H on partitions).
  2. per I chunk (<= 512, I / n rounded up to 128 rows for the fewest chunks n that fit SBUF,
     :func:`chunk_widths`; the next chunk's weights prefetched before this chunk's gradient
     stores): W_gate^T/W_up^T columns (rows loaded, then
     PE-transposed to H on partitions) and W_down columns (natural layout: H already on
     partitions), selected by the expert register; per slot tile g, u, dhy (slots on
     partitions, I chunk free) in fp32 PSUM (contraction over H tiles), then on ScalarE/VectorE:
     act, act' (silu_dx / gelu_dx; the tanh-GELU derivative composed from nl.tanh and VectorE
     ops), h, the partial d topk_weights, dg, du; PE-transpose dg/du into dgT/duT (I on
     partitions; software-pipelined: a tile's transposes follow the next tile's matmuls).
     Weight gradients of the chunk: contraction over the block's slots in PSUM (dW_down = do^T h,
     dW_gate = dg^T x, dW_up = du^T x; row pieces of up to ROW_BANKS PSUM banks evicted into one
     SBUF row and moved with one DMA), then by the block's mode (nested
     dynamic loops of 0/1 trips): only -> write the gradient rows in the weights' dtype; first ->
     write fp32 accumulator rows (HBM scratch); middle -> fp32 read-modify-write; last -> read,
     add, cast and write the gradient rows. Blocks in order: deterministic; an expert with one
     block never touches the fp32 scratch.
  3. dx rows = dgT^T W_gate + duT^T W_up per H chunk (contraction over I tiles in PSUM; natural
     weight rows of all I tiles loaded once per ``dx_span`` columns, the first span by the last
     I chunk's prefetch, ahead of its gradient stores), staged in SBUF and
     scattered to dx_slots[a, :H] (fp32, shared HBM, an output), with d topk_weights[a] in column
     H of the same rows (one indirect scatter per slot tile for both; the launcher takes the
     column as a view).
finally dx[t] = sum_j dx_slots[t * k + j] (fp32, fixed order).

Loop structure: idle experts (static > dynamic guard); ids; blocks (static) > guard (dynamic) >
{slot tiles (guarded); I chunks > (slot tiles (guarded) > H tiles) + weight-grad tiles > (slot
tiles (guarded)) + mode guards (dynamic); staging groups > H chunks > I tiles > slot tiles
(guarded)}; then the k-reduction of dx.

Shapes (dimension legend): T tokens, H hidden, I intermediate, E experts, k top-k, N = T*k, NB
blocks (groups), B block (group) size S. Kernel inputs (HBM): dy, x (T, H); topk_w (N, 1) fp32;
block_expert (NB,), slot_token, slot_assignment (NB*B,) int32 (the groups' experts and slots);
w_gate_up (E, 2I, H); w_down (E, H, I) (nn.Linear layouts as given); compile-time activation, top_k, i_chunk, dx_cols, prefetch_weights. Outputs: dx (T, H),
dtopk (N, 1) fp32, dw_gate_up (E, 2I, H), dw_down (E, H, I).

Limits: as the forward (bf16/fp16/fp32, B <= 512, LNC1) with the SBUF estimate :func:`sbuf_bytes`
(x, do rows and xT, dyT, dgT, duT of one block are resident, plus one I chunk of three weight
column tiles, plus the next block's gathered rows during step 3); every assignment appears
exactly once in the plan and each expert's blocks are consecutive (validated by the op); the
mode guards nest dynamic loops inside the block guard (NKI >= 0.6). HBM scratch: dx_slots N x (H + 1)
fp32, fp32 weight-gradient accumulators 3 x E x H x I (touched only by experts with several
blocks).
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

from nki_lib._nki import nisa, nki, nl
from nki_lib.dispatch import KernelLaunch, Unsupported
from nki_lib.moe.activations import GELU_TANH_A, GELU_TANH_C
from nki_lib.moe.kernels.moe_experts_gate import add_outer, bias_row, clamped_swiglu_terms, ones_row
from nki_lib.moe.kernels.moe_experts_groups import merge_blocks
from nki_lib.moe.kernels.moe_experts_host import (
    check_supported,
    choose_overlap_tiling,
    flags_sbuf_bytes,
    group_blocks_fitting,
    routing_weights,
    slot_tokens,
    staged_bytes,
    tail_sbuf_bytes,
)
from nki_lib.moe.kernels.moe_experts_steps import (
    WEIGHT_SPAN,
    act_fn,
    block_flags,
    block_registers,
    gather_rows_into,
    load_all_ids,
    load_expert_cols,
    load_expert_t,
    reduce_assignments,
    scatter_rows,
    transpose_rows,
)
from nki_lib.sizes import ceil_div, spans

ACT_GRAD_FN = {"silu": "silu_dx", "gelu": "gelu_dx"}   # ScalarE derivative functions
ACC_MODES = ("only", "first", "middle", "last")          # a block's place among its expert's blocks
ROW_BANKS = 4       # PSUM banks (fmax fp32 columns each) of one weight-gradient row piece, stored with one DMA
_FP32_TEMPS = 10    # fp32 (slots x I chunk) temporaries of _mlp_grads / _gelu_tanh_grad, upper bound
_FP32_TEMPS_CLAMPED = 12   # the same with clamped_swiglu_terms (gc, s, a, v, da, masks, h, dh, ...)


# --------------------------------------------------------------------------- elementwise pieces

def _gelu_tanh_grad(dst, g_psum, shape):
    """dst = d/dg [0.5 g (1 + tanh(c (g + a g^3)))], composed from ScalarE tanh and VectorE ops:
    0.5 (1 + t) + 0.5 g (1 - t^2) c (1 + 3 a g^2), t = tanh(c (g + a g^3))."""
    g2_sb = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=g2_sb, op=nl.square, data=g_psum)
    inner_sb = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=inner_sb, data=g2_sb, op0=nl.multiply, operand0=GELU_TANH_A, op1=nl.add,
                       operand1=1.0)
    nisa.tensor_tensor(dst=inner_sb, data1=inner_sb, data2=g_psum, op=nl.multiply)
    t_sb = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=t_sb, op=nl.tanh, data=inner_sb, scale=GELU_TANH_C)
    sech2_sb = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)                # 1 - t^2
    nisa.tensor_tensor(dst=sech2_sb, data1=t_sb, data2=t_sb, op=nl.multiply)
    nisa.tensor_scalar(dst=sech2_sb, data=sech2_sb, op0=nl.multiply, operand0=-1.0, op1=nl.add,
                       operand1=1.0)
    nisa.tensor_scalar(dst=g2_sb, data=g2_sb, op0=nl.multiply, operand0=3.0 * GELU_TANH_A * 0.5 * GELU_TANH_C,
                       op1=nl.add, operand1=0.5 * GELU_TANH_C)                    # 0.5 c (1 + 3 a g^2)
    nisa.tensor_tensor(dst=g2_sb, data1=g2_sb, data2=sech2_sb, op=nl.multiply)
    nisa.tensor_tensor(dst=g2_sb, data1=g2_sb, data2=g_psum, op=nl.multiply)
    nisa.tensor_scalar(dst=t_sb, data=t_sb, op0=nl.multiply, operand0=0.5, op1=nl.add, operand1=0.5)
    nisa.tensor_tensor(dst=dst, data1=g2_sb, data2=t_sb, op=nl.add)


def _act_grad(dst, g_psum, activation, shape):
    if activation == "gelu_tanh":
        _gelu_tanh_grad(dst, g_psum, shape)
    else:
        nisa.activation(dst=dst, op=getattr(nl, ACT_GRAD_FN[activation]), data=g_psum)


def _mlp_grads(g_psum, u_psum, dhy_psum, w_col, gate, dtype, dw_acc, first):
    """From g, u, dhy (ps, n) fp32: h and dg, du (in ``dtype``); adds <dhy, h> into dw_acc (ps, 1).
    With h = a(g) v(u): dg = dh v a'(g), du = dh a v'(u) (v = u, v' = 1 unless clamped swiglu)."""
    shape = g_psum.shape
    activation, alpha, limit = gate
    du_mask = None
    if activation == "clamped_swiglu":
        act_sb, v_tile, dact_sb, du_mask = clamped_swiglu_terms(g_psum, u_psum, alpha, limit)
    else:
        act_sb, v_tile = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf), u_psum
        nisa.activation(dst=act_sb, op=act_fn(activation), data=g_psum)
    h_sb = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=h_sb, data1=act_sb, data2=v_tile, op=nl.multiply)
    prod_sb = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=prod_sb, data1=h_sb, data2=dhy_psum, op=nl.multiply)
    part_sb = dw_acc if first else nl.ndarray((shape[0], 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=part_sb, op=nl.add, data=prod_sb, axis=1)
    if not first:
        nisa.tensor_tensor(dst=dw_acc, data1=dw_acc, data2=part_sb, op=nl.add)
    dh_sb = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=dh_sb, data=dhy_psum, op0=nl.multiply, operand0=w_col)
    du_sb = nl.ndarray(shape, dtype=dtype, buffer=nl.sbuf)
    if du_mask is None:
        nisa.tensor_tensor(dst=du_sb, data1=dh_sb, data2=act_sb, op=nl.multiply)
    else:
        nisa.tensor_tensor(dst=du_mask, data1=du_mask, data2=act_sb, op=nl.multiply)
        nisa.tensor_tensor(dst=du_sb, data1=dh_sb, data2=du_mask, op=nl.multiply)
    if activation != "clamped_swiglu":
        dact_sb = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)
        _act_grad(dact_sb, g_psum, activation, shape)
    nisa.tensor_tensor(dst=dh_sb, data1=dh_sb, data2=v_tile, op=nl.multiply)
    dg_sb = nl.ndarray(shape, dtype=dtype, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=dg_sb, data1=dh_sb, data2=dact_sb, op=nl.multiply)
    hx_sb = nl.ndarray(shape, dtype=dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=hx_sb, src=h_sb)
    return hx_sb, dg_sb, du_sb


# --------------------------------------------------------------------------- accumulators

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


def accumulate_rows(acc, out, mode_regs, expert_reg, r0, c0, parts):
    """Add the parts (PSUM tiles (rs, cn_j), side by side: (rs, cn) in all) into the expert's
    gradient rows [r0 : r0 + rs, c0 : c0 + cn], by the block's mode (dynamic loops of 0/1
    trips): only -> out = part; first -> acc = part; middle -> acc += part; last -> out = acc +
    part (acc fp32 in HBM, out in the weights' dtype). One DMA per direction for the whole row
    piece (long contiguous runs). An expert with one block never touches the fp32 accumulator."""
    rs, cn = parts[0].shape[0], sum(p.shape[1] for p in parts)
    cols = acc.shape[2]

    def rows(t):
        return t.ap([[cols, rs], [1, cn]], offset=r0 * cols + c0, scalar_offset=expert_reg, indirect_dim=0)

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


# --------------------------------------------------------------------------- block phases

class SlotTile(NamedTuple):
    """One slot tile (<= 128 slots) of a group: first slot, slots, token and assignment ids
    (ps, 1), routing weights (ps, 1) fp32, x rows (ps, H), and its 0/1 live register (None for
    the group's first tile, which is always computed: padding rows are zero, so a padding tile
    computed adds zeros, and the contractions over slots start their PSUM accumulation there)."""

    s0: int
    ps: int
    tok: object
    asg: object
    w_col: object
    x_rows: object
    live: object


def if_live(tile):
    """The tile's guard: one trip, or a dynamic loop of 0/1 trips (padding tiles skipped)."""
    return range(1) if tile.live is None else nl.dynamic_range(0, tile.live)


def _block_rows(x, dy, ids, b, block):
    """Group b's slot tiles (:class:`SlotTile`, ``ids`` = (token ids, assignment ids, live
    flags)) and dy rows, allocated here and filled by ``_gather_block``."""
    pmax = nl.tile_size.pmax
    tok_ids, asg_ids, live_sb = ids
    slot_tiles, dy_rows = [], []
    for st, (s0, ps) in enumerate(spans(block, pmax)):
        live_reg = None
        if st > 0:
            live_reg = nisa.register_alloc()
            nisa.register_load(live_reg, live_sb[b % pmax:b % pmax + 1, b // pmax, st:st + 1])
        slot_tiles.append(SlotTile(s0, ps, tok_ids[:ps, st, b:b + 1], asg_ids[:ps, st, b:b + 1],
                                   nl.ndarray((ps, 1), dtype=nl.float32, buffer=nl.sbuf),
                                   nl.ndarray((ps, x.shape[1]), dtype=x.dtype, buffer=nl.sbuf), live_reg))
        dy_rows.append(nl.ndarray((ps, dy.shape[1]), dtype=dy.dtype, buffer=nl.sbuf))
    return slot_tiles, dy_rows


def _gather_block(x, dy, topk_w, slot_tiles, dy_rows):
    """Indirect gathers of the group's x rows, routing weights and dy rows per live slot tile
    (padding slots stay zero)."""
    for tile, dy_sb in zip(slot_tiles, dy_rows):
        for _ in if_live(tile):
            gather_rows_into(tile.x_rows, x, tile.tok)
            gather_rows_into(tile.w_col, topk_w, tile.asg)
            gather_rows_into(dy_sb, dy, tile.tok)


def _load_grad_rows(dy_rows, slot_tiles, block):
    """Per slot tile: dy rows scaled by the routing weight (do); and dyT (P, HT, B)."""
    pmax = nl.tile_size.pmax
    hidden = dy_rows[0].shape[1]
    dy_t = nl.ndarray((pmax, len(spans(hidden, pmax)), block), dtype=dy_rows[0].dtype, buffer=nl.sbuf)
    do_rows = []
    for tile, dy_sb in zip(slot_tiles, dy_rows):
        do_sb = nl.ndarray((tile.ps, hidden), dtype=dy_sb.dtype, buffer=nl.sbuf)
        for _ in if_live(tile):
            transpose_rows(dy_t, dy_sb, tile.s0)
            nisa.tensor_scalar(dst=do_sb, data=dy_sb, op0=nl.multiply, operand0=tile.w_col)
        do_rows.append(do_sb)
    dy_rows.clear()                     # last use of the dy rows
    return do_rows, dy_t


def _bias_grads(slot_tiles, do_rows, chunk, bias, mode_regs, expert_reg, c0, inter):
    """db_down += sum over slots of do (once per block: the first I chunk); db_gate/up[chunk] +=
    sum over slots of dg / du: contractions over the slots against a column of ones."""
    pmax = nl.tile_size.pmax
    _, _, _, ones_col, (acc_bgu, db_gate_up), (acc_bd, db_down) = bias
    hidden = acc_bd.shape[1]
    cn = chunk[0][0].shape[1]
    if c0 == 0:
        for h0, hs in spans(hidden, pmax):
            part_psum = nl.ndarray((hs, 1), dtype=nl.float32, buffer=nl.psum)
            for st, (tile, do_sb) in enumerate(zip(slot_tiles, do_rows)):
                for _ in if_live(tile):
                    nisa.nc_matmul(dst=part_psum, stationary=do_sb[:, h0:h0 + hs], moving=ones_col[:tile.ps, :],
                                   accumulate=st > 0)
            accumulate_rows(acc_bd, db_down, mode_regs, expert_reg, h0, 0, [part_psum])
    for which, row0 in ((1, c0), (2, inter + c0)):
        for i0, isz in spans(cn, pmax):
            part_psum = nl.ndarray((isz, 1), dtype=nl.float32, buffer=nl.psum)
            for st, (tile, grads) in enumerate(zip(slot_tiles, chunk)):
                for _ in if_live(tile):
                    nisa.nc_matmul(dst=part_psum, stationary=grads[which][:, i0:i0 + isz],
                                   moving=ones_col[:tile.ps, :], accumulate=st > 0)
            accumulate_rows(acc_bgu, db_gate_up, mode_regs, expert_reg, row0 + i0, 0, [part_psum])


def _dtopk_bias(dy_t, slot_tiles, dw_accs, bias, expert_reg):
    """d topk_weights[a] += <dy_t, b_down[e]>: contraction over H tiles of dyT against the bias
    column (H on partitions)."""
    pmax = nl.tile_size.pmax
    b_down = bias[1]
    hidden = b_down.shape[1]
    h_tiles = spans(hidden, pmax)
    col_sb = nl.ndarray((pmax, len(h_tiles), 1), dtype=b_down.dtype, buffer=nl.sbuf)
    for ht, (h0, hs) in enumerate(h_tiles):
        nisa.dma_copy(dst=col_sb[:hs, ht, :], src=b_down.ap([[1, hs], [1, 1]], offset=h0, scalar_offset=expert_reg,
                                                            indirect_dim=0))
    for tile, dw_acc in zip(slot_tiles, dw_accs):
        s0, ps = tile.s0, tile.ps
        for _ in if_live(tile):
            part_psum = nl.ndarray((ps, 1), dtype=nl.float32, buffer=nl.psum)
            for ht, (h0, hs) in enumerate(h_tiles):
                nisa.nc_matmul(dst=part_psum, stationary=dy_t[:hs, ht, s0:s0 + ps], moving=col_sb[:hs, ht, :],
                               accumulate=ht > 0)
            nisa.tensor_tensor(dst=dw_acc, data1=dw_acc, data2=part_psum, op=nl.add)


def _chunk_weight_grads(slot_tiles, do_rows, chunk, grad_bufs, mode_regs, expert_reg, c0, inter):
    """dW_down[:, chunk] += do^T h; dW_gate/up[chunk, :] += dg^T x / du^T x (over the slots)."""
    pmax, fmax = nl.tile_size.pmax, nl.tile_size.gemm_moving_fmax
    (acc_gu, dw_gate_up), (acc_d, dw_down), bias = grad_bufs
    if bias is not None:
        _bias_grads(slot_tiles, do_rows, chunk, bias, mode_regs, expert_reg, c0, inter)
    hidden = acc_d.shape[1]
    cn = chunk[0][0].shape[1]
    row_cols = ROW_BANKS * fmax
    for h0, hs in spans(hidden, pmax):
        part_psum = nl.ndarray((hs, cn), dtype=nl.float32, buffer=nl.psum)
        for st, (tile, do_sb, grads) in enumerate(zip(slot_tiles, do_rows, chunk)):
            for _ in if_live(tile):
                nisa.nc_matmul(dst=part_psum, stationary=do_sb[:, h0:h0 + hs], moving=grads[0], accumulate=st > 0)
        accumulate_rows(acc_d, dw_down, mode_regs, expert_reg, h0, c0, [part_psum])
    for which, row0 in ((1, c0), (2, inter + c0)):
        for i0, isz in spans(cn, pmax):
            for g0, gn in spans(hidden, row_cols):          # whole rows (at most ROW_BANKS PSUM banks)
                parts = []
                for h0, hn in spans(gn, fmax):
                    part_psum = nl.ndarray((isz, hn), dtype=nl.float32, buffer=nl.psum)
                    for st, (tile, grads) in enumerate(zip(slot_tiles, chunk)):
                        for _ in if_live(tile):
                            nisa.nc_matmul(dst=part_psum, stationary=grads[which][:, i0:i0 + isz],
                                           moving=tile.x_rows[:, g0 + h0:g0 + h0 + hn], accumulate=st > 0)
                    parts.append(part_psum)
                accumulate_rows(acc_gu, dw_gate_up, mode_regs, expert_reg, row0 + i0, g0, parts)


def _dx_row_tiles(w_gate_up):
    """The (row, rows) tiles of W_gate then W_up (natural layout, I tiles of 128 rows)."""
    inter = w_gate_up.shape[1] // 2
    i_tiles = spans(inter, nl.tile_size.pmax)
    return [*i_tiles, *((inter + i0, isz) for i0, isz in i_tiles)]


def dx_first_weights(w_gate_up, expert_reg, dx_tiling):
    """The dx phase's first span of W_gate/W_up rows (loaded early: see :func:`_block_grads`)."""
    dx_cols, dx_span = dx_tiling
    wn = min(dx_cols, dx_span, w_gate_up.shape[2])
    return load_expert_cols(w_gate_up, expert_reg, _dx_row_tiles(w_gate_up), 0, wn)


def _dx(dg_t, du_t, w_gate_up, expert_reg, slot_tiles, dw_accs, dx_slots, dx_tiling, first_w=None):
    """dx_slots[a, :H] = dg @ W_gate + du @ W_up: per H chunk, contraction over I tiles in PSUM;
    rows staged ``dx_cols`` wide in SBUF and scattered once per slot tile and group, the last
    group's rows with one more column, dx_slots[a, H] = d topk_weights[a] (``dw_accs``), so that
    no scatter of its own is needed (each indirect DMA costs GpSimd a descriptor per row). The natural
    W_gate/W_up rows of all I tiles are loaded once per ``dx_span`` columns (one DMA per 128 rows,
    runs of dx_span elements), and the H chunks inside the span read them from SBUF."""
    dx_cols, dx_span = dx_tiling
    inter = w_gate_up.shape[1] // 2
    hidden = w_gate_up.shape[2]
    i_tiles = spans(inter, nl.tile_size.pmax)
    row_tiles = _dx_row_tiles(w_gate_up)
    grads = [(dg_t, it, isz) for it, (_, isz) in enumerate(i_tiles)] + \
            [(du_t, it, isz) for it, (_, isz) in enumerate(i_tiles)]
    for g0, gn in spans(hidden, dx_cols):
        extra = int(g0 + gn == hidden)                                  # the d topk_weights column
        dx_rows = [nl.ndarray((tile.ps, gn + extra), dtype=nl.float32, buffer=nl.sbuf) for tile in slot_tiles]
        for w0, wn in spans(gn, dx_span):
            w_sb = first_w if first_w is not None and g0 + w0 == 0 else \
                load_expert_cols(w_gate_up, expert_reg, row_tiles, g0 + w0, wn)
            for h0, hn in spans(wn, nl.tile_size.gemm_moving_fmax):
                dx_psums = [nl.ndarray((tile.ps, hn), dtype=nl.float32, buffer=nl.psum) for tile in slot_tiles]
                for rt, (grad_t, it, isz) in enumerate(grads):
                    for tile, dx_psum in zip(slot_tiles, dx_psums):
                        for _ in if_live(tile):
                            nisa.nc_matmul(dst=dx_psum, stationary=grad_t[:isz, it, tile.s0:tile.s0 + tile.ps],
                                           moving=w_sb[:isz, rt, h0:h0 + hn], accumulate=rt > 0)
                for tile, dx_psum, dx_sb in zip(slot_tiles, dx_psums, dx_rows):
                    for _ in if_live(tile):
                        nisa.tensor_copy(dst=dx_sb[:, w0 + h0:w0 + h0 + hn], src=dx_psum)
        for tile, dx_sb, dw_acc in zip(slot_tiles, dx_rows, dw_accs):
            for _ in if_live(tile):
                if extra:
                    nisa.tensor_copy(dst=dx_sb[:, gn:gn + 1], src=dw_acc)
                scatter_rows(dx_slots, tile.asg, dx_sb, g0)


def chunk_weights(w_gate_up, w_down, expert_reg, c0, cn):
    """The weights of one I chunk: W_gate^T and W_up^T columns (H on partitions) and W_down columns."""
    inter = w_down.shape[2]
    h_tiles = spans(w_down.shape[1], nl.tile_size.pmax)
    return [load_expert_t(w_gate_up, expert_reg, h_tiles, c0, cn),
            load_expert_t(w_gate_up, expert_reg, h_tiles, inter + c0, cn),
            load_expert_cols(w_down, expert_reg, h_tiles, c0, cn)]


def _slot_tile_grads(x_t, dy_t, tile, dw_acc, weights, rows, bias, gate, chunk):
    """One slot tile of an I chunk: g, u, dhy (slots on partitions, contraction over H tiles in
    PSUM), the elementwise gradients (returned: h, dg, du)."""
    s0, ps = tile.s0, tile.ps
    c0, cn, h_tiles = chunk
    psums = [nl.ndarray((ps, cn), dtype=nl.float32, buffer=nl.psum) for _ in weights]
    for dst, row_sb in zip(psums, rows):
        if row_sb is not None:
            add_outer(dst, bias[2][:, :ps], row_sb)
    for ht, (h0, hs) in enumerate(h_tiles):
        for dst, src_t, w_sb, row_sb in zip(psums, (x_t, x_t, dy_t), weights, rows):
            nisa.nc_matmul(dst=dst, stationary=src_t[:hs, ht, s0:s0 + ps], moving=w_sb[:hs, ht, :],
                           accumulate=ht > 0 or row_sb is not None)
    return _mlp_grads(*psums, tile.w_col, gate, x_t.dtype, dw_acc, c0 == 0)


def _transpose_grads(grads_t, tile, grads, c0):
    """dg/du of one slot tile (slots on partitions, an I chunk from c0) into dgT/duT."""
    pmax = nl.tile_size.pmax
    it0 = c0 // pmax
    for _ in if_live(tile):
        n_sub = len(spans(grads[1].shape[1], pmax))
        for grad_t, grad_sb in zip(grads_t, grads[1:]):
            transpose_rows(grad_t[:, it0:it0 + n_sub, :], grad_sb, tile.s0)


def _i_chunk(x_t, dy_t, slot_tiles, do_rows, dw_accs, weights, prefetch, expert_reg, c0, cn, gate,
             dg_t, du_t, grad_bufs, mode_regs):
    """One I chunk of a block (all its tiles die on return): g, u, dhy per slot tile (contraction
    over H tiles in PSUM; the gate/up biases first, as ones^T x bias_row), the elementwise
    gradients, dg/du transposed into dgT/duT, then the next chunk's weights (``prefetch()``,
    returned; ``weights``, a list, is released first), then the chunk's weight gradients
    accumulated into the expert's fp32 rows."""
    pmax = nl.tile_size.pmax
    _, hidden, inter = grad_bufs[1][0].shape          # the fp32 W_down accumulator: (E, H, I)
    h_tiles = spans(hidden, pmax)
    bias = grad_bufs[2]
    rows = (None, None, None)
    if bias is not None:
        rows = (bias_row(bias[0], expert_reg, c0, cn), bias_row(bias[0], expert_reg, inter + c0, cn), None)
    # software-pipelined: slot tile n's dg/du transposes follow tile n + 1's matmuls (TensorE runs
    # in program order: it would otherwise wait out tile n's elementwise chain)
    # (one entry per slot tile, None for a skipped one: a 0-trip guard does not run its body, so
    # the entries stay aligned with slot_tiles whichever tiles are padding)
    chunk = []
    for n, (tile, dw_acc) in enumerate(zip(slot_tiles, dw_accs)):
        entry = [None]
        for _ in if_live(tile):
            entry[0] = _slot_tile_grads(x_t, dy_t, tile, dw_acc, weights, rows, bias, gate, (c0, cn, h_tiles))
        chunk.append(entry[0])
        if n > 0:
            _transpose_grads((dg_t, du_t), slot_tiles[n - 1], chunk[n - 1], c0)
    _transpose_grads((dg_t, du_t), slot_tiles[-1], chunk[-1], c0)
    weights.clear()                     # last use of this chunk's weights (released)
    next_weights = prefetch()
    _chunk_weight_grads(slot_tiles, do_rows, chunk, grad_bufs, mode_regs, expert_reg, c0, inter)
    return next_weights


def _block_bwd(dy, x, topk_w, ids, w_gate_up, w_down, regs, mode_regs, rows, next_regs, b, block,
               gate, i_chunk, dx_tiling, grad_bufs, dx_slots, prefetch):
    """Block b in guarded phases: transposes, I chunks and weight gradients; then the gathers of
    block b + 1 into rows allocated here (``next_regs`` = its registers, or None; the rows are
    returned); then dx and d topk_weights. GpSimd issues DMAs in program order, so the next
    block's gathers must precede this block's scatters (which wait for its last matmul) to overlap
    this block's compute."""
    pmax = nl.tile_size.pmax
    inter = w_down.shape[2]
    expert_reg, trips_reg = regs
    slot_tiles, dy_rows = rows
    n_it = len(spans(inter, pmax))
    dg_t = nl.ndarray((pmax, n_it, block), dtype=x.dtype, buffer=nl.sbuf)
    du_t = nl.ndarray((pmax, n_it, block), dtype=x.dtype, buffer=nl.sbuf)
    dw_accs = [nl.ndarray((tile.ps, 1), dtype=nl.float32, buffer=nl.sbuf) for tile in slot_tiles]
    dx_first = []                       # the dx phase's first W rows, loaded with the last chunk
    for _ in nl.dynamic_range(0, trips_reg):
        _block_grads(x, slot_tiles, dy_rows, dw_accs, w_gate_up, w_down, expert_reg, mode_regs, block,
                     gate, (i_chunk, prefetch, dx_tiling, dx_first), dg_t, du_t, grad_bufs)
    next_rows = None
    if next_regs is not None:
        next_rows = _block_rows(x, dy, ids, b + 1, block)
        for _ in nl.dynamic_range(0, next_regs[1]):
            _gather_block(x, dy, topk_w, *next_rows)
    for _ in nl.dynamic_range(0, trips_reg):
        _dx(dg_t, du_t, w_gate_up, expert_reg, slot_tiles, dw_accs, dx_slots, dx_tiling,
            dx_first[0] if dx_first else None)
    return next_rows


def _block_grads(x, slot_tiles, dy_rows, dw_accs, w_gate_up, w_down, expert_reg, mode_regs, block,
                 gate, chunking, dg_t, du_t, grad_bufs):
    """xT, dyT and do from the gathered rows, then the I chunks (weight gradients, dgT, duT), then
    the down bias's share of d topk_weights. ``chunking`` = (I chunk, prefetch): with prefetch the
    next chunk's weights are loaded inside this chunk, else after it (see :func:`tiling`)."""
    i_chunk, prefetch, dx_tiling, dx_first = chunking

    def last_prefetch():
        # the dx phase's first W rows, before the last chunk's weight-gradient stores
        dx_first.append(dx_first_weights(w_gate_up, expert_reg, dx_tiling))
    pmax = nl.tile_size.pmax
    x_t = nl.ndarray((pmax, len(spans(x.shape[1], pmax)), block), dtype=x.dtype, buffer=nl.sbuf)
    for tile in slot_tiles:
        for _ in if_live(tile):
            transpose_rows(x_t, tile.x_rows, tile.s0)
    do_rows, dy_t = _load_grad_rows(dy_rows, slot_tiles, block)
    chunks = spans(w_down.shape[2], i_chunk)
    weights = chunk_weights(w_gate_up, w_down, expert_reg, *chunks[0])
    for n, (c0, cn) in enumerate(chunks):
        # the next chunk's weights are loaded before this chunk's weight-gradient stores (DMAs
        # start in program order; the stores wait for their PSUM evictions)
        following = chunks[n + 1] if n + 1 < len(chunks) else None
        weights = _i_chunk(x_t, dy_t, slot_tiles, do_rows, dw_accs, weights,
                           (last_prefetch if prefetch else (lambda: None)) if following is None else
                           (lambda: None) if not prefetch else
                           (lambda c=following: chunk_weights(w_gate_up, w_down, expert_reg, *c)),
                           expert_reg, c0, cn, gate, dg_t, du_t, grad_bufs, mode_regs)
        if following is not None and not prefetch:
            weights = chunk_weights(w_gate_up, w_down, expert_reg, *following)
    if grad_bufs[2] is not None:
        _dtopk_bias(dy_t, slot_tiles, dw_accs, grad_bufs[2], expert_reg)


# --------------------------------------------------------------------------- kernel

@nki.jit
def moe_experts_bwd_kernel(dy, x, topk_w, block_expert, slot_token, slot_assignment, w_gate_up, w_down, b_gate_up,
                           b_down, activation, swiglu_alpha, swiglu_limit, top_k, i_chunk, dx_cols,
                           prefetch_weights, dx_span):
    n_blocks = block_expert.shape[0]
    block = slot_token.shape[0] // n_blocks
    dx = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    dw_gate_up = nl.ndarray(w_gate_up.shape, dtype=w_gate_up.dtype, buffer=nl.shared_hbm)
    dw_down = nl.ndarray(w_down.shape, dtype=w_down.dtype, buffer=nl.shared_hbm)
    # per assignment: its dx row (fp32) and, in column H, its d topk_weights (an output: the
    # launcher takes the column as a view)
    dx_slots = nl.ndarray((topk_w.shape[0], x.shape[1] + 1), dtype=nl.float32, buffer=nl.shared_hbm)
    acc_gu = nl.ndarray(w_gate_up.shape, dtype=nl.float32, buffer=nl.private_hbm)
    acc_d = nl.ndarray(w_down.shape, dtype=nl.float32, buffer=nl.private_hbm)
    bias = _bias_context(b_gate_up, b_down, x.dtype)
    grad_bufs = ((acc_gu, dw_gate_up), (acc_d, dw_down), bias)
    zero_idle_experts(block_expert, (dw_gate_up, dw_down) + (() if bias is None else (bias[4][1], bias[5][1])))
    expert_sb, valid_sb = block_flags(block_expert)
    modes_sb = accumulation_modes(expert_sb)
    asg_ids, live_sb = load_all_ids(slot_assignment, n_blocks, block, live=True)
    ids = (load_all_ids(slot_token, n_blocks, block), asg_ids, live_sb)
    regs = block_registers(expert_sb, valid_sb, 0)
    rows = _block_rows(x, dy, ids, 0, block)
    for _ in nl.dynamic_range(0, regs[1]):
        _gather_block(x, dy, topk_w, *rows)
    # Blocks in order (weight-gradient accumulation), statically unrolled: block b's body also
    # issues block b + 1's gathers.
    for b in range(n_blocks):
        mode_regs = mode_registers(modes_sb, b)
        next_regs = block_registers(expert_sb, valid_sb, b + 1) if b + 1 < n_blocks else None
        rows = _block_bwd(dy, x, topk_w, ids, w_gate_up, w_down, regs, mode_regs, rows, next_regs, b,
                          block, (activation, swiglu_alpha, swiglu_limit), i_chunk, (dx_cols, dx_span), grad_bufs,
                          dx_slots, prefetch_weights)
        regs = next_regs
    reduce_assignments(dx_slots, dx, top_k)
    if bias is None:
        return dx, dx_slots, dw_gate_up, dw_down
    return dx, dx_slots, dw_gate_up, dw_down, bias[4][1], bias[5][1]


def _bias_context(b_gate_up, b_down, dtype):
    """None without biases; else (b_gate_up, b_down, ones row (1, P), ones column (P, 1),
    (fp32 accumulator, gradient) of b_gate_up as (E, 2I, 1), the same of b_down as (E, H, 1))."""
    if b_gate_up is None:
        return None
    pmax = nl.tile_size.pmax
    ones_col = nl.ndarray((pmax, 1), dtype=dtype, buffer=nl.sbuf)
    nisa.memset(dst=ones_col, value=1.0)
    bufs = []
    for b in (b_gate_up, b_down):
        shape = (b.shape[0], b.shape[1], 1)
        bufs.append((nl.ndarray(shape, dtype=nl.float32, buffer=nl.private_hbm),
                     nl.ndarray(shape, dtype=b.dtype, buffer=nl.shared_hbm)))
    return (b_gate_up, b_down, ones_row(pmax, dtype), ones_col, bufs[0], bufs[1])


# --------------------------------------------------------------------------- launcher

def sbuf_bytes_at(hidden, inter, block, itemsize, i_chunk, dx_cols, *, top_k, n_blocks, clamped=False,
                  biases=False, overlap=True, dx_span=None):
    """Peak SBUF bytes per partition of the backward kernel at I chunk ``i_chunk`` and dx staging
    width ``dx_cols`` (upper bound): the block's resident tiles plus the largest of its three
    phases (loading rows, I chunks, dx), whose tiles are freed before the next phase; the clamped
    swiglu's temporaries and the bias rows, ones and bias column when asked (``overlap``, the
    next I chunk's prefetched weight columns, takes the place of this chunk's); the dx phase's W
    rows ``dx_span`` wide (default gemm_moving_fmax)."""
    pmax, fmax = nl.tile_size.pmax, nl.tile_size.gemm_moving_fmax
    ht, it, st = ceil_div(hidden, pmax), ceil_div(inter, pmax), ceil_div(block, pmax)
    slot_tiles = st * (2 * hidden * itemsize + 4 * 4)            # x, do rows; ids, weight, d weight
    resident = (2 * ht + 2 * it) * block * itemsize             # xT, dyT, dgT, duT
    load = st * hidden * itemsize                               # phase 1: dy rows (until scaled/transposed)
    staging = 2 * min(hidden, WEIGHT_SPAN) * itemsize           # natural W rows before transposes
    # W_gate^T, W_up^T, W_down of one chunk: the next chunk's (prefetched with ``overlap``) are
    # allocated after this chunk's are released (``_i_chunk``), so one generation either way
    # (with ``overlap``, the last chunk prefetches the dx phase's first W rows in their place)
    streamed = max(3 * ht * i_chunk, 2 * it * (dx_span or fmax) if overlap else 0) * itemsize + staging
    temps = _FP32_TEMPS_CLAMPED if clamped else _FP32_TEMPS
    chunk = (st + 1) * 3 * i_chunk * itemsize + 2 * temps * i_chunk * 4   # h, dg, du; fp32 temps
    if biases:                                                  # g/u bias rows, ones row/column, b_down column
        chunk += 2 * (2 * i_chunk + pmax) * itemsize + (ht + 1) * itemsize
    chunks = streamed + chunk + 2 * ROW_BANKS * fmax * (4 + itemsize)   # phase 2, with the accumulate rows
    dx = 2 * it * (dx_span or fmax) * itemsize + staged_bytes(dx_cols, hidden, st)   # phase 3: W rows, dx rows
    dx += st * (2 * hidden * itemsize + 4)                      # and the next block's x, dy rows, weights
    body = slot_tiles + resident + max(load, chunks, dx)
    modes = len(ACC_MODES) * n_blocks * 4 + n_blocks * st * 4   # block accumulation modes, live flags
    setup = max(4 * n_blocks * 4, 2 * n_blocks * 4 + fmax * itemsize)   # edges; idle-expert count, zeros
    return flags_sbuf_bytes(n_blocks, block) + modes + max(body, setup, tail_sbuf_bytes(hidden, top_k, itemsize))


def chunk_widths(inter):
    """I chunk widths to try, widest first: for each chunk count n from ceil(I / gemm_moving_fmax)
    up, I / n rounded up to whole 128-row tiles (I = 768: 384, 256, 128), so that a narrower chunk
    is taken only when it means fewer, not just narrower, weight-column DMAs per chunk count."""
    pmax, fmax = nl.tile_size.pmax, nl.tile_size.gemm_moving_fmax
    widths = []
    for n in range(ceil_div(inter, fmax), ceil_div(inter, pmax) + 1):
        width = min(fmax, ceil_div(ceil_div(inter, n), pmax) * pmax)
        if width not in widths:
            widths.append(width)
    return widths


def tiling(hidden, inter, block, itemsize, **counts):
    """(i_chunk, dx_cols, prefetch_weights) of the backward kernel for this shape."""
    return choose_overlap_tiling(sbuf_bytes_at, hidden, hidden, inter, block, itemsize, widths=chunk_widths(inter),
                                 **counts)


def dx_span(hidden, inter, block, itemsize, i_chunk, dx_cols, overlap, **counts):
    """Columns of the dx phase's W_gate/W_up row loads at the chosen tiling: the widest of dx_cols
    halved down to gemm_moving_fmax whose SBUF estimate fits (longer DMA runs, each W row read
    once per span instead of once per H chunk)."""
    fmax, fit = nl.tile_size.gemm_moving_fmax, nl.tile_size.total_available_sbuf_size
    span = min(dx_cols, hidden)
    while span > fmax and sbuf_bytes_at(hidden, inter, block, itemsize, i_chunk, dx_cols, overlap=overlap,
                                        dx_span=span, **counts) > fit:
        span //= 2
    return max(span, min(fmax, dx_cols))


def sbuf_bytes(hidden, inter, block, itemsize, **counts):
    """Peak SBUF bytes per partition at the chosen tiling and dx span."""
    i_chunk, dx_cols, overlap = tiling(hidden, inter, block, itemsize, **counts)
    span = dx_span(hidden, inter, block, itemsize, i_chunk, dx_cols, overlap, **counts)
    return sbuf_bytes_at(hidden, inter, block, itemsize, i_chunk, dx_cols, overlap=overlap, dx_span=span, **counts)


def group_blocks(hidden, inter, block, itemsize, **counts):
    """Blocks per group (:mod:`.moe_experts_groups`): the most, up to MAX_PSUM_SLOT_TILES * 128
    slots, whose SBUF estimate fits (1 when no larger group does)."""
    return group_blocks_fitting(sbuf_bytes, hidden, inter, block, itemsize, **counts)


def launch_moe_experts_bwd(dy, x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down, b_gate_up=None,
                           b_down=None, *, activation, swiglu_alpha, swiglu_limit):
    """Launch the backward kernel (host side: index metadata, views, the exact widening of the
    routing weights to fp32 and the cast of their gradient to their dtype)."""
    if (b_gate_up is None) != (b_down is None):
        raise Unsupported("only one of b_gate_up / b_down (the kernel takes both or neither)")
    flags = dict(clamped=activation == "clamped_swiglu", biases=b_gate_up is not None)
    block_size = check_supported(x, topk_weights, block_expert, slot_assignment, w_down.shape[2],
                                 sbuf_fn=sbuf_bytes, **flags)
    top_k = topk_weights.shape[1]
    hidden, inter, itemsize = x.shape[1], w_down.shape[2], x.element_size()
    blocks = group_blocks(hidden, inter, block_size, itemsize, top_k=top_k, n_blocks=block_expert.shape[0],
                          **flags)
    group_expert, group_slots = merge_blocks(block_expert, slot_assignment, blocks, w_down.shape[0])
    counts = dict(top_k=top_k, n_blocks=group_expert.shape[0], **flags)
    i_chunk, dx_cols, prefetch = tiling(hidden, inter, blocks * block_size, itemsize, **counts)
    span = dx_span(hidden, inter, blocks * block_size, itemsize, i_chunk, dx_cols, prefetch, **counts)
    return KernelLaunch(
        moe_experts_bwd_kernel,
        (dy.contiguous(), x.contiguous(), routing_weights(topk_weights), group_expert,
         slot_tokens(group_slots, top_k), group_slots, w_gate_up.contiguous(),
         w_down.contiguous(), b_gate_up, b_down, activation, float(swiglu_alpha), float(swiglu_limit), top_k,
         i_chunk, dx_cols, prefetch, span),
        unpack=partial(_unpack_grads, x, topk_weights, b_gate_up, b_down))


def _unpack_grads(x, topk_weights, b_gate_up, b_down, outs):
    """The kernel's gradients in the op's shapes and dtypes (d topk_weights back to (T, k) and the
    routing weights' dtype; empty bias gradients without biases)."""
    dx, dx_slots, dw_gate_up, dw_down = outs[:4]
    dtopk = dx_slots[:, -1]                            # column H: d topk_weights per assignment (a view)
    db = (x.new_zeros(0), x.new_zeros(0)) if b_gate_up is None else (outs[4].reshape(b_gate_up.shape),
                                                                     outs[5].reshape(b_down.shape))
    return (dx, dtopk.reshape(topk_weights.shape).to(topk_weights.dtype, copy=True), dw_gate_up, dw_down) + db
