"""Host-side eligibility and SBUF budget pieces shared by the expert-MLP launchers.

The kernel dtypes and the PSUM slot-tile bound, the SBUF bytes of the block flags, the k-sum tail
and staged rows, the tiling choice over an SBUF budget, the eligibility check that raises
``Unsupported`` with a reason, the host-side preparation of slot tokens and routing weights
(plain torch ops, charged as host ops by the whole-op estimate), and :func:`plan_tiling_for`:
the launchers' tiling chosen for a larger plan than the one launched (the bench's two-point rule
simulates a few experts of a problem with the real problem's tiling).
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar

import torch

from nki_lib._nki import nl
from nki_lib.dispatch import Unsupported
from nki_lib.moe.kernels.moe_experts_groups import group_count
from nki_lib.moe.kernels.moe_experts_steps import reduce_chunk
from nki_lib.sizes import ceil_div
from nki_lib.validation import has_values, on_host

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

MAX_PSUM_SLOT_TILES = 4   # slot tiles whose down-projection accumulators are live at once

_TILING_PLAN: ContextVar = ContextVar("moe_experts_tiling_plan", default=None)   # (blocks, experts) or None


@contextlib.contextmanager
def plan_tiling_for(n_blocks, n_experts):
    """Inside the block the expert-MLP launchers choose what depends on the plan's size (the
    eligibility check, blocks per group, the SBUF estimates, which count the plan's blocks and
    groups) for a plan of ``n_blocks`` blocks over ``n_experts`` experts when that is larger than
    the plan they launch, and launch the plan they are given. The bench's two-point rule
    (nki_lib/bench/harness.py) simulates a few experts of a larger problem: with this its
    simulated kernels take the real problem's tiling."""
    token = _TILING_PLAN.set((n_blocks, n_experts))
    try:
        yield
    finally:
        _TILING_PLAN.reset(token)


def planned_blocks(n_blocks):
    """Plan blocks the launchers' tiling is chosen for (:func:`plan_tiling_for`; else ``n_blocks``)."""
    plan = _TILING_PLAN.get()
    return n_blocks if plan is None else max(n_blocks, plan[0])


def planned_groups(n_groups, group_blocks):
    """Groups the launchers' SBUF estimates count (:func:`plan_tiling_for`: those of its plan at
    ``group_blocks`` blocks per group; else ``n_groups``)."""
    plan = _TILING_PLAN.get()
    return n_groups if plan is None else max(n_groups, group_count(plan[0], plan[1], group_blocks, 0))


def tail_sbuf_bytes(hidden, top_k, itemsize):
    """SBUF bytes per partition of the final k-reduction (after the blocks; two generations of the
    parts, the fp32 sum, the output rows and the routing weights)."""
    chunk = reduce_chunk(hidden, top_k)
    return 2 * (top_k * chunk * 4 + chunk * 4 + hidden * itemsize + top_k * 4)


def flags_sbuf_bytes(n_blocks, block):
    """SBUF bytes per partition live through the kernel: block flags, the plan's slot ids."""
    slot_tiles = ceil_div(block, nl.tile_size.pmax)
    return 2 * n_blocks * 4 + 2 * slot_tiles * n_blocks * 4 + 2 * block * 4


def staged_bytes(cols, hidden, slot_tiles):
    """SBUF bytes per partition of fp32 output rows staged ``cols`` wide per slot tile (two
    generations unless one group covers all of H)."""
    return (1 if cols >= hidden else 2) * slot_tiles * cols * 4


def choose_tiling(sbuf_at, hidden, *args, widths=None, **counts):
    """(chunk, out_cols): the first choice whose SBUF estimate fits, preferring output rows staged
    whole (one indirect scatter per slot tile instead of one per chunk), then wide chunks
    (``widths``, default gemm_moving_fmax halved down to pmax)."""
    pmax, width = nl.tile_size.pmax, nl.tile_size.gemm_moving_fmax
    if widths is None:
        widths = []
        while width >= pmax:
            widths.append(width)
            width //= 2
    choices = [(w, hidden) for w in widths] + [(w, min(w, hidden)) for w in widths]
    for chunk, cols in choices:
        if sbuf_at(*args, chunk, cols, **counts) <= nl.tile_size.total_available_sbuf_size:
            return chunk, cols
    return choices[-1]


def choose_overlap_tiling(sbuf_at, hidden, *args, widths=None, **counts):
    """(chunk, out_cols, overlap): :func:`choose_tiling` with the buffers of the kernel's overlap
    (``sbuf_at(..., overlap=True)``: the forward's deferred y scatters, the backward's next-chunk
    weights) counted, unless leaving them out gets a preferred tiling (rows staged whole, or a
    wider chunk); then the kernel runs without the overlap. At deepseek-v3's H=7168 the overlap's
    buffers cost whole staging (forward) or half the I chunk (backward), which cost more than the
    overlap gains (docs/perf-log.md §10.6)."""
    with_overlap = choose_tiling(sbuf_at, hidden, *args, widths=widths, overlap=True, **counts)
    without = choose_tiling(sbuf_at, hidden, *args, widths=widths, overlap=False, **counts)

    def preference(choice):
        chunk, cols = choice
        return cols >= hidden, chunk, cols

    if preference(without) > preference(with_overlap):
        return (*without, False)
    return (*with_overlap, True)


def group_blocks_fitting(sbuf_fn, hidden, inter, block, itemsize, **counts):
    """Blocks per group (:mod:`.moe_experts_groups`): the most, up to MAX_PSUM_SLOT_TILES * 128
    slots, whose SBUF estimate ``sbuf_fn(hidden, inter, slots, itemsize, **counts)`` fits (1 when
    no larger group does)."""
    fit = nl.tile_size.total_available_sbuf_size
    blocks = max(1, MAX_PSUM_SLOT_TILES * nl.tile_size.pmax // block)
    while blocks > 1 and sbuf_fn(hidden, inter, blocks * block, itemsize, **counts) > fit:
        blocks //= 2
    return blocks


def check_supported(x, topk_weights, block_expert, slot_assignment, inter, *, sbuf_fn, **flags):
    """Raise Unsupported (before launching) for what the kernels cannot serve."""
    if x.dtype not in KERNEL_DTYPES:
        raise Unsupported(f"dtype {x.dtype} (kernel serves {[str(d) for d in KERNEL_DTYPES]})")
    block_size = slot_assignment.shape[0] // block_expert.shape[0]
    max_block = MAX_PSUM_SLOT_TILES * nl.tile_size.pmax
    if block_size > max_block:
        raise Unsupported(f"block_size {block_size} > {max_block}")
    need = sbuf_fn(x.shape[1], inter, block_size, x.element_size(), top_k=topk_weights.shape[1],
                   n_blocks=planned_blocks(block_expert.shape[0]), **flags)
    if need > nl.tile_size.total_available_sbuf_size:
        raise Unsupported(f"SBUF: {need} bytes per partition needed for H={x.shape[1]}, I={inter}, "
                          f"block_size={block_size}, > {nl.tile_size.total_available_sbuf_size}")
    return block_size


def slot_tokens(slot_assignment, top_k):
    """Index metadata: the token id a // k of each slot, -1 for padding (one op: the floor
    division keeps -1, as -1 // k = -1 for k >= 1)."""
    return torch.div(slot_assignment, top_k, rounding_mode="floor").to(torch.int32).contiguous()


def routing_weights(topk_weights):
    """(N, 1) fp32 routing weights for the kernels: bf16/fp16/fp32 widen exactly."""
    return topk_weights.reshape(-1, 1).to(torch.float32).contiguous()


def slot_weights(topk_weights, group_slots):
    """Index metadata for the backward: (NG*S,) fp32 routing weight of each slot (0 for padding),
    in slot order, so the kernel loads them with its slot ids instead of gathering them (each
    indirect DMA costs GpSimd a descriptor per row). The forward's "accumulate" combine loads
    them the same way and scales each slot's output row by its weight. Two ops: the weights with
    a 0 appended, indexed by the slots (a padding slot's -1 picks the appended 0)."""
    flat = routing_weights(topk_weights).reshape(-1)
    return torch.nn.functional.pad(flat, (0, 1))[group_slots].contiguous()


def repeats_a_token(slot_token, n_groups):
    """True when one group's slots name a token twice (a top-k list naming an expert twice), or
    when the plan has no values (traced): the forward's "accumulate" combine adds a slot tile's
    rows with one read-modify-write DMA, whose row indices must be distinct (docs/perf-log.md
    §14.2), so such a plan takes the "sum" combine. ``slot_token`` (NG*S,): token ids, -1 padding.
    A launch choice made on the host: checked on a host copy (``nki_lib.validation.on_host``)."""
    if not has_values(slot_token):
        return True
    if slot_token.numel() == 0:
        return False
    with on_host(slot_token) as (tokens,):
        ids = torch.sort(tokens.reshape(n_groups, -1), dim=1).values
        return bool(((ids[:, 1:] == ids[:, :-1]) & (ids[:, 1:] >= 0)).any())

