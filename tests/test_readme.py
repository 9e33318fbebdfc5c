"""The README's result tables are what the code prints from the committed JSON, so a table cannot drift from its
data: the showcase's table, and every table `benchmarks/kbit_sweep.py --report` prints for both real models."""

import importlib.util
import json
import re
from pathlib import Path

import pytest

from leanlm.showcase import showcase_table

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _normalized(text: str) -> str:
    """Markdown tables compare cell by cell: column padding is not content."""
    return "\n".join(re.sub(r"\s+", " ", line).strip() for line in text.splitlines())


def _tables(text: str) -> list[str]:
    tables, current = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append("\n".join(current))
            current = []
    return tables


README = _normalized((ROOT / "README.md").read_text())


def test_the_showcase_table_is_the_committed_run():
    table = showcase_table(json.loads((RESULTS / "showcase_smollm2-135m.json").read_text()))
    assert _normalized(table) in README


@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_the_kbit_sweep_tables_are_its_report(model):
    spec = importlib.util.spec_from_file_location("kbit_sweep", ROOT / "benchmarks" / "kbit_sweep.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    tables = _tables(script.report(json.loads((RESULTS / f"kbit_sweep_{model}.json").read_text())))
    assert len(tables) == 11
    missing = [table.splitlines()[2] for table in tables if _normalized(table) not in README]
    assert not missing, f"README tables that differ from the report (first row shown): {missing}"
