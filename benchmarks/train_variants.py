"""Train a small model with each attention variant on multi-query recall (T = 512 by default),
from several seeds, in two comparisons: the same wall-clock budget, and the same number of steps.
Seed 004's question, measured on a task that exact attention solves.

Task (recall among distractors): ``pairs`` tokens, each carrying a (key, value) pair with distinct
keys, at random places among filler tokens, then a query token naming one of the keys; the model
answers that key's value (chance 1 / values). The answer is one far-away token, found by content:
what a smoothed, low-rank or windowed attention may lose.

    python benchmarks/train_variants.py --out benchmarks/results-variants       # 45 s / 300 steps, 3 seeds: 50 min

Each variant is the one `mha bench --variants` times (mha.tools.bench_variants.VARIANTS, built for
this T and head width). Writes training.json (every run, mean and spread, which variants the seeds
separate, the minutes taken) and training.png. Not part of the test suite (tests/cli/test_study.py
runs it for two steps).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import mha
from mha.tools.bench_variants import VARIANTS
from mha.tools.plot_variants import study_styles

DEFAULT_VARIANTS = ["exact (sdpa)", "exact causal (sdpa)", "local w=256", "strided c=sqrt(T)", "fixed c=sqrt(T)",
                    "linformer k=256", "nystrom m=64", "linear", "performer m=256"]


class Task:
    """Each position is a symbol and a value: fillers (symbols 0..fillers-1, no value), pairs (a key
    symbol and its value) and, last, the query (the asked key's query symbol, no value)."""

    def __init__(self, length: int, *, pairs: int = 16, keys: int = 16, values: int = 16, fillers: int = 16):
        if pairs > keys or pairs >= length:
            raise ValueError(f"pairs={pairs} needs pairs <= keys={keys} and pairs < length={length}")
        self.length, self.pairs, self.keys, self.values, self.fillers = length, pairs, keys, values, fillers
        self.symbols = fillers + 2 * keys

    def batch(self, size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens (size, length, 2): symbol and value + 1 (0: none), answer (size,))."""
        symbols = torch.randint(self.fillers, (size, self.length), generator=generator)
        value_ids = torch.zeros(size, self.length, dtype=torch.long)
        keys = torch.rand(size, self.keys, generator=generator).argsort(-1)[:, : self.pairs]  # (size, pairs) distinct
        values = torch.randint(self.values, (size, self.pairs), generator=generator)
        places = torch.rand(size, self.length - 1, generator=generator).argsort(-1)[:, : self.pairs]  # (size, pairs)
        rows = torch.arange(size)[:, None]
        symbols[rows, places], value_ids[rows, places] = self.fillers + keys, 1 + values
        asked = torch.randint(self.pairs, (size,), generator=generator)
        symbols[:, -1] = self.fillers + self.keys + keys[torch.arange(size), asked]
        return torch.stack([symbols, value_ids], dim=-1), values[torch.arange(size), asked]


class Model(nn.Module):
    """Pre-norm transformer without positions (the task is found by content), read at the last token."""

    def __init__(self, task: Task, variant: str, *, d: int = 64, heads: int = 2, layers: int = 2):
        super().__init__()
        build, self.causal = VARIANTS[variant]
        self.symbol, self.value = nn.Embedding(task.symbols, d), nn.Embedding(task.values + 1, d)
        self.blocks = nn.ModuleList(nn.ModuleDict({
            "norm1": nn.LayerNorm(d), "norm2": nn.LayerNorm(d),
            "attention": mha.GeneralAttention(d, d, d, d // heads, d // heads, d, heads,
                                                attention=build(task.length, d // heads)),
            "mlp": nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))}) for _ in range(layers))
        self.head = nn.Linear(d, task.values)

    def forward(self, tokens):
        x = self.symbol(tokens[..., 0]) + self.value(tokens[..., 1])  # (B, T, d)
        for block in self.blocks:
            y = block["norm1"](x)
            x = x + block["attention"](y, y, y, is_causal=self.causal)
            x = x + block["mlp"](block["norm2"](x))
        return self.head(x[:, -1])  # (B, values)


def train(task: Task, variant: str, seed: int, *, budget: float | None = None, steps: int | None = None,
          batch_size: int = 16, checkpoints: int = 6, held_out: int = 256) -> dict:
    """Train until ``budget`` seconds of training steps (evaluations not counted) or ``steps`` steps."""
    torch.manual_seed(seed)
    model = Model(task, variant)
    optimiser = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.Generator().manual_seed(seed)
    test_tokens, test_answer = task.batch(held_out, torch.Generator().manual_seed(10_000))

    def accuracy():
        model.eval()
        with torch.no_grad():
            correct = torch.cat([model(t).argmax(-1) for t in test_tokens.split(128)]) == test_answer
        model.train()
        return correct.float().mean().item()

    def done(fraction):
        return trained >= budget * fraction if budget is not None else taken >= steps * fraction

    curve, trained, taken = [(0.0, 0, accuracy())], 0.0, 0
    for checkpoint in range(1, checkpoints + 1):
        while not done(checkpoint / checkpoints):
            tokens, answer = task.batch(batch_size, data)
            start = time.perf_counter()
            loss = F.cross_entropy(model(tokens), answer)
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            trained += time.perf_counter() - start
            taken += 1
        curve.append((round(trained, 2), taken, accuracy()))
    return {"variant": variant, "seed": seed, "curve": curve, "accuracy": curve[-1][2], "steps": taken,
            "ms_per_step": 1e3 * trained / max(taken, 1)}


def summarise(runs: list[dict]) -> dict:
    """Per variant: mean, spread (sample standard deviation) and range of the final accuracy over seeds."""
    table = {}
    for variant in dict.fromkeys(r["variant"] for r in runs):
        accuracies = [r["accuracy"] for r in runs if r["variant"] == variant]
        table[variant] = {"mean": statistics.fmean(accuracies),
                          "spread": statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0,
                          "min": min(accuracies), "max": max(accuracies),
                          "steps": statistics.fmean(r["steps"] for r in runs if r["variant"] == variant),
                          "ms_per_step": statistics.fmean(r["ms_per_step"] for r in runs if r["variant"] == variant)}
    return table


def separated(table: dict) -> list[tuple[str, str]]:
    """Pairs of variants whose seed ranges do not overlap: every seed of the first beat every seed of the second."""
    return [(a, b) for a in table for b in table if a != b and table[a]["min"] > table[b]["max"]]


def plot(comparisons: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["variant"] for runs in comparisons.values() for r in runs))
    styles = study_styles(names)
    fig, axes = plt.subplots(1, len(comparisons), figsize=(7 * len(comparisons), 5), squeeze=False)
    for ax, (title, runs) in zip(axes[0], comparisons.items()):
        x_index = 0 if title.startswith("same time") else 1  # seconds, or steps
        for name in names:
            colour, marker = styles[name]
            for i, run in enumerate(r for r in runs if r["variant"] == name):
                x = [point[x_index] for point in run["curve"]]
                ax.plot(x, [point[2] for point in run["curve"]], color=colour, marker=marker, markersize=4, alpha=0.8,
                        linestyle="-" if name.startswith("exact") else "--", label=name if i == 0 else None)
        ax.set(title=title, xlabel="seconds of training" if x_index == 0 else "training steps",
               ylabel="held-out accuracy", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=45.0, help="seconds of training per run (0: skip)")
    parser.add_argument("--steps", type=int, default=300, help="training steps per run (0: skip)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--length", type=int, default=512, help="T, the query token included")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--held-out", type=int, default=256, help="held-out sequences scored at each checkpoint")
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS))
    parser.add_argument("--out", default="benchmarks/results-variants")
    args = parser.parse_args(argv)
    task = Task(args.length)
    os.makedirs(args.out, exist_ok=True)
    began = time.perf_counter()
    comparisons = {}
    for title, limit in ((f"same time: {args.budget:g} s each", {"budget": args.budget}),
                         (f"same steps: {args.steps} each", {"steps": args.steps})):
        if not next(iter(limit.values())):
            continue
        runs = comparisons[title] = []
        for seed in range(args.seeds):
            for variant in args.variants:
                runs.append(train(task, variant, seed, batch_size=args.batch, held_out=args.held_out, **limit))
                print(f"{title:24} seed {seed} {variant:22} accuracy {runs[-1]['accuracy']:.3f} "
                      f"after {runs[-1]['steps']} steps ({runs[-1]['ms_per_step']:.0f} ms/step)", flush=True)
    summaries = {title: summarise(runs) for title, runs in comparisons.items()}
    with open(os.path.join(args.out, "training.json"), "w") as f:
        json.dump({"args": vars(args), "chance": 1 / task.values, "torch": torch.__version__,
                   "threads": torch.get_num_threads(), "minutes": (time.perf_counter() - began) / 60,
                   "summary": summaries, "separated": {t: separated(s) for t, s in summaries.items()},
                   "runs": comparisons}, f, indent=1)
    plot(comparisons, os.path.join(args.out, "training.png"))
    for title, table in summaries.items():
        print(title)
        for variant, s in table.items():
            print(f"  {variant:22} {s['mean']:.3f} ± {s['spread']:.3f} (range {s['min']:.3f}–{s['max']:.3f}), "
                  f"{s['steps']:.0f} steps, {s['ms_per_step']:.0f} ms/step")
    print(f"wrote {args.out}/training.json and training.png in {(time.perf_counter() - began) / 60:.1f} minutes")


if __name__ == "__main__":
    main()
