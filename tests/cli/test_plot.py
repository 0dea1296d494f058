"""mha plot and the BERT-checkpoint runner (a small checkpoint the test writes)."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from mha import cli
from mha.tools.bert import BertCheckpoint, attention_maps

HIDDEN, HEADS, LAYERS, FF = 16, 2, 2, 24
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "the", "cat", "sat", "on", "mat", "##s", ".", "dog"]


@pytest.fixture
def checkpoint(tmp_path):
    torch.manual_seed(0)
    r = lambda *shape: torch.randn(*shape) * 0.3  # noqa: E731
    state = {"bert.embeddings.word_embeddings.weight": r(len(VOCAB), HIDDEN),
             "bert.embeddings.position_embeddings.weight": r(32, HIDDEN),
             "bert.embeddings.token_type_embeddings.weight": r(2, HIDDEN),
             "bert.embeddings.LayerNorm.weight": 1 + r(HIDDEN), "bert.embeddings.LayerNorm.bias": r(HIDDEN)}
    for i in range(LAYERS):
        p = f"bert.encoder.layer.{i}."
        for name, shape in (("attention.self.query", (HIDDEN, HIDDEN)), ("attention.self.key", (HIDDEN, HIDDEN)),
                            ("attention.self.value", (HIDDEN, HIDDEN)), ("attention.output.dense", (HIDDEN, HIDDEN)),
                            ("intermediate.dense", (FF, HIDDEN)), ("output.dense", (HIDDEN, FF))):
            state[f"{p}{name}.weight"], state[f"{p}{name}.bias"] = r(*shape), r(shape[0])
        for name in ("attention.output.LayerNorm", "output.LayerNorm"):
            state[f"{p}{name}.weight"], state[f"{p}{name}.bias"] = 1 + r(HIDDEN), r(HIDDEN)
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "vocab.txt").write_text("\n".join(VOCAB))
    (tmp_path / "config.json").write_text(json.dumps(dict(
        hidden_size=HIDDEN, num_attention_heads=HEADS, num_hidden_layers=LAYERS, intermediate_size=FF,
        layer_norm_eps=1e-12, hidden_act="gelu")))
    return tmp_path, state


def _bert_by_hand(state, ids):
    """BERT's forward written from its raw keys (independent of mha's modules)."""
    p = "bert.embeddings."
    x = state[p + "word_embeddings.weight"][ids] + state[p + "position_embeddings.weight"][: len(ids)] \
        + state[p + "token_type_embeddings.weight"][0]
    ln = lambda t, name: F.layer_norm(t, (HIDDEN,), state[name + ".weight"], state[name + ".bias"], 1e-12)  # noqa: E731
    dense = lambda t, name: t @ state[name + ".weight"].T + state[name + ".bias"]  # noqa: E731
    x = ln(x, p + "LayerNorm")
    d = HIDDEN // HEADS
    for i in range(LAYERS):
        b = f"bert.encoder.layer.{i}."
        q, k, v = (dense(x, b + f"attention.self.{n}").view(-1, HEADS, d).transpose(0, 1) for n in ("query", "key", "value"))
        context = (torch.softmax(q @ k.transpose(1, 2) / math.sqrt(d), -1) @ v).transpose(0, 1).reshape(-1, HIDDEN)
        x = ln(x + dense(context, b + "attention.output.dense"), b + "attention.output.LayerNorm")
        x = ln(x + dense(F.gelu(dense(x, b + "intermediate.dense")), b + "output.dense"), b + "output.LayerNorm")
    return x


def test_bert_runner_equals_bert_written_by_hand(checkpoint):
    directory, state = checkpoint
    tokens, maps, hidden = attention_maps(directory, "The cats sat on the mat. A dog!")
    assert tokens == ["[CLS]", "the", "cat", "##s", "sat", "on", "the", "mat", ".", "[UNK]", "dog", "[UNK]", "[SEP]"]
    ids = torch.tensor([VOCAB.index(t) for t in tokens])
    torch.testing.assert_close(hidden[0], _bert_by_hand(state, ids), atol=1e-5, rtol=1e-5)
    assert len(maps) == LAYERS and maps[0].shape == (HEADS, len(tokens), len(tokens))
    torch.testing.assert_close(maps[1].sum(-1), torch.ones(HEADS, len(tokens)))


def test_plot_checkpoint_layer_and_heads(checkpoint, tmp_path):
    directory, _ = checkpoint
    out = tmp_path / "maps" / "bert.png"
    assert cli.main(["plot", "--checkpoint", str(directory), "--text", "the cat sat", "--layer", "1",
                     "--heads", "1", "--out", str(out)]) == 0
    assert out.stat().st_size > 10_000


def test_plot_seed_sentence_by_default(tmp_path):
    out = tmp_path / "seed.png"
    assert cli.main(["plot", "--out", str(out)]) == 0
    assert out.stat().st_size > 20_000


@pytest.mark.parametrize("args, words", [(["--layer", "5"], "layers 0..1"), (["--heads", "7"], "heads 0..1")])
def test_plot_errors(checkpoint, tmp_path, capsys, args, words):
    directory, _ = checkpoint
    assert cli.main(["plot", "--checkpoint", str(directory), "--out", str(tmp_path / "x.png"), *args]) == 2
    assert words in capsys.readouterr().err


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="config.json is missing"):
        BertCheckpoint.load(tmp_path)
