"""mha explain: each recomputed step equals torch's own intermediate."""

import pytest

from mha import cli
from mha.tools import explain


@pytest.mark.parametrize("options", [dict(readable=True), dict(), dict(batch=2, causal=True),
                                     dict(embed_dim=6, num_heads=3, length=5, batch=1),
                                     dict(embed_dim=5, num_heads=1, length=3, causal=True)], ids=str)
def test_every_step_equals_torch(options):
    steps = explain.trace(**options)
    compared = [s for s in steps if s.torch_value is not None]
    assert len(compared) >= 7  # in-projection, scores, softmax, values, out-projection, output, weights, per-head
    assert all(s.matches for s in steps), [(s.title, s.error) for s in steps if not s.matches]


def test_readable_trace_shows_seed_000_numbers():
    steps = {s.title: s for s in explain.trace(readable=True)}
    per_head = steps["per-head split"].value
    assert per_head[0].tolist() == [[530.0, 1370.0], [570.0, 1474.0]]  # the seed's q_0
    assert per_head[1].tolist() == [[2210.0, 3050.0], [2378.0, 3282.0]]  # and q_1
    assert steps["the per-head matrices this corresponds to"].value[0, 0].tolist() == [[1, 5], [2, 6], [3, 7], [4, 8]]


def test_a_wrong_step_is_reported():
    steps = explain.trace()
    projection = next(s for s in steps if s.title.startswith("in-projection"))
    projection.value = projection.value + 1
    assert not projection.matches
    assert "DIFFERS" in explain.render_markdown(steps)


def test_markdown_document(tmp_path, capsys):
    out = tmp_path / "trace.md"
    assert cli.main(["explain", "--readable", "--causal", "--out", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("# One forward") and "## 1. input" in text and "causal mask" in text
    assert text.count("matches torch's own result") >= 7


def test_rich_output_and_arguments(capsys):
    assert cli.main(["explain", "--embed-dim", "6", "--heads", "3", "--length", "3", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "per-head split" in out and "✓ equals torch's own result" in out
    assert cli.main(["explain", "--embed-dim", "5", "--heads", "2"]) == 2
    assert cli.main(["explain", "--length", "0"]) == 2
