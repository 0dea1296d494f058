"""Does a test kill a mutmut mutant?  Checks one mutant against chosen tests, quickly.

    python scripts/kill_check.py 'mha.kernels.flash.x__backward__mutmut_129' tests/kernels/test_flash.py -k broadcast

Applies the mutant (from the last ``mutmut run``, in mutants/) to a private copy of src/, never to
src/ itself, runs pytest on the given tests with that copy first on the path, and prints KILLED
(the tests fail) or SURVIVED. With --check-clean it first runs the same tests on the real code,
which must pass (else BROKEN). Use it while writing a test for a survivor; the scores come from
a full ``mutmut run`` (see docs/testing.md).
"""

from __future__ import annotations

import argparse
import ast
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import textwrap

ROOT = pathlib.Path(__file__).resolve().parent.parent


def mutated_functions(module: str) -> tuple[str, dict[str, ast.FunctionDef]]:
    """mutmut's rewrite of a module (mutants/src/...): its text, and every function in it by name
    (``x_band__mutmut_3``, ``x_band__mutmut_orig``, ``xǁKVCacheǁcrop__mutmut_13``, ...)."""
    text = (ROOT / "mutants" / "src" / pathlib.Path(*module.split("."))).with_suffix(".py").read_text()
    return text, {n.name: n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.FunctionDef)}


def mutated_source(name: str) -> tuple[pathlib.Path, str]:
    """(the module's path under src/, its source with the mutant's function in place of the original)."""
    module, function = name.rsplit(".", 1)  # mha._cache, xǁKVCacheǁcrop__mutmut_13 or x_band__mutmut_3
    relative = pathlib.Path(*module.split(".")).with_suffix(".py")
    mutants, functions = mutated_functions(module)
    node = functions[function]
    base = function.rsplit("__mutmut_", 1)[0]
    owner, method = base.split("ǁ")[1:] if "ǁ" in base else (None, base[2:])
    body = textwrap.dedent(ast.get_source_segment(mutants, node, padded=True)).replace(f"def {function}(", f"def {method}(", 1)
    source = (ROOT / "src" / relative).read_text()
    tree = ast.parse(source)
    scope = tree.body if owner is None else next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == owner).body
    target = next(n for n in scope if isinstance(n, ast.FunctionDef) and n.name == method)
    lines = source.splitlines(keepends=True)
    replaced = textwrap.indent(body, " " * target.col_offset).rstrip("\n") + "\n"
    return relative, "".join(lines[:target.lineno - 1]) + replaced + "".join(lines[target.end_lineno:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mutant")
    parser.add_argument("--check-clean", action="store_true", help="first check that the tests pass on the real code")
    args, pytest_args = parser.parse_known_args()
    relative, patched = mutated_source(args.mutant)
    with tempfile.TemporaryDirectory(prefix="kill-check-") as tmp:
        copy = pathlib.Path(tmp) / "src"
        shutil.copytree(ROOT / "src", copy)
        env = dict(os.environ, OMP_NUM_THREADS="1", HYPOTHESIS_PROFILE="mutation", PYTHONPATH=str(copy))
        command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *(pytest_args or ["tests/"])]
        if args.check_clean and subprocess.run(command, cwd=ROOT, env=env, capture_output=True).returncode:
            print("BROKEN: the tests fail on the real code")
            return 2
        (copy / relative).write_text(patched)
        killed = subprocess.run(command, cwd=ROOT, env=env, capture_output=True).returncode != 0
    print("KILLED" if killed else "SURVIVED", args.mutant)
    return 0


if __name__ == "__main__":
    sys.exit(main())
