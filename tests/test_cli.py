"""The mha command line."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mha import cli, kernels


def test_verify_quick_passes_and_prints_the_table(capsys, tmp_path):
    report = tmp_path / "verify.json"
    assert cli.main(["verify", "--quick", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "all passed" in out and "fp32 grads" in out and "is_causal" in out
    rows = json.loads(report.read_text())
    assert len(rows) == 48 and all(r["passed"] for r in rows)
    assert {"fp64/output", "fp32/output"} <= set(rows[0]["errors"])


def test_verify_exits_1_when_a_case_fails(monkeypatch, capsys):
    original = kernels.BACKENDS["math"]

    def off_by_a_little(q, k, v, *args):
        out, w = original(q, k, v, *args)
        return out * 1.0001, w

    monkeypatch.setitem(kernels.BACKENDS, "math", off_by_a_little)
    assert cli.main(["verify", "--quick"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_verify_rejects_a_bad_option():
    with pytest.raises(SystemExit):
        cli.main(["verify", "--per-group", "0"])


def test_module_and_console_script_entry_points():
    done = subprocess.run([sys.executable, "-m", "mha", "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "verify" in done.stdout
    beside_python = Path(sys.executable).parent / "mha"
    script = str(beside_python) if beside_python.exists() else shutil.which("mha")
    assert script, "the mha console script is installed with the package"
    done = subprocess.run([script, "verify", "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "--quick" in done.stdout
