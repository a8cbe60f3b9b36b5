"""Before/after table of two ``nki-lib bench`` runs (Markdown, trn2 figures, one row per case).

``python benchmarks/compare.py BEFORE/bench.jsonl AFTER/bench.jsonl`` prints, per case of the
"after" run: the program-order estimate before and after, the dependency-bound estimate after
(a run without it shows "-"), the host-side ops after (whole-op estimate), and the bound engine
before -> after. Used for the cost-model entries of docs/perf-log.md. A case labelled ``... LNC1``
also matches the unlabelled case of an older run (one launched at the default degree).
"""

import argparse
import json
import sys


def _load(path):
    with open(path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    return {row["label"]: row for row in lines[1:]}


def _fig(row, key, sub=None):
    est = (row or {}).get("estimates", {}).get("trn2", {})
    value = est.get(key) if sub is None else est.get(key, {}).get(sub)
    return value


def _us(value):
    return "-" if value is None else f"{value:.1f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before")
    parser.add_argument("after")
    args = parser.parse_args(argv)
    before, after = _load(args.before), _load(args.after)
    print("| case | before (us) | after, program order (us) | after, dependency bound (us) | host ops after (us) "
          "| bound before -> after |")
    print("|---|---:|---:|---:|---:|---|")
    for label, row in after.items():
        # a case that names LNC1 matches the same case of a run before cases named their degree
        old = before.get(label) or before.get(label.removesuffix(" LNC1"))
        print(f"| {label} | {_us(_fig(old, 'time_us'))} | {_us(_fig(row, 'time_us'))} | "
              f"{_us(_fig(row, 'dependency_bound_us'))} | {_us(_fig(row, 'host', 'time_us'))} | "
              f"{_fig(old, 'bound_engine') or '-'} -> {_fig(row, 'bound_engine') or '-'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
