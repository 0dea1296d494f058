"""Legal torch usage that a drop-in must also accept: empty sequences, torch.func transforms,
autocast, torch's Transformer layers around our module, SDPA broadcasting, NumPy scalars."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.func import jvp, vmap

import mha
from mha import numpy as oracle


def _pair(E=8, H=2, **options):
    theirs = torch.nn.MultiheadAttention(E, H, **options)
    ours = mha.nn.MultiheadAttention(E, H, **options)
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("masks", ["key_padding", "attn_2d", "none"])
def test_empty_key_sequence(need_weights, masks):
    theirs, ours = _pair()
    q, empty = torch.randn(3, 2, 8), torch.randn(0, 2, 8)
    kwargs = {"key_padding": dict(key_padding_mask=torch.zeros(2, 0, dtype=torch.bool)),
              "attn_2d": dict(attn_mask=torch.zeros(3, 0)), "none": {}}[masks]
    want, _ = theirs(q, empty, empty)  # no keys: masks change nothing (torch's fused path
    got, w = ours(q, empty, empty, need_weights=need_weights, **kwargs)  # crashes on a 0-key mask)
    torch.testing.assert_close(got, want)
    assert w is None or w.shape == (2, 3, 0)
    causal, _ = ours(q, empty, empty, is_causal=True, need_weights=need_weights)
    torch.testing.assert_close(causal, want)


def test_empty_query_sequence_with_3d_mask():
    theirs, ours = _pair()
    q, kv = torch.randn(0, 2, 8), torch.randn(3, 2, 8)
    mask = torch.zeros(4, 0, 3, dtype=torch.bool)
    got, w = ours(q, kv, kv, attn_mask=mask)
    assert got.shape == theirs(q, kv, kv, attn_mask=mask)[0].shape == (0, 2, 8)
    assert w.shape == (2, 0, 3)


def test_oracle_with_no_keys_gives_zeros():
    out, w = oracle.scaled_dot_product_attention(np.ones((3, 8)), np.ones((0, 8)), np.ones((0, 8)))
    assert out.shape == (3, 8) and np.all(out == 0) and w.shape == (3, 0)


@pytest.mark.parametrize("need_weights", [True, False])
def test_vmap_and_jvp_match_torch(need_weights):
    theirs, ours = _pair()
    x = torch.randn(2, 3, 8)
    run = lambda m: lambda a: m(a, a, a, need_weights=need_weights)[0]  # noqa: E731
    torch.testing.assert_close(vmap(run(ours))(x), vmap(run(theirs))(x))
    if not need_weights:
        return  # torch's fused CPU kernel has no forward-mode AD, for torch's module and ours
    tangent = torch.randn(3, 8)
    torch.testing.assert_close(jvp(run(ours), (x[0],), (tangent,))[1],
                               jvp(run(theirs), (x[0],), (tangent,))[1])


def test_forward_mode_ad_through_the_weights_path():
    import torch.autograd.forward_ad as fwAD
    _, ours = _pair()
    x, tangent = torch.randn(3, 8), torch.randn(3, 8)
    with fwAD.dual_level():
        dual = fwAD.make_dual(x, tangent)
        out, _ = ours(dual, dual, dual)
        got = fwAD.unpack_dual(out).tangent
    want = jvp(lambda a: ours(a, a, a)[0], (x,), (tangent,))[1]
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("with_mask", [False, True])
def test_autocast_output_and_weight_dtypes_match_torch(with_mask):
    theirs, ours = _pair()
    q = torch.randn(3, 2, 8)
    mask = torch.zeros(3, 3) if with_mask else None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, want_w = theirs(q, q, q, attn_mask=mask)
        got, got_w = ours(q, q, q, attn_mask=mask)
    assert (got.dtype, got_w.dtype) == (want.dtype, want_w.dtype)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_large_negative_float_mask_survives_float16():
    """-1e9 in a float32 mask must stay finite in a float16 module (else a row turns to zeros)."""
    theirs, ours = _pair()
    theirs, ours = theirs.half(), ours.half()
    q = torch.randn(3, 2, 8).half()
    mask = torch.zeros(3, 3)
    mask[1] = -1e9  # every key of row 1: torch averages the values uniformly
    with torch.no_grad():
        want, _ = theirs(q, q, q, attn_mask=mask, need_weights=False)
        got, _ = ours(q, q, q, attn_mask=mask, need_weights=False)
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
    assert not torch.allclose(got[1], ours.out_proj.bias.expand(2, 8))


@pytest.mark.parametrize("with_masks", [False, True])
def test_inside_torch_transformer_encoder_layer_eval_fast_path(with_masks):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True).eval()
    x = torch.randn(2, 5, 8)
    src_mask = torch.nn.Transformer.generate_square_subsequent_mask(5) if with_masks else None
    padding = torch.tensor([[False] * 5, [False] * 3 + [True] * 2]) if with_masks else None
    with torch.no_grad():
        want = layer(x, src_mask=src_mask, src_key_padding_mask=padding)
        ours = mha.nn.MultiheadAttention(8, 2, batch_first=True)
        ours.load_state_dict(layer.self_attn.state_dict())
        layer.self_attn = ours
        got = layer(x, src_mask=src_mask, src_key_padding_mask=padding)
    torch.testing.assert_close(got, want, equal_nan=True)


def test_merge_masks_matches_torch():
    theirs, ours = _pair(batch_first=True)
    q = torch.randn(2, 4, 8)
    attn = torch.randn(4, 4)
    padding = torch.zeros(2, 4)
    padding[1, 3] = float("-inf")
    for args in ((None, None), (None, padding), (attn, None), (attn, padding)):
        want, want_type = theirs.merge_masks(*args, q)
        got, got_type = ours.merge_masks(*args, q)
        assert got_type == want_type
        if want is None:
            assert got is None
        else:
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("key_shape", [(1, 3, 5, 8), (3, 5, 8), (5, 8)])
def test_sdpa_broadcasts_batch_dims_like_torch(key_shape):
    q, k = torch.randn(2, 3, 4, 8), torch.randn(key_shape)
    torch.testing.assert_close(mha.functional.scaled_dot_product_attention(q, k, k),
                               F.scaled_dot_product_attention(q, k, k))


def test_sdpa_gqa_with_different_key_and_value_heads():
    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 1, 5, 8)
    torch.testing.assert_close(mha.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                               F.scaled_dot_product_attention(q, k, v, enable_gqa=True))


def test_numpy_scalar_dropout_is_accepted():
    m = mha.nn.MultiheadAttention(8, 2, dropout=np.float32(0.25))
    assert m.dropout == pytest.approx(0.25)


@pytest.mark.parametrize("call, torch_words", [
    (lambda m, q: m(q, torch.randn(3, 3), q), "expected `key` and `value` to be 3-D but found 2-D and 3-D tensors"),
    (lambda m, q: m(q, q, torch.randn(3, 3)), "expected `key` and `value` to be 3-D but found 3-D and 2-D tensors"),
    (lambda m, q: m(q, q, q, key_padding_mask=torch.tensor([False, True, True])),
     "expected `key_padding_mask` to be `None` or 2-D but found 1-D tensor instead"),
    (lambda m, q: m(q, q, q, attn_mask=torch.tensor([False, True, True, True])),
     "expected `attn_mask` to be `None`, 2-D or 3-D but found 1-D tensor instead"),
    (lambda m, q: m(q[0], q[0], q[0], attn_mask=torch.zeros(5, 4, 4, dtype=torch.bool)),
     "Expected `attn_mask` shape to be (4, 4, 4)"),
])
def test_invalid_shapes_raise_what_torch_raises(call, torch_words):
    """An AssertionError with torch's words (torch's own tests catch that) that is also a ValueError."""
    m = mha.nn.MultiheadAttention(4, 4, batch_first=True)
    q = torch.randn(4, 4, 4)
    with pytest.raises(AssertionError) as info:
        call(m, q)
    assert isinstance(info.value, ValueError) and torch_words in str(info.value)


def test_an_in_proj_bias_of_another_dtype_is_used_as_torch_uses_it():
    torch.manual_seed(0)
    theirs = torch.nn.MultiheadAttention(4, 2, batch_first=True, dtype=torch.float64)
    torch.nn.init.normal_(theirs.in_proj_bias)
    ours = mha.nn.MultiheadAttention(4, 2, batch_first=True, dtype=torch.float64)
    ours.load_state_dict(theirs.state_dict())
    for m in (theirs, ours):
        m.in_proj_bias = torch.nn.Parameter(m.in_proj_bias.half())
    q = torch.randn(3, 5, 4, dtype=torch.float64)
    torch.testing.assert_close(ours(q, q, q)[0], theirs(q, q, q)[0])
