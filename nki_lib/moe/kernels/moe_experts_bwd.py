"""Fused MoE expert MLP backward over a block plan (NKI kernel + launcher).

Per assignment a = (t, j) on expert e, with g/u the gate/up projections of x_t, h = act(g) * u,
w_a = topk_weights[t, j] and dy_t the output gradient (moe_experts_reference.moe_experts_backward):
  dhy = dy_t @ W_down[e]             d topk_weights[a] = <dhy, h> (= <dy_t, h @ W_down[e]^T>)
  dh = w_a * dhy                     dg = dh * u * act'(g),  du = dh * act(g)
  dx_t += dg @ W_gate[e] + du @ W_up[e]
  dW_gate[e] += dg^T x_t,  dW_up[e] += du^T x_t,  dW_down[e] += (w_a dy_t)^T h
g and u come from the forward kernel's saved tensor (``gu_saved``, the op's training forward:
docs/contract.md §4.3), PE-transposed per slot tile and I chunk, with the forward's grouping; or,
without it, are recomputed from x (one extra gate/up projection per block, the W_gate^T/W_up^T
transposes and xT, no activation memory).

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
     partitions), selected by the expert register -- or, where SBUF has room (``down_group``),
     the group's whole W_down in rows of I, the next group's loaded by this group's last I chunk
     ahead of its weight-gradient stores and dx scatters (DMAs start in program order, and a
     store or scatter waiting for its data holds the DMA engines); per slot tile g, u, dhy (slots on
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

In the in_out layout (``in_out``; gpt-oss's, no host transposes) the same steps take the other
weight tiles from TensorE: W_gate/W_up columns load natural (H already on partitions), W_down
columns (or the group's whole W_down) and the dx phase's W_gate/W_up rows (I on partitions) are
PE-transposed from natural rows (``load_expert_t``); the weight gradients are the same products
with the operands swapped (dW_down^T = h^T do per I chunk in rows of H; dW_gate^T/dW_up^T =
x^T dg / x^T du, with ``down_rows`` after the last I chunk in row pieces of 2I of at most
ROW_BANKS banks, dg/du of every chunk kept), each in its weight's own rows.

Loop structure: idle experts (static > dynamic guard); ids; blocks (static) > guard (dynamic) >
{slot tiles (guarded); I chunks > (slot tiles (guarded) > H tiles) + weight-grad tiles > (slot
tiles (guarded)) + mode guards (dynamic); staging groups > H chunks > I tiles > slot tiles
(guarded)}; then the k-reduction of dx.

Shapes (dimension legend): T tokens, H hidden, I intermediate, E experts, k top-k, N = T*k, NB
blocks (groups), B block (group) size S. Kernel inputs (HBM): dy, x (T, H); topk_w (NB*B,) fp32 (the routing weight of each slot, 0 for
padding: ``moe_experts_host.slot_weights``);
block_expert (NB,), slot_token, slot_assignment (NB*B,) int32 (the groups' experts and slots);
w_gate_up (E, 2I, H); w_down (E, H, I) (nn.Linear layouts as given; with ``in_out``, the in_out
layout (E, H, 2I), (E, I, H) as given, the weight gradients in it too); gu_saved (NB, ST, P, 2 IT ps)
or None (``moe_experts_fwd.saved_shape``); compile-time activation, top_k, i_chunk, dx_cols, prefetch_weights,
dx_span, down_rows, down_group, in_out. Outputs: dx (T, H),
dtopk (N, 1) fp32, dw_gate_up (E, 2I, H), dw_down (E, H, I).

Limits: as the forward (bf16/fp16/fp32, B <= 512, LNC1) with the SBUF estimate :func:`sbuf_bytes`
(per phase of a group, the tiles live in it by the simulator's first-to-last-use rule: rows
loading; I chunks with x, do rows, dyT [xT], dgT, duT, the chunk's weights and the larger of one
slot tile's fp32 temporaries and one weight-gradient row piece; dx with dgT, duT, the dx W rows,
the staged dx rows and the next group's gathered rows); every assignment appears exactly once
in the plan and each expert's blocks are consecutive (validated by the op), and unused groups
(expert -1) come after the used ones (``merge_blocks``: a group not run has no next group to
prefetch); the mode guards nest dynamic loops inside the block guard (NKI >= 0.6). HBM scratch:
dx_slots N x (H + 1)
fp32, fp32 weight-gradient accumulators 3 x E x H x I (touched only by experts with several
blocks).

Files (helper modules by role, each imported only downward: no cycles): this module holds the
kernel entry point, the launcher and the SBUF sizing; :mod:`.moe_experts_bwd_blocks` the block
phases and I chunks (steps 1-3), :mod:`.moe_experts_bwd_rows` the slot tiles and gathered rows,
:mod:`.moe_experts_bwd_grads` the elementwise gradients, :mod:`.moe_experts_bwd_wgrads` the
weight and bias gradients of a chunk, :mod:`.moe_experts_bwd_accum` the accumulation modes and
fp32 accumulators, :mod:`.moe_experts_bwd_dx` the dx phase.
"""

from __future__ import annotations

from functools import partial

from nki_lib._nki import nisa, nki, nl
from nki_lib.dispatch import KernelLaunch, Unsupported
from nki_lib.moe.kernels.moe_experts_bwd_accum import ACC_MODES, accumulation_modes, mode_registers, zero_idle_experts
from nki_lib.moe.kernels.moe_experts_bwd_blocks import block_bwd, group_down_tile, load_group_down
from nki_lib.moe.kernels.moe_experts_bwd_grads import FP32_TEMPS, FP32_TEMPS_CLAMPED
from nki_lib.moe.kernels.moe_experts_bwd_rows import block_rows, gather_block, saved_cols
from nki_lib.moe.kernels.moe_experts_bwd_wgrads import ROW_BANKS, down_piece
from nki_lib.moe.kernels.moe_experts_gate import ones_row
from nki_lib.moe.kernels.moe_experts_groups import merge_blocks
from nki_lib.moe.kernels.moe_experts_host import (
    check_supported,
    choose_overlap_tiling,
    flags_sbuf_bytes,
    group_blocks_fitting,
    planned_blocks,
    planned_groups,
    slot_tokens,
    slot_weights,
    staged_bytes,
    tail_sbuf_bytes,
)
from nki_lib.moe.kernels.moe_experts_steps import (
    WEIGHT_SPAN,
    block_flags,
    block_registers,
    load_all_ids,
    mlp_dims,
    reduce_assignments,
)
from nki_lib.sizes import ceil_div, spans

# --------------------------------------------------------------------------- kernel


@nki.jit
def moe_experts_bwd_kernel(dy, x, topk_w, block_expert, slot_token, slot_assignment, w_gate_up, w_down, b_gate_up,
                           b_down, activation, swiglu_alpha, swiglu_limit, top_k, i_chunk, dx_cols,
                           prefetch_weights, dx_span, gu_saved=None, down_rows=False, down_group=False, in_out=False):
    n_blocks = block_expert.shape[0]
    block = slot_token.shape[0] // n_blocks
    dx = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    dw_gate_up = nl.ndarray(w_gate_up.shape, dtype=w_gate_up.dtype, buffer=nl.shared_hbm)
    dw_down = nl.ndarray(w_down.shape, dtype=w_down.dtype, buffer=nl.shared_hbm)
    # per assignment: its dx row (fp32) and, in column H, its d topk_weights (an output: the
    # launcher takes the column as a view)
    dx_slots = nl.ndarray((x.shape[0] * top_k, x.shape[1] + 1), dtype=nl.float32, buffer=nl.shared_hbm)
    acc_gu = nl.ndarray(w_gate_up.shape, dtype=nl.float32, buffer=nl.private_hbm)
    acc_d = nl.ndarray(w_down.shape, dtype=nl.float32, buffer=nl.private_hbm)
    bias = _bias_context(b_gate_up, b_down, x.dtype)
    grad_bufs = ((acc_gu, dw_gate_up), (acc_d, dw_down), bias)
    zero_idle_experts(block_expert, (dw_gate_up, dw_down) + (() if bias is None else (bias[4][1], bias[5][1])))
    expert_sb, valid_sb = block_flags(block_expert)
    modes_sb = accumulation_modes(expert_sb)
    asg_ids, live_sb = load_all_ids(slot_assignment, n_blocks, block, live=True)
    # routing weights per slot (in slot order from the host: no gather), slots on partitions
    weights_sb = load_all_ids(topk_w, n_blocks, block, dtype=nl.float32)
    ids = (load_all_ids(slot_token, n_blocks, block), asg_ids, live_sb, weights_sb)
    if gu_saved is not None:            # dead flags (1 - live): the first slot tile's saved g/u zeroed
        dead_sb = nl.ndarray(live_sb.shape, dtype=nl.int32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=dead_sb, data=live_sb, op0=nl.multiply, operand0=-1, op1=nl.add, operand1=1)
        ids += (dead_sb,)   # ids[4]
    _, inter = mlp_dims(w_down, in_out)
    regs = block_registers(expert_sb, valid_sb, 0)
    rows = block_rows(x, dy, ids, 0, block, saved_cols(gu_saved, inter))
    down_sb = None
    if down_group:                      # the first group's whole W_down (then each group loads the next one's)
        down_sb = group_down_tile(w_down, in_out)
        load_group_down(w_down, regs, down_sb, in_out)
    for _ in nl.dynamic_range(0, regs[1]):
        gather_block(x, dy, *rows, saved=None if gu_saved is None else (gu_saved, 0))
    # Blocks in order (weight-gradient accumulation), statically unrolled: block b's body also
    # issues block b + 1's gathers (and, with down_group, its W_down).
    for b in range(n_blocks):
        mode_regs = mode_registers(modes_sb, b)
        next_regs = block_registers(expert_sb, valid_sb, b + 1) if b + 1 < n_blocks else None
        rows, down_sb = block_bwd(dy, x, ids, w_gate_up, w_down, regs, mode_regs, rows, next_regs, b,
                                  block, (activation, swiglu_alpha, swiglu_limit), i_chunk, (dx_cols, dx_span),
                                  grad_bufs, dx_slots, prefetch_weights, gu_saved, down_rows, down_sb, in_out)
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
                  biases=False, overlap=True, dx_span=None, saved=False, down_rows=False, down_group=False,
                  in_out=False):
    """Peak SBUF bytes per partition of the backward kernel at I chunk ``i_chunk`` and dx staging
    width ``dx_cols`` (an upper bound by the simulator's liveness rule, docs/nki-semantics.md:
    a tile is live from its first to its last instruction in program order). A group runs three
    phases, each with the tiles live in it:

    * load: x, dy, do rows, dyT [, xT], this group's saved g/u [and W_down];
    * I chunks: x, do rows, dyT [, xT], saved g/u, dgT/duT, h/dg/du per slot tile (and, with
      ``down_rows``, h of the earlier chunks), the chunk's weights, and the larger of the
      elementwise step (one slot tile's fp32 temporaries: the next tile's start after its last
      use) and the weight-gradient step (one row piece's accumulate rows: ``accumulate_rows``
      stores a piece before the next is evicted; with ``overlap``, the next chunk's prefetched
      weights, allocated after this chunk's are released, or the dx phase's first W rows);
    * dx: dgT/duT, the dx phase's W rows ``dx_span`` wide (default gemm_moving_fmax), the staged
      dx rows, and the next group's x, dy rows and saved g/u [and W_down].

    ``saved``: the forward's g/u are loaded (2 IT columns per slot) in place of xT and the
    W_gate^T/W_up^T columns of the recompute. ``down_group``: W_down is loaded whole once per
    group (the next group's by the last chunk, in place of this group's) instead of per I chunk.
    ``in_out``: W_gate/W_up columns are loaded natural, and the PE transposes' staging rows are
    those of W_down (each chunk's, the first group's in the load phase, or the next group's) and
    of the dx phase's W rows (W_gate and W_up once each per span). The clamped swiglu's
    temporaries and the bias rows, ones and bias column when asked."""
    pmax, fmax = nl.tile_size.pmax, nl.tile_size.gemm_moving_fmax
    ht, it, st = ceil_div(hidden, pmax), ceil_div(inter, pmax), ceil_div(block, pmax)
    rows = st * hidden * itemsize                                # one (S, H) set of rows: x, dy or do
    small = st * 4 * 4                                           # per slot tile: d weight column and the like
    transposed = (1 if saved else 2) * ht * block * itemsize     # dyT [, xT]
    gu = 2 * it * block * itemsize                               # dgT, duT (and the saved g/u: the same size)
    this_saved = gu if saved else 0
    down = ht * inter * itemsize if down_group else 0            # the group's W_down
    # per-chunk weight columns: W_down (unless down_group) [, W_gate^T, W_up^T and their natural rows]
    cols = ((0 if down_group else 1) + (0 if saved else 2)) * ht * i_chunk * itemsize
    if in_out:                                                   # transposes' staging: W_down's, the dx W rows'
        staging, dx_staging = (2 * min(n, WEIGHT_SPAN) * itemsize for n in (hidden, inter))
    else:                                                        # W_gate/W_up's (the recompute)
        staging, dx_staging = 0 if saved else 2 * min(hidden, WEIGHT_SPAN) * itemsize, 0
    dx_w = 2 * it * (dx_span or fmax) * itemsize
    load = 3 * rows + transposed + this_saved + down + (staging if in_out and down_group else 0)
    temps = FP32_TEMPS_CLAMPED if clamped else FP32_TEMPS
    per_tile = (st + 1) * 3 * i_chunk * itemsize                # h, dg, du (one tile pipelined behind)
    # h (in_out: dg, du) of the earlier chunks
    per_tile += (2 if in_out else 1) * st * max(0, inter - i_chunk) * itemsize if down_rows else 0
    if biases:                                                  # g/u bias rows, ones row/column, b_down column
        per_tile += 2 * (2 * i_chunk + pmax) * itemsize + (ht + 1) * itemsize
    elementwise = cols + temps * i_chunk * 4
    accumulate = ROW_BANKS * fmax * (4 + max(4, itemsize))      # one row piece: fp32 accumulator rows in and out
    prefetched = max(cols + staging, dx_w + dx_staging) if overlap else 0
    wgrads = accumulate + prefetched
    chunks = 2 * rows + transposed + this_saved + gu + down + per_tile + max(elementwise + staging, wgrads)
    dx = gu + dx_w + dx_staging + staged_bytes(dx_cols, hidden, st) + 2 * rows + this_saved + down   # + the next group's
    body = small + max(load, chunks, dx)
    # modes; routing weights (P, ST, NB) fp32; live [and dead] flags (P, NBT, ST)
    modes = len(ACC_MODES) * n_blocks * 4 + st * n_blocks * 4 + (2 if saved else 1) * ceil_div(n_blocks, pmax) * st * 4
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


def _saved_blocks(saved, hidden, inter, block_size, itemsize, **counts):
    """The forward's blocks per group when its saved g/u can be used (the backward's SBUF estimate
    fits groups of that size with them), else None (g and u are recomputed)."""
    if saved is None:
        return None
    blocks = saved[1]
    fits = sbuf_bytes(hidden, inter, blocks * block_size, itemsize, saved=True, **counts)
    return blocks if fits <= nl.tile_size.total_available_sbuf_size else None


def reads_saved(x, topk_weights, block_expert, block_size, inter, blocks, *, activation, biases,
                weight_layout="out_in"):
    """Whether the backward launch of this plan (``block_size`` slots per plan block) reads the
    forward's saved g/u grouped ``blocks`` blocks per group (:func:`_saved_blocks`, as
    :func:`launch_moe_experts_bwd` decides), or recomputes them. Reads no data: the training
    forward asks it before it saves them, so that it saves nothing the backward would not read
    (docs/perf-log.md §16.4)."""
    counts = dict(top_k=topk_weights.shape[1], n_blocks=planned_blocks(block_expert.shape[0]),
                  **_flags(activation, biases, weight_layout))
    return _saved_blocks((None, blocks), x.shape[1], inter, block_size, x.element_size(), **counts) is not None


def _flags(activation, biases, weight_layout="out_in"):
    """The launch flags of the backward's SBUF estimate that come from the call."""
    return dict(clamped=activation == "clamped_swiglu", biases=biases, in_out=weight_layout == "in_out")


def down_rows_fit(inter, i_chunk):
    """Whether dW_down can be contracted after the last I chunk in whole rows of I (``down_rows``):
    I over more than one chunk, one SBUF row of at most ROW_BANKS banks of fp32, and the PSUM banks
    of one row piece (``moe_experts_bwd_wgrads.down_piece``: a bank per chunk narrower than one,
    the only PSUM tiles live in that step) within PSUM's banks."""
    fmax = nl.tile_size.gemm_moving_fmax
    if not i_chunk < inter <= ROW_BANKS * fmax:
        return False
    return down_piece([cn for _, cn in spans(inter, i_chunk)], True)[1] <= nl.tile_size.psum_num_banks


def launch_moe_experts_bwd(dy, x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down, b_gate_up=None,
                           b_down=None, *, activation, swiglu_alpha, swiglu_limit, saved=None,
                           weight_layout="out_in"):
    """Launch the backward kernel (host side: index metadata, views, the exact widening of the
    routing weights to fp32 and the cast of their gradient to their dtype). ``saved`` = (the
    forward kernel's saved g/u, its blocks per group) or None: with them the kernel groups the
    blocks as the forward did and reads g and u instead of recomputing them (two of its eight
    S x H x I products, xT [and, out_in, the W_gate^T/W_up^T transposes]), when its SBUF estimate
    fits. ``weight_layout``: the weights' (and their gradients') layout, taken as given (out_in:
    (E, 2I, H), (E, H, I); in_out: (E, H, 2I), (E, I, H)); no host transposes."""
    if (b_gate_up is None) != (b_down is None):
        raise Unsupported("only one of b_gate_up / b_down (the kernel takes both or neither)")
    flags = _flags(activation, b_gate_up is not None, weight_layout)
    hidden, inter = mlp_dims(w_down, flags["in_out"])
    block_size = check_supported(x, topk_weights, block_expert, slot_assignment, inter, sbuf_fn=sbuf_bytes, **flags)
    top_k = topk_weights.shape[1]
    itemsize = x.element_size()
    plan_blocks = planned_blocks(block_expert.shape[0])
    blocks = _saved_blocks(saved, hidden, inter, block_size, itemsize, top_k=top_k, n_blocks=plan_blocks, **flags)
    if blocks is None:
        saved = None
    else:
        flags["saved"] = True
    blocks = blocks or group_blocks(hidden, inter, block_size, itemsize, top_k=top_k, n_blocks=plan_blocks, **flags)
    group_expert, group_slots = merge_blocks(block_expert, slot_assignment, blocks, w_down.shape[0])
    counts = dict(top_k=top_k, n_blocks=planned_groups(group_expert.shape[0], blocks), **flags)
    slots = blocks * block_size
    i_chunk, dx_cols, prefetch = tiling(hidden, inter, slots, itemsize, **counts)
    span = dx_span(hidden, inter, slots, itemsize, i_chunk, dx_cols, prefetch, **counts)
    fit = nl.tile_size.total_available_sbuf_size
    # (in_out: dW_gate/up's rows in whole rows of 2I, in pieces of at most ROW_BANKS banks)
    rows_fit = i_chunk < inter if flags["in_out"] else down_rows_fit(inter, i_chunk)
    down_rows = rows_fit and sbuf_bytes_at(
        hidden, inter, slots, itemsize, i_chunk, dx_cols, overlap=prefetch, dx_span=span,
        down_rows=True, **counts) <= fit
    # W_down whole once per group (the next group's loaded ahead of this one's stores and
    # scatters) when it fits at the narrowest dx span; then the widest span that fits with it
    down_group = sbuf_bytes_at(hidden, inter, slots, itemsize, i_chunk, dx_cols, overlap=prefetch,
                               dx_span=min(span, nl.tile_size.gemm_moving_fmax), down_rows=down_rows,
                               down_group=True, **counts) <= fit
    if down_group:
        span = dx_span(hidden, inter, slots, itemsize, i_chunk, dx_cols, prefetch, down_rows=down_rows,
                       down_group=True, **counts)
    return KernelLaunch(
        moe_experts_bwd_kernel,
        (dy.contiguous(), x.contiguous(), slot_weights(topk_weights, group_slots), group_expert,
         slot_tokens(group_slots, top_k), group_slots, w_gate_up.contiguous(),
         w_down.contiguous(), b_gate_up, b_down, activation, float(swiglu_alpha), float(swiglu_limit), top_k,
         i_chunk, dx_cols, prefetch, span, None if saved is None else saved[0], down_rows, down_group,
         flags["in_out"]),
        unpack=partial(_unpack_grads, x, topk_weights, b_gate_up, b_down))


def _unpack_grads(x, topk_weights, b_gate_up, b_down, outs):
    """The kernel's gradients in the op's shapes and dtypes (d topk_weights back to (T, k) and the
    routing weights' dtype; empty bias gradients without biases: 0-element allocations, nothing to
    fill, so no launch on a device)."""
    dx, dx_slots, dw_gate_up, dw_down = outs[:4]
    dtopk = dx_slots[:, -1]                            # column H: d topk_weights per assignment (a view)
    db = (x.new_empty(0), x.new_empty(0)) if b_gate_up is None else (outs[4].reshape(b_gate_up.shape),
                                                                     outs[5].reshape(b_down.shape))
    return (dx, dtopk.reshape(topk_weights.shape).to(topk_weights.dtype, copy=True), dw_gate_up, dw_down) + db
