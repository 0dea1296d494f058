"""mha.masks: every entry of each adapter's result against the mask written out by hand.

The expected tensors are built with loops over (b, h, i, j) from the convention torch documents,
not with the reshapes and inversions under test.
"""

import itertools

import pytest
import torch

from helpers.exact import raises_exactly
from mha import masks

B, H, L, S = 2, 3, 4, 5


def _random_bool(shape, seed):
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed)) < 0.4


def _per_entry(fill, dtype=None):
    """A (B, H, L, S) tensor whose entry [b, h, i, j] is fill(b, h, i, j)."""
    index = itertools.product(range(B), range(H), range(L), range(S))
    return torch.tensor([fill(*bhij) for bhij in index], dtype=dtype).reshape(B, H, L, S)  # (B*H*L*S,) -> (B, H, L, S)


def _attends(mask, key_valid):
    """The contract's meaning, entry by entry: True where query i of head h in sequence b sees key j."""
    full = torch.ones(B, H, L, S, dtype=torch.bool)
    if mask is not None:
        full &= mask.expand(B, H, L, S) if mask.dtype == torch.bool else mask.expand(B, H, L, S).isfinite()
    if key_valid is not None:
        full &= key_valid[:, None, None, :]
    return full


def test_multihead_bool_masks_are_inverted_and_indexed_b_times_h_plus_h():
    attn = _random_bool((B * H, L, S), 0)  # torch: True = masked out, row b * H + h
    padding = _random_bool((B, S), 1)
    like = torch.empty(B, L, 8)
    mask, key_valid = masks.from_multihead(attn, padding, batch=B, num_heads=H, L=L, S=S, batched=True, like=like)
    want = _per_entry(lambda b, h, i, j: not attn[b * H + h, i, j] and not padding[b, j])
    assert torch.equal(_attends(mask, key_valid), want)


def test_multihead_two_dimensional_and_unbatched_masks():
    attn = _random_bool((L, S), 2)
    mask, key_valid = masks.from_multihead(attn, None, batch=B, num_heads=H, L=L, S=S, batched=True,
                                      like=torch.empty(B, L, 8))
    assert key_valid is None
    assert torch.equal(_attends(mask, None), _per_entry(lambda b, h, i, j: not attn[i, j]))
    per_head = _random_bool((H, L, S), 3)  # unbatched: one mask per head
    padding = _random_bool((S,), 4)
    mask, key_valid = masks.from_multihead(per_head, padding, batch=1, num_heads=H, L=L, S=S, batched=False,
                                      like=torch.empty(L, 8))
    assert key_valid.shape == (1, S)
    got = (mask.expand(1, H, L, S) & key_valid[:, None, None, :])[0]
    want = torch.tensor([[[not per_head[h, i, j] and not padding[j] for j in range(S)] for i in range(L)]
                         for h in range(H)])
    assert torch.equal(got, want)


def test_multihead_float_padding_is_added_to_the_mask_as_torch_adds_them():
    attn = torch.randn(B * H, L, S, dtype=torch.float64)
    padding = torch.randn(B, S, dtype=torch.float64)
    mask, key_valid = masks.from_multihead(attn, padding, batch=B, num_heads=H, L=L, S=S, batched=True,
                                      like=torch.empty(B, L, 8, dtype=torch.float64))
    assert key_valid is None and mask.dtype == torch.float64
    want = _per_entry(lambda b, h, i, j: (attn[b * H + h, i, j] + padding[b, j]).item(), torch.float64)
    torch.testing.assert_close(mask.expand(B, H, L, S), want, atol=0, rtol=0)
    bool_attn = _random_bool((L, S), 5)  # a bool attn_mask and a float padding: -inf where masked out
    mask, _ = masks.from_multihead(bool_attn, padding, batch=B, num_heads=H, L=L, S=S, batched=True,
                              like=torch.empty(B, L, 8, dtype=torch.float64))
    want = _per_entry(lambda b, h, i, j: float("-inf") if bool_attn[i, j] else padding[b, j].item(), torch.float64)
    torch.testing.assert_close(mask.expand(B, H, L, S), want, atol=0, rtol=0)


def test_combined_additive_is_zero_where_seen_and_minus_infinity_elsewhere():
    seen = _random_bool((L, S), 6)  # contract convention: True = attend
    key_valid = ~_random_bool((B, S), 7)
    got = masks.combined_additive(seen, key_valid, torch.float32)
    want = _per_entry(lambda b, h, i, j: 0.0 if seen[i, j] and key_valid[b, j] else float("-inf"))
    assert torch.equal(got.expand(B, H, L, S), want.float())
    bias = torch.randn(L, S)
    got = masks.combined_additive(bias, key_valid, torch.float32)
    want = _per_entry(lambda b, h, i, j: bias[i, j].item() if key_valid[b, j] else float("-inf"))
    assert torch.equal(got.expand(B, H, L, S), want.float())
    assert masks.combined_additive(None, None, torch.float32) is None
    assert torch.equal(masks.combined_additive(seen, None, torch.float64),
                       torch.where(seen, 0.0, float("-inf")).double())


@pytest.mark.parametrize("query_dtype, held", [(torch.float16, torch.float32), (torch.bfloat16, torch.float32),
                                               (torch.float32, torch.float32), (torch.float64, torch.float64)])
def test_masks_are_held_in_the_accumulation_dtype(query_dtype, held):
    assert masks.additive_dtype(query_dtype) == held
    mask = masks.from_sdpa(torch.randn(L, S, dtype=torch.float64), L=L, S=S, batch_shape=(B, H),
                      like=torch.empty(1, dtype=query_dtype))
    assert mask.dtype == held


def test_narrowing_keeps_finite_values_finite_and_infinities_infinite():
    wide = torch.tensor([-1e300, -1e10, 0.0, 1e300, float("-inf"), float("inf")], dtype=torch.float64)
    lowest, highest = torch.finfo(torch.float32).min, torch.finfo(torch.float32).max
    want = torch.tensor([lowest, -1e10, 0.0, highest, float("-inf"), float("inf")])
    assert torch.equal(masks.to_dtype(wide, torch.float32), want)
    same = torch.randn(3)
    assert masks.to_dtype(same, torch.float32) is same
    assert torch.equal(masks.as_additive(torch.tensor([True, False]), True, torch.float16),
                       torch.tensor([0.0, float("-inf")], dtype=torch.float16))
    assert torch.equal(masks.as_additive(torch.tensor([True, False]), False, torch.float16),
                       torch.tensor([float("-inf"), 0.0], dtype=torch.float16))


def test_sdpa_masks_keep_true_means_attend_and_gain_a_query_axis():
    keys = _random_bool((S,), 8)  # (S,) -> (1, S)
    got = masks.from_sdpa(keys, L=L, S=S, batch_shape=(B, H), like=torch.empty(1))
    assert got.shape == (1, S) and torch.equal(got[0], keys)
    full = _random_bool((B, 1, L, S), 9)
    assert masks.from_sdpa(full, L=L, S=S, batch_shape=(B, H), like=torch.empty(1)) is full
    assert masks.from_sdpa(None, L=L, S=S, batch_shape=(B, H), like=torch.empty(1)) is None
    with pytest.raises(ValueError, match=r"attn_mask of shape \(3, 5\) does not broadcast .* \(2, 3, 4, 5\)"):
        masks.from_sdpa(_random_bool((3, S), 10), L=L, S=S, batch_shape=(B, H), like=torch.empty(1))


def _raises(error, message):
    return raises_exactly(error, message)


def test_key_valid_is_the_inverse_of_a_bool_padding_mask():
    padding = _random_bool((B, S), 11)
    assert torch.equal(masks.key_valid(padding, B, S), ~padding)
    assert masks.key_valid(None, B, S) is None
    with _raises(TypeError, "with RoPE, windows, ALiBi or a cache, key_padding_mask must be bool (True = padding)"):
        masks.key_valid(padding.float(), B, S)
    with _raises(TypeError, "key_padding_mask must be a bool or floating point tensor, got dtype torch.int64"):
        masks.key_valid(padding.long(), B, S)
    with _raises(ValueError, "key_padding_mask must have shape (2, 6) (N, S), got (2, 5)"):
        masks.key_valid(padding, B, S + 1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_additive_masks_have_the_requested_dtype_and_the_mask_device(dtype):
    """0 / -inf in exactly the dtype asked for (the accumulation dtype), on the mask's own device."""
    seen = _random_bool((L, S), 12)  # contract convention: True = attend
    key_valid = ~_random_bool((B, S), 13)
    for got in (masks.as_additive(seen, True, dtype), masks.combined_additive(seen, None, dtype),
                masks.combined_additive(seen, key_valid, dtype), masks.combined_additive(None, key_valid, dtype)):
        assert got.dtype == dtype
    assert torch.equal(masks.as_additive(seen, True, dtype), torch.where(seen, 0.0, float("-inf")).to(dtype))
    on_meta = masks.as_additive(seen.to("meta"), False, dtype)
    assert on_meta.device.type == "meta" and on_meta.dtype == dtype and on_meta.shape == (L, S)
    both = masks.combined_additive(seen.to("meta"), key_valid.to("meta"), dtype)
    assert both.device.type == "meta" and both.dtype == dtype and both.shape == (B, 1, L, S)


def test_multihead_float_padding_alone_is_the_additive_mask():
    padding = torch.randn(B, S, dtype=torch.float64)
    mask, key_valid = masks.from_multihead(None, padding, batch=B, num_heads=H, L=L, S=S, batched=True,
                                      like=torch.empty(B, L, 8, dtype=torch.float64))
    assert key_valid is None and mask.dtype == torch.float64
    want = _per_entry(lambda b, h, i, j: padding[b, j].item(), torch.float64)
    torch.testing.assert_close(mask.expand(B, H, L, S), want, atol=0, rtol=0)


def _torch_broadcast(*shapes):
    try:
        return tuple(torch.broadcast_shapes(*shapes))
    except RuntimeError:
        return None


_SHAPES = [s for n in range(4) for s in itertools.product((0, 1, 2, 3), repeat=n)]


def test_the_shapes_broadcast_as_torchs_broadcast_shapes_says_for_every_small_shape():
    from mha.kernels._shapes import broadcast
    for a, b in itertools.product(_SHAPES, repeat=2):
        want = _torch_broadcast(a, b)
        if want is None:
            with pytest.raises(RuntimeError, match="do not broadcast"):
                broadcast(a, b)
        else:
            assert broadcast(a, b) == want and broadcast(torch.Size(a), b) == want, (a, b)
    for shapes in [((2, 1, 3), (1, 4, 1), (3,)), ((1,), (0,), (1, 1)), (), ((4,),)]:  # three, none, one
        assert broadcast(*shapes) == _torch_broadcast(*shapes), shapes
    with pytest.raises(RuntimeError, match=r"\(2,\), \(2,\), \(3,\) do not broadcast: 2 against 3 at dim -1"):
        broadcast((2,), (2,), (3,))


def test_an_sdpa_mask_is_taken_exactly_where_it_broadcasts_to_the_scores_shape():
    target = (2, 3, 1, 2)  # (B, H, L, S)
    for shape in (s for n in range(6) for s in itertools.product((0, 1, 2, 3), repeat=n) if n < 5 or s[:1] == (1,)):
        mask = torch.zeros(shape, dtype=torch.bool)
        if _torch_broadcast(shape, target) == target:
            assert masks.from_sdpa(mask, L=1, S=2, batch_shape=(2, 3), like=torch.empty(1)).dim() == max(2, len(shape))
        else:
            with pytest.raises(ValueError, match="does not broadcast to the attention scores' shape"):
                masks.from_sdpa(mask, L=1, S=2, batch_shape=(2, 3), like=torch.empty(1))
