"""Regenerate the model-vs-measured table of ``docs/calibration.md``.

Run from the repository root: ``PYTHONPATH=. python benchmarks/calibration.py`` (``--check``
only prints the table). The cases, their sources and how each is reproduced on the simulator and
the cost model are in ``nki_lib/bench/calibration.py``; the table sits between the two marker
lines of the document and nothing else in it is touched.
"""

import argparse
import pathlib
import sys

from nki_lib.bench.calibration import markdown, rows

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "calibration.md"
BEGIN, END = "<!-- calibration table: begin (benchmarks/calibration.py) -->", "<!-- calibration table: end -->"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="print the table, do not write the document")
    args = parser.parse_args(argv)
    table = markdown(rows())
    print(table)
    if args.check:
        return 0
    text = DOC.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{DOC}: the marker lines are missing")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    DOC.write_text(f"{head}{BEGIN}\n{table}\n{END}{tail}")
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
