"""mha.capture_attention: per-head weights of every mha module in a forward."""

import pytest
import torch

import mha
from mha import kernels


def test_capture_records_per_head_weights_and_changes_nothing_else():
    torch.manual_seed(0)
    layer = mha.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).eval()
    x = torch.randn(3, 5, 8)
    plain = layer(x)
    with mha.capture_attention(layer) as maps:
        captured = layer(x)
    torch.testing.assert_close(captured, plain)
    (weights,) = maps["self_attn"]
    assert weights.shape == (3, 2, 5, 5)
    want = layer.self_attn(x, x, x, average_attn_weights=False)[1]
    torch.testing.assert_close(weights, want)
    torch.testing.assert_close(weights.sum(-1), torch.ones(3, 2, 5))


def test_capture_keeps_what_the_caller_asked_for():
    m = mha.nn.MultiheadAttention(8, 2)
    x = torch.randn(4, 8)  # unbatched
    with mha.capture_attention() as maps:
        out, w = m(x, x, x, need_weights=False)
        _, averaged = m(x, x, x)
    assert w is None and averaged.shape == (4, 4)
    (first, second) = next(iter(maps.values()))
    assert first.shape == (1, 2, 4, 4)
    torch.testing.assert_close(first.mean(1)[0], averaged)


def test_capture_of_the_general_module_with_a_cache():
    m = mha.GeneralAttention(8, 8, 8, 4, 4, 8, 2, rope=mha.RotaryEmbedding(4)).eval()
    cache = mha.KVCache()
    x = torch.randn(1, 3, 8)
    with mha.capture_attention(m) as maps:
        out = m(x, x, x, is_causal=True, cache=cache)
        step = m(x[:, :1], x[:, :1], x[:, :1], is_causal=True, cache=cache)
    assert torch.is_tensor(out) and torch.is_tensor(step)
    prefill, decode = maps["GeneralAttention"]
    assert prefill.shape == (1, 2, 3, 3) and decode.shape == (1, 2, 1, 4)
    assert torch.all(prefill[..., 0, 1:] == 0)  # causal
    # the same weights as asking for them, on a fresh cache: the decode step sees the prefill's keys
    fresh = mha.KVCache()
    _, want_prefill = m.forward_with_weights(x, x, x, is_causal=True, cache=fresh, average_attn_weights=False)
    _, want_decode = m.forward_with_weights(x[:, :1], x[:, :1], x[:, :1], is_causal=True, cache=fresh,
                                            average_attn_weights=False)
    torch.testing.assert_close(prefill, want_prefill)
    torch.testing.assert_close(decode, want_decode)


def test_modules_outside_the_watched_model_are_not_recorded():
    watched, other = mha.nn.MultiheadAttention(8, 2), mha.nn.MultiheadAttention(8, 2)
    x = torch.randn(3, 1, 8)
    with mha.capture_attention(watched) as maps:
        other(x, x, x)
    assert not maps


def test_without_capture_no_weights_are_computed(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("weights computed outside a capture")

    monkeypatch.setitem(kernels.BACKENDS, "math", refuse)
    m = mha.nn.MultiheadAttention(8, 2)
    x = torch.randn(3, 1, 8)
    m(x, x, x, need_weights=False)
    with pytest.raises(AssertionError, match="outside"):
        with mha.capture_attention():
            m(x, x, x, need_weights=False)
