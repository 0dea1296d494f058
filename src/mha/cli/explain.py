"""Walk one forward of torch.nn.MultiheadAttention step by step, checked against torch's own.

Each step prints its line of computation, the tensor's shape and (small) values, and whether it
equals what torch computed at that step. --readable uses small integer inputs and weights (those of
examples/seed000_per_head_from_torch.py), easy to check by hand.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..tools import explain
from . import _common
from ._common import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--embed-dim", type=int, default=4, help="E (default 4)")
    parser.add_argument("--heads", type=int, default=2, help="h (default 2)")
    parser.add_argument("--length", type=int, default=2, help="sequence length L (default 2)")
    parser.add_argument("--batch", type=int, default=0, help="N; 0 = unbatched input (L, E)")
    parser.add_argument("--readable", action="store_true", help="integer inputs 51, 52, ... and weights 1, 2, ...")
    parser.add_argument("--causal", action="store_true", help="with a causal attn_mask")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--format", choices=("rich", "markdown"), default="rich")
    parser.add_argument("--out", type=Path, default=None, help="write the markdown document here")


def run(args: argparse.Namespace) -> int:
    for name in ("embed_dim", "heads", "length"):
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.batch < 0:
        raise UsageError(f"--batch must be >= 0, got {args.batch}")
    if args.embed_dim % args.heads:
        raise UsageError(f"--embed-dim must be divisible by --heads, got {args.embed_dim} and {args.heads}")
    steps = explain.trace(embed_dim=args.embed_dim, num_heads=args.heads, length=args.length, batch=args.batch,
                          readable=args.readable, causal=args.causal, seed=args.seed)
    args.status = 0 if all(step.matches for step in steps) else 1  # decided before printing
    if args.format == "markdown" or args.out:
        text = explain.render_markdown(steps)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(text)
            print(f"wrote {args.out}")
        else:
            print(text)
    else:
        explain.render_rich(steps, _common.console())
    return args.status
