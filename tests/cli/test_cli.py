"""The mha command line."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mha
from mha import cli, kernels
from mha.tools import verify


def test_verify_quick_passes_and_prints_the_table(capsys, tmp_path):
    report = tmp_path / "verify.json"
    assert cli.main(["verify", "--quick", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "all passed" in out and "fp32 grads" in out and "is_causal" in out
    report = json.loads(report.read_text())
    rows = report["cases"]
    cases = 3 * len(verify.groups())  # --quick: 3 per group (the native backend's where it is built)
    assert len(rows) == cases and all(r["passed"] for r in rows)
    assert report["summary"]["cases"] == cases and report["summary"]["failed"] == 0
    assert report["summary"]["versions"]["torch"] == torch.__version__
    assert {"fp64/output", "fp32/output"} <= set(rows[0]["errors"])


@pytest.mark.slow
def test_cli_version_and_a_closed_pipe(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"mha {mha.__version__}"
    for output in ("--format markdown", ""):  # markdown, and rich's tables
        ran = subprocess.run(f"set -o pipefail; {sys.executable} -m mha explain {output} --length 16 --embed-dim 32 "
                             "--batch 4 | head -1", shell=True, executable="/bin/bash", capture_output=True, text=True)
        assert ran.returncode == 0 and ran.stdout.strip() and "Traceback" not in ran.stderr, (output, ran.stderr)


def test_plot_refuses_text_without_a_checkpoint(tmp_path, capsys):
    assert cli.main(["plot", "--text", "hello", "--out", str(tmp_path / "a.png")]) == 2
    assert "--text needs --checkpoint" in capsys.readouterr().err


def test_verify_exits_1_when_a_case_fails(monkeypatch, capsys):
    original = kernels.BACKENDS["math"]

    def off_by_a_little(q, k, v, *args, **kwargs):
        out, w = original(q, k, v, *args, **kwargs)
        return out * 1.0001, w

    monkeypatch.setitem(kernels.BACKENDS, "math", off_by_a_little)
    assert cli.main(["verify", "--quick"]) == 1
    assert "FAIL" in capsys.readouterr().out


@pytest.mark.parametrize("option, value", [("--per-group", "0"), ("--threads", "0"), ("--threads", "-1")])
def test_verify_rejects_a_bad_option(capsys, option, value):
    threads = torch.get_num_threads()
    assert cli.main(["verify", option, value]) == 2  # a usage error, as argparse's; 1 means a failed case
    assert f"mha verify: error: {option} must be positive, got {value}" in capsys.readouterr().err
    assert torch.get_num_threads() == threads  # refused before anything ran (0 was once ignored, -1 a traceback)


def test_help_is_plain_text_and_counts_verifys_groups(capsys):
    """--help of the command and of each subcommand: no reStructuredText literals; verify's group
    count is the grid's."""
    for argv in (["--help"], *([name, "--help"] for name in cli.COMMANDS)):
        with pytest.raises(SystemExit):
            cli.main(argv)
        text = capsys.readouterr().out
        assert "``" not in text, argv
        if argv[0] == "verify":
            assert f"{len(verify.GROUPS)} groups" in " ".join(text.split())


@pytest.mark.slow
def test_module_and_console_script_entry_points():
    done = subprocess.run([sys.executable, "-m", "mha", "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "verify" in done.stdout
    beside_python = Path(sys.executable).parent / "mha"
    script = str(beside_python) if beside_python.exists() else shutil.which("mha")
    assert script, "the mha console script is installed with the package"
    done = subprocess.run([script, "verify", "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "--quick" in done.stdout


# --- mha convert -------------------------------------------------------------------------------


def _bert_checkpoint(path, heads=3, E=12):
    import torch

    from mha import layouts

    torch.manual_seed(0)
    attention = torch.nn.MultiheadAttention(E, heads, batch_first=True)
    block = layouts.convert(attention.state_dict(), "torch", "bert")
    state = {f"encoder.layer.0.attention.{k}": t for k, t in block.items()}
    state["encoder.layer.0.attention.output.LayerNorm.weight"] = torch.ones(E)  # not attention: kept
    state["embeddings.word_embeddings.weight"] = torch.randn(10, E)
    return attention, state


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_convert_bert_block_to_gpt2_keeps_other_keys_and_outputs(tmp_path, suffix, capsys):
    import torch
    from safetensors.torch import save_file

    from mha import layouts

    attention, state = _bert_checkpoint(tmp_path)
    source = tmp_path / f"bert{suffix}"
    save_file(state, str(source)) if suffix == ".safetensors" else torch.save(state, source)
    target = tmp_path / "out" / f"gpt2{suffix}"
    prefix = "encoder.layer.0.attention."
    assert cli.main(["convert", str(source), str(target), "--from", "bert", "--to", "gpt2",
                     "--prefix", prefix, "--out-prefix", "h.0.attn."]) == 0
    assert "c_attn.weight" in capsys.readouterr().out
    from mha.tools.convert import load_state

    written, metadata = load_state(target)
    if suffix == ".safetensors":
        assert metadata == {"format": "pt"}
    assert target.stat().st_mode & 0o777 == 0o666 & ~_umask()
    assert set(written) == {"h.0.attn.c_attn.weight", "h.0.attn.c_attn.bias", "h.0.attn.c_proj.weight",
                            "h.0.attn.c_proj.bias", f"{prefix}output.LayerNorm.weight",
                            "embeddings.word_embeddings.weight"}
    block = {k[len("h.0.attn."):]: t for k, t in written.items() if k.startswith("h.0.attn.")}
    module = layouts.general_module(block, "gpt2", 3)
    x = torch.randn(2, 4, 12)
    torch.testing.assert_close(module(x, x, x), attention(x, x, x)[0])


def _umask():
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_convert_per_head_takes_the_head_count_from_the_file(tmp_path, capsys):
    import torch

    import mha
    from mha import layouts
    from mha.tools.convert import load_state

    heads = layouts.per_head(mha.GeneralAttention(8, 8, 8, 2, 2, 8, 4).state_dict(), 4)
    source = tmp_path / "ph.pt"
    torch.save(heads.as_state(), source)
    assert cli.main(["convert", str(source), str(tmp_path / "t.pt"), "--from", "per_head", "--to", "torch"]) == 0
    assert set(load_state(tmp_path / "t.pt")[0]) == {"in_proj_weight", "in_proj_bias", "out_proj.weight",
                                                     "out_proj.bias"}
    assert cli.main(["convert", str(source), str(tmp_path / "u.pt"), "--from", "per_head", "--to", "torch",
                     "--num-heads", "2"]) == 2
    assert "4 heads" in capsys.readouterr().err and not (tmp_path / "u.pt").exists()


@pytest.mark.parametrize("name, content", [("bad.pt", b"not a pickle"), ("bad.safetensors", b"\xff" * 16)])
def test_convert_reports_unreadable_files(tmp_path, capsys, name, content):
    source = tmp_path / name
    source.write_bytes(content)
    assert cli.main(["convert", str(source), str(tmp_path / "o.pt"), "--from", "torch", "--to", "bert"]) == 2
    assert "could not read" in capsys.readouterr().err


def test_convert_refuses_missing_keys_and_writes_nothing(tmp_path, capsys):
    import torch

    _, state = _bert_checkpoint(tmp_path)
    del state["encoder.layer.0.attention.self.value.weight"]
    source, target = tmp_path / "bert.pt", tmp_path / "out.pt"
    torch.save(state, source)
    assert cli.main(["convert", str(source), str(target), "--from", "bert", "--to", "torch",
                     "--prefix", "encoder.layer.0.attention."]) == 2
    assert "self.value.weight" in capsys.readouterr().err
    assert not target.exists() and list(tmp_path.iterdir()) == [source]


@pytest.mark.parametrize("args, words", [
    (["--prefix", "nothing."], ["prefix"]),
    (["--to", "per_head"], ["--num-heads"]),
])
def test_convert_errors(tmp_path, capsys, args, words):
    import torch

    _, state = _bert_checkpoint(tmp_path)
    source = tmp_path / "bert.pt"
    torch.save(state, source)
    base = ["convert", str(source), str(tmp_path / "o.pt"), "--from", "bert", "--to", "torch",
            "--prefix", "encoder.layer.0.attention."]
    assert cli.main(base + args) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words)
    assert not (tmp_path / "o.pt").exists()


def test_convert_missing_input_file(tmp_path, capsys):
    assert cli.main(["convert", str(tmp_path / "none.pt"), str(tmp_path / "o.pt"), "--from", "torch",
                     "--to", "bert"]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.slow
def test_a_closed_pipe_keeps_verify_failures_and_its_report(tmp_path):
    """The outcome and the JSON report are settled before anything is printed."""
    script = tmp_path / "failing_verify.py"
    report = tmp_path / "deep" / "report.json"
    script.write_text(
        "import sys\n"
        "from mha.cli import main\n"
        "from mha.tools import verify\n"
        "cases = verify.default_grid(1, 0)[:3]\n"
        "verify.default_grid = lambda *args: cases\n"
        "verify.run_grid = lambda cs: (verify.Result(c, failures=['x']) for c in cs)\n"
        f"sys.exit(main(['verify', '--json', {str(report)!r}]))\n")
    ran = subprocess.run(f"set -o pipefail; {sys.executable} {script} | head -c 1", shell=True,
                         executable="/bin/bash", capture_output=True, text=True)
    assert ran.returncode == 1 and "Traceback" not in ran.stderr
    assert json.loads(report.read_text())["summary"]["failed"] == 3
