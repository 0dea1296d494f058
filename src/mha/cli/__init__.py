"""The ``mha`` command: ``mha verify``, ``mha convert``, ``mha bench``, ``mha explain``, ``mha plot``,
``mha view``, ``mha distributed``, ``mha tune``."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from .._version import __version__

if importlib.util.find_spec("rich") is None:  # every command prints with rich, a cli extra (import mha needs none)
    raise SystemExit("mha: the command needs rich, which comes with the cli extra: pip install 'mha[cli]'")

from . import bench, convert, distributed, explain, plot, tune, verify, view  # noqa: E402  (after the check above)
from ._common import UsageError  # noqa: E402

# each command module has add_arguments and run, and calls the mha.tools module of its name
COMMANDS = {"verify": verify, "convert": convert, "bench": bench, "explain": explain, "plot": plot,
            "view": view, "distributed": distributed, "tune": tune}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mha", description=_plain(__doc__))
    parser.add_argument("--version", action="version", version=f"mha {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, module in COMMANDS.items():
        text = _plain(module.__doc__)
        module.add_arguments(commands.add_parser(name, help=text.splitlines()[0], description=text))
    return parser


def _plain(doc: str) -> str:
    """A module's docstring as --help prints it: no reStructuredText literals (``mha verify``)."""
    return doc.replace("``", "")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command].run(args)
    except UsageError as error:
        print(f"mha {args.command}: error: {error}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `mha explain | head`: the reader left; end quietly, as cat does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at interpreter exit
        return getattr(args, "status", 0)  # the outcome a command decided before printing
