"""GQA/MQA, RoPE, ALiBi, sliding windows and the KV cache in mha.GeneralAttention."""


import pytest
import torch
import torch.nn.functional as F

import mha
from helpers.exact import raises_exactly
from helpers.tolerance import assert_close
from mha import positions
from mha.tools.verify import randomize_biases

E, H, D = 32, 4, 8


def _module(seed=0, **options):
    torch.manual_seed(seed)
    return randomize_biases(mha.GeneralAttention(E, E, E, D, D, E, H, **options)).eval()


def _reference(m, x, visible=None, alibi=False):
    """The formula by hand: projections, RoPE at positions 0..T-1, GQA by repetition, explicit masks."""
    N, T, _ = x.shape
    q = m.q_proj(x).view(N, T, H, D).transpose(1, 2)
    k = m.k_proj(x).view(N, T, m.num_kv_heads, D).transpose(1, 2)
    v = m.v_proj(x).view(N, T, m.num_kv_heads, D).transpose(1, 2)
    if m.rope is not None:
        q, k = m.rope(q, torch.arange(T)), m.rope(k, torch.arange(T))
    k, v = (t.repeat_interleave(H // m.num_kv_heads, dim=1) for t in (k, v))
    bias = torch.zeros(H, T, T)
    if alibi:
        bias = -positions.alibi_slopes(H)[:, None, None] * (torch.arange(T)[None, :] - torch.arange(T)[:, None]).abs()
    if visible is not None:
        bias = bias.masked_fill(~visible, float("-inf"))
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    return m.out_proj(o.transpose(1, 2).reshape(N, T, H * D))


def _causal(T, left=None):
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    visible = j <= i
    return visible if left is None else visible & (j >= i - left)


VARIANTS = {
    "plain": dict(),
    "gqa": dict(num_kv_heads=2),
    "mqa": dict(num_kv_heads=1),
    "rope": dict(rope=mha.RotaryEmbedding(D)),
    "rope-partial-interleaved": dict(rope=mha.RotaryEmbedding(4, interleaved=True)),
    "alibi": dict(alibi=True),
    "window": dict(window=(3, 0)),
    "everything": dict(num_kv_heads=2, rope=mha.RotaryEmbedding(D), alibi=True, window=(5, 0)),
}


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("backend", ["auto", "math", "flash"])
def test_full_forward_equals_the_formula(name, backend):
    options = VARIANTS[name]
    m = _module(**options)
    x = torch.randn(2, 11, E)
    left = options.get("window", (None, 0))[0]
    with torch.no_grad():
        got = m(x, x, x, is_causal=True, backend=backend)
        want = _reference(m, x, _causal(11, left), alibi=options.get("alibi", False))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


CACHE_CASES = [(name, kind) for name in VARIANTS for kind in ("growing", "preallocated", "rolling")
               if kind != "rolling" or "window" in VARIANTS[name]]  # a rolling cache serves windows


@pytest.mark.parametrize("name, cache_kind", CACHE_CASES)
def test_decoding_token_by_token_equals_the_full_causal_forward(name, cache_kind):
    options = VARIANTS[name]
    left = options.get("window", (None, 0))[0]
    m = _module(**options)
    x = torch.randn(2, 13, E)
    cache = {"growing": mha.KVCache(), "preallocated": mha.KVCache(max_length=13),
             "rolling": mha.KVCache(window=left)}[cache_kind]
    with torch.no_grad():
        full = m(x, x, x, is_causal=True)
        steps = [m(x[:, t:t + 1], x[:, t:t + 1], x[:, t:t + 1], is_causal=True, cache=cache) for t in range(13)]
    assert_close(torch.cat(steps, dim=1), full, chain=True)
    if cache_kind == "rolling":
        assert cache.size == left


@pytest.mark.parametrize("name", ["plain", "gqa", "rope", "alibi", "everything"])
def test_prefill_then_decode(name):
    m = _module(**VARIANTS[name])
    x = torch.randn(2, 12, E)
    cache = mha.KVCache()
    with torch.no_grad():
        full = m(x, x, x, is_causal=True)
        prefill = m(x[:, :7], x[:, :7], x[:, :7], is_causal=True, cache=cache)
        chunk = m(x[:, 7:9], x[:, 7:9], x[:, 7:9], is_causal=True, cache=cache)  # a two-token chunk
        rest = [m(x[:, t:t + 1], x[:, t:t + 1], x[:, t:t + 1], is_causal=True, cache=cache) for t in range(9, 12)]
    assert_close(torch.cat([prefill, chunk, *rest], dim=1), full, chain=True)
    assert cache.lengths.tolist() == [12, 12]


@pytest.mark.parametrize("name", ["plain", "rope", "alibi", "gqa"])
def test_batch_of_different_lengths_equals_each_sequence_alone(name):
    m = _module(**VARIANTS[name])
    lengths = [6, 3]
    x = torch.randn(2, 6, E)
    padding = torch.tensor([[False] * 6, [False] * 3 + [True] * 3])  # right-padded prompts
    new = torch.randn(2, 4, E)  # four decoded tokens each
    cache = mha.KVCache()
    with torch.no_grad():
        prefill = m(x, x, x, key_padding_mask=padding, is_causal=True, cache=cache)
        steps = [m(new[:, t:t + 1], new[:, t:t + 1], new[:, t:t + 1], is_causal=True, cache=cache) for t in range(4)]
        for n, length in enumerate(lengths):
            alone = torch.cat([x[n:n + 1, :length], new[n:n + 1]], dim=1)
            want = m(alone, alone, alone, is_causal=True)
            assert_close(prefill[n:n + 1, :length], want[:, :length], chain=True)
            assert_close(torch.cat(steps, 1)[n:n + 1], want[:, length:], chain=True)
    assert cache.lengths.tolist() == [10, 7]


def test_gqa_matches_torch_sdpa_enable_gqa_and_shares_heads():
    m = _module(num_kv_heads=2)
    assert m.k_proj.weight.shape == (2 * D, E) and m.v_proj.weight.shape == (2 * D, E)
    x = torch.randn(2, 5, E)
    N, T = 2, 5
    q = m.q_proj(x).view(N, T, H, D).transpose(1, 2)
    k = m.k_proj(x).view(N, T, 2, D).transpose(1, 2)
    v = m.v_proj(x).view(N, T, 2, D).transpose(1, 2)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(m(x, x, x, is_causal=True), m.out_proj(o.transpose(1, 2).reshape(N, T, H * D)))


def test_sliding_window_flash_visits_only_the_band():
    """At T=512, w=16 the flash backend computes ~T*w scores: time is not asserted, the result is."""
    m = _module(window=(16, 0))
    x = torch.randn(1, 512, E)
    with torch.no_grad():
        got = m(x, x, x, is_causal=True, backend="flash")
        want = _reference(m, x, _causal(512, 16))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("options, error, words", [
    (dict(num_kv_heads=3), ValueError, ["num_kv_heads", "divide"]),
    (dict(rope=mha.RotaryEmbedding(16)), ValueError, ["rotary_dim", "dk=8"]),
    (dict(rope="yes"), TypeError, ["RotaryEmbedding"]),
    (dict(window=(2,)), ValueError, ["window"]),
    (dict(alibi=True, add_bias_kv=True), ValueError, ["add_bias_kv"]),
])
def test_constructor_errors(options, error, words):
    with pytest.raises(error) as info:
        mha.GeneralAttention(E, E, E, D, D, E, H, **options)
    assert all(w in str(info.value) for w in words)


def test_cache_errors():
    m = _module()
    x = torch.randn(2, 3, E)
    cache = mha.KVCache(max_length=4)
    with torch.no_grad():
        m(x, x, x, is_causal=True, cache=cache)
        with pytest.raises(ValueError, match="max_length=4"):
            m(x, x, x, is_causal=True, cache=cache)
        with pytest.raises(ValueError, match="batch of 2|one batch"):
            m(x[:1], x[:1], x[:1], cache=cache)
        with pytest.raises(ValueError, match="attn_mask"):
            m(x, x, x, attn_mask=torch.zeros(3, 3), cache=mha.KVCache())
    windowed = _module(window=(2, 0))
    with torch.no_grad(), pytest.raises(ValueError, match="padding"):
        windowed(x, x, x, key_padding_mask=torch.tensor([[False, False, True]] * 2), cache=mha.KVCache(window=2))
    with pytest.raises(ValueError, match="one or the other"):
        mha.KVCache(max_length=4, window=2)
    assert "growing" in repr(mha.KVCache())


def test_llama_layout_round_trip_with_fewer_kv_heads():
    from mha import layouts

    torch.manual_seed(1)
    llama = {"q_proj.weight": torch.randn(H * D, E), "k_proj.weight": torch.randn(2 * D, E),
             "v_proj.weight": torch.randn(2 * D, E), "o_proj.weight": torch.randn(E, H * D)}
    module = layouts.general_module(llama, "llama", num_heads=H)
    assert module.num_kv_heads == 2 and module.q_proj.bias is None
    back = layouts.from_general(module.state_dict(), "llama", H)
    assert all(torch.equal(back[k], llama[k]) for k in llama)
    x = torch.randn(1, 6, E)
    q = (x @ llama["q_proj.weight"].T).view(1, 6, H, D).transpose(1, 2)
    k = (x @ llama["k_proj.weight"].T).view(1, 6, 2, D).transpose(1, 2)
    v = (x @ llama["v_proj.weight"].T).view(1, 6, 2, D).transpose(1, 2)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2).reshape(1, 6, -1)
    with torch.no_grad():
        torch.testing.assert_close(module(x, x, x, is_causal=True), o @ llama["o_proj.weight"].T)
    with pytest.raises(ValueError, match="no GQA"):
        layouts.from_general(module.state_dict(), "torch")
    with pytest.raises(ValueError, match="multiple"):
        layouts.general_module(llama, "llama", num_heads=1)  # 1 head cannot share 2 kv heads


@pytest.mark.parametrize("kind", [dict(max_length=16), dict()], ids=["preallocated", "growing"])
def test_a_cropped_cache_continues_as_if_the_dropped_tokens_never_came(kind):
    torch.manual_seed(0)
    module = mha.GeneralAttention(8, 8, 8, 4, 4, 8, 2, rope=mha.RotaryEmbedding(4)).eval()
    prompt, draft, token = torch.randn(1, 5, 8), torch.randn(1, 3, 8), torch.randn(1, 1, 8)
    cropped, clean = mha.KVCache(**kind), mha.KVCache(**kind)
    with torch.no_grad():
        for cache in (cropped, clean):
            module(prompt, prompt, prompt, is_causal=True, cache=cache)
        module(draft, draft, draft, is_causal=True, cache=cropped)  # rejected draft tokens
        cropped.crop(5)
        torch.testing.assert_close(module(token, token, token, is_causal=True, cache=cropped),
                                   module(token, token, token, is_causal=True, cache=clean))
    assert cropped.lengths.tolist() == [6]
    with pytest.raises(ValueError, match=r"length must be in \[0, 6\]"):
        cropped.crop(7)


@pytest.mark.parametrize("kind", [dict(), dict(max_length=16)], ids=["growing", "preallocated"])
def test_chunks_after_padding_continue_each_sequence(kind):
    """After a padded prefill, a multi-token chunk without a mask continues each sequence at its own
    length (positions start + 0, 1, 2: a single-token step cannot tell + from -)."""
    m = _module(**VARIANTS["rope"])
    x, chunk = torch.randn(2, 5, E), torch.randn(2, 3, E)
    padding = torch.tensor([[False] * 5, [False] * 2 + [True] * 3])
    cache = mha.KVCache(**kind)
    with torch.no_grad():
        m(x, x, x, key_padding_mask=padding, is_causal=True, cache=cache)
        got = m(chunk, chunk, chunk, is_causal=True, cache=cache)
        for n, length in enumerate([5, 2]):
            alone = torch.cat([x[n:n + 1, :length], chunk[n:n + 1]], dim=1)
            assert_close(got[n:n + 1], m(alone, alone, alone, is_causal=True)[:, length:], chain=True)
    assert cache.lengths.tolist() == [8, 5]


def test_cache_positions_and_messages_are_exact():
    assert mha.KVCache().next_positions(2, 3, torch.device("meta")).device.type == "meta"  # the caller's device
    m = _module(**VARIANTS["rope"])
    cache = mha.KVCache()
    x = torch.randn(2, 4, E)
    with torch.no_grad():
        m(x, x, x, is_causal=True, cache=cache)
        with pytest.raises(ValueError, match=r"the cache holds a batch of 2 sequences, got 1$"):
            cache.next_positions(1, 1, x.device)
    rolling = mha.KVCache(window=4)
    with pytest.raises(ValueError, match=r"^a rolling cache \(window\) takes no key_padding_mask"):
        rolling.update(torch.zeros(1, 1, 2, D), torch.zeros(1, 1, 2, D), None, torch.ones(1, 2, dtype=torch.bool))


def test_cache_bookkeeping_stays_on_the_keys_device():
    """On the "meta" device (shapes only): every tensor the cache makes follows the keys' device,
    so a CUDA cache never mixes in CPU tensors (a mixed step raises)."""
    meta = torch.device("meta")
    for kind in (dict(), dict(max_length=8)):
        cache = mha.KVCache(**kind)
        keys = torch.zeros(2, 1, 3, 4, device=meta)
        cache.update(keys, keys, None)  # uniform first, then padding arrives
        valid = torch.ones(2, 2, dtype=torch.bool, device=meta)
        cache.update(keys[:, :, :2], keys[:, :, :2], cache.next_positions(2, 2, meta, valid), valid)
        step = cache.next_positions(2, 1, meta)
        k, v, positions, valid = cache.update(keys[:, :, :1], keys[:, :, :1], step)
        assert {t.device.type for t in (step, k, v, positions, valid, cache.lengths)} == {"meta"}


@pytest.mark.parametrize("kind", [dict(), dict(max_length=8)], ids=["growing", "preallocated"])
def test_padding_after_a_uniform_prefix_tracks_each_sequence(kind):
    """The cache's state, by value and dtype, when padding first arrives after uniform steps, and
    after cropping a tracked cache: positions int64, validity bool, lengths per sequence."""
    cache = mha.KVCache(**kind)
    prefix, chunk = torch.randn(2, 1, 3, D), torch.randn(2, 1, 2, D)
    cache.update(prefix, prefix, None)
    valid = torch.tensor([[True, False], [True, True]])
    keys, values, positions, seen_valid = cache.update(chunk, chunk, cache.next_positions(2, 2, "cpu", valid), valid)
    assert torch.equal(keys, torch.cat([prefix, chunk], dim=2)) and torch.equal(values, keys)
    assert positions.dtype == torch.long and seen_valid.dtype == torch.bool and cache.lengths.dtype == torch.long
    assert positions.tolist() == [[0, 1, 2, 3, 4]] * 2  # a padded slot takes the next position, unseen
    assert seen_valid.tolist() == [[True] * 4 + [False], [True] * 5]
    assert cache.lengths.tolist() == [4, 5]
    assert cache.next_positions(2, 1, "cpu").tolist() == [[4], [5]]
    cache.crop(4)
    assert (cache.size, cache.keys.shape, cache.values.shape) == (4, (2, 1, 4, D), (2, 1, 4, D))
    assert cache.positions.tolist() == [[0, 1, 2, 3]] * 2 and cache.valid.tolist() == [[True] * 4] * 2
    assert cache.lengths.tolist() == [4, 4] and cache.next_positions(2, 1, "cpu").tolist() == [[4], [4]]
    cache.crop(4)  # the whole filled length is a valid crop
    assert cache.size == 4
    cache.crop(0)  # and nothing
    assert cache.size == 0 and cache.lengths.tolist() == [0, 0]


def test_cache_crop_and_repr_messages_are_exact():
    assert repr(mha.KVCache()) == "KVCache(growing, size=0)"
    assert repr(mha.KVCache(max_length=8)) == "KVCache(max_length=8, size=0)"
    assert repr(mha.KVCache(window=4)) == "KVCache(window=4, size=0)"
    with pytest.raises(ValueError, match=r"^a rolling cache \(window\) cannot be cropped: it has dropped its oldest keys$"):
        mha.KVCache(window=4).crop(0)
    with pytest.raises(TypeError, match=r"^length must be an int"):
        mha.KVCache().crop(1.5)
    with pytest.raises(ValueError, match=r"^length must be in \[0, 0\] \(the filled slots\), got -1$"):
        mha.KVCache().crop(-1)


@pytest.mark.parametrize("name, new_keys, new_values", [
    ("keys", (2, 1, 1, 4, torch.float64), (2, 1, 1, 5, torch.float32)),
    ("values", (2, 1, 1, 4, torch.float32), (2, 1, 1, 5, torch.float64)),
    ("keys", (2, 2, 1, 4, torch.float32), (2, 1, 1, 5, torch.float32)),
    ("values", (2, 1, 1, 4, torch.float32), (2, 2, 1, 5, torch.float32)),
    ("keys", (2, 1, 1, 3, torch.float32), (2, 1, 1, 5, torch.float32)),
    ("values", (2, 1, 1, 4, torch.float32), (2, 1, 1, 6, torch.float32)),
])
def test_a_cache_refuses_keys_or_values_unlike_the_stored_ones(name, new_keys, new_values):
    """Keys and values are checked each on its own: one unlike the stored ones is named exactly."""
    cache = mha.KVCache()
    cache.update(torch.zeros(2, 1, 3, 4), torch.zeros(2, 1, 3, 5), None)
    keys, values = (torch.zeros(*shape[:4], dtype=shape[4]) for shape in (new_keys, new_values))
    stored, new = (cache.keys, keys) if name == "keys" else (cache.values, values)
    if new.dtype != stored.dtype:
        message = f"the cache holds {name} of dtype torch.float32 on cpu, got torch.float64 on cpu"
    else:
        message = (f"the cache holds {name} of shape (B, Hkv, S, D) = (2, 1, S, {stored.shape[3]}), got new {name} "
                   f"of shape {tuple(new.shape)}: a cache serves one module and one batch")
    with raises_exactly(ValueError, message):
        cache.update(keys, values, None)
    assert cache.size == 3


def test_cache_construction_and_attachment_messages_are_exact():
    with raises_exactly(ValueError, "max_length must be greater than 0, got 0"):
        mha.KVCache(max_length=0)
    with raises_exactly(ValueError, "window must be greater than 0, got -2"):
        mha.KVCache(window=-2)
    with raises_exactly(ValueError, "a rolling cache (window) needs no max_length; pass one or the other"):
        mha.KVCache(max_length=4, window=2)
    x = torch.randn(1, 3, E)
    cache, first = mha.KVCache(), _module()
    with torch.no_grad():
        first(x, x, x, is_causal=True, cache=cache)
        with raises_exactly(ValueError, "this KVCache holds the keys of another attention module; give each module "
                                  "(each layer) its own KVCache"):
            _module()(x, x, x, is_causal=True, cache=cache)
    rolling = "KVCache(window=4) keeps the last 4 positions, but the module has {}: decoding would miss keys the " \
              "cache dropped; use a growing cache or KVCache(window >= the module's left window)"
    for window, seen in ((None, "no sliding window (it sees every past key)"), ((-1, 0), "no sliding window (it sees "
                         "every past key)"), ((6, 0), "window=(6, 0)")):
        with torch.no_grad(), raises_exactly(ValueError, rolling.format(seen)):
            _module(window=window)(x, x, x, is_causal=True, cache=mha.KVCache(window=4))


def test_a_cropped_cache_counts_the_valid_tokens_it_keeps():
    cache = mha.KVCache()
    cache.update(torch.zeros(2, 1, 3, D), torch.zeros(2, 1, 3, D), None)
    valid = torch.tensor([[True, False, False], [True, True, True]])
    cache.update(torch.zeros(2, 1, 3, D), torch.zeros(2, 1, 3, D), cache.next_positions(2, 3, "cpu", valid), valid)
    cache.crop(5)  # keeps the first padded slot of sequence 0
    assert cache.lengths.tolist() == [4, 5] and cache.next_positions(2, 1, "cpu").tolist() == [[4], [5]]


def test_a_rolling_cache_counts_what_it_dropped_in_int64():
    cache = mha.KVCache(window=3)
    for _ in range(3):
        cache.update(torch.zeros(1, 1, 2, D), torch.zeros(1, 1, 2, D), None)
    assert cache.size == 3 and cache.lengths.tolist() == [6] and cache.lengths.dtype == torch.long
    positions = cache.next_positions(1, 2, "cpu")
    assert positions.tolist() == [[6, 7]] and positions.dtype == torch.long


@pytest.mark.parametrize("kind", [dict(), dict(max_length=16), dict(quantize="int8"), dict(max_length=16, quantize="int8"),
                                  dict(window=6)], ids=["growing", "preallocated", "int8", "int8 preallocated", "rolling"])
@pytest.mark.parametrize("padded", [False, True], ids=["uniform", "padded"])
def test_a_selected_cache_decodes_the_sequences_it_kept(kind, padded):
    """select([2, 0, 0]) after a prefill of three sequences: the next steps equal a cache that only
    ever held those (sequence 0 twice: beam search's copies), every kind of cache."""
    if padded and (kind.get("quantize") or kind.get("window")):
        pytest.skip("an 8-bit or a rolling cache takes sequences of one length")
    m = _module(**VARIANTS["everything"] if "window" in kind else VARIANTS["rope"])
    g = torch.Generator().manual_seed(5)
    x, steps = torch.randn(3, 5, E, generator=g), torch.randn(3, 3, 1, E, generator=g)
    padding = torch.tensor([[False] * 5, [False] * 3 + [True] * 2, [False] * 4 + [True]]) if padded else None
    order = [2, 0, 0]
    selected, alone = mha.KVCache(**kind), mha.KVCache(**kind)
    with torch.no_grad():
        m(x, x, x, key_padding_mask=padding, is_causal=True, cache=selected)
        selected.select(order)
        m(x[order], x[order], x[order], key_padding_mask=None if padding is None else padding[order], is_causal=True,
          cache=alone)
        for t in range(3):
            token = steps[t][order]
            assert_close(m(token, token, token, is_causal=True, cache=selected),
                         m(token, token, token, is_causal=True, cache=alone), chain=True)
    if padded:
        assert selected.lengths.tolist() == [7, 8, 8]  # 4 + 3 steps, 5 + 3


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_a_growing_cache_writes_each_step_into_its_buffers_and_concatenates_under_autograd(quantize):
    """Under no_grad a growing cache's steps write into buffers with room (mha.kernels.storage.append):
    the same buffers from the prompt on, the outputs of a preallocated cache. With gradients (float),
    each step concatenates, and the prompt's keys get gradients through later steps."""
    m = _module(**VARIANTS["rope"])
    g = torch.Generator().manual_seed(6)
    prompt, steps = torch.randn(2, 5, E, generator=g), torch.randn(4, 2, 1, E, generator=g)
    growing, preallocated = mha.KVCache(quantize=quantize), mha.KVCache(max_length=9, quantize=quantize)
    with torch.no_grad():
        for cache in (growing, preallocated):
            m(prompt, prompt, prompt, is_causal=True, cache=cache)
        buffers = growing.keys.data_ptr(), growing.values.data_ptr()
        for token in steps:
            assert torch.equal(m(token, token, token, is_causal=True, cache=growing),
                               m(token, token, token, is_causal=True, cache=preallocated))
    assert (growing.keys.data_ptr(), growing.values.data_ptr()) == buffers and growing.size == 9
    if quantize:
        return
    x = prompt.clone().requires_grad_()
    cache = mha.KVCache()
    m(x, x, x, is_causal=True, cache=cache)
    first = cache.keys.data_ptr()
    m(steps[0], steps[0], steps[0], is_causal=True, cache=cache).sum().backward()
    assert cache.keys.data_ptr() != first and x.grad is not None and x.grad.abs().sum() > 0


def test_select_refuses_what_is_not_a_list_of_sequences():
    cache = mha.KVCache()
    cache.update(torch.zeros(2, 1, 3, D), torch.zeros(2, 1, 3, D), None)
    for bad in ([2], [[0, 1]], [0.5], [True, False]):
        with pytest.raises(ValueError, match=r"indices must be a 1-D list of sequences of the batch \(0..1\)"):
            cache.select(bad)
    cache.select([])
    assert cache.keys.shape[0] == 0


def test_the_scales_apart_are_deprecated_and_still_given():
    cache = mha.KVCache(quantize="int8")
    keys, values = torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 4)
    with pytest.warns(DeprecationWarning, match="update_quantized is deprecated"):
        k8, v8, k_scales, v_scales = cache.update_quantized(keys, values)
    rows, scales = mha.kernels.quantize.quantize_int8(values)
    assert torch.equal(v8, rows) and torch.equal(v_scales, scales) and k8.shape == (2, 2, 3, 8)
    for name in ("key_scales", "value_scales"):
        with pytest.warns(DeprecationWarning, match=f"KVCache.{name} is deprecated"):
            assert getattr(cache, name).shape == (2, 2, 3)
    paged = mha.PagedKVCache(num_blocks=2, block_size=4, num_kv_heads=2, head_dim=8, quantize="int8")
    with pytest.warns(DeprecationWarning, match="page_scales is deprecated"):
        assert paged.page_scales(0) == {}
    with pytest.warns(DeprecationWarning, match="PagedKVCache.value_scales is deprecated"):
        assert [s.shape for s in paged.value_scales] == [(2, 2, 4)]


_PADDED = dict(key_padding_mask=torch.tensor([[False] * 4 + [True]] * 2))  # a prompt of 4 tokens and 5 in the batch


@pytest.mark.parametrize("options, cache, steps, taken", [
    (dict(), dict(), [(6, {}), (1, {})], [True, True]),  # the prompt (top-left causal), a decoding step (nothing masked)
    (dict(num_kv_heads=2, rope=mha.RotaryEmbedding(D)), dict(max_length=12), [(5, {}), (1, {}), (1, {})], [True] * 3),
    (dict(), dict(), [(5, {}), (3, {})], [True, False]),  # a chunk after the prompt: bottom-right causality
    (dict(alibi=True), dict(), [(5, {}), (1, {})], [False, False]),  # a term of the module's own
    (dict(softcap=30.0), dict(), [(5, {}), (1, {})], [False, False]),
    (dict(window=(2, 0)), dict(), [(5, {}), (1, {})], [False, False]),  # a band torch's call does not take
    (dict(), dict(), [(5, dict(backend="math")), (1, dict(backend="math"))], [False, False]),
    (dict(), dict(), [(5, _PADDED), (1, {})], [False, False]),  # padding: each sequence's keys
], ids=["plain", "gqa rope preallocated", "chunk", "alibi", "softcap", "window", "backend math", "padding"])
def test_a_cached_step_torch_takes_as_it_is_builds_no_contract_and_keeps_the_bits(monkeypatch, options, cache, steps,
                                                                                 taken):
    """attend_positional hands torch's call a cached step whose only term is a band it takes
    (dispatch.plain_attention: the prompt's top-left causality, a decoding step's nothing) before
    building a contract; the same bits as the full path (plain_attention declining)."""
    from mha.kernels import dispatch
    real, answers = dispatch.plain_attention, []
    x = torch.randn(2, sum(T for T, _ in steps), E) * 3  # sharp scores: a dropped term shows
    outputs = {}
    for way in ("fast", "full"):
        module, kv = _module(**options), mha.KVCache(**cache)
        monkeypatch.setattr(dispatch, "plain_attention", (lambda *a, **kw: answers.append(real(*a, **kw)) or answers[-1])
                            if way == "fast" else (lambda *a, **kw: None))
        start, outputs[way] = 0, []
        for i, (T, call) in enumerate(steps):
            chunk = x[:, start:start + T]
            with torch.no_grad():
                outputs[way].append(module(chunk, chunk, chunk, is_causal=True, cache=kv, **call))
            if way == "fast":
                assert any(a is not None for a in answers) == taken[i], f"step {i}"
                answers.clear()
            start += T
    for fast, full in zip(outputs["fast"], outputs["full"]):
        assert torch.equal(fast, full)


def test_a_step_whose_cache_marks_padding_keys_takes_the_full_path():
    """A cache (the protocol of mha.modules.pipeline.attend_positional) may hand back key_valid without
    positions: the padding is then the contract's, never dropped by torch's plain call."""
    from mha.modules.cache import Seen
    from mha.modules.pipeline import attend_positional

    q, k, v = torch.randn(3, 2, 2, 1, D).unbind(0)  # (B, H, L, D): one new token
    keys, values = torch.randn(2, 2, 2, 5, D).unbind(0)  # (B, Hkv, S, D)
    key_valid = torch.tensor([[True, True, False, True, True], [True] * 5])

    class Marking:  # a uniform cache that marks one key of the first sequence as padding
        uniform, reads_pages = True, False

        def store(self, *_):
            return Seen(keys, values, key_valid=key_valid)

    out, _ = attend_positional(q, k, v, cache=Marking(), is_causal=True)
    expected = F.scaled_dot_product_attention(q, keys, values, attn_mask=key_valid[:, None, None, :])
    assert_close(out, expected)
