"""Run the parity matrix of mha.nn.MultiheadAttention against torch and the NumPy oracle.

Every case runs in float64 and float32 and compares the output, the returned weights and the
gradients (inputs and every parameter) with the float64 oracle. Pass: float64 error <= 1e-10;
float32 error <= 2x torch's own float32 error + 1e-6 x max(1, max |oracle value|). Exit status 1
if any case fails.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from rich.progress import Progress
from rich.table import Table

from ..tools import verify
from . import _common
from ._common import UsageError

QUICK_PER_GROUP = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_PER_GROUP} cases per group instead of the full grid")
    parser.add_argument("--per-group", type=int, default=14, metavar="N",
                        help=f"cases per configuration group (default 14; {len(verify.GROUPS)} groups, the native "
                             "backend's where its kernel builds)")
    parser.add_argument("--seed", type=int, default=0, help="grid seed (default 0)")
    parser.add_argument("--json", metavar="PATH", help="also write every case's errors as JSON")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")


def run(args: argparse.Namespace) -> int:
    if args.per_group <= 0:
        raise UsageError(f"--per-group must be positive, got {args.per_group}")
    if args.threads is not None:
        if args.threads <= 0:
            raise UsageError(f"--threads must be positive, got {args.threads}")
        torch.set_num_threads(args.threads)
    console = _common.console()
    if not console.is_terminal:
        console.width = max(console.width, 160)  # keep the table whole in logs and CI
    native_line = native_status()  # printed with the results: nothing is printed before the outcome is settled
    dispatch_line = dispatch_status() if "native backend group runs" in native_line else None
    cases = verify.default_grid(QUICK_PER_GROUP if args.quick else args.per_group, args.seed)
    results = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("verifying", total=len(cases))
        for result in verify.run_grid(cases):
            results.append(result)
            progress.advance(task)
    failures = [r for r in results if not r.passed]
    args.status = 1 if failures else 0  # decided before printing: a closed pipe keeps it (mha.cli.main)
    if args.json:
        verify.write_report(args.json, results)
    console.print(native_line)
    if dispatch_line:
        console.print(dispatch_line)
    console.print(summary_table(results))
    for r in failures[:20]:
        console.print(f"[red]FAIL[/] {r.case.group}: {r.case.describe()}\n      " + "; ".join(r.failures))
    verdict = "[green]all passed[/]" if not failures else f"[red]{len(failures)} failed[/]"
    console.print(f"{len(results)} configurations, {verdict} (torch {torch.__version__})")
    return args.status


def native_status() -> str:
    """A line on the native kernel: its build and whether it was compiled just now (the first use
    compiles it; it is then cached for this user), or why it is not built here."""
    from ..kernels import native
    start = time.perf_counter()
    available = native.native_available()
    seconds = time.perf_counter() - start
    if not available:
        return (f"native kernel: not built here ({native.variant() or 'MHA_NATIVE=off'}; the mha.dispatch log says "
                "why): the native group is left out, every call runs on the other backends")
    compiled = f", compiled now in {seconds:.0f} s" if seconds > 2 else ""
    return f"native kernel: {native.variant()} build ready{compiled}; the native backend group runs"


def dispatch_status() -> str:
    """Measure where native beats torch on this machine, unless it is stored or MHA_TUNE=off (the
    table backend="auto" reads: mha.kernels.tuning), and say what auto will do."""
    from ..kernels import tuning
    table = tuning.stored()
    if table is None and tuning.switched_off():
        return f"dispatch: not measured (MHA_TUNE=off); auto uses the defaults of this CPU kind ({tuning.cpu()['kind']})"
    if table is None:
        table = tuning.tune()
        where = "measured now"
    else:
        where = f"measured {table['measured']}"
    from .tune import describe
    found = "; ".join(f"{dtype}: prefill {describe('prefill_work', c['prefill_work'])}, decoding "
                      f"{describe('decode_keys', c['decode_keys'])} (plain calls without gradients: prefill "
                      f"{describe('prefill_work', c['plain_prefill_work'])}, decoding "
                      f"{describe('decode_keys', c['plain_decode_keys'])})" for dtype, c in table["crossovers"].items())
    why = tuning.unsure_because(table)
    sure = "" if why is None else f" (not sure: {why}; measured again by a later process, up to {tuning.CHECKS} times)"
    return f"dispatch ({where}; mha tune --show): auto picks native for {found}{sure}"


def summary_table(results: list[verify.Result]) -> Table:
    columns = [f"{tag}/{q}" for tag in ("fp64", "fp32") for q in verify.QUANTITIES]
    table = Table(title="mha.nn.MultiheadAttention vs the float64 oracle (max abs error)")
    table.add_column("group", no_wrap=True, max_width=26)
    table.add_column("result", no_wrap=True, min_width=6)  # second, so an 80-column terminal keeps it
    table.add_column("cases", justify="right", min_width=5)
    short = {"output": "out", "weights": "weights", "grads": "grads"}
    for c in columns:
        tag, quantity = c.split("/")
        table.add_column(f"{tag} {short[quantity]}", justify="right", no_wrap=True, min_width=7)
    table.add_column("torch fp32 out", justify="right", style="dim", no_wrap=True, min_width=7)
    by_group = defaultdict(list)
    for r in results:
        by_group[r.case.group].append(r)
    for group, rs in by_group.items():
        cells = [_max_cell(rs, c) for c in columns]
        failed = sum(not r.passed for r in rs)
        verdict = "[green]pass[/]" if not failed else f"[red]{failed} fail[/]"
        table.add_row(group, verdict, str(len(rs)), *cells, _max_cell(rs, "torch-fp32/output"))
    table.add_row("all", "[green]pass[/]" if all(r.passed for r in results) else "[red]fail[/]", str(len(results)),
                  *(_max_cell(results, c) for c in columns), _max_cell(results, "torch-fp32/output"), style="bold")
    return table


def _max_cell(results, key: str) -> str:
    values = [r.errors[key] for r in results if key in r.errors]
    return f"{max(values):.1e}" if values else "-"
