"""mha.efficient: exact limits, error falling with budget, causal variants never looking ahead."""

import math

import pytest
import torch
import torch.nn.functional as F

import mha
from mha import efficient


def _qkv(T=64, D=16, B=2, H=2, seed=0, dtype=torch.float64, grad=False):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, D, generator=g, dtype=dtype, requires_grad=grad) for _ in range(3)]


def _dense(q, k, v, causal):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


# --- exact limits --------------------------------------------------------------------------------

@pytest.mark.parametrize("T", [37, 64])
def test_sparse_patterns_covering_every_key_are_exact(T):
    q, k, v = _qkv(T)
    want = _dense(q, k, v, True)
    torch.testing.assert_close(efficient.Strided(stride=T)(q, k, v, True), want)  # local part holds all
    torch.testing.assert_close(efficient.Strided(stride=1)(q, k, v, True), want)  # strided part holds all
    torch.testing.assert_close(efficient.Fixed(block=8, summary=8)(q, k, v, True), want)  # all of every block


def test_sparse_patterns_equal_their_explicit_masks():
    T, c = 50, 7
    q, k, v = _qkv(T)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    strided = (j <= i) & (((i - j) < c) | ((i - j) % c == 0))
    fixed = (j <= i) & ((j // c == i // c) | ((j % c >= c - 2) & (j // c < i // c)))
    torch.testing.assert_close(efficient.Strided(c)(q, k, v, True), F.scaled_dot_product_attention(q, k, v, strided))
    torch.testing.assert_close(efficient.Fixed(c, 2)(q, k, v, True), F.scaled_dot_product_attention(q, k, v, fixed))


def test_nystrom_with_as_many_landmarks_as_keys_is_exact():
    q, k, v = _qkv(32)
    torch.testing.assert_close(efficient.Nystrom(landmarks=32, pinv_iterations=None)(q, k, v), _dense(q, k, v, False))


def test_linformer_with_identity_projections_and_k_equal_n_is_exact():
    q, k, v = _qkv(24)
    lin = efficient.Linformer(max_length=24, k=24).double()
    with torch.no_grad():
        lin.E.copy_(torch.eye(24))
        lin.F.copy_(torch.eye(24))
    torch.testing.assert_close(lin(q, k, v), _dense(q, k, v, False))


def test_local_with_a_window_covering_the_sequence_is_exact():
    q, k, v = _qkv(40)
    torch.testing.assert_close(efficient.Local(40)(q, k, v, True), _dense(q, k, v, True))
    torch.testing.assert_close(efficient.Local(40)(q, k, v, False), _dense(q, k, v, False))


def test_linear_attention_equals_its_formula_both_ways():
    q, k, v = _qkv(20)
    pq, pk = F.elu(q) + 1, F.elu(k) + 1
    scores = pq @ pk.transpose(-1, -2)
    for causal, chunk in ((False, 128), (True, 128), (True, 6)):
        w = scores.tril() if causal else scores
        want = (w @ v) / w.sum(-1, keepdim=True)
        torch.testing.assert_close(efficient.LinearAttention(chunk)(q, k, v, causal), want)


# --- error falls with the budget -----------------------------------------------------------------

def _error(variant, causal=False, seeds=3, T=128):
    errors = []
    for seed in range(seeds):
        q, k, v = (x * 0.5 for x in _qkv(T, seed=seed))
        errors.append((variant(q, k, v, causal) - _dense(q, k, v, causal)).abs().mean().item())
    return sum(errors) / len(errors)


def test_performer_error_falls_with_features():
    errors = [_error(efficient.Performer(16, m, generator_seed=0).double()) for m in (8, 64, 512)]
    assert errors[0] > errors[1] > errors[2], errors


def test_nystrom_error_falls_with_landmarks():
    errors = [_error(efficient.Nystrom(m, pinv_iterations=None)) for m in (4, 16, 64, 128)]
    assert errors[0] > errors[1] > errors[2] > errors[3] and errors[3] < 1e-10, errors


def test_linformer_error_falls_with_k():
    torch.manual_seed(0)
    errors = [_error(efficient.Linformer(128, k).double()) for k in (8, 32, 128)]
    assert errors[0] > errors[1] > errors[2], errors


@pytest.mark.parametrize("make", [lambda b: efficient.Local(b), lambda b: efficient.Strided(b),
                                  lambda b: efficient.Fixed(b, max(1, b // 4))])
def test_causal_sparse_error_falls_with_the_pattern(make):
    errors = [_error(make(b), causal=True) for b in (4, 16, 64)]
    assert errors[0] > errors[1] > errors[2], errors


def test_performer_redraw_changes_the_features():
    p = efficient.Performer(16, 32, generator_seed=0)
    before = p.projection.clone()
    p.redraw()
    assert not torch.equal(before, p.projection)


# --- causal variants never look ahead ------------------------------------------------------------

@pytest.mark.parametrize("variant", [efficient.Local(5), efficient.Strided(4), efficient.Fixed(4, 1),
                                     efficient.LinearAttention(chunk=7), efficient.Performer(16, 32, chunk=5)],
                         ids=lambda v: type(v).__name__)
def test_causal_output_never_depends_on_later_inputs(variant):
    variant = variant.double()
    q, k, v = _qkv(23, grad=True)
    out = variant(q, k, v, True)
    i = 9
    grads = torch.autograd.grad(out[..., i, :].sum(), (q, k, v))
    for g in grads:
        assert torch.all(g[..., i + 1:, :] == 0)  # nothing after position i
    assert grads[1][..., :i + 1, :].abs().sum() > 0  # and something before


# --- the module and the errors -------------------------------------------------------------------

@pytest.mark.parametrize("name, options, causal", [("local", dict(window=8), True), ("strided", dict(stride=8), True),
                                                   ("fixed", dict(block=8), True), ("linear", {}, True),
                                                   ("performer", dict(features=32), False),
                                                   ("nystrom", dict(landmarks=8), False),
                                                   ("linformer", dict(max_length=32, k=8), False)])
def test_selectable_on_the_general_module(name, options, causal):
    m = mha.MultiHeadAttention(16, 16, 16, 8, 8, 16, 2, attention=name, attention_options=options)
    x = torch.randn(2, 32, 16, requires_grad=True)
    out = m(x, x, x, is_causal=causal)
    assert out.shape == (2, 32, 16)
    out.sum().backward()
    assert torch.isfinite(x.grad).all()
    with pytest.raises(ValueError, match="is_causal only"):
        m(x, x, x, key_padding_mask=torch.zeros(2, 32, dtype=torch.bool))


@pytest.mark.parametrize("call, words", [
    (lambda: efficient.make("reformer"), "attention must be one of"),
    (lambda: efficient.Strided(4)(*_qkv(8), False), "causal"),
    (lambda: efficient.Linformer(8, 4)(*_qkv(8), True), "no causal form"),
    (lambda: efficient.Linformer(8, 4)(*_qkv(16)), "max_length=8"),
    (lambda: efficient.Nystrom(4)(*_qkv(8), True), "no causal form"),
    (lambda: efficient.Fixed(4, 5), "summary=5"),
    (lambda: mha.MultiHeadAttention(8, 8, 8, 4, 4, 8, 2, attention="linear", alibi=True), "does not combine"),
])
def test_errors(call, words):
    with pytest.raises(ValueError, match=words):
        call()


@pytest.mark.parametrize("window", [1, 3])
@pytest.mark.parametrize("causal", [True, False])
def test_local_equals_its_band_mask_built_by_hand(window, causal):
    """A window narrower than the sequence: key j is seen by query i when i - w <= j <= i (+ w both ways)."""
    T = 12
    q, k, v = _qkv(T)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    band = (j >= i - window) & ((j <= i) if causal else (j <= i + window))
    torch.testing.assert_close(efficient.Local(window)(q, k, v, causal), F.scaled_dot_product_attention(q, k, v, band))


def test_the_general_module_runs_its_variant_on_the_projected_heads():
    """Wiring by value: the module's output is out_proj(merge(variant(heads of q_proj, k_proj, v_proj)))."""
    torch.manual_seed(0)
    m = mha.MultiHeadAttention(16, 16, 16, 8, 8, 16, 2, attention="local", attention_options=dict(window=3))
    x = torch.randn(2, 10, 16)
    heads = [p(x).unflatten(-1, (2, 8)).transpose(1, 2) for p in (m.q_proj, m.k_proj, m.v_proj)]  # (2, 2, 10, 8)
    o = efficient.Local(3)(*heads, True)  # (2, 2, 10, 8)
    want = m.out_proj(o.transpose(1, 2).flatten(2))  # (2, 10, 16)
    torch.testing.assert_close(m(x, x, x, is_causal=True), want)


def test_performer_features_estimate_the_softmax_kernel_without_bias():
    """E[phi(q).phi(k)] = exp(q.k / sqrt(D)): the random features must be isotropic (a QR basis
    without the sign fix points away from its first axis and biased the estimate by about 10%)."""
    D = 8
    features = efficient.Performer(D, 200_000, generator_seed=1)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        q, k = (0.4 * torch.randn(1, D, generator=g, dtype=torch.float64) for _ in range(2))
        estimate = torch.exp(features._log_features(q) + features._log_features(k)).mean()
        exact = torch.exp(q @ k.T / math.sqrt(D)).squeeze()
        assert abs(estimate / exact - 1) < 0.01, (estimate.item(), exact.item())


def test_performer_error_keeps_falling_with_many_features():
    """No floor: at 16,384 features the output is within 2% of exact attention (1/sqrt(m) decay)."""
    q, k, v = _qkv(64, D=8, B=1)
    q, k = 0.4 * q, 0.4 * k
    exact = _dense(q, k, v, False)
    for seed in range(3):
        out = efficient.Performer(8, 16_384, generator_seed=seed)(q, k, v, False)
        assert (out - exact).norm() / exact.norm() < 0.02


def test_iterative_pinv_converges_to_the_pseudo_inverse():
    """Razavi et al.'s iteration, checked against torch.linalg.pinv on softmax-like matrices."""
    g = torch.Generator().manual_seed(0)
    a = torch.softmax(torch.randn(3, 8, 8, generator=g, dtype=torch.float64), dim=-1)
    torch.testing.assert_close(efficient.iterative_pinv(a, 20), torch.linalg.pinv(a), atol=1e-9, rtol=0)
