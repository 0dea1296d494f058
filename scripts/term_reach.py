"""How far a name reaches into src/: the functions whose text holds it, and their files.

    python scripts/term_reach.py logit_scale sinks

What docs/architecture.md's "How to add a score term" counts: a term that takes few places is
cheap to add and to check. A function counts once per name it holds, nested ones too (a method
and the class's other methods count apart; a closure counts beside its function).
"""

from __future__ import annotations

import ast
import pathlib
import sys

SRC = pathlib.Path(__file__).resolve().parent.parent / "src" / "mha"


def reach(name: str) -> tuple[list[str], set[str]]:
    """(every "file:function" whose source holds ``name``, their files)."""
    functions, files = [], set()
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        if name not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and name in ast.get_source_segment(text, node):
                functions.append(f"{path.relative_to(SRC.parent)}:{node.name}")
                files.add(str(path.relative_to(SRC.parent)))
    return functions, files


def main() -> int:
    for name in sys.argv[1:] or ["logit_scale", "sinks"]:
        functions, files = reach(name)
        print(f"{name}: {len(functions)} functions in {len(files)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
