"""Command line: ``python -m nki_lib report`` (the main job) and ``python -m nki_lib bench``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="nki-lib", description=__doc__)
    parser.add_argument("command", choices=("report", "bench"), help="what to run")
    args, rest = parser.parse_known_args(argv)
    if args.command == "report":
        from nki_lib.report import main as report_main
        return report_main(rest)
    from nki_lib.bench.cli import main as bench_main
    return bench_main(rest)


if __name__ == "__main__":
    sys.exit(main())
