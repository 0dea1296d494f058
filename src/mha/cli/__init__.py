"""The ``mha`` command: ``mha verify`` (more subcommands join as they are built)."""

from __future__ import annotations

import argparse

from . import verify


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mha", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    verify.add_arguments(commands.add_parser("verify", help=verify.__doc__.splitlines()[0],
                                             description=verify.__doc__))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    commands = {"verify": verify.run}
    return commands[args.command](args)

