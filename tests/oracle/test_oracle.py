"""The NumPy oracle against torch in float64, directly (no mha torch code involved)."""

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers.tolerance import assert_close
from mha import numpy as oracle


def test_softmax_matches_torch_and_handles_all_masked_rows():
    x = np.random.default_rng(0).normal(size=(3, 7)) * 30
    assert_close(oracle.softmax(x), torch.softmax(torch.from_numpy(x), -1).numpy())
    x[1] = -np.inf
    p = oracle.softmax(x)
    assert np.all(p[1] == 0) and np.all(np.isfinite(p))
    assert_close(p[[0, 2]].sum(-1), 1.0)


def test_softmax_is_max_subtracted():
    p = oracle.softmax(np.array([1000.0, 1001.0]))
    assert_close(p, [1 / (1 + np.e), np.e / (1 + np.e)])


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
    assert_close(got, want.numpy())
    assert_close(weights.sum(-1), 1.0)


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
    assert_close(out, want)
    scores = q @ np.swapaxes(k, -1, -2) / 2.0 + oracle.attention._additive(mask, True, q.dtype)
    if is_causal:
        scores = np.where(oracle.causal_mask(19, 23), scores, -np.inf)
    with np.errstate(divide="ignore"):
        assert_close(lse, np.log(np.exp(scores).sum(-1)))


# ---------------------------------------------------------------------------------------------
# softmax edge cases, against torch.softmax
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("axis", [-1, 0])
def test_softmax_normalises_each_row_on_its_own_scale(axis):
    """The max is taken per row (along ``axis``), not over the whole array: a row far below
    another must not underflow to zeros."""
    x = np.array([[0.0, 1.0, 2.0], [-1000.0, -1001.0, -999.0]])
    x = x if axis == -1 else x.T
    want = torch.softmax(torch.from_numpy(x), dim=axis).numpy()
    assert_close(oracle.softmax(x, axis=axis), want)
    if axis == -1:
        assert_close(oracle.softmax(x), want)  # default axis=-1


# ---------------------------------------------------------------------------------------------
# float32 stays float32 (the masks are cast to the scores' dtype)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mask_kind", ["none", "bool", "float32", "float64"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_sdpa_float32_runs_in_float32(mask_kind, is_causal):
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, n, 4, generator=g) for n in (5, 5, 5))
    mask = {"none": None, "bool": torch.rand(5, 5, generator=g) > 0.3,
            "float32": torch.randn(5, 5, generator=g), "float64": torch.randn(5, 5, generator=g, dtype=torch.float64)}[mask_kind]
    if mask is not None and mask.dtype == torch.bool:
        mask[:, 0] = True
    got, weights = oracle.scaled_dot_product_attention(
        q.numpy(), k.numpy(), v.numpy(), None if mask is None else mask.numpy(), is_causal)
    assert got.dtype == np.float32 and weights.dtype == np.float32
    torch_mask = mask if mask is None or mask.dtype == torch.bool else mask.float()
    if is_causal:
        causal = torch.ones(5, 5, dtype=torch.bool).tril()
        if torch_mask is None:
            torch_mask = causal
        elif torch_mask.dtype == torch.bool:
            torch_mask = torch_mask & causal
        else:
            torch_mask = torch_mask.masked_fill(~causal, -np.inf)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=torch_mask)
    assert_close(got, want.numpy(), chain=True)


def test_contract_float32_with_sinks_runs_in_float32():
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 3, 4, generator=g) for _ in range(3))
    sinks = [0.5, -1.0]  # a Python list: float64 if not cast
    out, weights = oracle.contract_attention(q.numpy(), k.numpy(), v.numpy(), sinks=sinks)
    assert out.dtype == np.float32 and weights.dtype == np.float32
    # torch: the sink is one more logit per head whose weight is dropped
    s = q @ k.transpose(-1, -2) / 2.0
    column = torch.tensor(sinks).view(1, 2, 1, 1).expand(1, 2, 3, 1)
    p = torch.softmax(torch.cat([s, column], -1), -1)[..., :-1]
    assert_close(out, (p @ v).numpy())
    assert_close(weights, p.numpy())


def test_contract_float32_with_alibi_runs_in_float32():
    """(Found by mutation testing: the int64 distances made a float32 bias float64.)"""
    rng = np.random.default_rng(5)
    q, k, v = (rng.normal(size=(1, 2, 3, 4)).astype(np.float32) for _ in range(3))
    slopes = np.array([0.5, 0.25], np.float32)
    out, weights = oracle.contract_attention(q, k, v, alibi_slopes=slopes)
    assert out.dtype == np.float32 and weights.dtype == np.float32
    assert oracle.contract_attention(q, k, v, alibi_slopes=slopes.astype(np.float64))[0].dtype == np.float32
    grads = oracle.contract_attention_vjp(q, k, v, np.ones_like(out), alibi_slopes=slopes)
    assert {name: g.dtype for name, g in grads.items()} == {name: np.float32 for name in ("q", "k", "v", "alibi_slopes")}
    i, j = np.arange(3)[:, None], np.arange(3)[None, :]
    bias = -torch.tensor([0.5, 0.25])[:, None, None] * torch.from_numpy(np.abs(j - i)).float()
    want = torch.softmax(torch.from_numpy(q) @ torch.from_numpy(k).transpose(-1, -2) / 2 + bias, dim=-1)
    assert_close(weights, want.numpy())


# ---------------------------------------------------------------------------------------------
# multi_head_attention and its VJP against torch.nn.functional.multi_head_attention_forward
# and torch.autograd, in float64
# ---------------------------------------------------------------------------------------------

def _torch_mha(query, key, value, params, H, *, attn_mask=None, key_padding_mask=None, is_causal=False,
               add_zero_attn=False, need_weights=True, average_attn_weights=True, batch_first=False):
    """torch's forward on leaf tensors; returns (out, weights, inputs, params) as tensors."""
    t = {n: torch.tensor(a, requires_grad=True) for n, a in params.items()}
    xs = [torch.tensor(a, requires_grad=True) for a in (query, key, value)]
    seq = [x.transpose(0, 1) if batch_first else x for x in xs]  # torch's functional form is (L, B, E)
    mask = None if attn_mask is None else torch.from_numpy(attn_mask)
    if is_causal:  # torch's is_causal is only a hint: fold the top-left causal mask into attn_mask
        L, S = (query.shape[0], key.shape[0]) if not batch_first else (query.shape[1], key.shape[1])
        hidden = ~torch.ones(L, S, dtype=torch.bool).tril()
        mask = hidden if mask is None else mask | hidden
    separate = "q_proj_weight" in t
    out, w = F.multi_head_attention_forward(
        *seq, t["out_proj.weight"].shape[0], H, t.get("in_proj_weight"), t.get("in_proj_bias"),
        t.get("bias_k"), t.get("bias_v"), add_zero_attn, 0.0, t["out_proj.weight"], t.get("out_proj.bias"),
        training=False, key_padding_mask=None if key_padding_mask is None else torch.from_numpy(key_padding_mask),
        need_weights=need_weights, attn_mask=mask, use_separate_proj_weight=separate,
        q_proj_weight=t.get("q_proj_weight"), k_proj_weight=t.get("k_proj_weight"),
        v_proj_weight=t.get("v_proj_weight"), average_attn_weights=average_attn_weights)
    return (out.transpose(0, 1) if batch_first else out), w, xs, t


def _mha_case(name):
    """(query, key, value, params, H, options): torch.nn.MultiheadAttention's parameter layouts."""
    rng = np.random.default_rng(7)
    E, H, L, S, N = 6, 3, 4, 5, 2
    packed = {"in_proj_weight": rng.normal(size=(3 * E, E)), "in_proj_bias": rng.normal(size=3 * E),
              "out_proj.weight": rng.normal(size=(E, E)), "out_proj.bias": rng.normal(size=E)}

    def x(*shape):
        return rng.normal(size=shape)

    if name == "defaults":  # no option at all: (L, N, E), no mask, averaged weights
        return x(L, N, E), x(S, N, E), x(S, N, E), packed, H, {}
    if name == "3d_float_mask":  # (N*H, L, S) indexed n*H + h, plus key padding
        return x(L, N, E), x(S, N, E), x(S, N, E), packed, H, dict(
            attn_mask=x(N * H, L, S), key_padding_mask=np.array([[0, 0, 0, 1, 1], [1, 0, 0, 0, 0]], bool))
    if name == "3d_bool_mask_per_head":
        mask = rng.random((N * H, L, S)) > 0.5
        mask[..., 1] = False  # every row sees key 1
        return x(L, N, E), x(S, N, E), x(S, N, E), packed, H, dict(attn_mask=mask, average_attn_weights=False)
    if name == "separate_bias_kv_zero_attn_batch_first":  # kdim 5, vdim 4
        params = {"q_proj_weight": x(E, E), "k_proj_weight": x(E, 5), "v_proj_weight": x(E, 4),
                  "in_proj_bias": x(3 * E), "bias_k": x(1, 1, E), "bias_v": x(1, 1, E),
                  "out_proj.weight": x(E, E), "out_proj.bias": x(E)}
        return x(N, L, E), x(N, S, 5), x(N, S, 4), params, H, dict(
            add_zero_attn=True, batch_first=True, key_padding_mask=np.array([[0, 1, 0, 0, 0], [0, 0, 0, 0, 1]], bool))
    if name == "separate_no_bias":
        params = {"q_proj_weight": x(E, E), "k_proj_weight": x(E, E), "v_proj_weight": x(E, E),
                  "out_proj.weight": x(E, E)}
        return x(L, N, E), x(S, N, E), x(S, N, E), params, H, dict(attn_mask=x(L, S))
    if name == "unbatched_3d_mask":  # (L, E) with an (H, L, S) mask and an (S,) key padding mask
        return x(L, E), x(S, E), x(S, E), packed, H, dict(
            attn_mask=x(H, L, S), key_padding_mask=np.array([0, 0, 1, 0, 0], bool))
    if name == "unbatched_per_head":
        return x(L, E), x(S, E), x(S, E), packed, H, dict(average_attn_weights=False, add_zero_attn=True)
    if name == "causal_and_bool_mask":
        mask = rng.random((L, S)) > 0.7
        mask[:, 0] = False
        return x(L, N, E), x(S, N, E), x(S, N, E), packed, H, dict(attn_mask=mask, is_causal=True)
    raise KeyError(name)


MHA_CASES = ["defaults", "3d_float_mask", "3d_bool_mask_per_head", "separate_bias_kv_zero_attn_batch_first",
             "separate_no_bias", "unbatched_3d_mask", "unbatched_per_head", "causal_and_bool_mask"]


@pytest.mark.parametrize("case", MHA_CASES)
def test_multi_head_attention_and_vjp_match_torch(case):
    query, key, value, params, H, options = _mha_case(case)
    got, got_w = oracle.multi_head_attention(query, key, value, params, H, **options)
    want, want_w, xs, t = _torch_mha(query, key, value, params, H, **options)
    assert_close(got, want.detach().numpy())
    assert got_w.shape == want_w.shape
    assert_close(got_w, want_w.detach().numpy())

    rng = np.random.default_rng(8)
    g_out, g_w = rng.normal(size=got.shape), rng.normal(size=got_w.shape)
    (torch.sum(want * torch.from_numpy(g_out)) + torch.sum(want_w * torch.from_numpy(g_w))).backward()
    grads = oracle.multi_head_attention_vjp(query, key, value, params, H, g_out, g_w, **options)
    expected = {"query": xs[0].grad, "key": xs[1].grad, "value": xs[2].grad, **{n: a.grad for n, a in t.items()}}
    assert sorted(grads) == sorted(expected)
    for name, g in expected.items():
        assert grads[name].shape == tuple(g.shape), name
        assert_close(grads[name], g.numpy(), chain=True, err_msg=name)


@pytest.mark.parametrize("need_weights, average", [(False, True), (True, True), (True, False)])
def test_multi_head_attention_need_weights_and_average(need_weights, average):
    query, key, value, params, H, _ = _mha_case("defaults")
    got, got_w = oracle.multi_head_attention(query, key, value, params, H, need_weights=need_weights,
                                             average_attn_weights=average)
    want, want_w, _, _ = _torch_mha(query, key, value, params, H, need_weights=need_weights,
                                    average_attn_weights=average)
    assert_close(got, want.detach().numpy())
    if not need_weights:
        assert got_w is None and want_w is None
    else:
        assert got_w.shape == ((2, 4, 5) if average else (2, 3, 4, 5))
        assert_close(got_w, want_w.detach().numpy())


def test_multi_head_attention_general_naming_with_head_dim_apart_from_embed_dim():
    """mha.GeneralAttention's naming: q_proj (H*D, Eq) with H*D != Eq, v_proj (H*Dv, Ev), out_proj
    (E, H*Dv); torch by hand: the projections, F.scaled_dot_product_attention per head, the output."""
    rng = np.random.default_rng(9)
    H, D, Dv, Eq, Ek, Ev, E, L, S, N = 2, 3, 5, 4, 7, 2, 4, 3, 6, 2
    params = {"q_proj.weight": rng.normal(size=(H * D, Eq)), "q_proj.bias": rng.normal(size=H * D),
              "k_proj.weight": rng.normal(size=(H * D, Ek)), "k_proj.bias": rng.normal(size=H * D),
              "v_proj.weight": rng.normal(size=(H * Dv, Ev)), "v_proj.bias": rng.normal(size=H * Dv),
              "out_proj.weight": rng.normal(size=(E, H * Dv)), "out_proj.bias": rng.normal(size=E)}
    query, key, value = rng.normal(size=(N, L, Eq)), rng.normal(size=(N, S, Ek)), rng.normal(size=(N, S, Ev))
    got, _ = oracle.multi_head_attention(query, key, value, params, H, batch_first=True)
    t = {n: torch.from_numpy(a) for n, a in params.items()}

    def heads(x, name, d):  # (N, T, H*d) -> (N, H, T, d)
        return F.linear(torch.from_numpy(x), t[f"{name}.weight"], t[f"{name}.bias"]).unflatten(-1, (H, d)).transpose(1, 2)

    o = F.scaled_dot_product_attention(heads(query, "q_proj", D), heads(key, "k_proj", D), heads(value, "v_proj", Dv))
    want = F.linear(o.transpose(1, 2).flatten(2), t["out_proj.weight"], t["out_proj.bias"])
    assert_close(got, want.numpy())


@pytest.mark.parametrize("option", ["bool_attn_mask", "float32_attn_mask", "key_padding_mask", "is_causal",
                                    "add_zero_attn"])
def test_multi_head_attention_float32_stays_float32_with_every_mask(option):
    rng = np.random.default_rng(10)
    E, H, L, N = 8, 2, 5, 2
    params = {"in_proj_weight": rng.normal(size=(3 * E, E)).astype(np.float32),
              "out_proj.weight": rng.normal(size=(E, E)).astype(np.float32)}
    x = rng.normal(size=(L, N, E)).astype(np.float32)
    options = {"bool_attn_mask": dict(attn_mask=np.triu(np.ones((L, L), bool), 1)),
               "float32_attn_mask": dict(attn_mask=rng.normal(size=(L, L)).astype(np.float32)),
               "key_padding_mask": dict(key_padding_mask=np.array([[0, 0, 0, 1, 1], [0, 0, 0, 0, 0]], bool)),
               "is_causal": dict(is_causal=True), "add_zero_attn": dict(add_zero_attn=True)}[option]
    out, w = oracle.multi_head_attention(x, x, x, params, H, **options)
    assert out.dtype == np.float32 and w.dtype == np.float32
    want, want_w, _, _ = _torch_mha(x, x, x, params, H, **options)
    np.testing.assert_allclose(out, want.detach().numpy(), atol=1e-4, rtol=1e-4)
    assert_close(w, want_w.detach().numpy(), chain=True)


# ---------------------------------------------------------------------------------------------
# blocked_attention (the online softmax) against torch's scaled_dot_product_attention
# ---------------------------------------------------------------------------------------------

def _torch_attention(q, k, v, mask=None, is_causal=False, scale=None):
    """torch's output and log-sum-exp of the scores, batch axes broadcast first."""
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    q, k, v = (torch.from_numpy(np.broadcast_to(a, (*batch, *a.shape[-2:])).copy()) for a in (q, k, v))
    L, S = q.shape[-2], k.shape[-2]
    bias = torch.zeros(L, S, dtype=q.dtype)
    if mask is not None:
        mask = torch.from_numpy(mask)
        bias = bias + (mask if mask.dtype != torch.bool else torch.zeros_like(bias).masked_fill(~mask, -np.inf))
    if is_causal:
        bias = bias.masked_fill(~torch.ones(L, S, dtype=torch.bool).tril(), -np.inf)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype), scale=scale)
    lse = torch.logsumexp(q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale) + bias, -1)
    return out.numpy(), lse.numpy()


SHAPES = {  # q, k, v shapes: every rank, and batch axes that only one of q, k, v carries
    "2d": ((5, 4), (7, 4), (7, 3)),
    "3d": ((2, 5, 4), (2, 7, 4), (2, 7, 3)),
    "batch_from_q_and_k": ((2, 1, 5, 4), (1, 3, 7, 4), (1, 1, 7, 3)),
    "batch_from_q_and_v": ((2, 1, 5, 4), (1, 1, 7, 4), (1, 3, 7, 3)),
    "5d": ((2, 1, 2, 5, 4), (1, 3, 2, 7, 4), (1, 3, 1, 7, 3)),
}


@pytest.mark.parametrize("shapes", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("scale", [None, 0.3])
@pytest.mark.parametrize("is_causal", [False, True])
def test_blocked_attention_matches_torch_for_every_rank_and_broadcast(shapes, scale, is_causal):
    rng = np.random.default_rng(11)
    q, k, v = (rng.normal(size=s) for s in shapes)
    out, lse = oracle.blocked_attention(q, k, v, None, is_causal, scale, block_q=2, block_k=3)
    want, want_lse = _torch_attention(q, k, v, None, is_causal, scale)
    assert out.shape == want.shape and lse.shape == want_lse.shape
    assert_close(out, want)
    assert_close(lse, want_lse)


def test_blocked_attention_defaults_are_not_causal_with_256_tiles():
    rng = np.random.default_rng(12)
    q, k, v = rng.normal(size=(1, 300, 4)), rng.normal(size=(1, 600, 4)), rng.normal(size=(1, 600, 3))
    out, lse = oracle.blocked_attention(q, k, v)
    want, want_lse = _torch_attention(q, k, v)
    assert_close(out, want)
    assert_close(lse, want_lse)
    # the default tiles are 256 x 256: the same rounding as when they are given
    explicit = oracle.blocked_attention(q, k, v, None, False, None, block_q=256, block_k=256)
    np.testing.assert_array_equal(out, explicit[0])
    np.testing.assert_array_equal(lse, explicit[1])


def test_blocked_attention_float32_stays_float32():
    g = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(2, n, 4, generator=g) for n in (5, 7, 7))
    mask = (torch.rand(5, 7, generator=g) > 0.3).numpy()
    mask[:, 0] = True
    out, lse = oracle.blocked_attention(q.numpy(), k.numpy(), v.numpy(), mask, block_q=2, block_k=3)
    assert out.dtype == np.float32 and lse.dtype == np.float32
    want, want_lse = _torch_attention(*(a.double().numpy() for a in (q, k, v)), mask)
    assert_close(out, want, chain=True)
    assert_close(lse, want_lse, chain=True)


def test_blocked_attention_shifts_each_row_by_its_own_max():
    """Rows (and heads) far below the others must not underflow: the running max is per row."""
    rng = np.random.default_rng(14)
    q, k, v = rng.normal(size=(2, 4, 3)), rng.normal(size=(2, 5, 3)), rng.normal(size=(2, 5, 2))
    mask = np.zeros((2, 4, 5))
    mask[0, 1] = -1000.0  # one row of head 0
    mask[1] = -2000.0  # all of head 1
    out, lse = oracle.blocked_attention(q, k, v, mask)
    want, want_lse = _torch_attention(q, k, v, mask)
    assert_close(out, want)
    np.testing.assert_allclose(lse, want_lse, atol=1e-9, rtol=0)


@pytest.mark.parametrize("block_q", [1, 2, 5])
def test_causal_blocked_attention_never_reads_keys_no_query_sees(block_q):
    """Top-left causal with L < S: keys L.. are never visible, and their tiles are skipped, so a NaN
    there cannot reach the output (0 * NaN would)."""
    rng = np.random.default_rng(15)
    q, k, v = rng.normal(size=(2, 5, 4)), rng.normal(size=(2, 8, 4)), rng.normal(size=(2, 8, 3))
    k[:, 5:], v[:, 5:] = np.nan, np.nan
    out, lse = oracle.blocked_attention(q, k, v, None, True, block_q=block_q, block_k=4)
    want, want_lse = _torch_attention(q, k[:, :5], v[:, :5], None, True)
    assert_close(out, want)
    assert_close(lse, want_lse)


def test_blocked_attention_fully_masked_row_is_zero_without_warnings():
    rng = np.random.default_rng(16)
    q, k, v = rng.normal(size=(3, 4)), rng.normal(size=(5, 4)), rng.normal(size=(5, 2))
    mask = np.ones((3, 5), bool)
    mask[1] = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = oracle.blocked_attention(q, k, v, mask, block_k=2)
    assert out[1].tolist() == [0.0, 0.0] and lse[1] == -np.inf
    want, want_lse = _torch_attention(q, k, v, mask)
    assert_close(out[[0, 2]], want[[0, 2]])
    assert_close(lse[[0, 2]], want_lse[[0, 2]])


def test_blocked_attention_single_visible_key_gives_its_value_exactly():
    """A row seeing one key (score 0, in the last tile, after fully masked tiles) has weight exactly 1
    on it: the output is that value bit for bit and the log-sum-exp exactly 0."""
    rng = np.random.default_rng(17)
    q, k, v = np.zeros((1, 4)), rng.normal(size=(6, 4)), rng.normal(size=(6, 16))
    mask = np.zeros((1, 6), bool)
    mask[0, 4] = True
    out, lse = oracle.blocked_attention(q, k, v, mask, block_k=2)
    np.testing.assert_array_equal(out[0], v[4])
    assert lse[0] == 0.0


def test_blocked_attention_fully_masked_tile_then_very_negative_scores():
    """The running max stays -inf while a row sees nothing (it used to be floored at 0, so scores
    below about -745 after a fully masked tile underflowed to zeros and lse -inf)."""
    rng = np.random.default_rng(18)
    q, k, v = rng.normal(size=(1, 4)), rng.normal(size=(3, 4)), rng.normal(size=(3, 2))
    mask = np.array([[-np.inf, -1000.0, -1001.0]])  # e.g. padding, then a large negative bias
    want, want_lse = _torch_attention(q, k, v, mask)
    out, lse = oracle.blocked_attention(q, k, v, mask, block_k=1)
    assert_close(out, want)
    np.testing.assert_allclose(lse, want_lse, atol=1e-9, rtol=0)


def test_numpy_encoder_block_asks_attention_for_no_weights(monkeypatch):
    """As torch.nn.TransformerEncoderLayer (need_weights=False): the block never has weights computed."""
    asked = []
    real = oracle.transformer.multi_head_attention

    def spy(*args, **kwargs):
        asked.append(kwargs.get("need_weights", "not given"))
        return real(*args, **kwargs)

    monkeypatch.setattr(oracle.transformer, "multi_head_attention", spy)
    torch.manual_seed(20)
    layer = torch.nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0).double().eval()
    src = torch.randn(5, 2, 8, dtype=torch.float64)
    params = {n: a.detach().numpy() for n, a in layer.state_dict().items()}
    got = oracle.transformer_encoder_layer(src.numpy(), params, 2)
    with torch.no_grad():
        want = layer(src)
    assert_close(got, want.numpy())
    assert len(asked) == 1 and asked[0] is False


def test_the_oracle_imports_nothing_from_mha():
    """A reference that shared code with what it checks could not see a bug in that code."""
    import ast
    from pathlib import Path

    for path in Path(oracle.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.level <= 1 and not (node.module or "").startswith("mha"), f"{path.name}: from {node.module}"
            elif isinstance(node, ast.Import):
                assert not any(a.name.split(".")[0] == "mha" for a in node.names), f"{path.name}: import mha"


@pytest.mark.parametrize("left, right", [(None, 0), (3, 0), (2, 1), (None, None), (0, 0), (4, None)])
@pytest.mark.parametrize("L, S, offset", [(5, 5, 0), (3, 8, 5), (8, 3, -5), (6, 7, 2)])
def test_the_oracles_band_equals_the_librarys(left, right, L, S, offset):
    """The oracle writes the band rule again; the two must agree on every (query, key)."""
    from mha.positions import Band

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 1, n, 4)) for n in (L, S, S))
    _, weights = oracle.contract_attention(q, k, v, band=(left, right), offset=offset)
    visible = Band(left, right).visible(L, S, offset).numpy()
    np.testing.assert_array_equal(weights[0, 0] > 0, visible & visible.any(-1, keepdims=True))
