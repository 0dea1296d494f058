"""Per-call cost of mha's default path against torch's, measured as interleaved A/B pairs.

    python scripts/per_call_ab.py                 # mha's sdpa, the dispatch's fast path and the native
                                                  # kernel's plain_sdpa alone, each against torch's SDPA
    python scripts/per_call_ab.py --generate 512  # a Llama's prefill and 32-token generation, mha vs sdpa

Where a call takes microseconds and the machine's own speed drifts (a shared machine: the same torch
call took 8.6 us in one run and 19 us in another here), a best-of ratio misleads: this times
``pairs`` pairs of ``n`` calls of A and of B, in alternating order, and prints the median of the
pairs' ratios beside the median times. mha bench measures the targets; this says where the time goes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def pair_ratio(a, b, *, n: int = 50, pairs: int = 200) -> tuple[float, float, float]:
    """(median of A/B over the pairs, A's median us, B's median us)."""
    for _ in range(20):
        a(), b()
    ratios, ta, tb = [], [], []
    for i in range(pairs):
        t = {}
        for f in ((a, b) if i % 2 == 0 else (b, a)):
            start = time.perf_counter()
            for _ in range(n):
                f()
            t[f] = (time.perf_counter() - start) / n
        ratios.append(t[a] / t[b])
        ta.append(t[a])
        tb.append(t[b])
    return statistics.median(ratios), statistics.median(ta) * 1e6, statistics.median(tb) * 1e6


def calls() -> None:
    from mha.functional import scaled_dot_product_attention as sdpa
    from mha.kernels import dispatch, native, tuning
    native.native_available()
    cases = [("T1 causal", (1, 8, 1), (1, 8, 1), True), ("T16 causal", (1, 8, 16), (1, 8, 16), True),
             ("T64 causal", (1, 8, 64), (1, 8, 64), True), ("decode S1024", (1, 8, 1), (1, 2, 1024), False)]
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            for name, qs, ks, causal in cases:
                q, k, v = (torch.randn(*shape, 64).to(dtype) for shape in (qs, ks, ks))
                gqa = qs[1] != ks[1]
                ways = {"mha sdpa": lambda: sdpa(q, k, v, is_causal=causal, enable_gqa=gqa),
                        "dispatch.plain_sdpa": lambda: dispatch.plain_sdpa(q, k, v, is_causal=causal, enable_gqa=gqa)}
                if native.loaded is not None:
                    ways["native plain_sdpa alone"] = lambda: native.loaded.plain_sdpa(
                        q, k, v, causal, gqa, dispatch.NATIVE_DECODE_ROWS, *tuning.crossover_ints(dtype))
                for way, call in ways.items():
                    r, ta, tb = pair_ratio(call, lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                                         enable_gqa=gqa),
                                           n=50 if ks[2] < 1000 else 10)
                    print(f"{str(dtype)[6:]:9s} {name:13s} {way:24s} {ta:8.2f} us, torch {tb:8.2f} us: {r:.3f}")


def generate(T: int, rounds: int = 3) -> None:
    from mha.tools import bench_hf
    models = {i: bench_hf.llama(i) for i in ("mha", "sdpa")}
    prompt = torch.randint(0, 8000, (1, T), generator=torch.Generator().manual_seed(T))
    with torch.no_grad():
        for m in models.values():
            m(prompt)
        for _ in range(rounds):
            took = {}
            for i, m in models.items():
                start = time.perf_counter()
                m(prompt)
                middle = time.perf_counter()
                bench_hf.generate(m, prompt, 32)
                took[i] = (middle - start, time.perf_counter() - middle)
            print(f"prompt {T}: prefill mha/sdpa {took['mha'][0] / took['sdpa'][0]:.2f}, "
                  f"generate 32 mha/sdpa {took['mha'][1] / took['sdpa'][1]:.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--generate", type=int, metavar="T", help="time generation after a prompt of T tokens")
    args = parser.parse_args()
    generate(args.generate) if args.generate else calls()
