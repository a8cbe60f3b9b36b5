"""The calibration table (docs/calibration.md) is reproducible from the model (issue 10, cost model 6)."""

import math
import pathlib

from nki_lib.bench.calibration import CASES, markdown, rows

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "calibration.md"


def test_every_case_has_a_source_and_a_model_figure():
    table = rows()
    assert len(table) == len(CASES) >= 10
    for row in table:
        assert row["source"] and row["measured"] > 0
        assert math.isfinite(row["model"]) and row["model"] > 0


def test_committed_table_is_the_regenerated_one():
    """docs/calibration.md holds exactly what benchmarks/calibration.py writes."""
    assert markdown(rows()) in DOC.read_text()
