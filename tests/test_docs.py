"""The code blocks of docs/*.md run, in order, in one namespace per document."""

import re
from pathlib import Path

import pytest

DOCS = sorted((Path(__file__).parent.parent / "docs").glob("*.md"))


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_code_blocks_run(path):
    blocks = re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)
    if not blocks:
        pytest.skip(f"{path.name} has no python code block (its shell blocks are not run yet)")
    namespace = {}
    for i, block in enumerate(blocks, 1):
        try:
            exec(compile(block, f"{path.name}:block{i}", "exec"), namespace)
        except Exception as error:  # say which block broke
            raise AssertionError(f"{path.name} code block {i} failed: {error!r}") from error


def test_walkthrough_covers_formula_to_kernel():
    text = (Path(__file__).parent.parent / "docs" / "walkthrough.md").read_text()
    for heading in ("The formula", "The NumPy oracle", "The per-head form", "The batched module", "The flash kernel"):
        assert re.search(rf"^## \d+\. {heading}$", text, flags=re.M), heading
