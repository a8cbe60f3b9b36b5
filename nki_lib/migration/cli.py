"""``nki-lib dry-run MODULE:CALLABLE``: the dry run of a no-argument callable that runs one step."""

from __future__ import annotations

import argparse
import importlib
import os
import sys


def load_callable(spec: str):
    """``package.module:attr.path`` -> the object (the current directory is importable)."""
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path:
        raise ValueError(f"expected MODULE:CALLABLE, got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    obj = importlib.import_module(module_name)
    for part in attr_path.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{spec} is not callable")
    return obj


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nki-lib dry-run", description=__doc__)
    parser.add_argument("callable", help="MODULE:CALLABLE, a callable taking no arguments that runs one step")
    parser.add_argument("--target", default=None, help="trn2 or trn3 (default: the simulator's target)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the report as JSON")
    args = parser.parse_args(argv)
    from nki_lib.migration import dry_run
    from nki_lib.simulator import get_target, set_target

    try:
        fn = load_callable(args.callable)
    except (ValueError, TypeError, ImportError, AttributeError) as exc:
        print(f"nki-lib dry-run: {exc}", file=sys.stderr)
        return 2
    previous = get_target()
    if args.target is not None:
        set_target(args.target)
    try:
        report = dry_run(fn)
    finally:
        set_target(previous)
    print(report)
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(report.to_json(indent=2) + "\n")
    return 0
