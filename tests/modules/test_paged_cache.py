"""mha.PagedKVCache: pages from a free list, block tables, appends by slot, freeing, prefix
sharing by content hash, copy on write; and a serving loop over it equal to dense attention."""

import pytest
import torch

import mha
from mha.kernels import paged_attention, storage


def _cache(**options):
    settings = dict(num_blocks=8, block_size=4, num_kv_heads=2, head_dim=3, num_layers=2)
    settings.update(options)
    return mha.PagedKVCache(**settings)


def _fill(cache, slots, seed=0):
    """Write distinct keys/values at ``slots`` in every layer; returns them per layer."""
    g = torch.Generator().manual_seed(seed)
    written = []
    for layer in range(cache.num_layers):
        k = torch.randn(len(slots), cache.num_kv_heads, cache.head_dim, generator=g)
        v = torch.randn(len(slots), cache.num_kv_heads, cache.value_dim, generator=g)
        cache.write(layer, slots, k, v)
        written.append((k, v))
    return written


def _keys(cache, seq_id, layer=0):
    """A sequence's keys, read back through its block table: (S, Hkv, D)."""
    table, S = cache.block_table([seq_id])[0], int(cache.lengths([seq_id])[0])
    pages = cache.keys[layer][table[table >= 0].long()]  # (n, Hkv, P, D)
    return pages.permute(0, 2, 1, 3).flatten(0, 1)[:S]  # (n, Hkv, P, D) -> (n * P, Hkv, D) -> (S, Hkv, D)


def test_blocks_come_from_the_free_list_and_return_to_it():
    cache = _cache()
    a, cached = cache.add()
    b, _ = cache.add()
    assert cached == 0 and cache.free_blocks == 8
    slots = cache.reserve([a, b], [5, 1])
    assert len(slots) == 6
    assert cache.lengths([a, b]).tolist() == [5, 1] and cache.free_blocks == 8 - 3
    table = cache.block_table([a, b])
    assert table.shape == (2, 2) and table[1, 1] == -1 and table.dtype == torch.int32
    assert slots.tolist()[:5] == [table[0, 0] * 4 + i for i in range(4)] + [table[0, 1] * 4]
    written = _fill(cache, slots)
    torch.testing.assert_close(_keys(cache, a), written[0][0][:5])
    cache.free(a)
    assert cache.free_blocks == 8 - 1
    with pytest.raises(ValueError, match="seq_id 0 is not a sequence of this cache"):
        cache.lengths([a])


def test_a_step_that_does_not_fit_changes_nothing():
    cache = _cache(num_blocks=2)
    a, _ = cache.add()
    cache.reserve([a], [3])
    b, _ = cache.add()
    with pytest.raises(RuntimeError, match="PagedKVCache is full: this step needs 2 free blocks, 1 are left"):
        cache.reserve([a, b], [2, 1])
    assert cache.lengths([a, b]).tolist() == [3, 0] and cache.free_blocks == 1


def test_a_shared_prompt_prefix_uses_the_same_full_blocks():
    cache = _cache()
    prompt = list(range(100, 110))  # 10 tokens: 2 full blocks of 4, and 2 more
    a, cached = cache.add(prompt)
    assert cached == 0
    slots = cache.reserve([a], [10], tokens=[prompt])
    _fill(cache, slots)
    b, cached = cache.add(prompt[:9] + [7, 8])  # the same first 8 tokens: 2 blocks shared
    c, cached_c = cache.add([5] + prompt[1:])  # differs in the first token: nothing shared
    assert cached == 8 and cached_c == 0
    assert cache.block_table([b])[0, :2].tolist() == cache.block_table([a])[0, :2].tolist()
    assert cache.free_blocks == 8 - 3
    before = _keys(cache, a)[:8].clone()
    cache.free(a)
    assert cache.free_blocks == 8 - 2  # a's last block only: the first two are b's too
    torch.testing.assert_close(_keys(cache, b)[:8], before)
    cache.free(b)
    assert cache.free_blocks == 8
    d, cached_d = cache.add(prompt)  # b's blocks were freed with it: nothing left to share
    assert cached_d == 0 and d != b


def test_the_last_prompt_token_is_always_computed():
    cache = _cache()
    prompt = list(range(8))  # exactly 2 full blocks
    a, _ = cache.add(prompt)
    _fill(cache, cache.reserve([a], [8], tokens=[prompt]))
    b, cached = cache.add(prompt)
    assert cached == 4  # the second block holds the last token, whose query gives the next logits


def test_blocks_are_shareable_only_once_their_step_is_written():
    cache = _cache()
    prompt = list(range(8))
    a, _ = cache.add(prompt)
    cache.reserve([a], [8], tokens=[prompt])
    # reserve then add before the writes would share unwritten blocks: add registers the blocks of the
    # step before (written by now, by the protocol reserve -> write -> attend)
    b, cached = cache.add(prompt + [1])
    assert cached == 8


def test_fork_shares_and_copies_a_shared_partial_block_on_write():
    cache = _cache()
    a, _ = cache.add()
    first = _fill(cache, cache.reserve([a], [6]))
    child = cache.fork(a)
    assert cache.block_table([child]).tolist() == cache.block_table([a]).tolist()
    free = cache.free_blocks
    slot = cache.reserve([child], [1])
    assert cache.free_blocks == free - 1  # the partial block copied
    assert cache.block_table([child])[0, 0] == cache.block_table([a])[0, 0]  # the full one still shared
    assert cache.block_table([child])[0, 1] != cache.block_table([a])[0, 1]
    _fill(cache, slot, seed=1)
    for layer in range(2):
        torch.testing.assert_close(_keys(cache, child, layer)[:6], first[layer][0])  # the copy kept every layer
        torch.testing.assert_close(_keys(cache, a, layer), first[layer][0])  # the parent unchanged


def test_crop_frees_the_blocks_past_the_kept_tokens_and_rewrites_the_last_one_safely():
    """crop(seq, 6) of 10 tokens: the third block returns to the pool, the second (partial now) is
    written anew without touching a sequence that shares it or offering stale keys to a new prompt."""
    cache = _cache()
    prompt = list(range(100, 110))
    a, _ = cache.add(prompt)
    first = _fill(cache, cache.reserve([a], [10], tokens=[prompt]))
    cache.crop(a, 6)
    assert cache.lengths([a]).tolist() == [6] and cache.free_blocks == 8 - 2
    assert cache.block_table([a]).shape == (1, 2)
    torch.testing.assert_close(_keys(cache, a), first[0][0][:6])
    _fill(cache, cache.reserve([a], [2], tokens=[[7, 7]]), seed=3)  # block 2 (tokens 4..7) written anew
    b, cached = cache.add(prompt)  # its block 2 no longer holds prompt[4:8]: only block 1 is shared
    assert cached == 4
    c = cache.fork(a)  # a shared partial block: a crop of one, then a write, copies it
    cache.crop(c, 5)
    before = _keys(cache, a).clone()
    _fill(cache, cache.reserve([c], [1]), seed=4)
    assert cache.block_table([c])[0, 1] != cache.block_table([a])[0, 1]
    torch.testing.assert_close(_keys(cache, a), before)
    torch.testing.assert_close(_keys(cache, c)[:5], before[:5])
    cache.crop(c, 0)
    assert cache.lengths([c]).tolist() == [0] and cache.block_table([c]).shape == (1, 0)
    with pytest.raises(ValueError, match="length must be between 0 and the sequence's 8 tokens, got 9"):
        cache.crop(a, 9)
    with pytest.raises(TypeError, match="length must be an int"):
        cache.crop(a, 2.0)


@pytest.mark.parametrize(("call", "error", "message"), [
    (lambda c, a: c.reserve([a], [1, 2]), ValueError, "counts must give one count >= 0 per distinct sequence"),
    (lambda c, a: c.reserve([a, a], [1, 1]), ValueError, "per distinct sequence"),
    (lambda c, a: c.reserve([a], [2], tokens=[[1]]), ValueError, "tokens must give 2 ids"),
    (lambda c, a: c.write(2, torch.tensor([0]), torch.zeros(1, 2, 3), torch.zeros(1, 2, 3)), ValueError,
     "layer must be an int in 0..1"),
    (lambda c, a: c.write(0, torch.tensor([0]), torch.zeros(1, 2, 4), torch.zeros(1, 2, 3)), ValueError,
     r"keys must be \(1, 2, 3\)"),
    (lambda c, a: c.add(["x"]), TypeError, "tokens must be token ids"),
    (lambda c, a: c.fork(99), ValueError, "seq_id 99 is not a sequence"),
])
def test_bad_calls_are_refused_naming_the_argument(call, error, message):
    cache = _cache()
    a, _ = cache.add()
    with pytest.raises(error, match=message):
        call(cache, a)


@pytest.mark.parametrize("options", [dict(num_blocks=0), dict(block_size=-1), dict(dtype=torch.int64)])
def test_bad_sizes_are_refused(options):
    with pytest.raises((ValueError, TypeError)):
        _cache(**options)


@torch.no_grad()
def _serve(cache, seq_ids, counts, H):
    """One step of layer 0: room reserved for ``counts`` new tokens of each sequence, random keys and
    values written; returns the new rows' q (T, H, D), k, v (T, Hkv, D) and cu_seqlens_q (B + 1,)."""
    slots = cache.reserve(seq_ids, counts)
    T = sum(counts)
    q, k, v = torch.randn(T, H, cache.head_dim), torch.randn(T, cache.num_kv_heads, cache.head_dim), \
        torch.randn(T, cache.num_kv_heads, cache.value_dim)
    cache.write(0, slots, k, v)
    return q, k, v, torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])


def test_a_serving_loop_equals_dense_attention_for_each_sequence():
    """Two prompts of different lengths prefilled in one step, then decoding steps for both (and a
    third sequence joining late): every step's paged attention equals each sequence's dense causal
    attention over all its keys so far."""
    torch.manual_seed(0)
    H, Hkv, D = 4, 2, 8
    cache = mha.PagedKVCache(num_blocks=16, block_size=3, num_kv_heads=Hkv, head_dim=D)
    history = {}  # seq -> (keys (S, Hkv, D), values)

    def step(seq_ids, counts):
        q, k, v, cu = _serve(cache, seq_ids, counts, H)
        out = paged_attention(q, *cache.pages(0), cache.block_table(seq_ids), cu, cache.lengths(seq_ids))
        for b, seq in enumerate(seq_ids):
            rows = slice(int(cu[b]), int(cu[b + 1]))
            old_k, old_v = history.get(seq, (k[:0], v[:0]))
            history[seq] = (torch.cat([old_k, k[rows]]), torch.cat([old_v, v[rows]]))
            keys, values = (x.transpose(0, 1)[None] for x in history[seq])  # (S, Hkv, D) -> (1, Hkv, S, D)
            want = mha.functional.scaled_dot_product_attention(
                q[rows].transpose(0, 1)[None], keys, values, is_causal=True, causal_alignment="bottom_right",
                enable_gqa=True, backend="math")[0].transpose(0, 1)
            torch.testing.assert_close(out[rows], want, atol=1e-5, rtol=1e-5)

    a, _ = cache.add()
    b, _ = cache.add()
    step([a, b], [7, 2])
    for _ in range(3):
        step([a, b], [1, 1])
    c, _ = cache.add()
    step([a, c, b], [1, 5, 1])  # a prefill chunk among decode rows
    cache.free(b)
    step([c, a], [2, 1])


@pytest.mark.parametrize("options", [dict(), dict(window=(3, 0)), dict(alibi=True, rope=None), dict(softcap=2.0),
                                     dict(sinks=True)], ids=lambda o: ",".join(o) or "rope")
@torch.no_grad()
def test_general_attention_over_a_paged_step_equals_a_kv_cache_per_sequence(options):
    """Two layers of mha.GeneralAttention (RoPE, GQA, sharpened q/k so that attention decides) over one
    PagedKVCache: sequences of 5, 2 and 7 prompt tokens prefilled right-padded in one step, then
    decoding steps, a sequence leaving; each sequence's output equals the same layers run on that
    sequence alone with a KVCache per layer (the contiguous cache's proven path)."""
    torch.manual_seed(0)
    options = dict(options)
    extra = {"rope": mha.RotaryEmbedding(8)} if options.pop("rope", True) is not None else {}
    if options.pop("alibi", False):
        extra["alibi"] = True
    if options.pop("sinks", False):
        extra["sinks"] = True
    layers = [mha.GeneralAttention(16, 16, 16, 8, 8, 16, 4, num_kv_heads=2, **extra, **options).eval() for _ in range(2)]
    for m in layers:
        m.q_proj.weight.mul_(3.0)  # sharpen: attention must decide
        m.k_proj.weight.mul_(3.0)
    paged = mha.PagedKVCache(num_blocks=32, block_size=4, num_kv_heads=2, head_dim=8, num_layers=2)
    alone = {}  # sequence -> [KVCache per layer]
    tokens = {}

    def run(x, caches):
        for m, cache in zip(layers, caches):
            x = m(x, x, x, is_causal=True, cache=cache)
        return x

    def step(seq_ids, counts):
        L = max(counts)
        x = torch.zeros(len(seq_ids), L, 16)
        for b, (seq, n) in enumerate(zip(seq_ids, counts)):
            x[b, :n] = torch.randn(n, 16)
            tokens.setdefault(seq, []).append(x[b, :n].clone())
        out = run(x, [paged.step(seq_ids, counts)] * 2)
        for b, (seq, n) in enumerate(zip(seq_ids, counts)):
            caches = alone.setdefault(seq, [mha.KVCache(), mha.KVCache()])
            want = run(x[b:b + 1, :n], caches)[0]
            torch.testing.assert_close(out[b, :n], want, atol=2e-5, rtol=1e-5)
            assert not out[b, n:].any()  # padding rows: zeros

    a, _ = paged.add()
    b, _ = paged.add()
    c, _ = paged.add()
    step([a, b, c], [5, 2, 7])
    for _ in range(3):
        step([a, b, c], [1, 1, 1])
    paged.free(b)
    step([c, a], [2, 1])


def test_a_paged_step_refuses_weights_and_more_layers_than_it_has():
    m = mha.GeneralAttention(8, 8, 8, 4, 4, 8, 2, rope=mha.RotaryEmbedding(4)).eval()
    paged = mha.PagedKVCache(num_blocks=4, block_size=2, num_kv_heads=2, head_dim=4)
    a, _ = paged.add()
    x = torch.randn(1, 2, 8)
    with pytest.raises(ValueError, match="serves inference: no weights"):
        m.forward_with_weights(x, x, x, is_causal=True, cache=paged.step([a], [2]))
    other = mha.GeneralAttention(8, 8, 8, 4, 4, 8, 2, rope=mha.RotaryEmbedding(4)).eval()
    with torch.no_grad(), pytest.raises(ValueError, match="this PagedKVCache has 1 layers, all taken"):
        step = paged.step([a], [1])
        m(x[:, :1], x[:, :1], x[:, :1], is_causal=True, cache=step)
        other(x[:, :1], x[:, :1], x[:, :1], is_causal=True, cache=step)


@torch.no_grad()
def _kept(cache, seq_id, layer=0):
    """(keys (S, Hkv, D), values (S, Hkv, Dv)) float64 of a sequence, read from its pages as kept."""
    P, S = cache.block_size, int(cache.lengths([seq_id])[0])
    slots = torch.arange(S)
    pages = cache.block_table([seq_id])[0].long()[slots // P]
    return tuple(storage.load(pool[pages, :, slots % P], torch.float64) for pool in cache.pages(layer))


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_a_paged_cache_keeps_what_it_was_given_and_a_copy_keeps_all_of_it(quantize):
    """Each row read back from the pages is the row written (int8: within half a level of it, its
    own scale: keys and values of different widths and ranges), and the copy a shared partial page
    gets before a write holds that page's keys and values, scales and all."""
    cache = mha.PagedKVCache(num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8, value_dim=4, quantize=quantize)
    g = torch.Generator().manual_seed(4)
    k, v = torch.randn(6, 2, 8, generator=g) * 30, torch.randn(6, 2, 4, generator=g) / 30
    a, _ = cache.add()
    cache.write(0, cache.reserve([a], [6]), k, v)
    for got, given in zip(_kept(cache, a), (k, v)):
        step = given.abs().amax(-1, keepdim=True).double() / 127 if quantize else 0
        assert bool(((got - given.double()).abs() <= step / 2 * (1 + 1e-6)).all())
    before = _kept(cache, a)
    b = cache.fork(a)  # page 1 (slots 4, 5) is partial and shared
    cache.write(0, cache.reserve([b], [1]), torch.randn(1, 2, 8), torch.randn(1, 2, 4))
    assert cache.block_table([b])[0, 1] != cache.block_table([a])[0, 1]  # copied
    for got, kept in zip(_kept(cache, b), before):
        assert torch.equal(got[:6], kept)


def test_a_paged_int8_cache_serves_a_batch_and_copies_scales_on_write():
    """PagedKVCache(quantize="int8"): a prefill of two sequences then decoding steps, and a fork whose
    shared partial page is copied before it is written: each step equals math over the dequantized
    pages; the copy carries the page's scales."""
    torch.manual_seed(0)
    H, Hkv, D = 4, 2, 8
    cache = mha.PagedKVCache(num_blocks=16, block_size=3, num_kv_heads=Hkv, head_dim=D, quantize="int8")
    assert cache.keys[0].dtype == torch.int8 and "quantize='int8'" in repr(cache)
    a, _ = cache.add()
    b, _ = cache.add()

    def step(seq_ids, counts):
        q, _, _, cu = _serve(cache, seq_ids, counts, H)
        table, lengths = cache.block_table(seq_ids), cache.lengths(seq_ids)
        got = paged_attention(q, *cache.pages(0), table, cu, lengths)
        pages = [storage.load(x, torch.float32) for x in cache.pages(0)]
        want = paged_attention(q, *pages, table, cu, lengths, backend="math")
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)

    step([a, b], [7, 2])
    step([a, b], [1, 1])
    c = cache.fork(a)  # a has 8 keys: its last page (3 slots) is partial and now shared
    step([c, a], [1, 1])  # c's write copies the page (keys, values and scales) first
    assert cache.block_table([c])[0, 2] != cache.block_table([a])[0, 2]
    step([a, b, c], [1, 3, 2])
