"""Train a tiny model with each attention variant on associative recall, for the same wall-clock
budget each, and report accuracy against time. Seed 004's question, measured.

Task (associative recall among distractors): 8 (key, value) pairs at random places among 512
filler tokens, then one of the keys again; the model must output that key's value. T = 513.
Recall needs attention from the end to one far-away token, which is what approximations blur.

    python benchmarks/train_variants.py --budget 60 --out benchmarks/results-variants

Not part of the test suite (minutes per variant). Writes training.json and training.png.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

import mha

# variant: (attention=..., options, causal)
SETUPS = {
    "exact": ("exact", {}, False),
    "local w=64": ("local", {"window": 64}, True),
    "strided c=sqrt(T)": ("strided", {"stride": 23}, True),
    "fixed c=sqrt(T)": ("fixed", {"block": 23, "summary": 3}, True),
    "linformer k=64": ("linformer", {"max_length": 513, "k": 64}, False),
    "nystrom m=32": ("nystrom", {"landmarks": 32}, False),
    "linear": ("linear", {}, False),
    "performer m=64": ("performer", {"features": 64}, False),
}


def batch(size: int, length: int, pairs: int, keys: int, values: int, generator: torch.Generator):
    """``pairs`` (key, value) pairs with distinct keys at random places among filler tokens, then one
    of the keys again. Tokens: filler 0, keys 1..keys, values keys+1..keys+values.
    Returns (tokens (B, length + 1), target value index (B,))."""
    tokens = torch.zeros(size, length, dtype=torch.long)
    key_ids = torch.stack([torch.randperm(keys, generator=generator)[:pairs] for _ in range(size)]) + 1
    value_ids = torch.randint(values, (size, pairs), generator=generator)
    slots = torch.stack([torch.randperm(length // 2, generator=generator)[:pairs] for _ in range(size)]) * 2
    rows = torch.arange(size)[:, None]
    tokens[rows, slots], tokens[rows, slots + 1] = key_ids, keys + 1 + value_ids
    pick = torch.randint(pairs, (size,), generator=generator)
    query = key_ids[torch.arange(size), pick]
    return torch.cat([tokens, query[:, None]], dim=1), value_ids[torch.arange(size), pick]


class Model(nn.Module):
    def __init__(self, vocab, length, d=64, heads=4, layers=2, attention="exact", options=None, causal=False):
        super().__init__()
        self.causal = causal
        self.embed = nn.Embedding(vocab, d)
        self.position = nn.Parameter(torch.randn(length, d) * 0.02)
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(nn.ModuleDict({
                "norm1": nn.LayerNorm(d), "norm2": nn.LayerNorm(d),
                "attention": mha.MultiHeadAttention(d, d, d, d // heads, d // heads, d, heads,
                                                    attention=attention, attention_options=dict(options or {})),
                "mlp": nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))}))
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens):
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            y = block["norm1"](x)
            x = x + block["attention"](y, y, y, is_causal=self.causal)
            x = x + block["mlp"](block["norm2"](x))
        return self.head(x[:, -1])  # the answer is read at the last position


def train(name, budget, length, pairs, keys, values, batch_size, seed=0):
    """Train for ``budget`` seconds of training steps (evaluations are not counted)."""
    attention, options, causal = SETUPS[name]
    torch.manual_seed(seed)
    model = Model(1 + keys + values, length + 1, attention=attention, options=options, causal=causal)
    optimiser = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data, held_out = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(10_000)
    test_tokens, test_target = batch(256, length, pairs, keys, values, held_out)

    def accuracy():
        with torch.no_grad():
            model.eval()
            correct = (model(test_tokens).argmax(-1) == test_target + keys + 1).float().mean().item()
            model.train()
        return correct

    curve, trained, steps = [(0.0, 0, accuracy())], 0.0, 0
    for checkpoint in range(1, 13):
        while trained < budget * checkpoint / 12:
            tokens, target = batch(batch_size, length, pairs, keys, values, data)
            start = time.perf_counter()
            loss = F.cross_entropy(model(tokens), target + keys + 1)
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            trained += time.perf_counter() - start
            steps += 1
        curve.append((round(trained, 2), steps, accuracy()))
    return {"variant": name, "curve": curve, "final_accuracy": curve[-1][2], "steps": steps,
            "ms_per_step": 1e3 * trained / max(steps, 1)}


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in results:
        t, _, acc = zip(*r["curve"])
        ax.plot(t, acc, marker="o", markersize=3, label=f"{r['variant']} ({r['ms_per_step']:.0f} ms/step)")
    ax.set(xlabel="wall-clock seconds of training", ylabel="held-out accuracy",
           title="associative recall among distractors, T = 513, same training time per variant")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=60.0, help="seconds of training per variant")
    parser.add_argument("--length", type=int, default=512, help="filler length; T = length + 1")
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--keys", type=int, default=32)
    parser.add_argument("--values", type=int, default=16)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--variants", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    parser.add_argument("--out", default="benchmarks/results-variants")
    args = parser.parse_args()
    if args.pairs > args.keys or 2 * args.pairs > args.length:
        raise SystemExit("--pairs cannot exceed --keys, nor half of --length")
    os.makedirs(args.out, exist_ok=True)
    results = []
    for name in args.variants:
        result = train(name, args.budget, args.length, args.pairs, args.keys, args.values, args.batch)
        results.append(result)
        print(f"{name:20} accuracy {result['final_accuracy']:.3f} after {result['steps']} steps "
              f"({result['ms_per_step']:.0f} ms/step); chance {1 / args.values:.3f}", flush=True)
    with open(os.path.join(args.out, "training.json"), "w") as f:
        json.dump({"args": vars(args), "torch": torch.__version__, "threads": torch.get_num_threads(),
                   "results": results}, f, indent=1)
    plot(results, os.path.join(args.out, "training.png"))
    print(f"wrote {args.out}/training.json and training.png")


if __name__ == "__main__":
    main()
