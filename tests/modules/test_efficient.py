"""mha.efficient: exact limits, error falling with budget, causal variants never looking ahead."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import mha
from helpers.exact import raises_exactly
from helpers.tolerance import assert_close
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
    m = mha.GeneralAttention(16, 16, 16, 8, 8, 16, 2, attention=name, attention_options=options)
    x = torch.randn(2, 32, 16, requires_grad=True)
    out = m(x, x, x, is_causal=causal)
    assert out.shape == (2, 32, 16)
    out.sum().backward()
    assert torch.isfinite(x.grad).all()
    with pytest.raises(ValueError, match="is_causal only"):
        m(x, x, x, key_padding_mask=torch.zeros(2, 32, dtype=torch.bool))


def test_an_efficient_variant_does_not_combine_with_positional_terms():
    with pytest.raises(ValueError, match="does not combine"):
        mha.GeneralAttention(8, 8, 8, 4, 4, 8, 2, attention="linear", alibi=True)


@pytest.mark.parametrize("call, message", [
    (lambda: efficient.make("reformer"),
     "attention must be one of ('exact', 'fixed', 'linear', 'linformer', 'local', 'nystrom', 'performer', "
     "'strided'), got 'reformer'"),
    (lambda: efficient.Strided(4)(*_qkv(8), False),
     "the strided pattern is defined for causal (autoregressive) attention: pass is_causal=True"),
    (lambda: efficient.Fixed(4)(*_qkv(8), False),
     "the fixed pattern is defined for causal (autoregressive) attention: pass is_causal=True"),
    (lambda: efficient.Strided(4)(_qkv(8, B=1, H=3)[0], *_qkv(6, B=1, H=3)[1:], True),
     "strided attention is self-attention: query and key lengths must match, got 8 and 6"),
    (lambda: efficient.Fixed(4)(_qkv(8, B=1, H=3)[0], *_qkv(6, B=1, H=3)[1:], True),
     "fixed attention is self-attention: query and key lengths must match, got 8 and 6"),
    (lambda: efficient.Fixed(4)(_qkv(8, B=3, H=4, D=2)[0][0], *(x[0] for x in _qkv(6, B=3, H=4, D=2)[1:]), True),
     "fixed attention is self-attention: query and key lengths must match, got 8 and 6"),  # (H, T, D) inputs
    (lambda: efficient.Linformer(8, 4)(*_qkv(8), True),
     "Linformer mixes all positions along the sequence: it has no causal form"),
    (lambda: efficient.Linformer(8, 4)(*_qkv(16)),
     "Linformer was built for sequences up to max_length=8, got 16"),
    (lambda: efficient.Nystrom(4)(*_qkv(8), True),
     "Nystromformer's landmarks summarise the whole sequence: it has no causal form"),
    (lambda: efficient.Fixed(4, 5), "summary=5 cannot exceed block=4"),
    (lambda: efficient.Local(0), "window must be greater than 0, got 0"),
    (lambda: efficient.Strided(-1), "stride must be greater than 0, got -1"),
    (lambda: efficient.Fixed(0), "block must be greater than 0, got 0"),
    (lambda: efficient.Fixed(4, 0), "summary must be greater than 0, got 0"),
    (lambda: efficient.Linformer(0), "max_length must be greater than 0, got 0"),
    (lambda: efficient.Linformer(8, 0), "k must be greater than 0, got 0"),
    (lambda: efficient.Nystrom(0), "landmarks must be greater than 0, got 0"),
    (lambda: efficient.LinearAttention(0), "chunk must be greater than 0, got 0"),
    (lambda: efficient.Performer(0), "head_dim must be greater than 0, got 0"),
    (lambda: efficient.Performer(8, 0), "features must be greater than 0, got 0"),
    (lambda: efficient.Performer(8, 16, 0), "chunk must be greater than 0, got 0"),
])
def test_errors_name_the_argument_and_what_it_got(call, message):
    with raises_exactly(ValueError, message):
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
    m = mha.GeneralAttention(16, 16, 16, 8, 8, 16, 2, attention="local", attention_options=dict(window=3))
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


# --- defaults -----------------------------------------------------------------------------------

def test_constructor_defaults():
    assert efficient.Local().window == 128
    assert efficient.Strided().stride == 64
    fixed = efficient.Fixed()
    assert (fixed.block, fixed.summary) == (64, 1)
    lin = efficient.Linformer(16)
    assert (lin.max_length, lin.k) == (16, 64)
    assert lin.E.shape == lin.F.shape == (64, 16) and lin.F is not lin.E  # not shared by default
    nystrom = efficient.Nystrom()
    assert (nystrom.landmarks, nystrom.pinv_iterations) == (64, 6)
    assert efficient.LinearAttention().chunk == 128
    performer = efficient.Performer(8)
    assert (performer.head_dim, performer.features, performer.chunk) == (8, 256, 128)
    assert performer.projection.shape == (256, 8)


def test_is_causal_defaults_to_the_variants_natural_form():
    """Causal-only patterns default to causal; the others default to bidirectional."""
    q, k, v = _qkv(12)
    T, c = 12, 4
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    strided = (j <= i) & (((i - j) < c) | ((i - j) % c == 0))
    fixed = (j <= i) & ((j // c == i // c) | ((j % c == c - 1) & (j // c < i // c)))
    torch.testing.assert_close(efficient.Strided(c)(q, k, v), F.scaled_dot_product_attention(q, k, v, strided))
    torch.testing.assert_close(efficient.Fixed(c)(q, k, v), F.scaled_dot_product_attention(q, k, v, fixed))
    torch.testing.assert_close(efficient.Exact()(q, k, v), _dense(q, k, v, False))
    torch.testing.assert_close(efficient.Local(T)(q, k, v), _dense(q, k, v, False))
    pq, pk = F.elu(q) + 1, F.elu(k) + 1
    scores = pq @ pk.transpose(-1, -2)
    torch.testing.assert_close(efficient.LinearAttention()(q, k, v), (scores @ v) / scores.sum(-1, keepdim=True))
    performer = efficient.Performer(16, 32, generator_seed=0).double()
    torch.testing.assert_close(performer(q, k, v), _performer_reference(performer, q, k, v, False))


@pytest.mark.parametrize("causal", [False, True])
def test_exact_is_torchs_attention(causal):
    q, k, v = _qkv(12)
    torch.testing.assert_close(efficient.Exact()(q, k, v, causal), _dense(q, k, v, causal))
    torch.testing.assert_close(efficient.Exact()(q, k, v, is_causal=causal), _dense(q, k, v, causal))


def test_make_builds_the_named_variant_with_its_options():
    p = efficient.make("performer", head_dim=8, features=16, chunk=3)
    assert type(p) is efficient.Performer and (p.head_dim, p.features, p.chunk) == (8, 16, 3)
    f = efficient.make("fixed", block=5, summary=2)
    assert type(f) is efficient.Fixed and (f.block, f.summary) == (5, 2)
    assert type(efficient.make("exact")) is efficient.Exact


# --- every variant against its formula, at any number of leading dims ----------------------------

# leading dims (H,), (B, H) with B != H, and (X, B, H); T = 13 is not a multiple of any block
# and differs from D = 5 (the variants index the sequence from the end: dim -2)
_LEADING = [(3,), (2, 3), (2, 1, 2)]


def _qkv_lead(lead, T=13, D=5, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [scale * torch.randn(*lead, T, D, generator=g, dtype=torch.float64) for _ in range(3)]


def _masked(q, k, v, allowed):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


def _segment_means_reference(x, m):
    """Mean of segment s = rows floor(s T / m) .. ceil((s + 1) T / m) - 1 (adaptive average pooling)."""
    T = x.shape[-2]
    m = min(m, T)
    return torch.stack([x[..., (s * T) // m: -((-(s + 1) * T) // m), :].mean(-2) for s in range(m)], dim=-2)


def _razavi_pinv(a, iterations):
    """Z0 = A^T / (|A|_1 |A|_inf); Z <- Z (13 I - A Z (15 I - A Z (7 I - A Z))) / 4, in float64 NumPy."""
    a = a.detach().double().numpy()
    n = a.shape[-1]
    eye = np.eye(n)
    out = []
    for m in a.reshape(-1, n, n):
        z = m.T / (np.abs(m).sum(axis=0).max() * np.abs(m).sum(axis=1).max())
        for _ in range(iterations):
            az = m @ z
            z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
        out.append(z)
    return torch.from_numpy(np.stack(out).reshape(a.shape))


def _nystrom_reference(q, k, v, landmarks, iterations):
    scale = q.shape[-1] ** -0.5
    q_l, k_l = _segment_means_reference(q, landmarks), _segment_means_reference(k, landmarks)
    k1 = torch.softmax(q @ k_l.transpose(-1, -2) * scale, -1)
    k2 = torch.softmax(q_l @ k_l.transpose(-1, -2) * scale, -1)
    k3 = torch.softmax(q_l @ k.transpose(-1, -2) * scale, -1)
    inverse = torch.linalg.pinv(k2) if iterations is None else _razavi_pinv(k2, iterations)
    return k1 @ inverse @ k3 @ v


def _performer_reference(performer, q, k, v, causal):
    """sum_j A_ij v_j / sum_j A_ij, A_ij = sum_f exp(w_f.q' - |q'|^2/2 + w_f.k' - |k'|^2/2), x' = x / D^(1/4),
    in float64 log space (log A_ij = max_f lq_if + max_f lk_jf + log sum_f e^(lq_if - max) e^(lk_jf - max))."""
    w = performer.projection.double()  # (m, D)
    D = q.shape[-1]

    def log_features(x):
        x = x.double() / D ** 0.25
        return x @ w.T - (x * x).sum(-1, keepdim=True) / 2  # (..., T, m)

    lq, lk = log_features(q), log_features(k)
    mq, mk = lq.amax(-1, keepdim=True), lk.amax(-1, keepdim=True)  # each row's own max: e^(l - m) <= 1
    log_a = mq + mk.transpose(-1, -2) + torch.log(torch.exp(lq - mq) @ torch.exp(lk - mk).transpose(-1, -2))
    if causal:
        L = q.shape[-2]
        log_a = log_a.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(log_a, dim=-1) @ v.double()


@pytest.mark.parametrize("lead", _LEADING, ids=str)
def test_sparse_and_local_variants_equal_their_masks_at_any_rank(lead):
    q, k, v = _qkv_lead(lead)
    i, j = torch.arange(13)[:, None], torch.arange(13)[None, :]
    c = 4
    strided = (j <= i) & (((i - j) < c) | ((i - j) % c == 0))
    fixed = (j <= i) & ((j // c == i // c) | ((j % c >= c - 2) & (j // c < i // c)))
    torch.testing.assert_close(efficient.Strided(c)(q, k, v, True), _masked(q, k, v, strided))
    torch.testing.assert_close(efficient.Fixed(c, 2)(q, k, v, True), _masked(q, k, v, fixed))
    for causal in (True, False):
        band = (j >= i - 2) & ((j <= i) if causal else (j <= i + 2))
        torch.testing.assert_close(efficient.Local(2)(q, k, v, causal), _masked(q, k, v, band))
        torch.testing.assert_close(efficient.Exact()(q, k, v, causal), _masked(q, k, v, (j <= i) | (not causal)))


@pytest.mark.parametrize("lead", _LEADING, ids=str)
def test_linear_attention_equals_its_formula_at_any_rank(lead):
    q, k, v = _qkv_lead(lead)
    pq, pk = F.elu(q) + 1, F.elu(k) + 1
    scores = pq @ pk.transpose(-1, -2)
    for causal in (False, True):
        w = scores.tril() if causal else scores
        torch.testing.assert_close(efficient.LinearAttention(4)(q, k, v, causal), (w @ v) / w.sum(-1, keepdim=True))


@pytest.mark.parametrize("lead", _LEADING, ids=str)
def test_nystrom_equals_its_landmark_formula_at_any_rank(lead):
    """Landmarks (8) fewer than the keys (13) and more than the head dim (5): the segment means are
    over the sequence; the pseudo-inverse is the given number of Razavi iterations, or exact."""
    q, k, v = _qkv_lead(lead)
    for iterations in (2, None):
        got = efficient.Nystrom(8, pinv_iterations=iterations)(q, k, v)
        torch.testing.assert_close(got, _nystrom_reference(q, k, v, 8, iterations))


@pytest.mark.parametrize("lead", _LEADING, ids=str)
def test_performer_equals_its_random_feature_formula_at_any_rank(lead):
    """Causal with chunks shorter than the sequence and keys whose norms grow along it (so each
    key's running-max scale differs): the chunked, rescaled prefix sums equal the formula."""
    q, k, v = _qkv_lead(lead)
    k = k * torch.linspace(0.5, 2.5, 13, dtype=torch.float64)[:, None]
    performer = efficient.Performer(5, 12, chunk=4, generator_seed=3).double()
    for causal in (False, True):
        torch.testing.assert_close(performer(q, k, v, causal), _performer_reference(performer, q, k, v, causal))


@pytest.mark.parametrize("lead", [(3,), (2, 3)], ids=str)
@pytest.mark.parametrize("causal", [True, False])
def test_local_aligns_fewer_queries_with_the_last_keys(lead, causal):
    """L = 5 queries after S = 13 keys (a decoding step): query i sits at position i + S - L and
    sees keys i + 8 - 3 <= j <= i + 8 (+ 3 bidirectional)."""
    q, _, _ = _qkv_lead(lead, T=5, seed=1)
    _, k, v = _qkv_lead(lead, T=13, seed=2)
    i, j = torch.arange(5)[:, None] + 8, torch.arange(13)[None, :]
    band = (j >= i - 3) & ((j <= i) if causal else (j <= i + 3))
    torch.testing.assert_close(efficient.Local(3)(q, k, v, causal), _masked(q, k, v, band))


# --- Linformer: projections ----------------------------------------------------------------------

def test_linformer_initialises_e_and_f_as_gaussians_scaled_by_one_over_sqrt_k():
    torch.manual_seed(5)
    want_e, want_f = torch.randn(16, 40) / 4, torch.randn(16, 40) / 4
    torch.manual_seed(5)
    lin = efficient.Linformer(40, 16)
    torch.testing.assert_close(lin.E.detach(), want_e)
    torch.testing.assert_close(lin.F.detach(), want_f)
    torch.manual_seed(5)
    shared = efficient.Linformer(40, 16, share=True)
    assert shared.F is shared.E
    torch.testing.assert_close(shared.E.detach(), want_e)


def test_linformer_projects_the_first_s_columns_in_the_inputs_dtype():
    """K' = E[:, :S] K, V' = F[:, :S] V, then softmax attention; float32 parameters, float64 inputs."""
    torch.manual_seed(0)
    lin = efficient.Linformer(max_length=20, k=6)
    q, k, v = _qkv(11, D=4, B=2, H=3)
    e, f = lin.E.detach().double()[:, :11], lin.F.detach().double()[:, :11]
    want = F.scaled_dot_product_attention(q, e @ k, f @ v)
    got = lin(q, k, v)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want)


# --- the pseudo-inverse --------------------------------------------------------------------------

def _ill_conditioned_batch():
    """A (2, 3) batch of non-symmetric softmax-like 6 x 6 matrices at very different scales."""
    g = torch.Generator().manual_seed(0)
    a = torch.softmax(2 * torch.randn(2, 3, 6, 6, generator=g, dtype=torch.float64), -1)
    return a * torch.tensor([[1.0, 10.0, 0.01], [3.0, 0.2, 50.0]], dtype=torch.float64)[..., None, None]


@pytest.mark.parametrize("iterations", [1, 2, 3])
def test_iterative_pinv_follows_razavis_iteration_from_its_scaled_start(iterations):
    """Before convergence the value depends on Z0 = A^T / (|A|_1 |A|_inf), each matrix by its own norms."""
    a = _ill_conditioned_batch()
    torch.testing.assert_close(efficient.iterative_pinv(a, iterations), _razavi_pinv(a, iterations),
                               rtol=1e-10, atol=0)


def test_iterative_pinv_defaults_to_six_iterations():
    a = _ill_conditioned_batch()
    assert (_razavi_pinv(a, 6) - _razavi_pinv(a, 7)).abs().max() > 1  # not converged: 6 and 7 differ
    torch.testing.assert_close(efficient.iterative_pinv(a), _razavi_pinv(a, 6), rtol=1e-10, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_nystrom_and_its_pinv_keep_a_half_precision_dtype(dtype):
    g = torch.Generator().manual_seed(0)
    a = torch.softmax(torch.randn(2, 4, 4, generator=g, dtype=torch.float64), -1)
    z = efficient.iterative_pinv(a.to(dtype), 2)
    assert z.dtype == dtype
    torch.testing.assert_close(z.double(), _razavi_pinv(a, 2), rtol=0.05, atol=0.05)
    q, k, v = (x.to(dtype) for x in _qkv(16, D=8))
    out = efficient.Nystrom(4, pinv_iterations=2)(q, k, v)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), _nystrom_reference(*(x.double() for x in (q, k, v)), 4, 2),
                               rtol=0.05, atol=0.05)


# --- Performer: features -------------------------------------------------------------------------

def _orthogonal_random_features(generator, features, d):
    """Blocks of d orthogonal rows (Q of a Gaussian's QR, R's diagonal made positive), cut to
    ``features`` rows, each row scaled by the norm of a fresh Gaussian d-vector."""
    blocks = []
    for _ in range(-(-features // d)):
        gaussian = torch.randn(d, d, generator=generator).double().numpy()
        qm, r = np.linalg.qr(gaussian)
        blocks.append((qm * np.sign(np.diag(r))).T)
    rows = np.concatenate(blocks)[:features]
    norms = torch.randn(features, d, generator=generator).double().norm(dim=1, keepdim=True).numpy()
    return torch.from_numpy(rows * norms)


@pytest.mark.parametrize("features, d", [(10, 4), (3, 5), (8, 4)])
def test_performer_draws_its_features_from_the_seeded_generator_and_redraws_the_next(features, d):
    torch.manual_seed(123)  # the global generator plays no part
    performer = efficient.Performer(d, features, generator_seed=7)
    g = torch.Generator().manual_seed(7)
    first = _orthogonal_random_features(g, features, d)
    second = _orthogonal_random_features(g, features, d)
    torch.testing.assert_close(performer.projection.double(), first, rtol=1e-5, atol=1e-5)
    performer.redraw()
    torch.testing.assert_close(performer.projection.double(), second, rtol=1e-5, atol=1e-5)
    assert "projection" in dict(performer.named_buffers())


def test_performer_is_stable_for_queries_and_keys_of_very_different_norms():
    """float32, |x'| up to 20: log-features near -170 (e^-170 underflows float32). Each query row is
    scaled by its own max, each head's keys by their own max (causal: by the running max), so the
    ratios survive; the reference works in float64 log space."""
    g = torch.Generator().manual_seed(0)
    D, T = 8, 10

    def rows(norms):  # (1, 2, T, D): random directions with the given norms (in units of D^(1/4))
        x = torch.randn(1, 2, T, D, generator=g, dtype=torch.float64)
        return x / x.norm(dim=-1, keepdim=True) * norms[..., None] * D ** 0.25

    head_norm = torch.tensor([1.0, 20.0], dtype=torch.float64)[:, None]  # one head small, one large
    q = rows(torch.where(torch.arange(T) % 2 == 0, 1.0, 20.0).double() * torch.ones(2, 1, dtype=torch.float64))
    k = rows(head_norm * torch.ones(T, dtype=torch.float64))
    v = torch.randn(1, 2, T, D, generator=g, dtype=torch.float64)
    performer = efficient.Performer(D, 16, chunk=4, generator_seed=0)
    for causal in (False, True):
        got = performer(q.float(), k.float(), v.float(), causal)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), _performer_reference(performer, q.float(), k.float(), v, causal),
                                   rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("T, size", [(32, 0.5), (1024, 0.05)])
def test_performer_in_float16_with_the_default_features_stays_in_range(T, size):
    """phi = exp(. - max) / sqrt(m): with m = 256 a product of features is at most 1/m, so float16
    (max 65504) neither overflows nor underflows. Near-zero inputs make every feature about its max:
    phi(q).phi(k) is then about 1 for each pair, and the sums over 1024 keys stay far from overflow."""
    q, k, v = _qkv(T, D=16, B=1, H=1)
    q, k = size * q, size * k
    performer = efficient.Performer(16, generator_seed=0)
    for causal in (False, True):
        got = performer(q.half(), k.half(), v.half(), causal)
        assert got.dtype == torch.float16 and torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), _performer_reference(performer, q.half(), k.half(), v, causal),
                                   rtol=0.02, atol=0.02)


# --- devices -------------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_variants_run_on_the_inputs_device():
    q, k, v = (x.cuda() for x in _qkv(13, D=8))
    c, T = 4, 13
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    fixed = ((j <= i) & ((j // c == i // c) | ((j % c >= c - 2) & (j // c < i // c)))).cuda()
    torch.testing.assert_close(efficient.Fixed(c, 2)(q, k, v, True), _masked(q, k, v, fixed))
    a = _ill_conditioned_batch()
    torch.testing.assert_close(efficient.iterative_pinv(a.cuda(), 2).cpu(), _razavi_pinv(a, 2), rtol=1e-10, atol=0)
    performer = efficient.Performer(8, 16, generator_seed=0).double().cuda()
    performer.redraw()
    assert performer.projection.device == q.device
    got = performer(q, k, v).cpu()
    torch.testing.assert_close(got, _performer_reference(performer.cpu(), *(x.cpu() for x in (q, k, v)), False))


def test_nystrom_takes_unbatched_input_like_every_variant():
    """(T, D) input, as the other variants take it (found by a helper: it failed inside torch)."""
    q, k, v = (torch.randn(1, 10, 4, dtype=torch.float64) for _ in range(3))
    nystrom = efficient.Nystrom(landmarks=4)
    assert_close(nystrom(q[0], k[0], v[0]), nystrom(q, k, v)[0])
