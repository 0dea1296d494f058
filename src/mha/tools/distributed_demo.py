"""One attention over a long sequence, split among ranks: time, memory, balance and a check.

    mha distributed --nproc 4 --length 65536 --mode ring --causal          (spawns the ranks here)
    torchrun --nproc-per-node 4 -m mha.tools.distributed_demo --length 65536 --causal

Each rank makes only its own shards of q, k, v (B, H, T, D) (random, drawn position block by
position block from a seed, so every rank draws the same sequence without holding it), runs
ring_attention or ulysses_attention once without gradients, and reports its wall time, its
attention's CPU time (the work it did: torch runs one thread per rank when the ranks share a
machine), the peak growth of its resident memory from before its inputs were made, and the scores
it computed. Rank 0 then checks query rows at the start, middle and end of the sequence against
flash attention in one process over the whole sequence.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import _checks, positions
from ..distributed import comm
from ..distributed.layout import BALANCES, SequenceLayout
from ..distributed.ring import ring_attention, visible_pairs
from ..distributed.ulysses import ulysses_attention
from ..kernels import Contract, flash_attention
from ..kernels.contract import contract_of
from . import launch

ATTENTION = {"ring": ring_attention, "ulysses": ulysses_attention}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
_BLOCK = 512  # positions drawn per generator seed


@dataclass(frozen=True)
class Settings:
    length: int = 65536
    mode: str = "ring"  # ring | ulysses | single (one process: flash over the whole sequence)
    balance: str = "zigzag"
    causal: bool = False
    batch: int = 1
    heads: int = 8
    kv_heads: int | None = None
    head_dim: int = 64
    dtype: str = "float32"
    check_rows: int = 64  # rows checked at each of three places (0: no check)
    seed: int = 0

    def __post_init__(self):
        _checks.one_of("mode", self.mode, (*ATTENTION, "single"))
        _checks.one_of("balance", self.balance, BALANCES)
        _checks.one_of("dtype", self.dtype, tuple(DTYPES))
        kv = self.heads if self.kv_heads is None else self.kv_heads
        if self.length < 1 or self.heads < 1 or kv < 1 or self.heads % kv:
            raise ValueError(f"length, heads and kv_heads must be positive and kv_heads must divide heads, got "
                             f"length={self.length}, heads={self.heads}, kv_heads={kv}")


def sequence_rows(settings: Settings, name: str, where: torch.Tensor) -> torch.Tensor:
    """q, k or v (``name``) at the positions ``where`` (n,): (B, heads, n, head_dim), the same values
    on every rank; a block of positions is drawn from one seed."""
    heads = settings.heads if name == "q" else (settings.kv_heads or settings.heads)
    out = torch.empty(settings.batch, heads, len(where), settings.head_dim, dtype=DTYPES[settings.dtype])
    block_of = where // _BLOCK
    for block in block_of.unique().tolist():
        picked = (block_of == block).nonzero()[:, 0]
        generator = torch.Generator().manual_seed(settings.seed * 1_000_003 + block * 3 + "qkv".index(name))
        drawn = torch.randn(settings.batch, heads, _BLOCK, settings.head_dim, generator=generator)
        out[:, :, picked] = drawn[:, :, where[picked] - block * _BLOCK].to(out.dtype)
    return out


def shard_inputs(settings: Settings, layout: SequenceLayout):
    """This rank's q, k, v (B, H, T, D), zeros in the padding slots."""
    where = layout.positions()
    real = where < settings.length
    shards = []
    for name in "qkv":
        x = torch.zeros(settings.batch, settings.heads if name == "q" else (settings.kv_heads or settings.heads),
                        layout.local_length, settings.head_dim, dtype=DTYPES[settings.dtype])
        x[:, :, real] = sequence_rows(settings, name, where[real])
        shards.append(x)
    return shards


def run_rank(settings: Settings) -> dict:
    """This rank's report (see the module docstring); rank 0's holds the check."""
    _attend(dataclasses.replace(settings, length=min(settings.length, 256)))  # warm-up: kernels, buffers
    _restart_peak()
    before = _rss_mib("VmRSS")
    wall, cpu = time.perf_counter(), time.thread_time()
    out, layout = _attend(settings)
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    steps = _step_scores(settings, layout)
    report = {"rank": layout.rank, "seconds": wall, "cpu_seconds": cpu, "peak_growth_mib": _rss_mib("VmHWM") - before,
              "scores": sum(steps), "step_scores": steps}
    checked = _checked_rows(settings, layout, out)
    del out
    if comm.initialized() and layout.world_size > 1:
        everyone = [None] * layout.world_size
        dist.all_gather_object(everyone, checked)
        checked = {p: row for part in everyone for p, row in part.items()}
    if layout.rank == 0 and settings.check_rows:
        report["check_error"] = _check(settings, checked)
    return report


def _attend(settings: Settings):
    if settings.mode == "single":
        layout = SequenceLayout(settings.length)
        q, k, v = (sequence_rows(settings, n, torch.arange(settings.length)) for n in "qkv")
        with torch.no_grad():
            return flash_attention(q, k, v, _contract(settings)), layout
    layout = SequenceLayout(settings.length, balance=settings.balance)
    q, k, v = shard_inputs(settings, layout)
    with torch.no_grad():
        out = ATTENTION[settings.mode](q, k, v, layout, is_causal=settings.causal, enable_gqa=k.shape[1] != q.shape[1])
    return out, layout


def _contract(settings: Settings, offset: int = 0) -> Contract:
    return Contract(band=positions.band(settings.causal), offset=offset)


def _step_scores(settings: Settings, layout: SequenceLayout) -> list[int]:
    """The (query, key) scores this rank computes at each step of the ring (per head and sequence;
    Ulysses and one process: a single step)."""
    W, terms = layout.world_size, _terms(settings)
    if settings.mode == "ulysses":  # the whole sequence for 1/W of the heads
        return [sum(visible_pairs(layout, mine, theirs, terms) for mine in range(W) for theirs in range(W)) // W]
    return [visible_pairs(layout, layout.rank, (layout.rank - step) % W, terms) for step in range(W)]


def _terms(settings: Settings) -> Contract:
    return contract_of(band=positions.band(settings.causal))


def check_positions(settings: Settings) -> list[range]:
    """Rows checked: ``check_rows`` at the start, the middle and the end of the sequence."""
    n, length = min(settings.check_rows, settings.length), settings.length
    return [range(start, start + n) for start in sorted({0, (length - n) // 2, length - n})]


def _checked_rows(settings: Settings, layout: SequenceLayout, out: torch.Tensor) -> dict[int, torch.Tensor]:
    """{position: output row (B, H, Dv)} of this rank's slots among the checked positions."""
    wanted = {p for rows in check_positions(settings) for p in rows} if settings.check_rows else set()
    where = layout.positions().tolist()
    return {p: out[:, :, slot].clone() for slot, p in enumerate(where) if p in wanted}


def _check(settings: Settings, checked: dict[int, torch.Tensor]) -> float:
    """Largest |ours - flash| over the checked rows (flash over the whole keys, in one process)."""
    everything = torch.arange(settings.length)
    k, v = sequence_rows(settings, "k", everything), sequence_rows(settings, "v", everything)
    error = 0.0
    for rows in check_positions(settings):
        q = sequence_rows(settings, "q", torch.arange(rows.start, rows.stop))
        with torch.no_grad():
            expected = flash_attention(q, k, v, _contract(settings, offset=rows.start))  # query i at i + start
        ours = torch.stack([checked[p] for p in rows], dim=2)  # (B, H, n, Dv)
        error = max(error, (ours.float() - expected.float()).abs().max().item())
    return error


def _restart_peak() -> None:
    """Make the peak resident size (VmHWM) restart from the current one (Linux)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _rss_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 1024


def summary(reports: list[dict]) -> dict:
    """Balance across ranks (slowest / fastest attention CPU time, and of the scores computed),
    the largest peak and the check."""
    cpu = [r["cpu_seconds"] for r in reports]
    scores = [r["scores"] for r in reports]
    return {"cpu_balance": max(cpu) / min(cpu), "score_balance": max(scores) / max(min(scores), 1),
            "seconds": max(r["seconds"] for r in reports), "peak_growth_mib": max(r["peak_growth_mib"] for r in reports),
            "check_error": reports[0].get("check_error")}


def spawn_run(settings: Settings, nprocs: int, *, timeout: float = 600.0) -> list[dict]:
    """run_rank on ``nprocs`` processes of this machine (fresh processes: their peaks are their own)."""
    return launch.spawn(run_rank, nprocs, settings, timeout=timeout, env={"MALLOC_MMAP_THRESHOLD_": "65536"})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The settings as options (``mha distributed`` and this module's torchrun entry share them)."""
    defaults = Settings()
    parser.add_argument("--length", type=int, default=defaults.length, help="tokens in the sequence")
    parser.add_argument("--mode", choices=tuple(ATTENTION), default=defaults.mode)
    parser.add_argument("--balance", choices=BALANCES, default=defaults.balance)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--batch", type=int, default=defaults.batch)
    parser.add_argument("--heads", type=int, default=defaults.heads)
    parser.add_argument("--kv-heads", type=int, default=None, help="key/value heads (GQA); default: --heads")
    parser.add_argument("--head-dim", type=int, default=defaults.head_dim)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=defaults.dtype)
    parser.add_argument("--check-rows", type=int, default=defaults.check_rows,
                        help="rows checked against one-process flash at the start, middle and end (0: none)")
    parser.add_argument("--seed", type=int, default=defaults.seed)


def settings_from(args: argparse.Namespace) -> Settings:
    return Settings(length=args.length, mode=args.mode, balance=args.balance, causal=args.causal, batch=args.batch,
                    heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=args.dtype,
                    check_rows=args.check_rows, seed=args.seed)


def format_reports(settings: Settings, reports: list[dict]) -> str:
    """Plain text: a line per rank and the summary."""
    lines = [f"{settings.mode} attention, {len(reports)} ranks, balance {settings.balance}, length {settings.length}, "
             f"causal {settings.causal}, B{settings.batch} H{settings.heads} D{settings.head_dim} {settings.dtype}",
             "rank  seconds  attention CPU s  peak growth MiB  scores"]
    for r in reports:
        lines.append(f"{r['rank']:>4}  {r['seconds']:7.2f}  {r['cpu_seconds']:15.2f}  {r['peak_growth_mib']:15.1f}  "
                     f"{r['scores']:,}")
    s = summary(reports)
    lines.append(f"balance (slowest / fastest CPU time): {s['cpu_balance']:.3f}; of the scores: {s['score_balance']:.3f}")
    if s["check_error"] is not None:
        lines.append(f"largest error against one-process flash over {3 * settings.check_rows} rows: {s['check_error']:.2e}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """The torchrun entry: every rank runs this with torchrun's environment."""
    parser = argparse.ArgumentParser(prog="python -m mha.tools.distributed_demo", description=__doc__.split("\n")[0])
    add_arguments(parser)
    settings = settings_from(parser.parse_args(argv))
    dist.init_process_group(launch.backend_for("cpu"))
    try:
        report = run_rank(settings)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, report)
        if dist.get_rank() == 0:
            print(format_reports(settings, everyone), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    if os.environ.get("MASTER_ADDR") in ("127.0.0.1", "localhost"):  # torchrun --standalone: one machine
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    main()
