"""Scores of the last mutmut run, per core module, with the documented equivalent mutants.

    python scripts/mutation_report.py                 # the score table (markdown)
    python scripts/mutation_report.py --survivors     # every surviving mutant not documented, with its diff
    python scripts/mutation_report.py --survivors mha.kernels.flash   # ... of one module

Reads mutmut's results (mutants/**/*.meta) and the mutated sources beside them, and
scripts/mutation_equivalents.txt: one surviving mutant per line, ``name  # why it is equivalent``
(or ``# [outside] test``: killed by a test the mutation run leaves out for speed, or ``# [import]``:
run at import, where mutmut cannot switch it, or ``# [applied]``: a default argument, which a test
reads through ``inspect`` and mutmut's trampoline hides; both killed when applied with kill_check.py;
all three counted as killed).
A documented name that mutmut no longer generates (the function changed) is reported as stale:
check it again.
"""

from __future__ import annotations

import argparse
import collections
import difflib
import json
import pathlib
import re

from kill_check import mutated_functions  # scripts/ is on the path when run as a script

ROOT = pathlib.Path(__file__).resolve().parent.parent
MUTANTS = ROOT / "mutants" / "src"
EQUIVALENTS = ROOT / "scripts" / "mutation_equivalents.txt"
STATUS = {0: "survived", 1: "killed", 3: "killed", 33: "no tests", 34: "skipped", 36: "timeout", -24: "timeout",
          24: "timeout", 152: "timeout"}


def statuses() -> dict[str, str]:
    found = {}
    for meta in MUTANTS.rglob("*.meta"):
        for name, code in json.loads(meta.read_text())["exit_code_by_key"].items():
            found[name] = ("pending" if code is None else STATUS.get(code, "killed" if code < 0 else f"suspicious (exit {code})"))
            # a negative exit is a signal: the mutant crashed the tests (mutmut shows it as suspicious)
    return found


def equivalents() -> dict[str, str]:
    documented = {}
    for line in EQUIVALENTS.read_text().splitlines():
        name, _, why = line.partition("#")
        if name.strip():
            documented[name.strip()] = why.strip()
    return documented


def module_of(name: str) -> str:
    return name.rsplit(".", 1)[0]


def diff_of(name: str) -> list[str]:
    """The mutant's changed lines against the original function (from mutmut's mutated source)."""
    module, function = name.rsplit(".", 1)
    source, functions = mutated_functions(module)
    original = functions[function.rsplit("__mutmut_", 1)[0] + "__mutmut_orig"]
    lines = source.splitlines()
    before, after = (lines[f.lineno:f.end_lineno] for f in (original, functions[function]))
    return [line for line in difflib.unified_diff(before, after, lineterm="", n=0)
            if line[:1] in "+-" and line[:3] not in ("+++", "---")]


def table(found: dict[str, str], documented: dict[str, str]) -> str:
    counts = collections.defaultdict(collections.Counter)
    for name, state in found.items():
        if state == "survived" and name in documented:
            state = "killed" if documented[name].startswith(("[outside", "[import", "[applied")) else "equivalent"
        counts[module_of(name)][state] += 1
    rows = ["| module | mutants | killed | equivalent | surviving | killed or equivalent |",
            "| --- | --- | --- | --- | --- | --- |"]
    total = collections.Counter()
    for module in sorted(counts):
        c = counts[module]
        total.update(c)
        rows.append(_row(f"`{module}`", c))
    rows.append(_row("**all**", total))
    stale = sorted(set(documented) - set(found))
    if stale:
        rows.append(f"\nstale (documented, no longer generated): {', '.join(stale)}")
    return "\n".join(rows)


def _row(label: str, c: collections.Counter) -> str:
    n = sum(c.values())
    good = c["killed"] + c["timeout"] + c["equivalent"]
    surviving = n - good
    return f"| {label} | {n} | {c['killed'] + c['timeout']} | {c['equivalent']} | {surviving} | {100 * good / n:.1f}% |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--survivors", nargs="?", const="", metavar="MODULE", help="list undocumented survivors")
    args = parser.parse_args()
    found, documented = statuses(), equivalents()
    if args.survivors is None:
        print(table(found, documented))
        return
    for name, state in sorted(found.items()):
        if state != "killed" and state != "timeout" and name not in documented and re.match(re.escape(args.survivors), name):
            print(f"== {name} ({state})")
            print("\n".join("   " + line for line in diff_of(name)))


if __name__ == "__main__":
    main()
