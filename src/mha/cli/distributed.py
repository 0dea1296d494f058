"""Run one attention over a long sequence split among processes of this machine, and check it.

Spawns --nproc ranks joined by torch.distributed (gloo over 127.0.0.1), runs ring or Ulysses
attention once and prints each rank's time, attention CPU time, peak memory growth and scores,
the balance between ranks, and the largest error against one-process flash attention on rows at
the start, middle and end of the sequence. Exits with 1 when that error is above the dtype's
tolerance. (On several machines: torchrun -m mha.tools.distributed_demo with the same options.)
"""

from __future__ import annotations

import argparse

from rich.table import Table

from ..tools import distributed_demo as demo
from . import _common
from ._common import UsageError

TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2, "float64": 1e-10}  # |ours - flash| on the checked rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, default=4, help="ranks (processes) to spawn (default 4)")
    demo.add_arguments(parser)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before every rank is stopped")


def run(args: argparse.Namespace) -> int:
    if args.nproc < 1:
        raise UsageError(f"--nproc must be >= 1, got {args.nproc}")
    try:
        settings = demo.settings_from(args)
    except ValueError as error:
        raise UsageError(str(error)) from None
    reports = demo.spawn_run(settings, args.nproc, timeout=args.timeout)
    console = _common.console()
    if not console.is_terminal:
        console.width = max(console.width, 140)
    table = Table(title=f"{settings.mode} attention on {args.nproc} ranks ({settings.balance}), length "
                        f"{settings.length}{', causal' if settings.causal else ''}, B{settings.batch} H{settings.heads} "
                        f"D{settings.head_dim} {settings.dtype}")
    for column in ("rank", "seconds", "attention CPU s", "peak growth MiB", "scores"):
        table.add_column(column, justify="right")
    for r in reports:
        table.add_row(str(r["rank"]), f"{r['seconds']:.2f}", f"{r['cpu_seconds']:.2f}", f"{r['peak_growth_mib']:.1f}",
                      f"{r['scores']:,}")
    console.print(table)
    s = demo.summary(reports)
    console.print(f"balance, slowest / fastest rank: attention CPU time {s['cpu_balance']:.3f}, scores "
                  f"{s['score_balance']:.3f}")
    if s["check_error"] is None:
        return 0
    passed = s["check_error"] <= TOLERANCE[settings.dtype]
    console.print(f"largest error against one-process flash on {3 * min(settings.check_rows, settings.length)} rows: "
                  f"{s['check_error']:.2e} ({'ok' if passed else 'ABOVE'} the {settings.dtype} tolerance "
                  f"{TOLERANCE[settings.dtype]:.0e})")
    return 0 if passed else 1
