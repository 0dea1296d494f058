"""Measure where mha's compiled kernel beats torch's on this machine; backend="auto" follows it.

Times the native kernel against torch's SDPA on a small grid (prefill lengths and decoding steps,
float32 and bfloat16) and stores the crossovers in the per-user cache that auto reads
(mha.kernels.tuning). --show prints the stored table and the CPU without measuring.
"""

from __future__ import annotations

import argparse
import math

from rich.table import Table

from ..kernels import native, tuning
from . import _common
from ._common import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--show", action="store_true", help="print the stored table, measure nothing")


def run(args: argparse.Namespace) -> int:
    console = _common.console()
    console.print(describe_cpu())
    if args.show:
        table = tuning.stored()
        if table is None:
            console.print(f"not measured on this machine yet (cache: {tuning.cache_path()}); auto uses "
                          f"{_defaults()} until `mha tune` or its first call measures")
            return 0
    else:
        with console.status("building the native kernel if it is not built yet (about 40 s on 2 cores, once)"):
            built = native.native_available()
        if not built:
            raise UsageError("the native kernel cannot be built or loaded here (no compiler, or MHA_NATIVE=off; "
                             "the debug log 'mha.dispatch' says why): auto runs torch's kernels, nothing to measure")
        with console.status("timing native against torch (a few seconds)"):
            table = tuning.tune()
    console.print(render(table))
    threads = table.get("threads", "?")
    console.print(f"measured {table.get('measured', 'at a time not stored')}, "
                  f"{threads} thread{'' if threads == 1 else 's'}; stored in {tuning.cache_path()}")
    console.print(confidence(table))
    return 0


def confidence(table: dict) -> str:
    """How sure the table is, in a line: the load while it was measured, split points, measurements."""
    load = table.get("load")
    seen = "the load was not readable here" if load is None else f"other processes took {load:.0%} of the CPUs meanwhile"
    checks = f"{table.get('checks', 1)} measurement(s)"
    why = tuning.unsure_because(table)
    split = table.get("split") or []
    rounds = (f"rounds disagreed at {', '.join(split)} (near the margin; the worst round decides)" if split
              else "every round agreed")
    if untimed := table.get("untimed"):
        rounds += (f"; {len(untimed)} full-path points not timed, their fast-path call's ratio kept "
                   "(it lost there: the full path only adds Python's checks)")
    if why is None:
        return f"sure: {seen}, {rounds} ({checks})"
    then = ("a later process measures it again" if table.get("checks", 1) < tuning.CHECKS
            else "kept; `mha tune` on a quiet machine measures it again")
    return f"not sure: {why} ({checks}); {then}"


def describe_cpu() -> str:
    info = tuning.cpu()
    return f"CPU: {info['model']} ({info['kind']}; flags: {' '.join(info['flags']) or 'none of ' + ', '.join(tuning.FLAGS)})"


def render(table: dict) -> Table:
    out = Table(title=f"native time / torch time (below 1: native faster; a win at <= {tuning.MARGIN}); auto picks "
                      "native from the crossover on")
    for column in ("dtype", "call", "size", "ratio", "a win", "crossover"):
        out.add_column(column)
    ratios = table.get("ratios", {})
    for dtype, crossover in table["crossovers"].items():
        for call, field in tuning.RATIO_FIELDS:
            points = ratios.get(dtype, {}).get(call) or {"-": None}  # a hand-written table may hold crossovers alone
            for i, (size, ratio) in enumerate(points.items()):
                shown = ("-", "-", "") if ratio is None else (tuning.size_label(call, size), f"{ratio:.3f}",
                                                               "yes" if ratio <= tuning.MARGIN else "no")
                out.add_row(dtype, call.rsplit(" ", 1)[0], *shown, describe(field, crossover[field]) if i == 0 else "")
    return out


def describe(field: str, where: int | None) -> str:
    """A crossover in words: prefill_work T*T applies to calls with L and S both >= T."""
    if where is None:
        return "never"
    return f"L, S >= {math.isqrt(where)}" if field.endswith("prefill_work") else f"S >= {where}"


def _defaults() -> str:
    kind = tuning.cpu()["kind"]
    if kind in tuning.KNOWN:
        return f"the crossovers measured on its kind ({kind}) when the kernel was written"
    return f"torch's kernel wherever it takes the call (native is not known to win on {kind})"
