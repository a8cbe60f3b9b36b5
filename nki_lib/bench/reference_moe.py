"""MoE reference-path speed: ``nki::moe_experts`` on the reference path against a plain loop over
experts in the inputs' dtype (what a transformers model's eager experts do), bf16, forward and
forward + backward, on this machine's CPU.

Ratios come from interleaved runs (A, B, A, B, ...; median of each), so drifting machine load
hits both sides alike; a row stops after its time budget (the slowest rows, a bf16 loop's
backward, take about a minute per pair on 2 cores), with at least one pair. ``ratio`` = reference time / loop time: <= 1 means the reference is no
slower than the loop (:data:`TARGET`). Run with ``python -m nki_lib.bench.reference_moe
[--repeats N]``; ``nki-lib bench --sweep reference`` runs these cases after the attention ones.

Shapes (dimension legend): T tokens, H hidden, I intermediate, E experts, k top-k.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import nki_lib
from nki_lib.moe import moe_experts_op


@dataclass(frozen=True)
class Case:
    t: int
    h: int
    inter: int
    e: int
    k: int
    dtype: torch.dtype = torch.bfloat16

    @property
    def label(self) -> str:
        return f"T={self.t} H={self.h} I={self.inter} E={self.e} k={self.k} {str(self.dtype).replace('torch.', '')}"


CASES = (
    Case(512, 1024, 512, 8, 2),       # Mixtral-like routing, few experts
    Case(256, 2048, 768, 16, 4),      # wider hidden
    Case(1024, 512, 256, 64, 8),      # many small experts (per-expert overhead dominates)
)
BLOCK_SIZE = 128
TARGET = 1.0        # issue 12: the bf16 MoE reference no slower than a loop over experts


def expert_loop(x, topk_weights, topk_ids, w_gate_up, w_down):
    """The baseline: per expert, its tokens through the gated MLP in the inputs' dtype."""
    y = torch.zeros_like(x)
    inter = w_down.shape[2]
    for e in range(w_gate_up.shape[0]):
        token, slot = torch.where(topk_ids == e)
        if token.numel() == 0:
            continue
        gu = F.linear(x[token], w_gate_up[e])
        h = F.silu(gu[:, :inter]) * gu[:, inter:]
        out = F.linear(h, w_down[e]) * topk_weights[token, slot, None].to(x.dtype)
        y = y.index_add(0, token, out)
    return y


def _inputs(case: Case, requires_grad: bool):
    gen = torch.Generator().manual_seed(0)
    topk_ids = torch.argsort(torch.rand(case.t, case.e, generator=gen), dim=1)[:, :case.k]
    sample = moe_experts_op.make_sample(case.t, case.h, case.inter, case.e, case.k, BLOCK_SIZE, case.dtype,
                                     requires_grad, topk_ids=topk_ids)
    return sample.args, topk_ids


def _runners(case: Case, backward: bool):
    (x, w, block_expert, slots, w_gate_up, w_down), topk_ids = _inputs(case, backward)

    def finish(y):
        if backward:
            y.float().sum().backward()

    def reference():
        with nki_lib.use_backend("reference"):
            finish(torch.ops.nki.moe_experts(x, w, block_expert, slots, w_gate_up, w_down))

    def loop():
        finish(expert_loop(x, w, topk_ids, w_gate_up, w_down))

    return reference, loop


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


WARMUP_BELOW_S = 1.0   # a first pair slower than this counts as a measurement (lazy init is ms-scale)


def measure(case: Case, *, backward: bool, repeats: int = 5, budget_s: float = 60.0) -> dict:
    """{case, pass, reference_ms, loop_ms, ratio, pairs} from interleaved (reference, loop) pairs:
    up to ``repeats`` pairs, stopping early once ``budget_s`` seconds are spent (at least one
    pair). A first pair faster than :data:`WARMUP_BELOW_S` per side is a discarded warm-up."""
    reference, loop = _runners(case, backward)
    ref_times, loop_times = [_seconds(reference)], [_seconds(loop)]
    if max(ref_times[0], loop_times[0]) < WARMUP_BELOW_S:
        ref_times, loop_times = [], []
    start = time.perf_counter()
    while len(ref_times) < repeats and (not ref_times or time.perf_counter() - start < budget_s):
        ref_times.append(_seconds(reference))
        loop_times.append(_seconds(loop))
    ref_ms, loop_ms = 1e3 * statistics.median(ref_times), 1e3 * statistics.median(loop_times)
    return dict(case=case.label, pass_="fwd+bwd" if backward else "fwd", reference_ms=ref_ms, loop_ms=loop_ms,
                ratio=ref_ms / loop_ms, pairs=len(ref_times))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--budget", type=float, default=60.0, help="seconds of timed pairs per row")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{torch.get_num_threads()} CPU thread(s)")
    print(f"{'case':<40} {'pass':<8} {'reference ms':>13} {'loop ms':>10} {'ratio':>7} {'pairs':>5}")
    for case in CASES:
        for backward in (False, True):
            r = measure(case, backward=backward, repeats=args.repeats, budget_s=args.budget)
            print(f"{r['case']:<40} {r['pass_']:<8} {r['reference_ms']:>13.1f} {r['loop_ms']:>10.1f} "
                  f"{r['ratio']:>7.2f} {r['pairs']:>5}", flush=True)


if __name__ == "__main__":
    main()
