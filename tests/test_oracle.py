"""The NumPy oracle against torch in float64, directly (no mha torch code involved)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mha import numpy as oracle

TOL = 1e-12


def test_softmax_matches_torch_and_handles_all_masked_rows():
    x = np.random.default_rng(0).normal(size=(3, 7)) * 30
    np.testing.assert_allclose(oracle.softmax(x), torch.softmax(torch.from_numpy(x), -1).numpy(),
                               atol=TOL, rtol=0)
    x[1] = -np.inf
    p = oracle.softmax(x)
    assert np.all(p[1] == 0) and np.all(np.isfinite(p))
    np.testing.assert_allclose(p[[0, 2]].sum(-1), 1.0, atol=TOL)


def test_softmax_is_max_subtracted():
    p = oracle.softmax(np.array([1000.0, 1001.0]))
    np.testing.assert_allclose(p, [1 / (1 + np.e), np.e / (1 + np.e)], atol=TOL)


def test_causal_mask_is_top_left():
    assert oracle.causal_mask(2, 4).tolist() == [[True, False, False, False], [True, True, False, False]]


@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_sdpa_matches_torch(mask_kind, is_causal, scale):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, n, d, generator=g, dtype=torch.float64)
               for n, d in ((5, 4), (6, 4), (6, 3)))
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(5, 6, generator=g) > 0.3
        mask[:, 0] = True
    elif mask_kind == "float":
        mask = torch.randn(2, 1, 5, 6, generator=g, dtype=torch.float64)
    if is_causal and mask is not None:  # torch takes one or the other: fold causal into the mask
        causal = torch.ones(5, 6, dtype=torch.bool).tril()
        want_mask = (mask & causal) if mask.dtype == torch.bool else mask.masked_fill(~causal, -np.inf)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=want_mask, scale=scale)
    else:
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)
    got, weights = oracle.scaled_dot_product_attention(
        q.numpy(), k.numpy(), v.numpy(), None if mask is None else mask.numpy(), is_causal, scale)
    np.testing.assert_allclose(got, want.numpy(), atol=TOL, rtol=0)
    np.testing.assert_allclose(weights.sum(-1), 1.0, atol=TOL)


def test_multi_head_attention_float32_runs_in_float32():
    rng = np.random.default_rng(0)
    E, H = 8, 2
    params = {"in_proj_weight": rng.normal(size=(3 * E, E)).astype(np.float32),
              "out_proj.weight": rng.normal(size=(E, E)).astype(np.float32)}
    x = rng.normal(size=(4, E)).astype(np.float32)
    out, w = oracle.multi_head_attention(x, x, x, params, H)
    assert out.dtype == np.float32 and out.shape == (4, E) and w.shape == (4, 4)
    out64, _ = oracle.multi_head_attention(*(a.astype(np.float64) for a in (x, x, x)),
                                           {k: a.astype(np.float64) for k, a in params.items()}, H)
    np.testing.assert_allclose(out, out64, atol=1e-4)


def test_vjp_matches_finite_differences():
    """The hand-written backward against central differences of the forward (independent of torch)."""
    rng = np.random.default_rng(3)
    E, H, L, S, N = 6, 3, 3, 4, 2
    params = {"q_proj_weight": rng.normal(size=(E, E)), "k_proj_weight": rng.normal(size=(E, 5)),
              "v_proj_weight": rng.normal(size=(E, 4)), "in_proj_bias": rng.normal(size=3 * E),
              "bias_k": rng.normal(size=(1, 1, E)), "bias_v": rng.normal(size=(1, 1, E)),
              "out_proj.weight": rng.normal(size=(E, E)), "out_proj.bias": rng.normal(size=E)}
    q, k, v = rng.normal(size=(L, N, E)), rng.normal(size=(S, N, 5)), rng.normal(size=(S, N, 4))
    options = dict(add_zero_attn=True, key_padding_mask=np.array([[0, 0, 1, 0], [0, 0, 0, 0]], bool))
    g_out, g_w = rng.normal(size=(L, N, E)), rng.normal(size=(N, L, S + 2))

    def loss(q, k, v, params):
        out, w = oracle.multi_head_attention(q, k, v, params, H, **options)
        return np.sum(out * g_out) + np.sum(w * g_w)

    grads = oracle.multi_head_attention_vjp(q, k, v, params, H, g_out, g_w, **options)
    eps = 1e-6
    named = {"query": q, "key": k, "value": v, **params}
    for name, array in named.items():
        idx = tuple(rng.integers(0, n) for n in array.shape)
        plus, minus = array.copy(), array.copy()
        plus[idx] += eps
        minus[idx] -= eps

        def with_(a):
            inputs = {"query": q, "key": k, "value": v, name: a}
            p = {**params, **({name: a} if name in params else {})}
            return loss(inputs["query"], inputs["key"], inputs["value"], p)

        numeric = (with_(plus) - with_(minus)) / (2 * eps)
        assert abs(numeric - grads[name][idx]) < 1e-6 * max(1.0, abs(numeric)), name


@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("blocks", [(1, 1), (5, 7), (64, 64)])
def test_blocked_attention_equals_the_readable_one(mask_kind, is_causal, blocks):
    rng = np.random.default_rng(4)
    q, k, v = rng.normal(size=(2, 3, 19, 4)), rng.normal(size=(2, 3, 23, 4)), rng.normal(size=(2, 3, 23, 6))
    mask = {"none": None, "bool": rng.random((19, 23)) > 0.3, "float": rng.normal(size=(3, 19, 23))}[mask_kind]
    if mask_kind == "bool":
        mask[4] = False  # a row with nothing visible
    out, lse = oracle.blocked_attention(q, k, v, mask, is_causal, None, block_q=blocks[0], block_k=blocks[1])
    want, _ = oracle.scaled_dot_product_attention(q, k, v, mask, is_causal)
    np.testing.assert_allclose(out, want, atol=1e-12, rtol=0)
    scores = q @ np.swapaxes(k, -1, -2) / 2.0 + oracle.attention._additive(mask, True, q.dtype)
    if is_causal:
        scores = np.where(oracle.causal_mask(19, 23), scores, -np.inf)
    with np.errstate(divide="ignore"):
        np.testing.assert_allclose(lse, np.log(np.exp(scores).sum(-1)), atol=1e-12, rtol=0)
