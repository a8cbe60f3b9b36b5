"""Issue 13's AWS comparison problems, each simulated at its full shape (no extrapolation).

``PYTHONPATH=$PWD python benchmarks/aws_problems.py [--ops OP ...]`` prints one Markdown row per
case of ``nki-lib bench --sweep aws``: the trn2 program-order estimate, the dependency bound, the
busy-time lower bound (``lower_bound_us``: the busiest engine plus launch, the figure issue 13's
"lower bound" column uses), the bound engine and its busy time. The bench itself extrapolates
batched attention/decode from one (batch x kv-head) group (``time = launch + groups x makespan``),
which leaves out the overlap of consecutive groups; this script simulates every group, so its
figures are the ones to set beside AWS's (docs/perf-log.md §8). Set
``NEURON_LOGICAL_NC_CONFIG=2`` for the two-core cases. ``train`` rows are forward + backward.
"""

import argparse

from nki_lib.bench import harness
from nki_lib.bench.shapes import sweep


def _row(case) -> str:
    full = harness.SimPlan(dict(case.dims), 1.0, None)
    planner, harness.plan = harness.plan, (lambda _case: full)
    try:
        res = harness.run_case(case, ("trn2",), steady=False, cpu_paths=False)
    finally:
        harness.plan = planner
    est = res.estimates.get("trn2")
    if est is None:
        return f"| {case.label} | {res.status} | | | | |"
    bound = est["bound_engine"]
    return (f"| {case.label} | {est['time_us']:.1f} | {est['dependency_bound_us']:.1f} | "
            f"{est['lower_bound_us']:.1f} | {bound} ({est['busy_us'][bound]:.1f} us busy) | "
            f"{est['host']['time_us']:.1f} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", nargs="*", default=None, help="only these ops")
    args = p.parse_args(argv)
    print("| case | in order (us) | dependency bound (us) | lower bound (us) | bound engine | +host (us) |")
    print("|---|---:|---:|---:|---|---:|")
    for case in sweep("aws"):
        if args.ops is None or case.op in args.ops:
            print(_row(case), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
