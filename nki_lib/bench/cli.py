"""``nki-lib bench``: estimated Trainium performance of every kernel on real model shapes.

Usage::

    nki-lib bench [--sweep default|full|smoke|targets|aws] [--ops OP ...] [--models NAME ...]
                  [--targets trn2,trn3] [--out DIR] [--no-steady] [--no-cpu] [--no-plot] [--limit N]
                  [--lnc 1|2] [--set NAME=VALUE ...] [--sensitivity]

``--set dma_chunk_floor_ns=150`` replaces a cost-model constant (both targets) for this run;
``--sensitivity`` also estimates trn2 with each low-confidence constant at each of its documented
bounds (docs/cost-model.md §7.9) and prints every figure's range.

Writes ``DIR/bench.jsonl`` (schema in benchmarks/README.md), ``DIR/bench.txt`` (the table),
``DIR/roofline_<family>.png`` and ``DIR/command.txt``; prints the table, with a progress bar on
stderr while it runs. Exit status 1 if a case errored (a missing kernel is not an error).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    from nki_lib.bench.shapes import MODELS, SWEEPS

    p = argparse.ArgumentParser(prog="nki-lib bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--sweep", default="default", choices=sorted(SWEEPS) + ["reference"],
                   help="which case list to run (reference: the CPU reference path vs SDPA)")
    p.add_argument("--ops", nargs="*", default=None, help="only these ops (registry names)")
    p.add_argument("--models", nargs="*", default=None, help=f"only these models ({', '.join(sorted(MODELS))})")
    p.add_argument("--modes", nargs="*", default=None, choices=("prefill", "train", "decode"))
    p.add_argument("--targets", default="trn2,trn3", help="comma-separated: trn2, trn3")
    p.add_argument("--out", default=None, help="output directory (default: no files)")
    p.add_argument("--no-steady", action="store_true", help="skip the second (steady-state) simulator call")
    p.add_argument("--no-cpu", action="store_true", help="skip the CPU reference / baseline timings")
    p.add_argument("--no-plot", action="store_true", help="skip the roofline PNGs")
    p.add_argument("--limit", type=int, default=None, help="run only the first N cases")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads for --sweep reference (default: torch's own)")
    p.add_argument("--lnc", type=int, choices=(1, 2), default=None,
                   help="logical NeuronCore degree the kernels launch with (sets NEURON_LOGICAL_NC_CONFIG; "
                        "default: the environment's, else 1; a case that names its own, as in the targets "
                        "sweep, keeps it)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="set a cost-model constant for this run (repeatable), e.g. dma_chunk_floor_ns=150")
    p.add_argument("--sensitivity", action="store_true",
                   help="also estimate trn2 at each documented bound of each low-confidence constant")
    return p


def _overrides(pairs: list[str], targets) -> tuple[dict, dict]:
    """(target -> HardwareParams with the ``--set`` values, the values) ; bad names are an error."""
    from nki_lib.simulator.profile import params

    values = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep:
            raise SystemExit(f"--set: expected NAME=VALUE, got {pair!r}")
        try:
            values[name.strip()] = float(text)
        except ValueError:
            raise SystemExit(f"--set {name}: {text!r} is not a number") from None
    if not values:
        return {}, {}
    try:
        hws = {t: params(t).with_values("set on the command line (nki-lib bench --set)", **values) for t in targets}
    except ValueError as exc:
        raise SystemExit(f"--set: {exc}") from None
    return hws, values


_FAMILIES = ("nki_lib.attention.decode_attention_op", "nki_lib.moe")


def _import_families() -> None:
    """Register every op family that exists, also before ``import nki_lib`` imports it."""
    import importlib

    for name in _FAMILIES:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # a family that exists but fails to import is an error
                raise


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.sweep == "reference":
        from nki_lib.bench.reference_sweep import main as reference_main
        return reference_main(args)
    import torch

    import nki_lib  # noqa: F401 - registers the ops
    _import_families()
    from nki_lib.bench.harness import run_case
    from nki_lib.bench.output import Progress, plot_rooflines, table, targets_report, write_jsonl
    from nki_lib.bench.shapes import sweep

    if args.lnc is not None:
        os.environ["NEURON_LOGICAL_NC_CONFIG"] = str(args.lnc)
    targets = tuple(t.strip() for t in args.targets.split(",") if t.strip())
    for t in targets:
        if t not in ("trn2", "trn3"):
            raise SystemExit(f"--targets: unknown target {t!r} (trn2, trn3)")
    hws, values = _overrides(args.set, targets)
    cases = [c for c in sweep(args.sweep)
             if (args.ops is None or c.op in args.ops) and (args.models is None or c.model in args.models)
             and (args.modes is None or c.mode in args.modes)]
    if args.limit is not None:
        cases = cases[:args.limit]
    progress = Progress(len(cases))
    results = []
    for case in cases:
        progress.step(case.label)
        results.append(run_case(case, targets, steady=not args.no_steady, cpu_paths=not args.no_cpu, hw=hws,
                                sensitivity=args.sensitivity))
    progress.close()
    text = table(results)
    goals = targets_report(results)
    if goals:
        text += "\n\n" + goals
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        command = "nki-lib bench " + " ".join(argv if argv is not None else sys.argv[1:])
        header = {"command": command, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  "sweep": args.sweep, "targets": list(targets),
                  "lnc": os.environ.get("NEURON_LOGICAL_NC_CONFIG", "1"), "set": values,
                  "sensitivity": args.sensitivity, "torch": torch.__version__,
                  "python": platform.python_version(), "machine": platform.machine(),
                  "nki_lib": getattr(nki_lib, "__version__", "?")}
        write_jsonl(os.path.join(args.out, "bench.jsonl"), results, header)
        with open(os.path.join(args.out, "bench.txt"), "w") as f:
            f.write(text + "\n")
        with open(os.path.join(args.out, "command.txt"), "w") as f:
            f.write(command + "\n")
        if not args.no_plot:
            for path in plot_rooflines(results, args.out):
                print(f"wrote {path}")
    return 1 if any(r.status.startswith("error") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
