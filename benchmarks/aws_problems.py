"""Issue 13's AWS comparison problems, each simulated at its full shape (no extrapolation).

``PYTHONPATH=$PWD python benchmarks/aws_problems.py [--ops OP ...] [--lnc 1|2] [--out DIR]``
prints one Markdown row per case of ``nki-lib bench --sweep aws``: the trn2 program-order
estimate, the dependency bound, the busy-time lower bound (``lower_bound_us``: the busiest engine
plus launch, the figure issue 13's "lower bound" column uses), the bound engine and its busy
time, and the host-side ops of the call. The ``aws`` sweep's cases are simulated at their full
shape (``Case.extrapolate=False``: no per-group extrapolation), so these are the figures to set
beside AWS's (docs/perf-log.md §8). ``train`` rows are forward + backward.

``--out DIR`` writes ``DIR/lnc1.md`` (every problem at LNC1), ``DIR/lnc2.md`` (the problems
whose ops split over two cores, at LNC2) and ``DIR/command.txt``: the committed
``benchmarks/results/aws`` in one command.
"""

import argparse
import os
import sys
from dataclasses import replace

from nki_lib.bench import harness
from nki_lib.bench.shapes import sweep

LNC2_OPS = ("flash_attention", "moe_router", "moe_experts")  # ops whose kernels split over two cores
HEADER = ("| case | in order (us) | dependency bound (us) | lower bound (us) | bound engine | +host (us) |\n"
          "|---|---:|---:|---:|---|---:|")


def _row(case) -> str:
    res = harness.run_case(case, ("trn2",), steady=False, cpu_paths=False)
    est = res.estimates.get("trn2")
    if est is None:
        return f"| {case.label} | {res.status} | | | | |"
    bound = est["bound_engine"]
    return (f"| {case.label} | {est['time_us']:.1f} | {est['dependency_bound_us']:.1f} | "
            f"{est['lower_bound_us']:.1f} | {bound} ({est['busy_us'][bound]:.1f} us busy) | "
            f"{est['host']['time_us']:.1f} |")


def _table(cases, lnc, stream) -> str:
    lines = [HEADER]
    print(HEADER, file=stream, flush=True)
    for case in cases:
        lines.append(_row(replace(case, lnc=lnc)))
        print(lines[-1], file=stream, flush=True)
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", nargs="*", default=None, help="only these ops")
    p.add_argument("--lnc", type=int, choices=(1, 2), default=None,
                   help="LNC degree of every case (default: the environment's)")
    p.add_argument("--out", default=None, help="write lnc1.md, lnc2.md and command.txt here")
    args = p.parse_args(argv)
    cases = [c for c in sweep("aws") if args.ops is None or c.op in args.ops]
    if args.out is None:
        _table(cases, args.lnc, sys.stdout)
        return 0
    os.makedirs(args.out, exist_ok=True)
    for lnc in (1, 2):
        chosen = cases if lnc == 1 else [c for c in cases if c.op in LNC2_OPS]
        print(f"LNC{lnc}:", flush=True)
        text = _table(chosen, lnc, sys.stdout)
        with open(os.path.join(args.out, f"lnc{lnc}.md"), "w") as f:
            f.write(text)
    with open(os.path.join(args.out, "command.txt"), "w") as f:
        f.write("python benchmarks/aws_problems.py " + " ".join(argv if argv is not None else sys.argv[1:]) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
