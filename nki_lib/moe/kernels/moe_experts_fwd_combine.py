"""The expert-MLP forward's combine y[t] = sum_j w[t, j] * o[t * k + j]: where each slot's output
row o goes once the down projection has made it.

Two combines (chosen by the launcher, :func:`combine_mode`):

- ``"sum"`` (LNC2, output rows staged in parts, or repeated tokens): every assignment's fp32
  row is scattered into the assignment-ordered scratch y_slots (N, H) in HBM, and after the last
  group (and a core barrier) :func:`~.moe_experts_steps.reduce_assignments` sums each token's k
  rows in the fixed order j = 0..k-1, reading N x H x 4 bytes after the loop. The order does not
  depend on which core made a row, so LNC2 is bitwise LNC1.
- ``"accumulate"`` (LNC1, output rows staged whole): the PSUM eviction multiplies each slot's
  row by its routing weight (ScalarE ``activation`` scale, a per-partition fp32 operand: slots
  sit on partitions), and the
  weighted row is added into a token-ordered accumulator (T, H) in HBM by the DMA engines'
  indexed read-modify-write (``nisa.dma_compute``, "Scatter RMW": dst(HBM)[indices] =
  dst(HBM)[indices] + src(SBUF), computed in fp32 inside the DMA and cast to dst's dtype;
  docs/nki-semantics.md §8.24), the slot's token id as the row index; padding slots (-1) are
  skipped. The sum thus runs inside the group loop, overlapped with TensorE. The accumulator
  is y itself (:data:`FP32_ACCUMULATOR` False: each of a token's k additions rounds to x's
  dtype, as PyTorch's own ``index_add_`` loop in that dtype does; no tail), or, with
  :data:`FP32_ACCUMULATOR`, an fp32 scratch and a tail that converts it to x's dtype
  (docs/perf-log.md §14.2 gives the cost and the error of both). Within one indirect DMA the
  row indices are distinct (a plan whose group names a token twice takes "sum"); successive
  scatters touch the accumulator in program order (the HBM side of an indirect DMA covers the
  whole tensor for hazards), so a token's terms are added in group order, which is fixed on one
  core: the result is deterministic. On LNC2 the two cores would add into the same rows at once, a race that no
  documented atomicity rules out, so LNC2 keeps ``"sum"``.

Shapes (dimension legend): T tokens, H hidden, N = T * k assignments, NG groups, S slots per
group, ST slot tiles per group, P = 128 partitions. Limits: as :mod:`.moe_experts_fwd`.
"""

from __future__ import annotations

from nki_lib._nki import nisa, nl
from nki_lib.moe.kernels.moe_experts_steps import WEIGHT_SPAN, scatter_rows
from nki_lib.sizes import spans

# The "accumulate" combine's accumulator for 16-bit x: False = y itself (x's dtype, no tail;
# error about that of PyTorch's own loop in x's dtype, within the parity rule), True = an fp32
# scratch converted after the loop (error about a third of it, 0.8 ms more at the MFU case).
FP32_ACCUMULATOR = False

# Engines that convert the accumulator's fp32 rows to y's dtype in the tail, in turn (SBUF->SBUF
# copies; each token tile's rows go to one engine).
CONVERT_ENGINES = (nisa.engine.vector, nisa.engine.gpsimd, nisa.engine.scalar)


def combine_mode(programs, repeated_tokens, whole_rows=True):
    """The combine of a launch on ``programs`` cores: "accumulate" on one core, "sum" on two
    (see the module docstring), when a token holds two slots of one expert (``repeated_tokens``:
    one read-modify-write DMA must not name a row twice; AWS's own scatter-add kernels state the
    same rule for a 128-row tile), or when the output rows are staged in parts (not
    ``whole_rows``: one read-modify-write per slot tile and staging group, each waiting for the
    previous one, which holds the in-order DMA queue: mixtral-8x7b prefill +8 %, deepseek-v3
    +40 % in order, docs/perf-log.md §14.2)."""
    return "accumulate" if programs == 1 and not repeated_tokens and whole_rows else "sum"


def accumulator(y, t_len, hidden):
    """The (T, H) accumulator of the "accumulate" combine: y itself when it is fp32 or without
    :data:`FP32_ACCUMULATOR`, else an fp32 scratch tensor in HBM."""
    if y.dtype == nl.float32 or not FP32_ACCUMULATOR:
        return y
    return nl.ndarray((t_len, hidden), dtype=nl.float32, buffer=nl.shared_hbm)


def accumulate_sbuf_bytes(hidden, itemsize):
    """(through the loop, tail) SBUF bytes per partition of the "accumulate" combine for x of
    ``itemsize`` bytes: the zero tile of :func:`zero_rows` (an upper bound: needed only at the
    start), and :func:`convert_rows`'s two generations of fp32 rows and the converted rows (only
    with the fp32 accumulator of 16-bit x, else 0)."""
    acc_itemsize = 4 if FP32_ACCUMULATOR else itemsize
    tail = 2 * hidden * 4 + hidden * itemsize if FP32_ACCUMULATOR and itemsize < 4 else 0
    return min(hidden, WEIGHT_SPAN) * acc_itemsize, tail


def zero_rows(acc):
    """acc = 0: one (P, <= WEIGHT_SPAN) zero tile (memset on GpSimd) stored over every 128-row tile
    and column span with static DMAs (precomputed descriptors; the scatters' read-modify-writes
    wait for them)."""
    t_len, hidden = acc.shape
    width = min(hidden, WEIGHT_SPAN)
    zero_sb = nl.ndarray((nl.tile_size.pmax, width), dtype=acc.dtype, buffer=nl.sbuf)
    nisa.memset(dst=zero_sb, value=0.0, engine=nisa.engine.gpsimd)
    for t0, tp in spans(t_len, nl.tile_size.pmax):
        for c0, cn in spans(hidden, width):
            nisa.dma_copy(dst=acc[t0:t0 + tp, c0:c0 + cn], src=zero_sb[:tp, :cn])


def accumulate_rows(acc, tok_sb, rows_sb, col0):
    """acc[tok, col0 : col0 + n] += rows (fp32 read-modify-write in the DMA engines, software DGE;
    rows whose token id is -1 are skipped)."""
    ps, n = rows_sb.shape
    cols = acc.shape[1]
    acc_rows = acc.ap([[cols, ps], [1, n]], offset=col0, vector_offset=tok_sb, indirect_dim=0)
    nisa.dma_compute(dst=acc_rows, srcs=[acc_rows, rows_sb], reduce_op=nl.add, oob_mode=nisa.oob_mode.skip)


class GroupSink:
    """Where a group's staged output rows go: ``write(slot tile, rows, first column)``, and the
    per-slot-tile eviction scale (``scale(n)``: the routing weights of slot tile n, or None)."""

    def __init__(self, mode, dst, weights_sb=None, g=0):
        self.mode, self.dst, self.weights_sb, self.g = mode, dst, weights_sb, g

    def scale(self, slot_tile, ps):
        if self.mode != "accumulate":
            return None
        return self.weights_sb[:ps, slot_tile, self.g:self.g + 1]

    def write(self, tile, rows_sb, col0):
        _, _, tok_sb, _, asg_sb, _ = tile
        if self.mode == "accumulate":
            accumulate_rows(self.dst, tok_sb, rows_sb, col0)
        else:
            scatter_rows(self.dst, asg_sb, rows_sb, col0)


def convert_rows(acc, y):
    """y = acc cast to y's dtype, per 128-token tile (whole rows: one load, one copy on an engine
    of :data:`CONVERT_ENGINES` in turn, one store; the next tile's load is issued before this
    tile's copy)."""
    t_len, hidden = y.shape
    tiles = spans(t_len, nl.tile_size.pmax)

    def load(t0, tp):
        rows_sb = nl.ndarray((tp, hidden), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=rows_sb, src=acc[t0:t0 + tp, :])
        return rows_sb

    pending = load(*tiles[0]) if tiles else None
    for n, (t0, tp) in enumerate(tiles):
        rows_sb = pending
        pending = load(*tiles[n + 1]) if n + 1 < len(tiles) else None
        out_sb = nl.ndarray((tp, hidden), dtype=y.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=out_sb, src=rows_sb, engine=CONVERT_ENGINES[n % len(CONVERT_ENGINES)])
        nisa.dma_copy(dst=y[t0:t0 + tp, :], src=out_sb)
