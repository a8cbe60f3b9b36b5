"""Fused MoE expert MLP forward over a block plan: the NKI kernel and its group loop.

Files by role: this one (the kernel entry :func:`moe_experts_fwd_kernel`, the group body
:func:`_group_fwd`, the saved g/u layout :func:`saved_shape`), :mod:`.moe_experts_fwd_dmas` (the
slot tiles, gathers, transposes of x, deferred writes, saved g/u stores and the next group's
prefetch), :mod:`.moe_experts_fwd_proj` (the gate/up and down projections),
:mod:`.moe_experts_fwd_launch` (the launcher: tiling, grouping, SBUF estimate, eligibility),
:mod:`.moe_experts_fwd_combine` (the two combines).

Algorithm (one kernel launch, docs/contract.md §4.3 ``moe_experts``):
host (index metadata only, :mod:`.moe_experts_groups`): up to G consecutive blocks of one expert are
  merged into a group of S = G*B slots (S <= 512, the largest whose SBUF estimate fits, or fewer,
  down to an expert's blocks on balanced routing, when only those stage the output rows whole:
  :func:`.moe_experts_fwd_launch.group_blocks`), so every weight tile is loaded and transposed once per group instead of
  once per block; per group the
  expert id, per slot the assignment id a and the token id a // k (-1 = padding).
once: the slot token and assignment ids are loaded with one contiguous DMA per 128 groups each and
  PE-transposed so that slots sit on partitions; on VectorE the group flags valid[g] =
  (group_expert[g] >= 0) and each slot tile's live flag (max of its assignment ids >= 0).
for each group g of this program (static loop, in order; LNC2: the two cores take alternate
  groups, LNC1: all of them), with the expert id and a 0/1 trip count in
  registers (a dynamic loop runs the body once, or not at all for unused groups), and each slot
  tile under its own 0/1 live guard (padding tiles cost no gather, matmul or write):
  1. gather the token rows of x with an indirect DMA per slot tile (``vector_offset``; -1 rows are
     skipped and keep the zero fill); issued during the previous group (GpSimd issues DMAs in
     program order), then PE-transposed into xT (H on partitions, slots on the free axis).
  2. per I tile (128): the expert's gate and up weight rows (``scalar_offset`` = the expert
     register; nn.Linear layout, long contiguous runs) PE-transposed to W^T tiles (H on
     partitions; evictions alternate VectorE/ScalarE) -- or, with the in_out weight layout
     (``gu_cols`` > 0), the W^T tiles loaded as they are, per span of ``gu_cols`` I columns (gate
     and up columns in one run of 2I per H row when the span is all of I; two consecutive H rows
     per partition, ``H_INTERLEAVE``, so one run of 4I, with xT and out_in's W^T tiles in the same
     H order), no transposes; when the span is all of I and SBUF allows (``prefetch_gu``), the
     next group's tile is loaded during this group, between the deferred writes and the next
     gathers (see the group loop below; the first group's in the prologue, between its gathers);
     per live slot tile gT/uT = W^T-tile x xT
     into fp32 PSUM (contraction over H tiles; an expert bias enters first as bias_row^T x ones,
     a contraction of size 1); hT = act(gT) * uT, or gpt-oss's clamped swiglu
     (:mod:`.moe_experts_gate`), -> SBUF (I on partitions).
  3. per H chunk (<= 512): W_down^T tiles (rows loaded and PE-transposed per span of I tiles;
     in_out: w_down's own rows, I on partitions, loaded as they are),
     o = h x W_down^T (+ b_down: ones^T x bias_row first) into fp32 PSUM per live slot tile
     (contraction over I tiles), evicted on
     ScalarE into fp32 rows staged in SBUF and written by one indirect DMA per live slot tile and
     staging group (padding slots not written), as the combine (:mod:`.moe_experts_fwd_combine`)
     says: "sum" (LNC2, or a token holding two slots of one expert): scattered into the
     assignment-ordered scratch y_slots[a] (shared HBM: every assignment written exactly once, by
     one core); "accumulate" (LNC1, rows staged whole): each row scaled by its routing weight at the eviction and
     added into the token-ordered accumulator by a DMA read-modify-write (``dma_compute``),
     zeroed at the start.
finally, "sum" (LNC2: after a core barrier, so that each core sees the other's rows; the cores
take alternate 128-token tiles): y[t] = sum_j topk_weights[t, j] * y_slots[t * k + j] in the fixed
order j = 0..k-1 (contiguous loads in token order, no gather; fp32 sum), cast to x's dtype. Every
row is computed by the same instructions on either core, so LNC2 is bitwise LNC1's "sum".
"accumulate": nothing (y is the accumulator), or the fp32 accumulator's conversion to x's dtype.

With ``prefetch_gu`` each group body issues, one slot tile at a time, the previous group's
write, a share of the next group's gate/up weight blocks and the next group's gather: GpSimd
(descriptors) and the DMA queues take instructions in program order, and the writes form a
chain (each waits for the previous one), so the gathers' descriptors are made while a write is
in flight and the weight loads fill the queues meanwhile (docs/perf-log.md §16.1).

Loop structure: ids; groups (static) > guard (dynamic, 0/1 trips) > {slot tiles (guarded);
I tiles > slot tiles (guarded) > H tiles; staging groups > H chunks > I spans > slot tiles
(guarded) > I tiles}; then (barrier) token tiles > H chunks > j.

Shapes (dimension legend): T tokens, H hidden, I intermediate, E experts, k top-k, N = T*k
assignments, B plan block size, NG groups, S slots per group, ST slot tiles per group. Kernel
inputs (HBM): x (T, H), topk_w (N, 1) fp32 ("sum": per assignment; "accumulate": (NG*S,), per
slot, 0 for padding), group_expert (NG,) int32, slot_token and
slot_assignment (NG*S,) int32 (a // k and a, or -1), w_gate_up
(E, 2I, H), w_down (E, H, I) (nn.Linear layouts, as the op receives them) or, in_out,
(E, H, 2I) and (E, I, H), b_gate_up (E, 2I) and
b_down (E, H) or None; compile-time activation, swiglu_alpha, swiglu_limit, top_k, h_chunk,
y_cols, defer_scatters, gu_cols and wd_cols (0: the out_in layout), combine ("sum" or
"accumulate"), prefetch_gu (in_out, one gate/up span: the next group's weights loaded during the
current group). Output y (T, H) in x's dtype; scratch y_slots (N, H) fp32 ("sum") or the fp32
accumulator (T, H) ("accumulate" with FP32_ACCUMULATOR) in shared HBM.

Limits: x and weights bf16/fp16/fp32 (one dtype); B <= 512 and S <= 512 (one PSUM bank per slot
tile, at most 4 slot tiles in flight); the SBUF estimate :func:`.moe_experts_fwd_launch.sbuf_bytes` (dominated by xT, hT,
two generations of x rows, double-buffered W_gate^T/W_up^T tiles and the staged y rows) must fit
``nl.tile_size.total_available_sbuf_size`` for the plan's block at the narrowest tiling, else the
launcher raises Unsupported; every assignment appears exactly once in the plan (validated by the
op); LNC1 or LNC2 (``NEURON_LOGICAL_NC_CONFIG``). The group loop is unrolled NG times (program size grows with NG).
"""

from __future__ import annotations

from nki_lib._nki import nisa, nki, nl
from nki_lib.moe.kernels.moe_experts_fwd_combine import GroupSink, accumulator, convert_rows, zero_rows
from nki_lib.moe.kernels.moe_experts_fwd_dmas import (
    H_INTERLEAVE,
    group_tiles,
    next_group_dmas,
    scatter_deferred,
    store_saved,
    transpose_group,
)
from nki_lib.moe.kernels.moe_experts_fwd_proj import down_projection, gate_up_projection, preload_down
from nki_lib.moe.kernels.moe_experts_gate import ones_row
from nki_lib.moe.kernels.moe_experts_steps import block_flags, block_registers, load_all_ids, reduce_assignments
from nki_lib.sizes import ceil_div, spans


def _group_fwd(x, slot_tiles, x_rows, weights, regs, next_group, group, gate, tiles, sink, ones_sb,
               deferred, defer, gu_saved=None, group_index=0, prefetch=(False, None)):
    """Group body in guarded phases: xT (then the x rows are released), h (gate/up; then xT is
    released), the gather of the next group's rows (``next_group`` = (registers, slot tiles) or
    None), the previous group's ``deferred`` y scatters, the down projection and the writes of y
    but the last staging group's. Returns (next group's rows, this group's deferred
    scatters); with ``defer`` False (see :func:`.moe_experts_fwd_launch.tiling`) the last scatters follow the down
    projection at once and None is returned in their place. ``gu_saved``: the backward's saved
    g/u (HBM, see :func:`saved_shape`), written for group ``group_index`` after the gate/up
    projections, or None. GpSimd issues DMAs in program order, so the next gather is issued before this
    group's last matmul; the releases keep the x rows of two groups and xT from being live at
    once (SBUF: see :func:`.moe_experts_fwd_launch.sbuf_bytes_at`). ``prefetch`` = (whether the in_out gate/up weights
    of the next group are loaded in this body, this group's tile loaded so or None), see
    :func:`.moe_experts_fwd_dmas.next_group_dmas`; the third value returned is the next group's tile or None."""
    pmax = nl.tile_size.pmax
    w_gate_up, w_down, b_gate_up, b_down = weights
    expert_reg, trips_reg = regs
    gu_cols = tiles[2]
    inter = (w_gate_up.shape[2] if gu_cols else w_gate_up.shape[1]) // 2
    h_tiles, i_tiles = spans(x.shape[1], pmax), spans(inter, pmax)
    x_t = nl.ndarray((pmax, len(h_tiles), group), dtype=x.dtype, buffer=nl.sbuf)
    h_t = nl.ndarray((pmax, len(i_tiles), group), dtype=x.dtype, buffer=nl.sbuf)
    transpose_group(x_t, slot_tiles, x_rows, trips_reg, H_INTERLEAVE)
    x_rows.clear()                      # last use of this group's x rows
    saved = None if gu_saved is None else [nl.ndarray((pmax, 2 * len(i_tiles), ps), dtype=x.dtype, buffer=nl.sbuf)
                                            for _, ps, *_ in slot_tiles]
    for _ in nl.dynamic_range(0, trips_reg):
        gate_up_projection(x_t, w_gate_up, b_gate_up, expert_reg, slot_tiles, h_tiles, gate, h_t, ones_sb, inter,
                           gu_cols, saved, prefetch[1])
    del x_t                             # last use of xT
    hidden = x.shape[1]
    one_block = tiles[3] >= hidden and tiles[1] >= hidden     # in_out: W_down rows H wide, staged whole
    preloaded = preload_down(w_down, expert_reg, i_tiles, hidden, trips_reg) if one_block else None
    # the next group's gathers (and weights), the previous group's last writes (own guards)
    next_rows, next_gu = next_group_dmas(x, w_gate_up, next_group, deferred, h_tiles, prefetch[0])
    last_cols = spans(x.shape[1], tiles[1])[-1][1]
    last_rows = [nl.ndarray((ps, last_cols), dtype=nl.float32, buffer=nl.sbuf) for _, ps, *_ in slot_tiles]
    for _ in nl.dynamic_range(0, trips_reg):
        down_projection(h_t, w_down, b_down, expert_reg, i_tiles, slot_tiles, sink, tiles, ones_sb, last_rows,
                        preloaded)
    if saved is not None:
        # after the down projection in program order: DMAs start in program order, and these
        # stores wait for the gate/up evictions, which the next loads must not queue behind
        store_saved(gu_saved, group_index, slot_tiles, saved, trips_reg)
        saved.clear()                   # released (the stores read them)
    last = [trips_reg, slot_tiles, last_rows, x.shape[1] - last_cols, sink]
    if not defer:
        scatter_deferred(last)
        last = None
    return next_rows, last, next_gu


@nki.jit
def moe_experts_fwd_kernel(x, topk_w, group_expert, slot_token, slot_assignment, w_gate_up, w_down, b_gate_up,
                           b_down, activation, swiglu_alpha, swiglu_limit, top_k, h_chunk, y_cols, defer_scatters,
                           gu_cols, wd_cols, save_gu=False, combine="sum", prefetch_gu=False):
    t_len, hidden = x.shape
    n_groups = group_expert.shape[0]
    group = slot_token.shape[0] // n_groups
    n_prog, pid = nl.num_programs(axes=0), nl.program_id(axis=0)
    y = nl.ndarray((t_len, hidden), dtype=x.dtype, buffer=nl.shared_hbm)
    if combine == "accumulate":      # topk_w: the routing weight of each slot (NG*S,), 0 for padding
        out = accumulator(y, t_len, hidden)
        slot_w_sb = load_all_ids(topk_w, n_groups, group, dtype=nl.float32)
    else:
        out = nl.ndarray((topk_w.shape[0], hidden), dtype=nl.float32, buffer=nl.shared_hbm)   # y_slots
        slot_w_sb = None
    inter = (w_gate_up.shape[2] if gu_cols else w_gate_up.shape[1]) // 2
    gu_saved = nl.ndarray(saved_shape(n_groups, group, inter), dtype=x.dtype, buffer=nl.shared_hbm) if save_gu \
        else None
    expert_sb, valid_sb = block_flags(group_expert)
    asg_ids, live_sb, partial_sb = load_all_ids(slot_assignment, n_groups, group, live=True, partial=True)
    ids = (load_all_ids(slot_token, n_groups, group), asg_ids, partial_sb)
    ones_sb = ones_row(nl.tile_size.pmax, x.dtype)
    weights = (w_gate_up, w_down, b_gate_up, b_down)
    gate = (activation, swiglu_alpha, swiglu_limit)
    # LNC2: the cores take alternate groups (all of them under LNC1).
    mine = list(range(pid, n_groups, n_prog))
    next_gu = None
    if mine:
        current = (block_registers(expert_sb, valid_sb, mine[0]), group_tiles(ids, live_sb, mine[0], group))
        # the first group's gathers, and with prefetch_gu its gate/up tile, as a group body issues them
        x_rows, next_gu = next_group_dmas(x, w_gate_up, current, None, spans(hidden, nl.tile_size.pmax),
                                          prefetch_gu)
    if combine == "accumulate":
        zero_rows(out)                 # before the first read-modify-write (program order)
    deferred = None
    # Static unroll (compile-time Python loop): each group's body also issues the next one's gather
    # and the previous one's last y scatters.
    for n, g in enumerate(mine):
        following = None
        if n + 1 < len(mine):
            following = (block_registers(expert_sb, valid_sb, mine[n + 1]),
                         group_tiles(ids, live_sb, mine[n + 1], group))
        sink = GroupSink(combine, out, slot_w_sb, g)
        x_rows, deferred, next_gu = _group_fwd(x, current[1], x_rows, weights, current[0], following, group, gate,
                                      (h_chunk, y_cols, gu_cols, wd_cols), sink, ones_sb, deferred, defer_scatters,
                                      gu_saved, g, (prefetch_gu, next_gu))
        current = following
    scatter_deferred(deferred)
    if combine == "accumulate":
        if out is not y:
            convert_rows(out, y)
    else:
        if n_prog > 1:
            nisa.core_barrier(out, (0, 1))     # the k-sum reads rows the other core wrote
        reduce_assignments(out, y, top_k, topk_w, share=(pid, n_prog))
    if save_gu:
        return y, gu_saved
    return y


def saved_shape(n_groups, group, inter):
    """Shape of the forward's saved g/u for the backward (``save_gu``): (NG, ST, P, 2 IT ps_max),
    [g, st, p, j ps + s] = g (j < IT) or u (j >= IT) of I row (j mod IT) * 128 + p at slot
    st * 128 + s of group g (pre-activation, biases included, in x's dtype); rows of padding
    slot tiles are not written."""
    pmax = nl.tile_size.pmax
    return (n_groups, ceil_div(group, pmax), pmax, 2 * ceil_div(inter, pmax) * min(group, pmax))
