"""The torch the project claims is the torch CI tests: pyproject's floor is the release constraints.txt
pins (the one CI installs), and the installed torch is at least that floor."""

import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _release(text: str) -> tuple[int, int]:
    return tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", text).groups())


def test_the_torch_floor_is_the_torch_ci_installs():
    floor = re.search(r'"torch>=([\d.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    pinned = re.search(r"^torch==([\d.]+)", (ROOT / "constraints.txt").read_text(), re.MULTILINE).group(1)
    assert _release(floor) == _release(pinned), (floor, pinned)


def test_the_installed_torch_is_within_the_claimed_range():
    floor = re.search(r'"torch>=([\d.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert _release(torch.__version__) >= _release(floor)
