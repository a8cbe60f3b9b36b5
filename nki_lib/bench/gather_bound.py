"""How early can a paged decode call's K/V traffic end? A search over gather plans, timed by the cost model.

Issue 13's gpt-oss-120b paged target (B=1, Hkv=8, L=8192, D=64, 64-key blocks, bf16; docs/perf-log.md
§28) needs the kernel's in-order estimate within its HBM roofline / 0.70 at every documented corner.
Whatever the compute does, the last K/V byte must land first. This module times only that traffic: it
builds DMA-only traces (``TraceEntry`` lists) for many *gather plans* and schedules each with the
cost model's own ``estimate`` (both estimates, any corner). So the DGE rule, the descriptor
generation on GpSimd or SP, the ``E_used`` DMA engines a DMA waits for, the rows per engine, the chunk
floor and the completion latency are exactly those of docs/cost-model.md §7.3 and §7.4.

A plan is a program-ordered list of DMAs after the block ids have landed (one static DMA of the
block-table row into SBUF, which every later DMA reads):

* ``("swdge", P, h)``: an indirect gather of P blocks (one partition and one descriptor each), each
  descriptor a run of h consecutive kv heads of the block's row (h * bs * D elements);
* ``("hwdge", 1, h)``: one block at a runtime ``scalar_offset``, a run of h heads (SP issues it).

Together a plan moves every (block, head) row of K and of V once: 2 * blocks * heads rows. Where
the rows sit (which heads, which partitions) does not change the traffic's timing, so plans are
counted by (mode, P, h) only, each DMA writing its own SBUF buffer (no false dependencies).

The search: seeded random plans and the uniform plans (whole-block gathers of one head run; h = 4 is
the kernel's), the best few improved by hill climbing (swap two DMAs, or split
or merge gathers). It is a search, not a proof: it reports the earliest end it found for plans with
software DGE only, and with hardware-DGE single-block DMAs mixed in.

Run by ``benchmarks/paged_gather_bound.py``, which prints the lines of ``report``.
"""

from __future__ import annotations

import functools
import random

import torch

from nki_lib.bench.targets import TUNING_TARGETS
from nki_lib.simulator.profile import estimate, params
from nki_lib.simulator.trace import Access, TraceEntry

CORNER = "dma_issue_swdge_per_descriptor_ns"     # the corner the target fails at (§27)
TARGET = "decode 8k paged cache, block 64 (gpt-oss-120b"   # the start of the target's name (TUNING_TARGETS)
GATHER_SIZES = (8, 16, 24, 32, 48, 64, 96, 112, 128)   # gather partitions tried (multiples of the
                                                        # 8 partitions one DMA engine covers)
HEAD_RUNS = (1, 2, 4, 8)                        # kv heads per descriptor tried (divisors of Hkv = 8)
HW_SHARES = (0.2, 0.4, 0.6, 0.8, 0.9)           # shares of hwdge DMAs in the random plans tried
KERNEL_HEAD_RUN = 4                             # the kernel's gathers: all blocks, 4 kv heads (a wave)


@functools.cache
def target():
    """The gpt-oss paged tuning target (``nki_lib.bench.targets``; looked up once, every trace reads it)."""
    return next(t for t in TUNING_TARGETS if t.name.startswith(TARGET))


def problem():
    """(blocks, kv heads, bytes of one (block, head) row) of the target's case."""
    case = target().case
    dims, block = case.dims, case.dims["block_size"]
    return dims["L"] // block, dims["Hkv"], block * dims["D"] * getattr(torch, case.dtype).itemsize


class _Trace:
    """A DMA-only trace under construction, in the target case's cache dtype: every access its own buffer."""

    def __init__(self):
        self.entries = []
        self.buffers = 0
        self.dtype = target().case.dtype
        self.itemsize = getattr(torch, self.dtype).itemsize

    def access(self, memory, partitions, nbytes):
        self.buffers += 1
        return Access(self.buffers, memory, (0, partitions) if memory == "sbuf" else (0, 1), (0, nbytes),
                      (partitions, nbytes // self.itemsize), self.dtype)

    def dma(self, reads, write, rows, row_bytes, attrs):
        elems = row_bytes // self.itemsize
        self.entries.append(TraceEntry(len(self.entries), 0, "dma", "dma_copy", tuple(reads), (write,),
                                       (rows, elems), self.dtype, rows * elems, rows * row_bytes,
                                       dict(attrs, queue="dma", src_memory="hbm", dst_memory="sbuf",
                                            contiguous_bytes=row_bytes)))


def plan_trace(plan, blocks, row_bytes):
    """The DMA-only trace of ``plan`` (after the block ids' load)."""
    tr = _Trace()
    ids = tr.access("sbuf", blocks, 4)
    tr.dma([tr.access("hbm", 1, blocks * 4)], ids, blocks, 4, {"indirect": None, "dge_mode": "none"})
    for mode, rows, heads in plan:
        src = tr.access("hbm", 1, rows * heads * row_bytes)
        form = {"indirect": "vector", "dge_mode": "swdge"} if mode == "swdge" else \
               {"indirect": "scalar", "dge_mode": "hwdge"}
        tr.dma([ids, src], tr.access("sbuf", rows, heads * row_bytes), rows, heads * row_bytes, form)
    return tr.entries


def traffic_end(plan, hw, blocks, row_bytes):
    """(in order, dependency bound) ns from launch until the plan's last byte has landed."""
    est = estimate(plan_trace(plan, blocks, row_bytes), hw)
    return est.makespan_ns, est.dependency_makespan_ns


def random_plan(rng, rows_left, hw_share):
    """A random plan covering ``rows_left`` (block, head) rows; about ``hw_share`` of its DMAs hwdge."""
    plan = []
    while rows_left:
        if rng.random() < hw_share:
            item = ("hwdge", 1, rng.choice(HEAD_RUNS))
        else:
            item = ("swdge", rng.choice(GATHER_SIZES), rng.choice(HEAD_RUNS))
        if item[1] * item[2] <= rows_left:
            plan.append(item)
            rows_left -= item[1] * item[2]
    return plan


def uniform_plans(blocks, heads):
    """The plans of whole-block gathers of one head run each: for every run h, 2 * heads / h gathers of
    all blocks (h = 4 is the kernel's own plan, docs/perf-log.md §24.2)."""
    return [[("swdge", blocks, h)] * (2 * heads // h) for h in HEAD_RUNS if heads % h == 0]


def neighbour(plan, rng):
    """One local change that keeps the rows covered: swap two DMAs, split a gather in two, or merge
    two gathers of the same head run."""
    plan = list(plan)
    move = rng.randrange(3)
    i = rng.randrange(len(plan))
    if move == 0:
        j = rng.randrange(len(plan))
        plan[i], plan[j] = plan[j], plan[i]
    elif move == 1 and plan[i][0] == "swdge" and plan[i][1] > 8:
        mode, rows, heads = plan[i]
        cut = rng.randrange(1, rows // 8) * 8
        plan[i:i + 1] = [(mode, cut, heads), (mode, rows - cut, heads)]
    else:
        same = [j for j, item in enumerate(plan) if j != i and item[0] == "swdge" == plan[i][0]
                and item[2] == plan[i][2] and item[1] + plan[i][1] <= max(GATHER_SIZES)]
        if same:
            j = rng.choice(same)
            plan[i] = ("swdge", plan[i][1] + plan[j][1], plan[i][2])
            del plan[j]
    return plan


def search(hw, blocks, heads, row_bytes, hw_shares, n_plans, n_climb, rng, keep=4):
    """The plan with the earliest in-order traffic end found: ``n_plans`` random plans per hwdge share,
    the ``keep`` best of each improved by ``n_climb`` hill-climbing steps."""
    rows = 2 * blocks * heads
    best = None
    for share in hw_shares:
        plans = [random_plan(rng, rows, share) for _ in range(n_plans)] + uniform_plans(blocks, heads)
        scored = sorted(((traffic_end(p, hw, blocks, row_bytes)[0], p) for p in plans), key=lambda s: s[0])[:keep]
        for end, plan in scored:
            for _ in range(n_climb):
                cand = neighbour(plan, rng)
                cand_end = traffic_end(cand, hw, blocks, row_bytes)[0]
                if cand_end <= end:
                    plan, end = cand, cand_end
            if best is None or end < best[0]:
                best = (end, plan)
    return best


def summary(plan):
    """Compact text of a plan: its swdge gathers (P x h) in order and its count of hwdge DMAs."""
    gathers = " ".join(f"{rows}x{heads}" for mode, rows, heads in plan if mode == "swdge")
    return f"swdge [{gathers}], {sum(mode == 'hwdge' for mode, _, _ in plan)} hwdge"


def report(n_plans, n_climb, seed):
    """The lines the script prints: the target's limit, then per estimate corner (nominal, swdge 105 ns)
    the kernel's own plan and the earliest end found with software DGE only and with hwdge mixed in."""
    blocks, heads, row_bytes = problem()
    nominal = params("trn2")
    corner_value = nominal.param(CORNER).bounds[1]
    roofline_ns = 2 * blocks * heads * row_bytes / nominal.hbm_bw_share
    limit_ns = roofline_ns / target().limits["in order"] - nominal.kernel_launch_ns
    lines = [f"{blocks} blocks x {heads} kv heads x (K, V), {row_bytes} B per (block, head) row; K/V roofline "
             f"{roofline_ns / 1e3:.1f} us; the target leaves {limit_ns / 1e3:.1f} us after the launch for the "
             f"whole kernel (the last byte and everything after it)"]
    for label, hw in (("nominal", nominal),
                      (f"{CORNER}={corner_value:g}", nominal.with_values("paged_gather_bound corner",
                                                                         **{CORNER: corner_value}))):
        kernel_plan = [("swdge", blocks, KERNEL_HEAD_RUN)] * (2 * heads // KERNEL_HEAD_RUN)
        lines.append(f"  {label:40s} {'the kernel':14s} its plan ends "
                     f"{traffic_end(kernel_plan, hw, blocks, row_bytes)[0] / 1e3:5.1f} us in order: {summary(kernel_plan)}")
        for name, shares in (("swdge only", (0.0,)), ("swdge + hwdge", HW_SHARES)):
            end, plan = search(hw, blocks, heads, row_bytes, shares, n_plans, n_climb, random.Random(seed))
            dep = traffic_end(plan, hw, blocks, row_bytes)[1]
            lines.append(f"  {label:40s} {name:14s} earliest end found {end / 1e3:5.1f} us in order "
                         f"({dep / 1e3:.1f} us dependency bound): {summary(plan)}")
    return lines
