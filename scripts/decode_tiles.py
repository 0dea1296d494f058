"""A bfloat16 decoding step on AMX tiles against the vector loops, from memory and from cache.

    python scripts/decode_tiles.py --threads 2                       # S 1024-65536, both regimes
    python scripts/decode_tiles.py --threads 16 --keys 4096 16384 --rounds 5

One native ``forward`` of B1 Hq x 1 query row over a dense bfloat16 cache (Hkv x S x D), timed with the
tiles allowed (``set_amx(True)``) and forbidden (``set_amx(False)``: the same call on the vector loops),
the two alternated round by round in one process. Two regimes:

- ``cache``: the same cache every call, as a one-layer benchmark reads it (it may sit in the last-level
  cache, up to its size);
- ``memory``: calls over enough distinct caches in turn (400 MiB of them) that each is read from memory,
  as a model's layers read theirs, one after another, once a token.

Prints the CPU, each point's tiles time, its rate in GB/s and the median of vector-loop time / tile time
over the rounds (above 1: the tiles are faster). The dispatch takes the tiles wherever AMX is usable;
this measures whether that rule holds on the CPU at hand (it did not from memory on one AMX VM: see
docs/native.md, "AMX tiles").
"""

import argparse
import statistics
import time

import torch

from mha.kernels import native


def cpu_line() -> str:
    info = open("/proc/cpuinfo").read()
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = ("avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
    return f"{model} ({' '.join(flag for flag in flags if f' {flag}' in info)}), torch {torch.__version__}"


def caches(S: int, Hkv: int, D: int, regime: str, generator: torch.Generator) -> list:
    per = 2 * Hkv * S * D * 2
    count = max(1, (400 << 20) // per) if regime == "memory" else 1
    return [tuple(torch.randn(1, Hkv, S, D, generator=generator).bfloat16() for _ in range(2)) for _ in range(count)]


def point(kernel, S: int, Hq: int, Hkv: int, D: int, regime: str, rounds: int) -> str:
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, Hq, 1, D, generator=generator).bfloat16()
    kv = caches(S, Hkv, D, regime, generator)
    terms = kernel.Terms()
    terms.scale = D ** -0.5

    def run() -> None:
        for k, v in kv:
            kernel.forward(q, k, v, terms, False)

    reps = max(1, 2_000_000 // (S * len(kv)))
    took = {True: [], False: []}
    for round_ in range(rounds):
        for tiles in ((True, False) if round_ % 2 == 0 else (False, True)):  # neither always second
            kernel.set_amx(tiles)
            run()
            start = time.perf_counter()
            for _ in range(reps):
                run()
            took[tiles].append((time.perf_counter() - start) / reps / len(kv))
    kernel.set_amx(True)
    best = min(took[True])
    ratio = statistics.median(loops / tiles for loops, tiles in zip(took[False], took[True]))
    nbytes = 2 * Hkv * S * D * 2
    return (f"S {S} from {regime} ({len(kv)} caches of {nbytes / 1e6:.1f} MB): tiles {best * 1e3:.3f} ms "
            f"({nbytes / best / 1e9:.1f} GB/s), vector loops / tiles median {ratio:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--keys", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    parser.add_argument("--heads", type=int, nargs=2, default=[32, 8], metavar=("HQ", "HKV"))
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--regimes", nargs="+", choices=("memory", "cache"), default=["memory", "cache"])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    kernel = native._kernel()
    if kernel is None or not kernel.amx_active():
        raise SystemExit("no AMX tiles here (no native kernel, no AMX, or the OS does not grant them)")
    torch.set_num_threads(args.threads)
    print(f"{cpu_line()}, {args.threads} threads, Hq {args.heads[0]} Hkv {args.heads[1]} D {args.dim}", flush=True)
    for regime in args.regimes:
        for S in args.keys:
            print(point(kernel, S, *args.heads, args.dim, regime, args.rounds), flush=True)


if __name__ == "__main__":
    main()
