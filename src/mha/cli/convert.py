"""Convert attention weights between layouts in a .pt or .safetensors file.

The attention block under --prefix is read in the --from layout and written in the --to layout
(under --out-prefix, by default the same prefix); every other key is copied unchanged. Nothing is
written when a key is missing or mis-shaped. Layouts: see mha.layouts.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from rich.table import Table

from .. import layouts
from ..tools import convert
from . import _common


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", type=Path, help="a .pt/.pth/.bin state_dict or a .safetensors file")
    parser.add_argument("output", type=Path, help="where to write (.safetensors or a torch file)")
    parser.add_argument("--from", dest="source", required=True, choices=sorted(layouts.LAYOUTS))
    parser.add_argument("--to", dest="target", required=True, choices=sorted(layouts.LAYOUTS))
    parser.add_argument("--num-heads", type=int, default=None,
                        help="number of heads (needed by the per_head layout)")
    parser.add_argument("--prefix", default="", help="key prefix of the attention block, e.g. "
                        "'bert.encoder.layer.0.attention.'")
    parser.add_argument("--out-prefix", default=None, help="prefix of the written block (default: --prefix)")


def run(args: argparse.Namespace) -> int:
    if any(path.suffix.lower() == ".safetensors" for path in (args.input, args.output)):
        _common.require("safetensors", command="convert")
    console = _common.console()
    try:
        written = convert.convert_file(args.input, args.output, source=args.source, target=args.target,
                                         num_heads=args.num_heads, prefix=args.prefix, out_prefix=args.out_prefix)
    except (ValueError, TypeError, OSError) as error:
        message = re.sub(r"\bnum_heads\b", "--num-heads", str(error))  # the library's argument is this command's flag
        print(f"mha convert: error: {message}", file=sys.stderr)
        return 2
    table = Table(title=f"{args.input} ({args.source}) -> {args.output} ({args.target})")
    table.add_column("key")
    table.add_column("shape", justify="right")
    for key, shape in written.items():
        table.add_row(key, str(shape))
    console.print(table)
    return 0
