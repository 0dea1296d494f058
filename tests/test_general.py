"""mha.MultiHeadAttention (seed 002's general module) against the float64 oracle and torch."""

import itertools

import numpy as np
import pytest
import torch

import mha
from mha import numpy as oracle
from mha.tools.verify import numpy_state, randomize_biases

WIDTHS = dict(cq=6, ck=5, cv=7, dk=3, dv=4, do=9, h=2)  # dk != dv, h*dk != cq, do != h*dv


def _module(**options):
    torch.manual_seed(0)
    m = mha.MultiHeadAttention(**{**WIDTHS, **options}, dtype=torch.float64)
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
    np.testing.assert_allclose(out.detach().numpy(), want, atol=1e-12, rtol=0)
    np.testing.assert_allclose(w.detach().numpy(), want_w, atol=1e-12, rtol=0)
    g_out, g_w = torch.randn_like(out), torch.randn_like(w)
    ((out * g_out).sum() + (w * g_w).sum()).backward()
    grads = oracle.multi_head_attention_vjp(*arrays, numpy_state(m), 2, g_out.numpy(), g_w.numpy(),
                                            average_attn_weights=False, **options)
    for name, t in [("query", q), ("key", k), ("value", v), *m.named_parameters()]:
        np.testing.assert_allclose(t.grad.numpy(), grads[name], atol=1e-10, rtol=0, err_msg=name)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("add_bias_kv", [True, False])
def test_seed_002_loading_from_torch_gives_torch_outputs(bias, add_bias_kv):
    """Seed 002's experiment: torch's module with kdim != vdim, weights copied by hand."""
    d, ck, cv, h = 16, 32, 64, 2
    theirs = torch.nn.MultiheadAttention(d, h, kdim=ck, vdim=cv, batch_first=True, bias=bias,
                                         add_bias_kv=add_bias_kv)
    ours = mha.MultiHeadAttention(cq=d, ck=ck, cv=cv, dk=d // h, dv=d // h, do=d, h=h, bias=bias,
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
    m = mha.MultiHeadAttention(cq=6, ck=5, cv=7, dk=3, dv=4, do=9, h=2, add_bias_kv=True)
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
    m = mha.MultiHeadAttention(**WIDTHS, dropout=p, dtype=torch.float64)
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


@pytest.mark.parametrize("call, error, words", [
    (lambda m: m(torch.randn(2, 4, 7), torch.randn(2, 5, 5), torch.randn(2, 5, 7)), ValueError, ["query", "cq=6"]),
    (lambda m: m(torch.randn(2, 4, 6), torch.randn(2, 5, 6), torch.randn(2, 5, 7)), ValueError, ["key", "ck=5"]),
    (lambda m: m(torch.randn(2, 4, 6), torch.randn(2, 5, 5), torch.randn(2, 5, 6)), ValueError, ["value", "cv=7"]),
    (lambda m: m(torch.randn(2, 4, 6), torch.randn(2, 5, 5), torch.randn(2, 6, 7)), ValueError, ["length"]),
    (lambda m: m(*(torch.randn(2, 4, c, dtype=torch.float64) for c in (6, 5, 7))), TypeError, ["float64", "float32"]),
    (lambda m: m(torch.randn(2, 4, 6), torch.randn(2, 5, 5), torch.randn(2, 5, 7),
                 attn_mask=torch.zeros(4, 4)), ValueError, ["attn_mask", "(4, 5)"]),
])
def test_bad_input(call, error, words):
    m = mha.MultiHeadAttention(**WIDTHS)
    with pytest.raises(error) as info:
        call(m)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("name, value", [("h", 0), ("dk", -1), ("do", 2.5)])
def test_constructor_rejects_bad_widths(name, value):
    with pytest.raises((ValueError, TypeError), match=name):
        mha.MultiHeadAttention(**{**WIDTHS, name: value})
