"""The ``mha`` command: ``mha verify``, ``mha convert``, ``mha bench``, ``mha explain``, ``mha plot``."""

from __future__ import annotations

import argparse

from . import bench, convert, explain, plot, verify

COMMANDS = {"verify": verify, "convert": convert, "bench": bench, "explain": explain, "plot": plot}  # each module has add_arguments and run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mha", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, module in COMMANDS.items():
        module.add_arguments(commands.add_parser(name, help=module.__doc__.splitlines()[0],
                                                 description=module.__doc__))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return COMMANDS[args.command].run(args)
