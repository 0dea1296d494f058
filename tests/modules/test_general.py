"""mha.GeneralAttention (seed 002's general module) against the float64 oracle and torch."""

import itertools
import warnings

import pytest
import torch

import mha
from helpers.backends import ALL
from helpers.exact import raises_exactly
from helpers.tolerance import assert_close
from mha import numpy as oracle
from mha.tools.verify import numpy_state, randomize_biases

WIDTHS = dict(cq=6, ck=5, cv=7, dk=3, dv=4, do=9, h=2)  # dk != dv, h*dk != cq, do != h*dv


def _module(**options):
    torch.manual_seed(0)
    m = mha.GeneralAttention(**{**WIDTHS, **options}, dtype=torch.float64)
    return randomize_biases(m)


OPTIONS = list(itertools.product([True, False], [False, True], [False, True]))


@pytest.mark.parametrize("bias, add_bias_kv, add_zero_attn", OPTIONS)
@pytest.mark.parametrize("batched", [True, False])
def test_forward_weights_and_gradients_equal_the_oracle(bias, add_bias_kv, add_zero_attn, batched):
    m = _module(bias=bias, add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn)
    g = torch.Generator().manual_seed(1)
    N, L, S = 3, 4, 5
    lead = (N,) if batched else ()
    q = torch.randn(*lead, L, 6, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(*lead, S, 5, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(*lead, S, 7, generator=g, dtype=torch.float64, requires_grad=True)
    padding = torch.zeros(*lead, S, dtype=torch.bool)
    padding[..., 3] = True
    out, w = m.forward_with_weights(q, k, v, key_padding_mask=padding, is_causal=True,
               average_attn_weights=False)
    options = dict(key_padding_mask=padding.numpy(), is_causal=True, add_zero_attn=add_zero_attn,
                   batch_first=True)
    arrays = [t.detach().numpy() for t in (q, k, v)]
    want, want_w = oracle.multi_head_attention(*arrays, numpy_state(m), 2, average_attn_weights=False, **options)
    assert out.shape == (*lead, L, 9)
    assert_close(out.detach().numpy(), want)
    assert_close(w.detach().numpy(), want_w)
    g_out, g_w = torch.randn_like(out), torch.randn_like(w)
    ((out * g_out).sum() + (w * g_w).sum()).backward()
    grads = oracle.multi_head_attention_vjp(*arrays, numpy_state(m), 2, g_out.numpy(), g_w.numpy(),
                                            average_attn_weights=False, **options)
    for name, t in [("query", q), ("key", k), ("value", v), *m.named_parameters()]:
        assert_close(t.grad.numpy(), grads[name], chain=True, err_msg=name)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("add_bias_kv", [True, False])
def test_seed_002_loading_from_torch_gives_torch_outputs(bias, add_bias_kv):
    """Seed 002's experiment: torch's module with kdim != vdim, weights copied by hand."""
    d, ck, cv, h = 16, 32, 64, 2
    theirs = torch.nn.MultiheadAttention(d, h, kdim=ck, vdim=cv, batch_first=True, bias=bias,
                                         add_bias_kv=add_bias_kv)
    ours = mha.GeneralAttention(cq=d, ck=ck, cv=cv, dk=d // h, dv=d // h, do=d, h=h, bias=bias,
                                  add_bias_kv=add_bias_kv)
    if add_bias_kv:  # the order seed 002 prints
        assert [n for n, _ in ours.named_parameters()][:2] == ["bias_k", "bias_v"]
    with torch.no_grad():
        ours.q_proj.weight.copy_(theirs.q_proj_weight)
        ours.k_proj.weight.copy_(theirs.k_proj_weight)
        ours.v_proj.weight.copy_(theirs.v_proj_weight)
        ours.out_proj.weight.copy_(theirs.out_proj.weight)
        if bias:
            for proj, b in zip((ours.q_proj, ours.k_proj, ours.v_proj), theirs.in_proj_bias.chunk(3)):
                proj.bias.copy_(b)
            ours.out_proj.bias.copy_(theirs.out_proj.bias)
        if add_bias_kv:
            ours.bias_k.copy_(theirs.bias_k.squeeze(0))
            ours.bias_v.copy_(theirs.bias_v.squeeze(0))
    q, k, v = torch.rand(10, 5, d), torch.rand(10, 3, ck), torch.rand(10, 3, cv)
    torch.testing.assert_close(ours(q, k, v), theirs(q, k, v)[0])
    out, w = ours.forward_with_weights(q, k, v)
    torch.testing.assert_close(w, theirs(q, k, v)[1])


def test_parameter_shapes_and_initialisation():
    m = mha.GeneralAttention(cq=6, ck=5, cv=7, dk=3, dv=4, do=9, h=2, add_bias_kv=True)
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert shapes == {"bias_k": (1, 1, 6), "bias_v": (1, 1, 8), "q_proj.weight": (6, 6), "q_proj.bias": (6,),
                      "k_proj.weight": (6, 5), "k_proj.bias": (6,), "v_proj.weight": (8, 7),
                      "v_proj.bias": (8,), "out_proj.weight": (9, 8), "out_proj.bias": (9,)}
    assert torch.all(m.q_proj.bias == 0) and torch.all(m.out_proj.bias == 0)
    bound = (6 / (6 + 5)) ** 0.5
    assert m.k_proj.weight.abs().max() <= bound
    assert "dk=3, dv=4" in repr(m)


def test_dropout_in_training_only():
    """In training each weight is dropped with probability p and the survivors are scaled by
    1 / (1 - p); the output is the dropped weights applied to the values."""
    p = 0.25
    m = mha.GeneralAttention(**WIDTHS, dropout=p, dtype=torch.float64)
    x = tuple(torch.randn(4, n, c, dtype=torch.float64) for n, c in ((30, 6), (40, 5), (40, 7)))
    m.eval()
    dense_out, dense = m.forward_with_weights(*x, average_attn_weights=False)
    torch.testing.assert_close(m(*x), dense_out)
    m.train()
    torch.manual_seed(0)
    out, w = m.forward_with_weights(*x, average_attn_weights=False)
    kept = w != 0
    assert 0.73 < kept.double().mean() < 0.77  # 1 - p of 9,600 weights
    torch.testing.assert_close(w[kept], dense[kept] / (1 - p))
    v = m.v_proj(x[2]).view(4, 40, 2, 4).transpose(1, 2)  # (B, S, H*Dv) -> (B, H, S, Dv)
    heads = (w @ v).transpose(1, 2).reshape(4, 30, 8)  # (B, H, L, Dv) -> (B, L, H*Dv)
    torch.testing.assert_close(out, m.out_proj(heads))


def _bad(q_shape, k_shape, v_shape, dtypes=(torch.float32,) * 3):
    return tuple(torch.zeros(s, dtype=d) for s, d in zip((q_shape, k_shape, v_shape), dtypes))


F32, F64, I64 = torch.float32, torch.float64, torch.int64


@pytest.mark.parametrize("inputs, options, error, message", [
    (_bad((2, 4, 7), (2, 5, 5), (2, 5, 7)), {}, ValueError, "query's last dim must be cq=6, got shape (2, 4, 7)"),
    (_bad((2, 4, 6), (2, 5, 6), (2, 5, 7)), {}, ValueError, "key's last dim must be ck=5, got shape (2, 5, 6)"),
    (_bad((2, 4, 6), (2, 5, 5), (2, 5, 6)), {}, ValueError, "value's last dim must be cv=7, got shape (2, 5, 6)"),
    (_bad((2, 4, 6), (2, 5, 5), (2, 6, 7)), {}, ValueError,
     "key and value must have the same length (and batch size), got shapes (2, 5, 5) and (2, 6, 7)"),
    (_bad((2, 4, 6), (3, 5, 5), (3, 5, 7)), {}, ValueError,
     "key and query must have the same batch size (dim 0), got shapes (3, 5, 5) and (2, 4, 6)"),
    (_bad((2, 4, 6), (2, 5, 5), (2, 5, 7), (I64, F32, F32)), {}, TypeError,
     "query must have a floating point dtype, got torch.int64"),
    (_bad((2, 4, 6), (2, 5, 5), (2, 5, 7), (F32, I64, F32)), {}, TypeError,
     "key must have a floating point dtype, got torch.int64"),
    (_bad((2, 4, 6), (2, 5, 5), (2, 5, 7), (F32, F32, I64)), {}, TypeError,
     "value must have a floating point dtype, got torch.int64"),
    (_bad((2, 4, 6), (2, 5, 5), (2, 5, 7), (F32, F64, F32)), {}, TypeError,
     "key has dtype torch.float64 but query has dtype torch.float32; they must match (convert one with .to(dtype))"),
    (_bad((2, 4, 6), (2, 5, 5), (2, 5, 7), (F32, F32, F64)), {}, TypeError,
     "value has dtype torch.float64 but query has dtype torch.float32; they must match (convert one with .to(dtype))"),
    (_bad((2, 4, 6), (2, 5, 5), (2, 5, 7), (F64, F64, F64)), {}, TypeError,
     "the module's weight has dtype torch.float32 but query has dtype torch.float64; "
     "they must match (convert one with .to(dtype))"),
    (_bad((1, 2, 4, 6), (1, 2, 5, 5), (1, 2, 5, 7)), {}, ValueError,
     "query must be 2-D or 3-D ((B, L, E) batched, (L, E) unbatched), got 4-D with shape (1, 2, 4, 6)"),
    (_bad((2, 4, 6), (2, 5, 5), (2, 5, 7)), dict(attn_mask=torch.zeros(4, 4)), ValueError,
     "Expected `attn_mask` shape to be (4, 5) (L, S) but got (4, 4)"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_bad_input_is_refused_with_a_message_naming_it(inputs, options, error, message):
    m = mha.GeneralAttention(**WIDTHS)
    with raises_exactly(error, message):
        m(*inputs, **options)


def test_the_batch_first_layout_is_named_by_the_module_that_has_it():
    """mha.GeneralAttention is batch-first; mha.nn.MultiheadAttention is sequence-first by default."""
    x = torch.zeros(1, 2, 4, 8)
    for module, layout in ((mha.GeneralAttention(8, 8, 8, 4, 4, 8, 2), "(B, L, E)"),
                           (mha.nn.MultiheadAttention(8, 2), "(L, B, E)"),
                           (mha.nn.MultiheadAttention(8, 2, batch_first=True), "(B, L, E)")):
        want = f"query must be 2-D or 3-D ({layout} batched, (L, E) unbatched), got 4-D with shape (1, 2, 4, 8)"
        with raises_exactly(ValueError, want):
            module(x, x.clone(), x.clone())


SELF_CASES = [  # self-attention (query is key is value): the same checks, the same words
    (dict(cq=6, ck=5, cv=7), torch.zeros(2, 4, 6), ValueError, "key's last dim must be ck=5, got shape (2, 4, 6)"),
    (dict(cq=6, ck=5, cv=6), torch.zeros(2, 4, 6), ValueError, "key's last dim must be ck=5, got shape (2, 4, 6)"),
    (dict(cq=6, ck=6, cv=7), torch.zeros(2, 4, 6), ValueError, "value's last dim must be cv=7, got shape (2, 4, 6)"),
    (dict(cq=6, ck=6, cv=6), torch.zeros(2, 6, 4), ValueError, "query's last dim must be cq=6, got shape (2, 6, 4)"),
    (dict(cq=6, ck=6, cv=6), torch.zeros(1, 2, 3, 6), ValueError,
     "query must be 2-D or 3-D ((B, L, E) batched, (L, E) unbatched), got 4-D with shape (1, 2, 3, 6)"),
    (dict(cq=6, ck=6, cv=6), torch.zeros(2, 3, 6, dtype=torch.long), TypeError,
     "query must have a floating point dtype, got torch.int64"),
    (dict(cq=6, ck=6, cv=6), [[0.0] * 6] * 3, TypeError, "query must be a torch.Tensor, got list"),
]


@pytest.mark.parametrize("widths, x, error, message", SELF_CASES, ids=lambda x: x if isinstance(x, str) else "")
def test_self_attention_input_is_checked_like_any_input(widths, x, error, message):
    m = mha.GeneralAttention(**{**WIDTHS, **widths})
    with raises_exactly(error, message):
        m(x, x, x)


def test_nested_self_attention_input_israises_exactly():
    m = mha.GeneralAttention(6, 6, 6, 3, 3, 6, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: nested tensors are a prototype
        x = torch.nested.nested_tensor([torch.randn(3, 6), torch.randn(4, 6)])
    message = "query is a nested tensor; mha expects dense tensors (pad and pass a mask)"
    with raises_exactly(TypeError, message):
        m(x, x, x)


def test_a_module_on_another_device_is_named():
    m = mha.GeneralAttention(8, 8, 8, 4, 4, 8, 2, device="meta")
    x = torch.zeros(2, 3, 8)
    message = "the module's weight is on device meta but query is on cpu; they must be on the same device"
    with raises_exactly(ValueError, message):
        m(x, x, x)


@pytest.mark.parametrize("options, error, message", [
    *((({name: 0}, ValueError, f"{name} must be greater than 0, got 0")) for name in WIDTHS),
    *((({name: 2.5}, TypeError, f"{name} must be an int, got float (2.5)")) for name in WIDTHS),
    (dict(num_kv_heads=0), ValueError, "num_kv_heads must be greater than 0, got 0"),
    (dict(num_kv_heads=3), ValueError, "num_kv_heads must divide h: got h=2, num_kv_heads=3"),
    (dict(dropout=1.5), ValueError, "dropout must be in [0, 1], got 1.5"),
    (dict(dropout="0.1"), TypeError, "dropout must be a float in [0, 1], got str ('0.1')"),
    (dict(softcap=-1.0), ValueError, "softcap must be a finite number greater than 0, got -1.0"),
    (dict(sinks="yes"), TypeError, "sinks must be a bool, got str ('yes')"),
    (dict(rope=4), TypeError, "rope must be an mha.RotaryEmbedding, got int"),
    (dict(alibi="yes"), TypeError, "alibi must be a bool, got str ('yes')"),
    *(((dict(extra, **kv)), ValueError, "add_bias_kv / add_zero_attn have no position: they do not combine "
       "with rope, alibi or window") for extra in (dict(rope=mha.RotaryEmbedding(2)), dict(alibi=True),
                                                   dict(window=(1, 0)))
      for kv in (dict(add_bias_kv=True), dict(add_zero_attn=True))),
], ids=lambda x: x if isinstance(x, str) else "")
def test_constructor_names_the_bad_argument(options, error, message):
    with raises_exactly(error, message):
        mha.GeneralAttention(**{**WIDTHS, **options})


EFFICIENT_REFUSED = "an efficient attention variant does not combine with rope, alibi, window, softcap, sinks, " \
    "logit_scale, add_bias_kv or add_zero_attn"


@pytest.mark.parametrize("option", [dict(rope=mha.RotaryEmbedding(2)), dict(alibi=True), dict(window=(1, 0)),
                                    dict(softcap=2.0), dict(sinks=True), dict(logit_scale=True), dict(add_bias_kv=True),
                                    dict(add_zero_attn=True)], ids=str)
def test_an_efficient_variant_refuses_each_exact_only_feature(option):
    with raises_exactly(ValueError, EFFICIENT_REFUSED):
        mha.GeneralAttention(**WIDTHS, attention="linear", **option)


EFFICIENT_CALL = "an efficient attention variant takes is_causal only: no attn_mask, key_padding_mask, cache " \
    "or weights (forward_with_weights)"


@pytest.mark.parametrize("call", [
    lambda m, x: m(x, x, x, attn_mask=torch.zeros(3, 3)),
    lambda m, x: m(x, x, x, key_padding_mask=torch.zeros(2, 3, dtype=torch.bool)),
    lambda m, x: m(x, x, x, cache=mha.KVCache()),
    lambda m, x: m.forward_with_weights(x, x, x),
], ids=["attn_mask", "key_padding_mask", "cache", "weights"])
def test_an_efficient_variant_refuses_masks_caches_and_weights(call):
    m = mha.GeneralAttention(8, 8, 8, 4, 4, 8, 2, attention="linear")
    with raises_exactly(ValueError, EFFICIENT_CALL):
        call(m, torch.randn(2, 3, 8))


@pytest.mark.parametrize("lead", [(1,), (3,), ()], ids=["batch of one", "batch of three", "unbatched"])
def test_an_efficient_variant_keeps_the_batch_dim_it_was_given(lead):
    """The exact variant (torch's kernel) gives the formula written out by hand, in every layout."""
    torch.manual_seed(0)
    m = randomize_biases(mha.GeneralAttention(6, 5, 7, 3, 4, 9, 2, attention=mha.efficient.Exact(),
                                                dtype=torch.float64))
    q, k, v = (torch.randn(*lead, n, c, dtype=torch.float64) for n, c in ((4, 6), (5, 5), (5, 7)))
    with torch.no_grad():
        out = m(q, k, v)
        heads = []
        for h in range(2):  # by hand: one head at a time, widths dk=3, dv=4
            wq, wk, wv = (p.weight[h * d:(h + 1) * d] for p, d in ((m.q_proj, 3), (m.k_proj, 3), (m.v_proj, 4)))
            bq, bk, bv = (p.bias[h * d:(h + 1) * d] for p, d in ((m.q_proj, 3), (m.k_proj, 3), (m.v_proj, 4)))
            scores = (q @ wq.T + bq) @ (k @ wk.T + bk).transpose(-1, -2) / 3 ** 0.5
            heads.append(scores.softmax(-1) @ (v @ wv.T + bv))
        want = torch.cat(heads, -1) @ m.out_proj.weight.T + m.out_proj.bias
    assert out.shape == (*lead, 4, 9)
    assert_close(out, want)


def test_extra_repr_lists_the_widths_then_each_feature_in_use():
    plain = mha.GeneralAttention(6, 5, 7, 3, 4, 9, 2)
    assert plain.extra_repr() == "cq=6, ck=5, cv=7, dk=3, dv=4, do=9, h=2, add_zero_attn=False, dropout=0.0"
    full = mha.GeneralAttention(8, 8, 8, 4, 4, 8, 4, num_kv_heads=2, alibi=True, window=[2, 0], softcap=2,
                                  sinks=True, add_zero_attn=False, dropout=0.5)
    assert full.extra_repr() == ("cq=8, ck=8, cv=8, dk=4, dv=4, do=8, h=4, add_zero_attn=False, dropout=0.5, "
                                 "num_kv_heads=2, alibi=True, window=(2, 0), softcap=2.0, sinks=True")
    one = mha.GeneralAttention(8, 8, 8, 4, 4, 8, 4, window=(-1, 3))
    assert one.extra_repr().endswith("dropout=0.0, window=(-1, 3)")


def test_constructor_defaults():
    m = mha.GeneralAttention(6, 5, 7, 3, 4, 9, 2)
    assert (m.num_kv_heads, m.dropout, m.add_zero_attn, m.rope, m.window, m.softcap) == (2, 0.0, False, None, None, None)
    assert m.bias_k is None and m.bias_v is None and m.sinks is None and m.alibi_slopes is None
    assert m.attention is None and not m.positional and m.training
    assert all(p.bias is not None for p in (m.q_proj, m.k_proj, m.v_proj, m.out_proj))


def test_alibi_slopes_are_a_buffer_outside_the_state_dict():
    """Fixed by h (Press et al.: 2^(-8 i / h)), so checkpoints do not carry them."""
    m = mha.GeneralAttention(8, 8, 8, 2, 2, 8, 4, alibi=True, dtype=torch.float64)
    assert m.alibi_slopes.tolist() == [0.25, 0.0625, 0.015625, 0.00390625]
    assert "alibi_slopes" in dict(m.named_buffers())
    assert "alibi_slopes" not in m.state_dict()
    assert list(m.state_dict()) == ["q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias",
                                    "v_proj.weight", "v_proj.bias", "out_proj.weight", "out_proj.bias"]


def test_parameters_are_drawn_in_the_dtype_asked_for():
    """float64 modules draw float64 values (not float32 values widened), sinks included."""
    torch.manual_seed(0)
    m = mha.GeneralAttention(8, 8, 8, 4, 4, 8, 2, sinks=True, dtype=torch.float64)  # the packed (3E, E) init
    for proj in (m.q_proj, m.k_proj, m.v_proj):
        w = proj.weight.detach()
        assert w.dtype == torch.float64
        assert (w.float().double() != w).float().mean() > 0.9  # float32 values would all round-trip
    assert m.sinks.dtype == torch.float64 and m.sinks.tolist() == [0.0, 0.0]


def test_building_on_the_meta_device_draws_no_random_numbers():
    """As torch.nn.MultiheadAttention: deferred initialisation leaves the CPU generator untouched."""
    for build in (lambda: torch.nn.MultiheadAttention(8, 2, device="meta"),
                  lambda: mha.GeneralAttention(8, 8, 8, 4, 4, 8, 2, device="meta")):
        state = torch.get_rng_state()
        m = build()
        assert torch.equal(torch.get_rng_state(), state)
        assert all(p.device.type == "meta" for p in m.parameters())


def _inputs(lead=(3,), L=4, S=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*lead, n, c, generator=g, dtype=torch.float64) for n, c in ((L, 6), (S, 5), (S, 7)))


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("add_bias_kv, add_zero_attn", [(False, False), (True, False), (False, True), (True, True)])
def test_attn_mask_with_appended_keys_equals_the_oracle(kind, add_bias_kv, add_zero_attn):
    """The caller's mask covers the S keys; the appended ones (bias_k, zero) stay visible to every query."""
    m = _module(add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn)
    q, k, v = _inputs()
    g = torch.Generator().manual_seed(2)
    blocked = torch.rand(4, 5, generator=g) < 0.4
    blocked[:, 0] = False
    mask = blocked if kind == "bool" else torch.randn(4, 5, generator=g, dtype=torch.float64).masked_fill(
        blocked, float("-inf"))
    with torch.no_grad():
        out, w = m.forward_with_weights(q, k, v, attn_mask=mask, average_attn_weights=False)
    want, want_w = oracle.multi_head_attention(q.numpy(), k.numpy(), v.numpy(), numpy_state(m), 2,
                                               attn_mask=mask.numpy(), add_zero_attn=add_zero_attn,
                                               batch_first=True, average_attn_weights=False)
    assert w.shape == (3, 2, 4, 5 + add_bias_kv + add_zero_attn)
    assert_close(out.numpy(), want)
    assert_close(w.numpy(), want_w)
    with torch.no_grad():
        assert_close(m(q, k, v, attn_mask=mask).numpy(), want)


def test_forward_with_weights_reads_and_fills_the_cache():
    """A decode step through forward_with_weights sees the cached keys: its row is the oracle's last
    causal row, its weights cover every position so far, and the cache grows by one."""
    torch.manual_seed(0)
    m = randomize_biases(mha.GeneralAttention(6, 6, 6, 3, 3, 6, 2, dtype=torch.float64))
    x = torch.randn(2, 5, 6, dtype=torch.float64)
    cache = mha.KVCache()
    with torch.no_grad():
        m(x[:, :4], x[:, :4], x[:, :4], is_causal=True, cache=cache)
        out, w = m.forward_with_weights(x[:, 4:], x[:, 4:], x[:, 4:], is_causal=True, cache=cache,
                                        average_attn_weights=False)
    assert cache.size == 5
    arr = x.numpy()
    want, want_w = oracle.multi_head_attention(arr, arr, arr, numpy_state(m), 2, is_causal=True, batch_first=True,
                                               average_attn_weights=False)
    assert_close(out.numpy(), want[:, 4:])
    assert_close(w.numpy(), want_w[:, :, 4:])


@pytest.mark.parametrize("average", [True, False])
@pytest.mark.parametrize("batched", [True, False])
def test_capture_leaves_the_returned_weights_as_asked(average, batched):
    """Under mha.capture_attention, forward_with_weights still returns what it was asked for (the
    per-head weights go to the capture), and forward still returns the output alone."""
    m = _module()
    q, k, v = _inputs(lead=(3,) if batched else ())
    with torch.no_grad(), mha.capture_attention() as maps:
        out, w = m.forward_with_weights(q, k, v, is_causal=True, average_attn_weights=average)
        plain = m(q, k, v, is_causal=True)
    want, want_w = oracle.multi_head_attention(q.numpy(), k.numpy(), v.numpy(), numpy_state(m), 2, is_causal=True,
                                               batch_first=True, average_attn_weights=average)
    _, per_head = oracle.multi_head_attention(q.numpy(), k.numpy(), v.numpy(), numpy_state(m), 2, is_causal=True,
                                              batch_first=True, average_attn_weights=False)
    assert_close(out.numpy(), want)
    assert_close(plain.numpy(), want)
    assert w.shape == want_w.shape
    assert_close(w.numpy(), want_w)
    # forward_with_weights is no module call (no forward hook runs): its call is "attention"
    assert sorted(name.split("@")[0] for name in maps) == ["GeneralAttention", "attention"]
    recorded = [w for calls in maps.values() for w in calls]
    assert len(recorded) == 2
    for r in recorded:  # (B, H, L, S), a batch of one for unbatched input
        assert_close(r.numpy(), per_head if batched else per_head[None])


def _alibi_by_hand(m, q, k, v, padding, is_causal=False):
    """ALiBi written out: scores - slope_h |j - i| (query i at i, key j at j), padding and causal
    keys at -inf, softmax, values, out-projection. q (B, L, cq), padding (B, S) True = padding."""
    B, L, S, h, dk = q.shape[0], q.shape[1], k.shape[1], m.h, m.dk
    Q = (q @ m.q_proj.weight.T + m.q_proj.bias).view(B, L, h, dk).transpose(1, 2)
    K = (k @ m.k_proj.weight.T + m.k_proj.bias).view(B, S, h, dk).transpose(1, 2)
    V = (v @ m.v_proj.weight.T + m.v_proj.bias).view(B, S, h, m.dv).transpose(1, 2)
    i, j = torch.arange(L)[:, None], torch.arange(S)[None, :]
    bias = -torch.tensor([2.0 ** (-8 * (n + 1) / h) for n in range(h)], dtype=q.dtype)[:, None, None] * (j - i).abs()
    bias = bias.expand(B, h, L, S).masked_fill(padding[:, None, None, :], float("-inf"))
    if is_causal:
        bias = bias.masked_fill(j > i, float("-inf"))
    o = torch.nn.functional.scaled_dot_product_attention(Q, K, V, attn_mask=bias)
    return o.transpose(1, 2).reshape(B, L, h * m.dv) @ m.out_proj.weight.T + m.out_proj.bias


@pytest.mark.parametrize("padded", [False, True])
def test_unbatched_alibi_input_with_or_without_key_padding(padded):
    torch.manual_seed(0)
    m = randomize_biases(mha.GeneralAttention(6, 5, 7, 3, 4, 9, 2, alibi=True, dtype=torch.float64))
    q, k, v = _inputs(lead=())
    padding = torch.tensor([False, False, True, False, True]) if padded else None
    with torch.no_grad():
        out = m(q, k, v, key_padding_mask=padding)
        want = _alibi_by_hand(m, q[None], k[None], v[None], torch.zeros(1, 5, dtype=torch.bool) if padding is None
                              else padding[None])[0]
    assert out.shape == (4, 9)
    assert_close(out, want)


@pytest.mark.parametrize("options", [{}, dict(alibi=True)], ids=["plain", "positional"])
def test_the_backend_asked_for_is_the_one_that_runs(options):
    m = _module(**options)
    q, k, v = _inputs()
    message = "backend must be one of ('auto', 'math', 'sdpa', 'flash', 'native', 'flex'), got 'fast'"
    with raises_exactly(ValueError, message):
        m(q, k, v, backend="fast")
    with torch.no_grad():
        if options:
            want = _alibi_by_hand(m, q, k, v, torch.zeros(3, 5, dtype=torch.bool)).numpy()
        else:
            want, _ = oracle.multi_head_attention(q.numpy(), k.numpy(), v.numpy(), numpy_state(m), 2, batch_first=True)
        for backend in ALL:
            assert_close(m(q, k, v, backend=backend).numpy(), want, err_msg=backend)


def test_dropout_in_training_on_the_positional_path():
    """ALiBi (positions) takes the same dropout: each weight dropped with probability p, the rest scaled."""
    p = 0.25
    m = _module(alibi=True, dropout=p)
    q, k, v = (torch.randn(4, n, c, dtype=torch.float64) for n, c in ((30, 6), (40, 5), (40, 7)))
    m.eval()
    with torch.no_grad():
        _, dense = m.forward_with_weights(q, k, v, average_attn_weights=False)
        m.train()
        torch.manual_seed(0)
        out, w = m.forward_with_weights(q, k, v, average_attn_weights=False)
    kept = w != 0
    assert 0.73 < kept.double().mean() < 0.77  # 1 - p of 9,600 weights
    torch.testing.assert_close(w[kept], dense[kept] / (1 - p))


POSITIONS_NOT_MASKS = ("with rope, alibi, window or a cache the masks come from positions: pass key_padding_mask / "
                       "is_causal, not attn_mask")


@pytest.mark.parametrize("options, call, error, message", [
    ({}, lambda m, x: m(x, x, x, cache={}), TypeError,
     "cache must be an mha.KVCache or a PagedKVCache step (cache.step(...)), got dict"),
    (dict(alibi=True), lambda m, x: m(x, x, x, attn_mask=torch.zeros(3, 3)), ValueError, POSITIONS_NOT_MASKS),
    (dict(window=(1, 0)), lambda m, x: m(x, x, x, attn_mask=torch.zeros(3, 3)), ValueError, POSITIONS_NOT_MASKS),
    ({}, lambda m, x: m(x, x, x, attn_mask=torch.zeros(3, 3), cache=mha.KVCache()), ValueError, POSITIONS_NOT_MASKS),
], ids=lambda x: x if isinstance(x, str) else "")
def test_the_positional_path_names_what_it_refuses(options, call, error, message):
    m = mha.GeneralAttention(8, 8, 8, 4, 4, 8, 2, **options)
    with raises_exactly(error, message):
        call(m, torch.randn(2, 3, 8))
