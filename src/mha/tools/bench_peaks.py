"""``mha bench --sections peaks``: this CPU's limits, measured in the run whose figures they judge.

A kernel's GFLOP/s or GB/s mean little alone; beside what the machine can do at all they say how
much is left. Each limit is measured now, at the thread count in use (every figure per machine, not
per core):

    fp32 FMA        independent chains of the native build's fused multiply-adds on every thread
                    (mha.kernels.native: fma_peak_work), GFLOP/s: the ceiling of float32 products
    bf16 dot        the same with bfloat16 dot products (vdpbf16ps), where the CPU and build have
                    them (AVX512-BF16); else absent
    AMX tiles       independent chains of tdpbf16ps on every thread (amx_tile_peak_work), operands in
                    the tile registers: the tiles' nominal rate, where the CPU has AMX and the native
                    kernel's products run on it (native.set_amx); the ceiling of bfloat16 products
    AMX bf16 matmul torch's 4096^3 bfloat16 matmul (oneDNN runs it on AMX tiles), where the CPU has
                    AMX: what a large product achieves with its data to move (beside, not judged by)
    read            bench_native.read_call over 512 MiB (past every cache: torch's int64 sum, one stream
                    a thread), GB/s: what decoding is judged against

The native rows print their fraction of the limit of their dtype (``limit_of``): float32 products
against the FMA peak; bfloat16 against the AMX tiles where present, else the bf16 dot peak, else the FMA peak
(a CPU without bf16 instructions widens to float32 and multiplies there); decoding against the read
rate.
"""

from __future__ import annotations

import functools
import time

import torch

from ..kernels import native, tuning
from .bench_native import matmul_gflops, read_gbytes_per_second

__all__ = ["LIMITS", "current", "limit_of", "limits"]

LIMITS = ("fp32 FMA GFLOP/s", "bf16 dot GFLOP/s", "AMX tiles GFLOP/s", "AMX bf16 matmul GFLOP/s", "read GB/s")


@functools.cache
def limits(threads: int | None = None) -> dict[str, float | None]:
    """{name in LIMITS: the figure, or None where this CPU or build lacks it}, measured once per
    thread count in a process (``threads``: the current count, the cache's key)."""
    kernel = native._kernel() if native.native_available() else None
    flags = tuning.cpu()["flags"]
    return {"fp32 FMA GFLOP/s": _chains(kernel.fma_peak_work) if kernel else None,
            "bf16 dot GFLOP/s": _chains(kernel.bf16_dot_peak_work) if kernel else None,
            "AMX tiles GFLOP/s": _chains(kernel.amx_tile_peak_work) if kernel else None,
            "AMX bf16 matmul GFLOP/s": matmul_gflops(torch.bfloat16, 4096) if "amx_bf16" in flags else None,
            "read GB/s": read_gbytes_per_second(mib=512)}


def current() -> dict[str, float | None]:
    """limits() at the thread count in use."""
    return limits(torch.get_num_threads())


def limit_of(dtype: str, measured: dict[str, float | None]) -> tuple[str, float] | None:
    """(name, GFLOP/s) of the limit a ``dtype`` ("fp32" or "bf16") forward is judged against."""
    order = ("fp32 FMA GFLOP/s",) if dtype == "fp32" else ("AMX tiles GFLOP/s", "bf16 dot GFLOP/s", "fp32 FMA GFLOP/s")
    return next(((name, measured[name]) for name in order if measured.get(name)), None)


def _chains(work, *, seconds: float = 0.1, repeat: int = 5) -> float | None:
    """GFLOP/s of a native chain function (work(iterations) -> flops, -1 where the build lacks the
    instruction): its iterations set to last about ``seconds``, the best of ``repeat`` calls."""
    if work(1) < 0:
        return None
    iterations, elapsed = 1 << 10, 0.0
    while elapsed < seconds / 4:  # grow until a call lasts long enough to time
        iterations *= 4
        elapsed, _ = _timed(work, iterations)
    iterations = max(1, int(iterations * seconds / elapsed))
    best = min(_timed(work, iterations) for _ in range(repeat))
    return best[1] / best[0] / 1e9


def _timed(work, iterations: int) -> tuple[float, float]:
    start = time.perf_counter()
    flops = work(iterations)
    return time.perf_counter() - start, flops
