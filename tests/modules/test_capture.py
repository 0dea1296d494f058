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


# -- every entry of the dispatch reaches the observers ---------------------------------------------------

def _watched(call):
    """(what call() returned, the observed (q, k, v, contract, out, weights) of each call)."""
    seen = []
    kernels.dispatch.OBSERVERS.append(lambda q, k, v, contract, out, weights, dropout_p=0.0:
                                      seen.append((q, k, v, contract, out, weights)))
    try:
        return call(), seen
    finally:
        kernels.dispatch.OBSERVERS.pop()


def _softmax_weights(q, k, contract):
    """The weights by hand: softmax of the scaled scores under the contract (float64)."""
    s = (q @ k.transpose(-1, -2)) * contract.scale_for(q.shape[-1])
    s = contract.shape_scores(contract.cap(s, inplace=False)[0], range(q.shape[-2]), range(k.shape[-2]), inplace=False)
    return torch.softmax(s, -1).nan_to_num()


def test_the_lse_path_is_observed_with_its_output_and_the_weights():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=g, dtype=torch.float64) for _ in range(3))
    contract = kernels.Contract(band=mha.positions.Band(3, 0), softcap=5.0)
    (out, lse), seen = _watched(lambda: kernels.attention_with_lse(q, k, v, contract))
    ((_, _, _, c, o, w),) = seen
    assert c is contract and o is out
    torch.testing.assert_close(w, _softmax_weights(q, k, contract))
    torch.testing.assert_close(torch.logsumexp((q @ k.transpose(-1, -2)).div(8 ** 0.5).div(5).tanh().mul(5)
                                               .masked_fill(~mha.positions.Band(3, 0).visible(6, 6), float("-inf")), -1), lse)


def test_varlen_is_observed_as_one_packed_call():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(9, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    cu = torch.tensor([0, 4, 9])
    out, seen = _watched(lambda: kernels.varlen_attention(q, k, v, cu, cu, is_causal=True))
    ((oq, _, _, contract, o, w),) = seen
    assert oq.shape == (1, 2, 9, 8) and w.shape == (1, 2, 9, 9)
    assert not w[0, :, :4, 4:].any() and not w[0, :, 4:, :4].any()  # no row sees another sequence's keys
    torch.testing.assert_close(o[0].transpose(0, 1), out)


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_paged_attention_is_observed_per_sequence(quantize):
    cache = mha.PagedKVCache(num_blocks=8, block_size=4, num_kv_heads=1, head_dim=8, quantize=quantize)
    a, _ = cache.add()
    b, _ = cache.add()
    slots = cache.reserve([a, b], [6, 3])
    g = torch.Generator().manual_seed(2)
    cache.write(0, slots, torch.randn(9, 1, 8, generator=g), torch.randn(9, 1, 8, generator=g))
    q = torch.randn(2, 2, 8, generator=g)  # one new row per sequence (its last key)
    call = lambda: kernels.paged_attention(q, *cache.pages(0), cache.block_table([a, b]), torch.tensor([0, 1, 2]),  # noqa: E731
                                           cache.lengths([a, b]))
    out, seen = _watched(call)
    assert [w.shape for *_, w in seen] == [(2, 1, 6), (2, 1, 3)]
    for row, (rows, keys, _values, contract, o, w) in enumerate(seen):
        torch.testing.assert_close(o[:, 0], out[row])
        torch.testing.assert_close(w, _softmax_weights(rows, keys, contract))
    with mha.capture_attention() as maps:
        call()
    assert [x.shape for x in maps["attention"]] == [(1, 2, 1, 6), (1, 2, 1, 3)]


def test_what_cannot_be_recorded_is_refused_by_name():
    from mha.distributed import SequenceLayout, ring_attention
    q = torch.randn(1, 2, 6, 8)
    with mha.capture_attention(), pytest.raises(ValueError, match="ring attention cannot be recorded"):
        ring_attention(q, q, q, SequenceLayout(6))
    for term in (dict(score_mod=lambda s, b, h, i, j: s), dict(logit_scale=torch.ones(2))):
        with mha.explorer.record() as recording, pytest.raises(
                ValueError, match=f"its breakdown does not take {next(iter(term))}: this call cannot be recorded"):
            mha.functional.scaled_dot_product_attention(q, q, q, **term)
        assert not recording.calls
    for variant in ("strided", "fixed"):  # their parts of each row's softmax are merged after the calls
        module = mha.GeneralAttention(8, 8, 8, 4, 4, 8, 2, attention=variant, attention_options={"stride": 2}
                                      if variant == "strided" else {"block": 2})
        x = torch.randn(1, 6, 8)
        with mha.capture_attention(), pytest.raises(ValueError, match=f"the {variant} variant cannot be recorded"):
            module(x, x, x, is_causal=True)
    with mha.capture_attention() as maps:  # its weights are what capture keeps
        mha.functional.scaled_dot_product_attention(q, q, q, mask_mod=lambda b, h, i, j: i >= j)
    assert not maps["attention"][0].triu(1).any()
