"""Forward time of mha.nn.MultiheadAttention against torch.nn.MultiheadAttention, fp32, no_grad.

Ratios are measured in one run on the same inputs (best of --repeat). The full grid and
`mha bench` come with the fast-attention work; this script checks the drop-in's default paths.

    python benchmarks/drop_in_speed.py [--threads 2] [--repeat 5]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

import mha

SHAPES = [(4, 512, 512), (1, 2048, 512), (8, 128, 256)]  # (B, T, E), H = 8


def best_times(fns: dict, repeat: int) -> dict:
    """Best time of each function, the functions run in turn each round (drift hits all alike)."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: min(ts) for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, fp32, batch_first self-attention, H=8")
    print(f"{'B':>2} {'T':>5} {'E':>4} | {'no weights: /torch train':>25} {'/torch eval':>12} | "
          f"{'weights: /torch eval':>21}")
    for B, T, E in SHAPES:
        torch.manual_seed(0)
        theirs = torch.nn.MultiheadAttention(E, 8, batch_first=True)
        ours = mha.nn.MultiheadAttention(E, 8, batch_first=True).eval()
        ours.load_state_dict(theirs.state_dict())
        x = torch.randn(B, T, E)
        theirs_eval = copy.deepcopy(theirs).eval()
        theirs.train()  # dropout is 0: the training path is torch's faster one on CPU
        fns = {
            "ours_fused": lambda: ours(x, x, x, need_weights=False),
            "ours_weights": lambda: ours(x, x, x),
            "torch_train": lambda: theirs(x, x, x, need_weights=False),
            "torch_eval": lambda: theirs_eval(x, x, x, need_weights=False),
            "torch_eval_weights": lambda: theirs_eval(x, x, x),
        }
        with torch.no_grad():
            t = best_times(fns, args.repeat)
        ours_fused, ours_weights = t["ours_fused"], t["ours_weights"]
        torch_train, torch_eval, torch_eval_weights = t["torch_train"], t["torch_eval"], t["torch_eval_weights"]
        print(f"{B:>2} {T:>5} {E:>4} | {ours_fused / torch_train:>25.2f} {ours_fused / torch_eval:>12.2f} | "
              f"{ours_weights / torch_eval_weights:>21.2f}")


if __name__ == "__main__":
    main()
