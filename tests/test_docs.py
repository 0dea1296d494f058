"""Every code block of README.md, CHANGELOG.md and docs/*.md is exercised here.

- ```python blocks run, in order, in one namespace per page.
- ```bash / ```sh / ```shell / ```console blocks: every command line is checked by a rule below
  (COMMANDS). Cheap commands run (`mha explain`, `--help`, ...); expensive or environment-changing
  ones (installs, benchmarks, the whole suite, spawned ranks, mutmut) are parsed without running:
  `mha ...` by the CLI's own argparse parser, `python -m module` / `python script.py` by running
  the entry point with argparse stopped right after it has parsed, and the rest by checking what
  they name (files, extras, modules). Each such rule states why it does not run the command.
  A command no rule knows fails the test: add a rule.
- ```text and bare ``` blocks are pictures, formulas and file trees: not code.
- Relative links between the pages point to files and headings that exist.
"""

from __future__ import annotations

import argparse
import re
import runpy
import shlex
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import tomllib
import torch

ROOT = Path(__file__).resolve().parent.parent
PAGES = [p for p in (ROOT / "README.md", ROOT / "CHANGELOG.md") if p.exists()] + sorted((ROOT / "docs").glob("*.md"))
SHELL = {"bash", "sh", "shell", "console"}
NOT_CODE = {"", "text"}  # pictures, formulas, file trees
FENCE = re.compile(r"^```(\S*)\s*$")


def blocks(path: Path) -> list[tuple[str, str, int]]:
    """(language, body, line of the opening fence) of every fenced block of a page."""
    found, open_at, language, body = [], None, "", []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        fence = FENCE.match(line)
        if open_at is None and fence:
            open_at, language, body = number, fence.group(1), []
        elif open_at is not None and line.rstrip() == "```":
            found.append((language, "\n".join(body) + "\n", open_at))
            open_at = None
        elif open_at is not None:
            body.append(line)
    assert open_at is None, f"{path.name}: the block opened at line {open_at} is never closed"
    return found


def _page_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


# -- python blocks ----------------------------------------------------------------------------------

PYTHON_PAGES = [p for p in PAGES if any(language == "python" for language, _, _ in blocks(p))]
NEEDS = {"# requires: cuda": (torch.cuda.is_available, "needs a CUDA device")}  # a block's first line may say


def test_every_block_has_a_known_language():
    for path in PAGES:
        for language, _, line in blocks(path):
            assert language in {"python"} | SHELL | NOT_CODE, (
                f"{_page_id(path)}:{line}: a ```{language} block: run it here (add a rule) or mark it text")


@pytest.mark.parametrize("path", PYTHON_PAGES, ids=_page_id)
def test_python_blocks_run(path):
    namespace = {"__name__": f"docs:{path.name}"}
    for language, code, line in blocks(path):
        if language != "python":
            continue
        first = code.splitlines()[0].strip() if code.strip() else ""
        if first in NEEDS and not NEEDS[first][0]():
            pytest.skip(f"{_page_id(path)}:{line}: {NEEDS[first][1]}")
        try:
            exec(compile(code, f"{_page_id(path)}:{line}", "exec"), namespace)
        except Exception as error:  # say which block broke
            raise AssertionError(f"{_page_id(path)}: the code block at line {line} failed: {error!r}") from error


def test_readme_has_three_runnable_examples():
    assert sum(language == "python" for language, _, _ in blocks(ROOT / "README.md")) >= 3


def test_changelog_has_no_code():
    path = ROOT / "CHANGELOG.md"
    if path.exists():
        assert [language for language, _, _ in blocks(path)] == []


# -- shell blocks -----------------------------------------------------------------------------------


def command_lines(path: Path) -> list[tuple[str, int]]:
    """(logical command line, its line number) in the shell blocks of a page: continuations joined,
    console output left out (there only `$ ` lines are commands)."""
    lines = []
    for language, code, start in blocks(path):
        if language not in SHELL:
            continue
        pending, first = "", None
        for offset, raw in enumerate(code.splitlines(), 1):
            if language == "console" and not pending:
                if not raw.startswith("$ "):
                    continue
                raw = raw[2:]
            first = first or start + offset
            if raw.rstrip().endswith("\\"):
                pending += raw.rstrip()[:-1] + " "
                continue
            text = (pending + raw).strip()
            if text and not text.startswith("#"):
                lines.append((text, first))
            pending, first = "", None
    return lines


def simple_commands(line: str) -> list[list[str]]:
    """The simple commands of a line (split at &&, ||, ;, |), comments dropped."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands, current = [], []
    for token in lexer:
        if token in {"&&", "||", ";", "|"}:
            commands.append(current)
            current = []
        else:
            assert token not in {"&", "(", ")", "<", ">", ">>"}, f"no rule for the shell syntax {token!r} in {line!r}"
            current.append(token)
    return [c for c in commands + [current] if c]


SHELL_LINES = [(path, text, number) for path in PAGES for text, number in command_lines(path)]


@pytest.mark.parametrize("path, line, number", SHELL_LINES,
                         ids=[f"{_page_id(p)}:{n}" for p, _, n in SHELL_LINES])
def test_shell_commands(path, line, number, tmp_path, monkeypatch, capsys):
    for argv in simple_commands(line):
        env = []
        while argv and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", argv[0]):
            env.append(argv.pop(0).split("=", 1)[0])
        for name in env:
            if name.startswith("MHA_"):  # an environment variable of ours: something must read it
                assert any(name in p.read_text() for p in (ROOT / "src" / "mha").rglob("*") if p.is_file()
                           and p.suffix in {".py", ".cpp"}), f"{name} is read nowhere in src/mha"
        rule = COMMANDS.get(argv[0])
        assert rule is not None, f"{_page_id(path)}:{number}: no rule for {argv[0]!r}; add one to COMMANDS"
        rule(argv[1:], tmp_path=tmp_path, monkeypatch=monkeypatch, capsys=capsys)


def test_the_ci_reads_the_readme_commands():
    """.ci/run takes the first line of the block after each marker (its own awk, run here)."""
    script = (ROOT / ".ci" / "run").read_text()
    function = re.search(r"^readme_command\(\) \{.*?^\}", script, flags=re.M | re.S)
    assert function, ".ci/run defines readme_command"
    read = {}
    for marker in ("install", "test"):
        result = subprocess.run(["bash", "-c", f"{function.group(0)}\nreadme_command {marker}"], cwd=ROOT,
                                capture_output=True, text=True, check=True)
        read[marker] = result.stdout.strip()
    assert "pip install" in read["install"] and "mha verify" in read["install"], read
    assert read["test"].startswith("python -m pytest"), read
    for command in read.values():  # and they are checked like every other command line
        assert any(command == text for path, text, _ in SHELL_LINES if path.name == "README.md")


# -- the rules --------------------------------------------------------------------------------------


class _Parsed(Exception):
    """Raised right after an entry point's outermost argparse call has returned."""


def _stop_after_parsing(monkeypatch) -> None:
    depth = [0]

    def outermost(original):
        def parse(self, args=None, namespace=None):
            depth[0] += 1
            try:
                result = original(self, args, namespace)
            finally:
                depth[0] -= 1
            if depth[0] == 0:
                raise _Parsed(result)
            return result
        return parse

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", outermost(argparse.ArgumentParser.parse_args))
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args",
                        outermost(argparse.ArgumentParser.parse_known_args))


def _parses(run, argv: list[str], monkeypatch, capsys) -> None:
    """Run an entry point until its arguments are parsed; fail on argparse's error (or if it never parses)."""
    _stop_after_parsing(monkeypatch)
    try:
        run()
    except _Parsed:
        return
    except SystemExit as stop:
        pytest.fail(f"{' '.join(argv)}: its parser refused it (exit {stop.code}): {capsys.readouterr().err}")
    pytest.fail(f"{' '.join(argv)}: finished without parsing arguments with argparse: give it a rule")


# What each command costs, and so whether it runs here.
MHA_CHEAP = {
    "explain": "walks a forward of a 4-wide module: well under a second",
    "plot": "seed 003's sentence, three heads: under a second (a PNG in a temporary folder)",
    "view": "all-MiniLM-L6-v2 on a short text: a few seconds (a page in a temporary folder)",
}
NEEDS_FILES = {"plot": ("--checkpoint",), "view": ("--model", "--compare")}  # run only without the paths they name
MHA_PARSED = {
    "verify": "the parity matrix, and the native kernel's build on a fresh machine (about 30 s); "
              ".ci/run runs it as the install command, and tests/ cover it",
    "bench": "a benchmark: minutes",
    "distributed": "spawns processes over a long sequence: minutes",
    "convert": "needs the checkpoint files it names",
    "tune": "times native against torch (a few seconds) and writes the per-user cache; "
            "tests/kernels/test_tuning.py runs it with a fake timer",
}


def _mha(args, *, tmp_path, monkeypatch, capsys, **_):
    import mha.cli

    helps = {"-h", "--help", "--version"} & set(args)
    if helps or (args and args[0] in MHA_CHEAP and not set(NEEDS_FILES.get(args[0], ())) & set(args)):
        monkeypatch.chdir(tmp_path)  # whatever it writes
        try:
            status = mha.cli.main(args)
        except SystemExit as stop:  # argparse's help and version end so
            assert helps and stop.code == 0, f"mha {' '.join(args)}: exit {stop.code}: {capsys.readouterr().err}"
            return
        assert status == 0, f"mha {' '.join(args)}: exit {status}"
        assert capsys.readouterr().out
        return
    # not run: MHA_PARSED says why (or NEEDS_FILES: the checkpoint folders they name)
    assert args and (args[0] in MHA_PARSED or args[0] in NEEDS_FILES), f"mha {args}: cheap or not? add it to a table"
    _parses(lambda: mha.cli.build_parser().parse_args(args), ["mha", *args], monkeypatch, capsys)


# python -m MODULE: run (cheap) or parsed (why not run)
MODULES = {
    "mha.tools.fuzz": "thousands of random calls in child processes: minutes",
    "mha.tools.distributed_demo": "one rank of a torchrun job",
}
# python SCRIPT: run (cheap) or parsed (why not run)
SCRIPTS_RUN = {
    "benchmarks/study_tables.py": "prints tables from saved results: under a second",
}
SCRIPTS_PARSED = {
    "benchmarks/train_variants.py": "trains models for 40-50 minutes",
    "scripts/mutation_report.py": "reads the results of a mutmut run (mutants/, git-ignored)",
    "scripts/kill_check.py": "runs tests against a mutant in a copy of src",
    "scripts/per_call_ab.py": "times thousands of interleaved calls, or a model's generation: minutes",
}


def _python(args, *, monkeypatch, capsys, tmp_path, **_):
    if args[:1] == ["-m"]:
        module, rest = args[1], args[2:]
        if module == "mha":
            return _mha(rest, monkeypatch=monkeypatch, capsys=capsys, tmp_path=tmp_path)
        if module in SPECIAL_MODULES:
            return SPECIAL_MODULES[module](rest)
        assert module in MODULES, f"python -m {module}: cheap or not? add it to MODULES"
        monkeypatch.setattr(sys, "argv", [module, *rest])

        def run():
            with warnings.catch_warnings():  # runpy: "found in sys.modules ... prior to execution" (imported before)
                warnings.simplefilter("ignore", RuntimeWarning)
                runpy.run_module(module, run_name="__main__", alter_sys=True)
        return _parses(run, ["python -m", module, *rest], monkeypatch, capsys)
    script, rest = args[0], args[1:]
    assert (ROOT / script).is_file(), f"python {script}: no such file"
    monkeypatch.setattr(sys, "argv", [script, *rest])
    monkeypatch.syspath_prepend(str((ROOT / script).parent))  # as python does for a script
    monkeypatch.chdir(ROOT)
    if script in SCRIPTS_RUN:
        runpy.run_path(str(ROOT / script), run_name="__main__")
        assert capsys.readouterr().out
        return
    assert script in SCRIPTS_PARSED, f"python {script}: cheap or not? add it to SCRIPTS_RUN or SCRIPTS_PARSED"
    _parses(lambda: runpy.run_path(str(ROOT / script), run_name="__main__"), ["python", script, *rest],
            monkeypatch, capsys)


def _pip(args, **_):
    """Not run: it changes the environment. What it names must exist: the constraints file, the extras."""
    assert args[:1] == ["install"], args
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    args = args[1:]
    while args:
        option = args.pop(0)
        if option in {"-c", "--constraint", "-r", "--requirement"}:
            assert (ROOT / args.pop(0)).is_file()
        elif option in {"-e", "--editable"}:
            target = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", args.pop(0))
            assert target, "an editable install of this folder"
            for extra in filter(None, (target.group(1) or "").split(",")):
                assert extra in extras, f"no extra {extra!r} in pyproject.toml"
        else:
            assert option in {"-q", "-U", "--upgrade"} or not option.startswith("-"), option


def _pytest(args, **_):
    """Not run: the suite, or a part of it, and this test is in it. The files and tests it names exist."""
    args = list(args)
    while args:
        token = args.pop(0)
        if token in {"-k", "-m", "-p", "-o", "-c", "--durations", "-n"}:
            args.pop(0)
        elif not token.startswith("-"):
            file, _, test = token.partition("::")
            assert (ROOT / file).exists(), f"pytest {token}: no such file"
            if test:
                assert re.search(rf"def {re.escape(test.split('::')[-1].split('[')[0])}\b", (ROOT / file).read_text())


SPECIAL_MODULES = {"pip": _pip, "pytest": _pytest}

BASH_SCRIPTS = {
    ".ci/run": "a fresh virtual environment, the install and the whole suite: minutes",
    "scripts/sanitize.sh": "builds the native kernel with AddressSanitizer, then runs tests on it: minutes",
}


def _bash(args, **_):
    """Not run (BASH_SCRIPTS says why): the script exists and parses; arguments it passes to pytest are checked."""
    script, rest = args[0], args[1:]
    assert script in BASH_SCRIPTS, f"bash {script}: add it to BASH_SCRIPTS"
    subprocess.run(["bash", "-n", str(ROOT / script)], check=True)
    if rest:
        assert 'pytest' in (ROOT / script).read_text() and '"$@"' in (ROOT / script).read_text()
        _pytest(rest)


def _torchrun(args, **kwargs):
    """Not run: it starts processes. Its module's arguments are parsed."""
    while args and args[0] != "-m" and not args[0].endswith(".py"):
        args = args[2:] if "=" not in args[0] and args[0].startswith("--") and len(args) > 1 \
            and not args[1].startswith("-") else args[1:]
    assert args, "torchrun needs -m MODULE or a script"
    _python(args, **kwargs)


def _mutmut(args, **_):
    """Not run: mutation testing takes about 17 minutes. It is configured, and the mutants it names exist."""
    assert "[tool.mutmut]" in (ROOT / "pyproject.toml").read_text()
    assert args and args[0] in {"run", "results", "show", "browse", "apply"}, args
    rest = list(args[1:])
    while rest:
        token = rest.pop(0)
        if token == "--max-children":
            int(rest.pop(0))
        else:
            assert not token.startswith("-"), token
            prefix = token.rstrip("*").split(".x_")[0]  # mha.kernels.sdpa* or mha.kernels.flash.x_backward__mutmut_1
            modules = [".".join(p.relative_to(ROOT / "src").with_suffix("").parts)
                       for p in (ROOT / "src" / "mha").rglob("*.py")]
            assert any(m.startswith(prefix) for m in modules), f"mutmut {token}: no such module"


def _rm(args, **_):
    """Not run: it deletes. Only a git-ignored folder (a tool's scratch space) may be named."""
    ignored = (ROOT / ".gitignore").read_text().split()
    for target in (a for a in args if not a.startswith("-")):
        assert f"{target.rstrip('/')}/" in ignored or target in ignored, f"rm {target}: not a git-ignored path"


COMMANDS = {"mha": _mha, "python": _python, "python3": _python, "pip": _pip, "bash": _bash,
            "torchrun": _torchrun, "mutmut": _mutmut, "rm": _rm}


# -- links ------------------------------------------------------------------------------------------


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", text, flags=re.M)}


@pytest.mark.parametrize("path", PAGES, ids=_page_id)
def test_links_point_to_pages_and_headings_that_exist(path):
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        assert linked.exists(), f"{_page_id(path)}: link to {target}: no such file"
        if anchor and linked.suffix == ".md":
            assert anchor in _anchors(linked), f"{_page_id(path)}: link to {target}: no such heading"


def test_walkthrough_covers_formula_to_kernel():
    text = (ROOT / "docs" / "walkthrough.md").read_text()
    for heading in ("The formula", "The NumPy oracle", "The per-head form", "The batched module", "The flash kernel"):
        assert re.search(rf"^## \d+\. {heading}$", text, flags=re.M), heading
