"""What every command shares: its console and its usage errors."""

from __future__ import annotations

import importlib.util

from rich.console import Console


class UsageError(ValueError):
    """A bad argument: ``mha`` prints ``mha <command>: error: <message>`` and exits with 2 (as
    argparse does), keeping 1 for a result that failed (a verify case, an explain step)."""


class _PipeConsole(Console):
    def on_broken_pipe(self) -> None:  # rich would exit with 1; let mha.cli.main end quietly
        self.quiet = True  # nothing more to print, as rich's own handler does
        raise BrokenPipeError


def require(module: str, *, command: str, extra: str = "cli") -> None:
    """Exit with a message saying what to install when ``module`` (of an extra) is missing."""
    if importlib.util.find_spec(module) is None:
        raise SystemExit(f"mha {command}: needs {module}, which comes with the {extra} extra: "
                         f"pip install 'mha[{extra}]'")


def console() -> Console:
    """A rich console whose closed pipe (``mha explain | head``) ends the command quietly."""
    return _PipeConsole()
