"""A causal prompt attended over KV-cache pages against the dense native forward, bfloat16 and float32.

    python benchmarks/paged_prompt.py [--tokens 2048] [--rounds 5]

B1, Hq 8 over Hkv 2, D 64 (a Llama-type layer's shape), 2048 rows over their own 2048 keys: the dense
forward (mha.kernels.native.native_attention), paged_attention over one page a sequence, over pages of
16 keys, and over 8-bit pages (kept with their scales), each the best of ``rounds`` interleaved calls.
docs/native.md ("bfloat16 prompts over pages") quotes it.
"""

from __future__ import annotations

import argparse
import time

import torch

from mha.kernels import Contract, native, paged_attention, storage
from mha.positions import CAUSAL


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    T, H, Hkv, D, P = args.tokens, 8, 2, 64, 16
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        q = torch.randn(1, H, T, D, generator=g).to(dtype)
        k, v = (torch.randn(1, Hkv, T, D, generator=g).to(dtype) for _ in range(2))
        rows = q[0].transpose(0, 1).contiguous()  # (T, H, D)
        one, cu, lengths = torch.zeros(1, 1, dtype=torch.long), torch.tensor([0, T]), torch.tensor([T])
        paged = [x[0].transpose(0, 1).reshape(T // P, P, Hkv, D).transpose(1, 2).contiguous() for x in (k, v)]
        kept = [storage.store(x.float(), True) for x in (k, v)]
        calls = {"dense native": lambda: native.native_attention(q, k, v, Contract(band=CAUSAL)),
                 "paged one page": lambda: paged_attention(rows, k, v, one, cu, lengths),
                 f"paged pages of {P}": lambda: paged_attention(rows, *paged, torch.arange(T // P)[None], cu, lengths),
                 "paged 8-bit, one page": lambda: paged_attention(rows, *kept, one, cu, lengths)}
        times = {name: [] for name in calls}
        with torch.no_grad():
            for call in calls.values():
                call()
            for _ in range(args.rounds):
                for name, call in calls.items():
                    start = time.perf_counter()
                    call()
                    times[name].append(time.perf_counter() - start)
        print(str(dtype).removeprefix("torch."), " ".join(f"{n} {min(t) * 1e3:.2f} ms," for n, t in times.items()),
              f"{torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
