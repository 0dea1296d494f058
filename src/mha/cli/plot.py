"""Draw attention maps: per-head heatmaps and the head average, as a PNG.

Without --checkpoint: the sentence "Life is short, eat dessert first" through three heads.
With --checkpoint DIR (config.json, model.safetensors, vocab.txt of a BERT-family model): the
attention of --text at --layer, heads --heads (default all), run on mha's own layers.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..tools import plot
from . import _common


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", type=Path, default=None, help="a BERT-family checkpoint directory")
    parser.add_argument("--text", default=None,
                        help="the sentence to run through --checkpoint (default: 'The quick brown fox jumps over the "
                             "lazy dog.'); without a checkpoint the example sentence is drawn and --text is refused")
    parser.add_argument("--layer", type=int, default=0, help="which layer (default 0)")
    parser.add_argument("--heads", type=int, nargs="+", default=None, help="which heads (default all)")
    parser.add_argument("--out", type=Path, default=Path("attention.png"))


def run(args: argparse.Namespace) -> int:
    _common.require("matplotlib", command="plot")
    if args.checkpoint is not None:
        _common.require("safetensors", command="plot")
    try:
        if args.checkpoint is None:
            if args.text is not None:
                raise ValueError("--text needs --checkpoint (a model to run it through); without one the example "
                                 "sentence 'Life is short, eat dessert first' is drawn")
            weights, tokens = plot.sentence_example()
            title = "'Life is short, eat dessert first', 3 heads (d_k=24, d_v=28)"
        else:
            from ..tools.bert import attention_maps

            text = "The quick brown fox jumps over the lazy dog." if args.text is None else args.text
            tokens, maps, _ = attention_maps(args.checkpoint, text)
            if not 0 <= args.layer < len(maps):
                raise ValueError(f"--layer {args.layer} does not exist: the model has layers 0..{len(maps) - 1}")
            weights = maps[args.layer]
            title = f"{args.checkpoint.name}, layer {args.layer}"
        figure = plot.attention_figure(weights, tokens, tokens, title=title, heads=args.heads)
    except (ValueError, OSError) as error:
        print(f"mha plot: error: {error}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0
