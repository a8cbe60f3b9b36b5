"""Command line: ``nki-lib report`` (the main job: parity and estimated device performance of
every kernel), ``nki-lib bench`` (microbenchmarks on real model shapes),
``nki-lib dry-run MODULE:CALLABLE`` (the migration reading of one step of your own model) and
``nki-lib scaleout`` (bytes and collective time of expert-parallel MoE and ring attention beside
the kernel time).
``python -m nki_lib <command>`` is the same."""

from __future__ import annotations

import sys

USAGE = "usage: nki-lib {report,bench,dry-run,scaleout} [options]   (nki-lib <command> --help for its options)"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip() + "\n\n" + USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "report":
        from nki_lib.report import main as report_main
        return report_main(rest)
    if command == "bench":
        from nki_lib.bench.cli import main as bench_main
        return bench_main(rest)
    if command == "dry-run":
        from nki_lib.migration.cli import main as dry_run_main
        return dry_run_main(rest)
    if command == "scaleout":
        from nki_lib.bench.scaleout import main as scaleout_main
        return scaleout_main(rest)
    print(f"nki-lib: unknown command {command!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
