"""The expert-MLP forward's launcher (:mod:`.moe_experts_fwd`): tiling, grouping, SBUF estimate.

Algorithm (host side, no data read but the plan's slot ids for the combine): check the call
(``moe_experts_host.check_supported``), choose the blocks per group (:func:`group_blocks`: the
most whose SBUF estimate fits, or fewer on balanced routing when only those stage the output
rows whole), merge the plan's blocks into groups (``moe_experts_groups.merge_blocks``), choose
the tiling (:func:`tiling`: H chunk, y staging width, deferred writes, in_out gate/up span and
W_down width), the combine ("accumulate" on one core with the rows staged whole and no token
twice in a group, else "sum") and the gate/up prefetch (:func:`_prefetch_fits`), then build the
index tables (slot tokens, routing weights) and return the :class:`KernelLaunch`.

Loop structure: tiling choices in order of preference (widest gate/up span first, W_down rows
wide or not, staged whole first, widest chunk first), the first whose :func:`sbuf_bytes_at` fits.

Shapes (dimension legend): T tokens, H hidden, I intermediate, E experts, k top-k, N = T*k
assignments, B plan block size, NB plan blocks, NG groups, S = G*B slots per group, ST slot tiles.
Inputs as ``moe_experts_fwd_kernel``'s before grouping: x (T, H), topk_weights (T, k),
block_expert (NB,), slot_assignment (NB*B,), weights (E, 2I, H) / (E, H, I) or in_out
(E, H, 2I) / (E, I, H). SBUF figures are bytes per partition.

Limits: Unsupported where the SBUF estimate at the narrowest tiling does not fit
``nl.tile_size.total_available_sbuf_size``, B > 512 or the dtype is not bf16/fp16/fp32;
``saved_grouping`` also where the backward would not read the saved g/u.
"""

from __future__ import annotations

from nki_lib._nki import nl
from nki_lib.backend import lnc_degree
from nki_lib.dispatch import KernelLaunch, Unsupported
from nki_lib.moe.kernels.moe_experts_fwd import moe_experts_fwd_kernel, saved_shape
from nki_lib.moe.kernels.moe_experts_fwd_combine import accumulate_sbuf_bytes, combine_mode
from nki_lib.moe.kernels.moe_experts_groups import group_count, merge_blocks
from nki_lib.moe.kernels.moe_experts_host import (
    check_supported,
    choose_overlap_tiling,
    flags_sbuf_bytes,
    group_blocks_fitting,
    planned_blocks,
    planned_groups,
    repeats_a_token,
    routing_weights,
    slot_tokens,
    slot_weights,
    staged_bytes,
    tail_sbuf_bytes,
)
from nki_lib.moe.kernels.moe_experts_steps import WEIGHT_SPAN, mlp_dims
from nki_lib.sizes import ceil_div


def sbuf_bytes_at(hidden, inter, block, itemsize, h_chunk, y_cols, *, top_k, n_blocks, clamped=False,
                  biases=False, overlap=True, in_out=False, gu_cols=None, wd_cols=0, save=False, accumulate=False,
                  prefetch=False):
    """Peak SBUF bytes per partition of the forward kernel at down-projection H chunk ``h_chunk``
    and y staging width ``y_cols`` (upper bound: two generations of every streamed tile; with the
    clamped swiglu's three more fp32 temporaries and the bias rows and ones when asked; with
    ``overlap``, the previous group's last staged y rows, whose scatters are deferred). ``in_out``:
    the weights come as W^T (no natural rows staged for transposes), the gate/up tiles ``gu_cols``
    I columns wide (default all of I) for gate and up together, and with ``wd_cols`` the W_down^T
    rows of every I tile ``wd_cols`` columns wide. ``save``: the saved g/u tiles of the group
    (``save_gu``, live from the gate/up phase to the end of the down projection). ``accumulate``:
    the launch may take the "accumulate" combine (:mod:`.moe_experts_fwd_combine`): its slot
    weights and its other buffers are counted (:func:`accumulate_sbuf_bytes`), and the tail is the
    larger of its own and the k-sum's (the "sum" combine serves the same plan when a group names a
    token twice). ``prefetch``: the next group's in_out gate/up tile (all of I) is loaded during
    the down projection (:func:`.moe_experts_fwd_dmas.next_group_dmas`) and counted there; W_down, then preloaded
    whole once per group after the gate/up projections, is counted once in that phase."""
    pmax, fmax = nl.tile_size.pmax, nl.tile_size.gemm_moving_fmax
    ht, it, st = ceil_div(hidden, pmax), ceil_div(inter, pmax), ceil_div(block, pmax)
    rows = st * hidden * itemsize                                # x rows of one group
    x_t, h_t = ht * block * itemsize, it * block * itemsize
    if in_out:
        staging = 0
        gu_width = min(inter, gu_cols or inter)
        gate_up = 2 * (2 * ht * gu_width * itemsize + fmax * 4)  # W_gate^T/W_up^T column spans, act
    else:
        staging = 2 * min(max(hidden, inter), WEIGHT_SPAN) * itemsize   # natural weight rows before transposes
        gate_up = 2 * (2 * ht * pmax * itemsize + fmax * 4)     # W_gate^T/W_up^T tiles, act
    gate_up += 2 * 3 * fmax * 4 if clamped else 0               # gc, s, v of the clamped swiglu
    bias = 2 * (3 * pmax + fmax) * itemsize if biases else 0    # gate/up/down bias rows, ones row
    span_tiles = min(it, WEIGHT_SPAN // pmax)
    wd_bytes = it * wd_cols if in_out and wd_cols else span_tiles * h_chunk       # W_down^T: all I tiles, or a span
    down = 2 * wd_bytes * itemsize + staged_bytes(y_cols, hidden, st)            # W_down^T, o rows
    if prefetch:                                                # one W_down^T block, the next gate/up tile
        down += 2 * ht * inter * itemsize - wd_bytes * itemsize
    phases = (rows + x_t + h_t,                                 # transposes: x rows -> xT
              x_t + h_t + staging + gate_up + bias + (2 * it * block * itemsize if save else 0),  # gate/up (+ saved g/u)
              rows + h_t + staging + down + bias + (2 * it * block * itemsize if save else 0))   # down, next rows
    deferred = st * min(y_cols, hidden) * 4 if overlap else 0   # previous group's last staged y rows
    body = max(phases) + deferred
    live_flags = 2 * n_blocks * st * 4                        # live and partial flags of the slot tiles
    tail = tail_sbuf_bytes(hidden, top_k, itemsize)
    if accumulate:
        zero, convert = accumulate_sbuf_bytes(hidden, itemsize)
        live_flags += n_blocks * st * 4 + zero                  # slot weights, zero tile
        tail = max(tail, convert)
    return flags_sbuf_bytes(n_blocks, block) + live_flags + max(body, tail)


def gate_up_widths(inter):
    """The in_out layout's gate/up column spans, widest first: all of I (gate and up in one run
    per H row), then 1024 halved down to 128."""
    pmax, widths, width = nl.tile_size.pmax, [inter], 8 * nl.tile_size.pmax
    while width >= pmax:
        if width < inter:
            widths.append(width)
        width //= 2
    return widths


def tiling(hidden, inter, block, itemsize, *, in_out=False, **counts):
    """(h_chunk, y_cols, defer_scatters, gu_cols, wd_cols) of the forward kernel for this shape
    (gu_cols, wd_cols 0: the out_in layout; in_out: the widest gate/up span, then W_down rows
    loaded WEIGHT_SPAN columns wide for all I tiles at once if possible, whose tiling fits)."""
    if not in_out:
        return (*choose_overlap_tiling(sbuf_bytes_at, hidden, hidden, inter, block, itemsize, **counts), 0, 0)
    fit = nl.tile_size.total_available_sbuf_size
    for cols in gate_up_widths(inter):
        for wd_cols in (min(hidden, WEIGHT_SPAN), 0):
            choice = choose_overlap_tiling(sbuf_bytes_at, hidden, hidden, inter, block, itemsize, in_out=True,
                                           gu_cols=cols, wd_cols=wd_cols, **counts)
            h_chunk, y_cols, overlap = choice
            if wd_cols % h_chunk:
                continue
            if sbuf_bytes_at(hidden, inter, block, itemsize, h_chunk, y_cols, overlap=overlap, in_out=True,
                             gu_cols=cols, wd_cols=wd_cols, **counts) <= fit:
                return (*choice, cols, wd_cols)
    return (*choice, cols, wd_cols)


def sbuf_bytes(hidden, inter, block, itemsize, *, in_out=False, **counts):
    """Peak SBUF bytes per partition at the chosen tiling."""
    h_chunk, y_cols, overlap, gu_cols, wd_cols = tiling(hidden, inter, block, itemsize, in_out=in_out, **counts)
    return sbuf_bytes_at(hidden, inter, block, itemsize, h_chunk, y_cols, overlap=overlap, in_out=in_out,
                         gu_cols=gu_cols or None, wd_cols=wd_cols, **counts)


def group_blocks(hidden, inter, block, itemsize, *, routed=None, **counts):
    """Blocks per group (see :mod:`.moe_experts_groups`): the most, up to MAX_PSUM_SLOT_TILES * 128
    slots, whose SBUF estimate fits (1 when no larger group does). With ``routed`` = (assignments
    N, experts E) of the plan: fewer blocks, down to :func:`filled_group_blocks`, when those stage
    the output rows whole and the most that fit do not. A group larger than an expert's blocks
    holds only padding slot tiles past them (skipped, no work), yet its SBUF estimate counts them:
    at H = 7168 (deepseek-v3) four 128-slot tiles stage y in 14 column groups of 512, so each live
    slot tile makes 14 indirect writes (14 software-DGE descriptors per row instead of one;
    docs/perf-log.md §16.4), while an expert holds 1 block (prefill, 32 tokens) or 2 (expert
    parallelism, 160)."""
    blocks = group_blocks_fitting(sbuf_bytes, hidden, inter, block, itemsize, **counts)
    if routed is None:
        return blocks
    fewer = min(blocks, filled_group_blocks(*routed, block))
    if fewer < blocks and _stages_whole(hidden, inter, block, itemsize, fewer, routed[1], counts) and \
            not _stages_whole(hidden, inter, block, itemsize, blocks, routed[1], counts):
        return fewer
    return blocks


def filled_group_blocks(n_assignments, n_experts, block):
    """Blocks of one expert when the routing is balanced, ceil(N / (E B)), rounded up to a power of
    two (the group sizes :func:`group_blocks` takes): a larger group only adds padding slot tiles."""
    per_expert, blocks = ceil_div(n_assignments, max(1, n_experts) * block), 1
    while blocks < per_expert:
        blocks *= 2
    return blocks


def _stages_whole(hidden, inter, block, itemsize, blocks, n_experts, counts):
    """Whether the forward's tiling at ``blocks`` blocks per group stages the output rows whole
    (``counts`` with the plan's blocks; its groups as the launcher counts them)."""
    n_groups = planned_groups(group_count(counts["n_blocks"], n_experts, blocks, 0), blocks)
    return tiling(hidden, inter, blocks * block, itemsize, **dict(counts, n_blocks=n_groups))[1] >= hidden


def _launch_flags(x, topk_weights, block_expert, slot_assignment, w_down, b_gate_up, b_down, activation,
                  weight_layout, save):
    """(inter, flags, block size) of a forward launch; raises Unsupported as the launcher does. The
    SBUF figures count the "accumulate" combine's buffers (``accumulate``) when the launch may take
    it: on one core, where they still fit and leave the output rows staged whole
    (:func:`_accumulate_fits`), whichever combine the data then selects, so the grouping does not
    depend on the data."""
    in_out = weight_layout == "in_out"
    _, inter = mlp_dims(w_down, in_out)
    flags = dict(clamped=activation == "clamped_swiglu", biases=b_gate_up is not None or b_down is not None,
                 in_out=in_out, save=save, accumulate=False)
    block_size = check_supported(x, topk_weights, block_expert, slot_assignment, inter, sbuf_fn=sbuf_bytes, **flags)
    shape = (x.shape[1], inter, block_size, x.element_size(), topk_weights.shape[1],
             planned_blocks(block_expert.shape[0]), w_down.shape[0], topk_weights.numel())
    if lnc_degree() == 1 and _accumulate_fits(shape, dict(flags, accumulate=True)):
        flags["accumulate"] = True
    return inter, flags, block_size


def _launch_group_blocks(x, topk_weights, block_expert, inter, block_size, flags, n_experts):
    """Blocks per group of a forward launch (:func:`group_blocks` at the planned plan size; fewer
    for its assignments and experts only without saved g/u, see :func:`_routed`)."""
    return group_blocks(x.shape[1], inter, block_size, x.element_size(), top_k=topk_weights.shape[1],
                        n_blocks=planned_blocks(block_expert.shape[0]),
                        routed=_routed(topk_weights.numel(), n_experts, flags), **flags)


def _routed(n_assignments, n_experts, flags):
    """``routed`` of :func:`group_blocks` for a launch: (N, E), or None when the launch saves g/u.
    The backward reads saved g/u grouped as the forward grouped them, so a saving forward keeps
    the groups the backward was measured with: the smaller groups were measured only without
    saved g/u (docs/perf-log.md §16.4; the first try with them, at deepseek-v3's expert-parallel
    shape, met the backward's PSUM overflow that ``moe_experts_bwd.down_rows_fit`` now rules out,
    and was not re-measured)."""
    return None if flags.get("save") else (n_assignments, n_experts)


def _accumulate_fits(shape, flags):
    """Whether the forward with the "accumulate" combine's buffers counted (``flags``) fits SBUF
    and stages its output rows whole; ``shape`` = (H, I, block size, itemsize, k, plan blocks,
    experts, assignments)."""
    hidden, inter, block_size, itemsize, top_k, n_blocks, n_experts, n_assignments = shape
    fit = nl.tile_size.total_available_sbuf_size
    if sbuf_bytes(hidden, inter, block_size, itemsize, top_k=top_k, n_blocks=n_blocks, **flags) > fit:
        return False
    blocks = group_blocks(hidden, inter, block_size, itemsize, top_k=top_k, n_blocks=n_blocks,
                          routed=_routed(n_assignments, n_experts, flags), **flags)
    n_groups = group_count(n_blocks, n_experts, blocks, 0)
    return tiling(hidden, inter, blocks * block_size, itemsize, top_k=top_k, n_blocks=n_groups, **flags)[1] >= hidden


def _prefetch_fits(shape, tiles, counts):
    """Whether the forward loads each next group's in_out gate/up weights during the current group
    (kernel flag ``prefetch_gu``): with the in_out layout, one gate/up span of all of I, W_down
    preloaded whole and the output rows staged whole, when the SBUF estimate with that tile
    counted (``sbuf_bytes_at(..., prefetch=True)``) fits at the tiling already chosen
    (``tiles`` = (h_chunk, y_cols, overlap, gu_cols, wd_cols); ``shape`` = (H, I, S, itemsize);
    ``counts``: the launch's flags and counts), so the tiling never depends on it."""
    hidden, inter, group, itemsize = shape
    h_chunk, y_cols, overlap, gu_cols, wd_cols = tiles
    if not counts.get("in_out") or gu_cols < inter or wd_cols < hidden or y_cols < hidden:
        return False
    need = sbuf_bytes_at(hidden, inter, group, itemsize, h_chunk, y_cols, overlap=overlap, gu_cols=gu_cols,
                         wd_cols=wd_cols, prefetch=True, **counts)
    return need <= nl.tile_size.total_available_sbuf_size


def saved_grouping(x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down, b_gate_up=None, b_down=None,
                   *, activation, weight_layout="out_in"):
    """(blocks per group, saved_shape) of a forward launch with ``save_activations`` (no data read:
    the op's fake uses it); raises Unsupported where the forward kernel cannot serve the call, or
    where the backward would not read the saved g/u at these groups (its SBUF estimate does not
    fit them: it recomputes g and u, and saving them would only cost the forward their SBUF, which
    at deepseek-v3's H = 7168 stages the output rows in 14 column groups, and their stores;
    docs/perf-log.md §16.4)."""
    from nki_lib.moe.kernels.moe_experts_bwd import reads_saved

    inter, flags, block_size = _launch_flags(x, topk_weights, block_expert, slot_assignment, w_down, b_gate_up,
                                             b_down, activation, weight_layout, True)
    blocks = _launch_group_blocks(x, topk_weights, block_expert, inter, block_size, flags, w_down.shape[0])
    if not reads_saved(x, topk_weights, block_expert, block_size, inter, blocks, activation=activation,
                       biases=flags["biases"], weight_layout=weight_layout):
        raise Unsupported("the backward would recompute g and u at these groups (its SBUF estimate)")
    n_groups = group_count(block_expert.shape[0], w_gate_up.shape[0], blocks, 0)
    return blocks, saved_shape(n_groups, blocks * block_size, inter)


def launch_moe_experts_fwd(x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down, b_gate_up=None,
                           b_down=None, *, activation, swiglu_alpha, swiglu_limit, weight_layout="out_in",
                           save_activations=False):
    """The launch of the forward kernel, which returns y (T, H) (host side: index metadata, views and
    the exact widening of the routing weights to fp32). ``weight_layout`` "in_out": w_gate_up
    (E, H, 2I), w_down (E, I, H), multiplied as they are (no weight transposes on chip).
    ``save_activations``: the kernel also returns the pre-activation g and u in the layout
    :func:`saved_shape` (for the backward, which then does not recompute them). The combine
    (:func:`combine_mode`): "accumulate" on one core with the output rows staged whole, unless a
    group's slots name a token twice;
    its routing weights are per slot (:func:`slot_weights`)."""
    inter, flags, block_size = _launch_flags(x, topk_weights, block_expert, slot_assignment, w_down, b_gate_up,
                                             b_down, activation, weight_layout, save_activations)
    top_k = topk_weights.shape[1]
    hidden, itemsize = x.shape[1], x.element_size()
    blocks = _launch_group_blocks(x, topk_weights, block_expert, inter, block_size, flags, w_down.shape[0])
    group_expert, group_slots = merge_blocks(block_expert, slot_assignment, blocks, w_down.shape[0])
    h_chunk, y_cols, defer, gu_cols, wd_cols = tiling(hidden, inter, blocks * block_size, itemsize, top_k=top_k,
                                                      n_blocks=planned_groups(group_expert.shape[0], blocks), **flags)
    tokens = slot_tokens(group_slots, top_k)
    whole_rows = flags["accumulate"] and y_cols >= hidden     # its buffers counted, rows staged whole
    repeated = whole_rows and repeats_a_token(tokens, group_expert.shape[0])
    combine = combine_mode(lnc_degree(), repeated, whole_rows)
    weights = slot_weights(topk_weights, group_slots) if combine == "accumulate" else routing_weights(topk_weights)
    n_groups = planned_groups(group_expert.shape[0], blocks)
    prefetch = _prefetch_fits((hidden, inter, blocks * block_size, itemsize), (h_chunk, y_cols, defer, gu_cols, wd_cols),
                              dict(flags, top_k=top_k, n_blocks=n_groups))
    return KernelLaunch(moe_experts_fwd_kernel,
                        (x.contiguous(), weights, group_expert, tokens,
                         group_slots, w_gate_up.contiguous(), w_down.contiguous(), b_gate_up, b_down,
                         activation, float(swiglu_alpha), float(swiglu_limit), top_k, h_chunk, y_cols, defer, gu_cols,
                         wd_cols, save_activations, combine, prefetch),
                        grid=lnc_degree())
