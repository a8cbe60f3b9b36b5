"""Search gather plans for the earliest end of a paged decode call's K/V traffic (docs/perf-log.md §28).

The plans, the search and how each plan is timed by the cost model are in
``nki_lib/bench/gather_bound.py``. Run from the repository root (package installed or ``PYTHONPATH=.``)::

    python benchmarks/paged_gather_bound.py                      # about 2 minutes on this CPU
    python benchmarks/paged_gather_bound.py --plans 4000 --climb 400 --seed 1
"""

import argparse

from nki_lib.bench.gather_bound import report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plans", type=int, default=1500, help="random plans per hwdge share")
    parser.add_argument("--climb", type=int, default=300, help="hill-climbing steps per kept plan")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for line in report(args.plans, args.climb, args.seed):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
