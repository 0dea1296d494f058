"""Worker of ``mha bench --sections variants``: one efficient variant against exact attention.

    python -m mha.tools.bench_variants NAME T REPEAT   prints {"ms": ..., "peak_mib": ..., "finite": ...}

Each run is a fresh process, so its peak resident set is the variant's own. The inputs are random
(speed does not depend on them); the quality of each variant is measured on real attention, by
mha.tools.bench_quality, and on a trained task, by benchmarks/train_variants.py.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable

import torch

from .. import efficient
from ..kernels import Contract, flash_attention
from ..positions import CAUSAL
from .bench_memory import HEAD_DIM, HEADS, peak_rss_mib


class FlashCausal(torch.nn.Module):
    """Exact causal attention on mha's flash kernel, with the variants' signature."""

    def forward(self, q, k, v, is_causal: bool = False):
        return flash_attention(q, k, v, Contract(band=CAUSAL if is_causal else None))


def _sqrt(T: int) -> int:
    return max(1, int(T ** 0.5))


# name: (variant for length T and head width D, causal); budgets follow each method's paper-style defaults
VARIANTS: dict[str, tuple[Callable[[int, int], torch.nn.Module], bool]] = {
    "exact (sdpa)": (lambda T, D: efficient.Exact(), False),
    "exact causal (sdpa)": (lambda T, D: efficient.Exact(), True),
    "exact causal (flash)": (lambda T, D: FlashCausal(), True),
    "local w=256": (lambda T, D: efficient.Local(256), True),
    "strided c=sqrt(T)": (lambda T, D: efficient.Strided(_sqrt(T)), True),
    "fixed c=sqrt(T)": (lambda T, D: efficient.Fixed(_sqrt(T), max(1, _sqrt(T) // 8)), True),
    "linformer k=256": (lambda T, D: efficient.Linformer(T, 256), False),
    "nystrom m=64": (lambda T, D: efficient.Nystrom(64), False),
    "linear": (lambda T, D: efficient.LinearAttention(), False),
    "linear causal": (lambda T, D: efficient.LinearAttention(), True),
    "performer m=256": (lambda T, D: efficient.Performer(D, 256, generator_seed=0), False),
    "performer m=256 causal": (lambda T, D: efficient.Performer(D, 256, generator_seed=0), True),
}


def variant_case(name: str, T: int, repeat: int) -> dict[str, float]:
    """Best time (ms) of ``repeat`` no-grad calls at B=1, H=8, D=64, peak RSS growth (MiB), and
    whether the output is finite."""
    build, causal = VARIANTS[name]
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, T, HEAD_DIM) for _ in range(3))
    variant = build(T, HEAD_DIM)
    before = peak_rss_mib()
    best = float("inf")
    with torch.no_grad():
        for _ in range(repeat):
            start = time.perf_counter()
            out = variant(q, k, v, is_causal=causal)
            best = min(best, time.perf_counter() - start)
        peak = peak_rss_mib() - before
    return {"ms": best * 1e3, "peak_mib": peak, "finite": bool(out.isfinite().all())}


def main(argv: list[str]) -> None:
    name, T, repeat = argv
    print(json.dumps(variant_case(name, int(T), int(repeat))))


if __name__ == "__main__":
    main(sys.argv[1:])
