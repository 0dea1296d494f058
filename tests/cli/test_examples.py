"""Every example runs and its assertions hold (each reproduces one seed document's experiment)."""

import runpy
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("seed*.py"))


def test_one_example_per_seed():
    assert [p.name[:7] for p in EXAMPLES] == ["seed000", "seed001", "seed002", "seed003", "seed004"]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_runs(path, capsys):
    runpy.run_path(str(path), run_name="__main__")
    assert capsys.readouterr().out.strip(), "each example reports what it checked"
