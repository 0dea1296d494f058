"""Attention maps as pictures: one heatmap per head and the head average, tokens on the axes."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def attention_figure(weights: Tensor, query_tokens: list[str], key_tokens: list[str], *, title: str,
                     heads: list[int] | None = None):
    """A matplotlib Figure: the selected heads of ``weights`` (H, L, S) and their average."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    H = weights.shape[0]
    heads = list(range(H)) if heads is None else heads
    for h in heads:
        if not 0 <= h < H:
            raise ValueError(f"head {h} does not exist: the layer has heads 0..{H - 1}")
    panels = [(f"head {h}", weights[h]) for h in heads] + [("average of all heads", weights.mean(0))]
    cols = min(4, len(panels))
    rows = math.ceil(len(panels) / cols)
    side = max(2.6, 0.32 * max(len(query_tokens), len(key_tokens)))
    fig, axes = plt.subplots(rows, cols, figsize=(side * cols + 1.2, side * rows + 0.8), squeeze=False)
    for ax, (name, w) in zip(axes.flat, panels):
        image = ax.imshow(w.detach().float().numpy(), cmap="viridis", vmin=0.0, vmax=1.0, aspect="equal")
        ax.set_title(name, fontsize=10)
        ax.set_xticks(range(len(key_tokens)), key_tokens, rotation=90, fontsize=8)
        ax.set_yticks(range(len(query_tokens)), query_tokens, fontsize=8)
        ax.set_xlabel("key", fontsize=8)
        ax.set_ylabel("query", fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(title, fontsize=12)
    fig.tight_layout()
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label="attention weight")
    return fig


def sentence_example() -> tuple[Tensor, list[str]]:
    """Seed 003's sentence through three heads with its stacked random weights: ((3, 6, 6), tokens)."""
    from ..explorer import capture_attention
    from ..layouts import PerHead, from_per_head, general_module

    sentence = "Life is short, eat dessert first"
    words = sentence.replace(",", "").split()
    vocabulary = {s: i for i, s in enumerate(sorted(words))}
    torch.manual_seed(123)
    x = torch.nn.Embedding(6, 16)(torch.tensor([vocabulary[w] for w in words])).detach()
    torch.manual_seed(123)
    h, d, d_k, d_v = 3, 16, 24, 28
    W_q, W_k, W_v = torch.rand(h, d_k, d), torch.rand(h, d_k, d), torch.rand(h, d_v, d)
    heads = PerHead(W_q=[w.T for w in W_q], W_k=[w.T for w in W_k], W_v=[w.T for w in W_v], W_o=torch.eye(h * d_v))
    module = general_module(from_per_head(heads), "general", num_heads=h)
    with torch.no_grad(), capture_attention(module) as maps:
        module(x, x, x)
    return maps["GeneralAttention"][0][0], words  # (1, 3, 6, 6) -> (3, 6, 6)
