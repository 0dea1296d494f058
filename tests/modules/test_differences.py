"""The deliberate differences from torch (listed in the README), checked against the oracle."""

import itertools

import pytest
import torch

import mha
from helpers.tolerance import assert_close
from mha import kernels
from mha import numpy as oracle
from mha.tools.verify import numpy_state, randomize_biases

E, H, L, N = 8, 2, 4, 2


def _module(batch_first=False, **options):
    torch.manual_seed(0)
    m = mha.nn.MultiheadAttention(E, H, batch_first=batch_first, dtype=torch.float64, **options)
    return randomize_biases(m)


def _all_masked_row(kind, dtype=torch.float64):
    """Self-attention attn_mask (L, L) whose query row 1 has every key masked (True = masked out)."""
    blocked = torch.zeros(L, L, dtype=torch.bool)
    blocked[1] = True
    if kind == "bool":
        return blocked
    return torch.zeros(L, L, dtype=dtype).masked_fill(blocked, float("-inf"))


PATHS = list(itertools.product(["bool", "float"], [True, False], [True, False], [True, False]))


@pytest.mark.parametrize("kind, need_weights, training, grad", PATHS)
def test_all_masked_query_row_gives_zeros_and_finite_gradients(kind, need_weights, training, grad):
    m = _module(batch_first=True).train(training)
    x = torch.randn(N, L, E, dtype=torch.float64, requires_grad=grad)
    mask = _all_masked_row(kind)
    with torch.set_grad_enabled(grad):
        out, w = m(x, x, x, attn_mask=mask, need_weights=need_weights, average_attn_weights=False)
    want, want_w = oracle.multi_head_attention(x.detach().numpy(), x.detach().numpy(),
                                               x.detach().numpy(), numpy_state(m), H,
                                               attn_mask=mask.numpy(), batch_first=True,
                                               average_attn_weights=False)
    assert_close(out.detach().numpy(), want, chain=True)
    # the attention part of row 1 is zero: the output there is the out-projection's bias
    torch.testing.assert_close(out[:, 1].detach(), m.out_proj.bias.detach().expand(N, E))
    if need_weights:
        assert torch.all(w[:, :, 1] == 0)
        assert_close(w.detach().numpy(), want_w, chain=True)
    if grad:
        out.sum().backward()
        assert torch.isfinite(x.grad).all()
        assert all(torch.isfinite(p.grad).all() for p in m.parameters())


def test_torch_gives_nan_where_mha_gives_zeros():
    """The difference itself: torch's weights path returns NaN for the all-masked row."""
    theirs = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.float64)
    ours = mha.nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.float64)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(N, L, E, dtype=torch.float64)
    mask = _all_masked_row("bool")
    assert torch.isnan(theirs(x, x, x, attn_mask=mask)[0][:, 1]).all()
    assert torch.isfinite(ours(x, x, x, attn_mask=mask)[0]).all()


def test_all_masked_by_key_padding_gives_zeros():
    m = _module()
    x = torch.randn(L, N, E, dtype=torch.float64)
    padding = torch.zeros(N, L, dtype=torch.bool)
    padding[1] = True  # batch item 1 has no visible key at all
    out, w = m(x, x, x, key_padding_mask=padding)
    assert torch.all(w[1] == 0) and torch.isfinite(out).all()
    torch.testing.assert_close(out[:, 1], m.out_proj.bias.detach().expand(L, E))


@pytest.mark.parametrize("need_weights, training", list(itertools.product([True, False], [True, False])))
@pytest.mark.parametrize("with_mask", [False, True])
def test_is_causal_is_honored_with_or_without_attn_mask(need_weights, training, with_mask):
    m = _module(batch_first=True).train(training)
    x = torch.randn(N, L, E, dtype=torch.float64)
    mask = torch.randn(L, L, dtype=torch.float64) if with_mask else None
    with torch.no_grad():
        out, _ = m(x, x, x, attn_mask=mask, is_causal=True, need_weights=need_weights)
    arr = x.numpy()
    want, _ = oracle.multi_head_attention(arr, arr, arr, numpy_state(m), H, is_causal=True,
                                          attn_mask=None if mask is None else mask.numpy(),
                                          batch_first=True)
    assert_close(out.numpy(), want, chain=True)
    explicit = torch.ones(L, L, dtype=torch.bool).triu(1)
    if mask is not None:
        explicit = mask.masked_fill(explicit, float("-inf"))
    with torch.no_grad():
        same, _ = m(x, x, x, attn_mask=explicit, need_weights=need_weights)
    torch.testing.assert_close(out, same)


def test_torch_is_causal_without_mask_raises_in_train_and_is_ignored_in_eval():
    theirs = torch.nn.MultiheadAttention(E, H, batch_first=True)
    x = torch.randn(N, L, E)
    with pytest.raises(RuntimeError):
        theirs(x, x, x, is_causal=True)
    theirs.eval()
    with torch.no_grad():
        ignored, _ = theirs(x, x, x, is_causal=True, need_weights=False)
        plain, _ = theirs(x, x, x, need_weights=False)
    torch.testing.assert_close(ignored, plain)  # the hint was silently dropped
    ours = mha.nn.MultiheadAttention(E, H, batch_first=True).eval()
    ours.load_state_dict(theirs.state_dict())
    with torch.no_grad():
        assert not torch.allclose(ours(x, x, x, is_causal=True)[0], ours(x, x, x)[0])


def test_causal_with_appended_keys_keeps_the_appended_keys_visible():
    m = _module(add_bias_kv=True, add_zero_attn=True)
    x = torch.randn(L, N, E, dtype=torch.float64)
    out, w = m(x, x, x, is_causal=True, average_attn_weights=False)
    assert w.shape[-1] == L + 2
    assert torch.all(w[..., 0, 1:L] == 0) and torch.all(w[..., 0, L:] > 0)
    arr = x.numpy()
    want, _ = oracle.multi_head_attention(arr, arr, arr, numpy_state(m), H, is_causal=True,
                                          add_zero_attn=True)
    assert_close(out.detach().numpy(), want, chain=True)


def test_need_weights_false_never_computes_weights(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the math (weights) backend ran although need_weights=False")

    monkeypatch.setitem(kernels.BACKENDS, "math", refuse)
    m = _module()
    x = torch.randn(L, N, E, dtype=torch.float64)
    out, w = m(x, x, x, need_weights=False, attn_mask=torch.randn(L, L, dtype=torch.float64))
    assert w is None and out.shape == (L, N, E)
    with pytest.raises(AssertionError, match="math"):
        m(x, x, x, need_weights=True)
