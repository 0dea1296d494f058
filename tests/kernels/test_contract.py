"""The attention contract itself: every backend against one float64 reference built from the
single position rule (mha.numpy.contract), forward and gradients, over random contracts; what
padding and causality promise; the dispatch; flash's dropout."""

import dataclasses
import math
import os
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from helpers.backends import ALL, NATIVE, TILED, TILED_REASON
from helpers.exact import raises_exactly
from helpers.tolerance import assert_close, assert_within_torch_error
from mha import kernels, positions
from mha import numpy as oracle
from mha.kernels import Contract
from mha.kernels.contract import LEARNED
from mha.positions import Band

EXACT = ["math", "flash", "sdpa", "auto"]


@pytest.mark.parametrize("backend", [name for name in ALL if name != "sdpa"])  # sdpa: where torch keeps O(T) memory
@pytest.mark.parametrize("shapes", [((7, 4), (9, 4), (9, 5)),  # bare matrices
                                    ((3, 7, 4), (9, 4), (9, 5)),  # heads on q alone
                                    ((4, 7, 4), (2, 9, 4), (2, 9, 5)),  # two query heads per kv head, 3-D
                                    ((2, 4, 7, 4), (1, 2, 9, 4), (2, 2, 9, 5))])  # and a batch
def test_every_backend_takes_bare_matrices_mixed_ranks_and_shared_heads(backend, shapes):
    """mha.kernels.attention, the public dispatch, on any rank: as the math kernel on heads repeated by hand."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (_tensor(shape, g) for shape in shapes)
    contract = Contract(band=Band(None, 0), offset=2)
    grouped = k.dim() > 2 and k.shape[-3] != q.shape[-3]
    repeat = (lambda x: x.repeat_interleave(2, -3)) if grouped else (lambda x: x)  # noqa: E731
    expected, _ = kernels.math_attention(q, repeat(k), repeat(v), contract)
    out, _ = kernels.attention(q, k, v, contract, backend=backend)
    assert_close(out, expected)


def test_the_native_kernel_builds_wherever_a_compiler_is_found():
    """Where torch's extension tooling finds a C++ compiler (CXX, else c++), the native backend is
    there: its tests skip only where nothing could build it, never because a build broke."""
    if shutil.which(os.environ.get("CXX", "c++")) is None or os.environ.get("MHA_NATIVE", "").lower() == "off":
        pytest.skip("no C++ compiler here (or MHA_NATIVE=off)")
    assert kernels.native_available()


def _tensor(shape, g, dtype=torch.float64):
    return torch.randn(shape, generator=g, dtype=dtype)


@st.composite
def contracts(draw):
    """(q, k, v, contract) with every term of the contract drawn at random, float64."""
    B, H = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    L, S = draw(st.integers(0, 13)), draw(st.integers(0, 17))
    D, Dv = draw(st.sampled_from([1, 4, 5])), draw(st.sampled_from([1, 3, 4]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31)))
    q, k, v = _tensor((B, H, L, D), g) * 2, _tensor((B, H, S, D), g) * 2, _tensor((B, H, S, Dv), g)
    terms = {}
    kind = draw(st.sampled_from(["none", "causal", "window", "left window", "right window"]))
    bound = st.integers(0, 6)
    terms["band"] = {"none": None, "causal": Band(None, 0), "window": Band(draw(bound), draw(bound)),
                     "left window": Band(draw(bound), None), "right window": Band(None, draw(bound))}[kind]
    if draw(st.booleans()):  # per-sequence positions, as a KV cache holding sequences of different lengths
        terms["positions"] = (torch.randint(0, 20, (B, L), generator=g), torch.randint(0, 20, (B, S), generator=g))
    else:
        terms["offset"] = draw(st.sampled_from([0, S - L, draw(st.integers(-5, 5))]))
    if draw(st.booleans()):
        terms["key_valid"] = torch.rand(B, S, generator=g) > 0.3
    mask_shape = draw(st.sampled_from([None, (L, S), (B, 1, 1, S), (1, H, L, S), (1, S)]))
    if mask_shape is not None:
        attend = torch.rand(mask_shape, generator=g) > 0.25
        terms["mask"] = attend if draw(st.booleans()) else _tensor(mask_shape, g).masked_fill(~attend, float("-inf"))
    if draw(st.booleans()):
        terms["alibi_slopes"] = torch.rand(H, generator=g, dtype=torch.float64)
    if draw(st.booleans()):
        terms["softcap"] = draw(st.sampled_from([0.5, 3.0, 20.0]))
    if draw(st.booleans()):
        terms["sinks"] = _tensor((H,), g)
    if draw(st.booleans()):
        terms["scale"] = draw(st.sampled_from([0.1, 1.0]))
    if draw(st.booleans()):
        terms["logit_scale"] = _tensor((H,), g) * 2
    return q, k, v, Contract(**terms)


def _oracle_terms(contract: Contract) -> dict:
    """The contract as the NumPy reference's keyword arguments."""
    as_numpy = lambda t: None if t is None else t.numpy()  # noqa: E731
    terms = dict(band=contract.band, offset=contract.offset, key_valid=as_numpy(contract.key_valid),
                 mask=as_numpy(contract.mask), alibi_slopes=as_numpy(contract.alibi_slopes),
                 scale=contract.scale, softcap=contract.softcap, sinks=as_numpy(contract.sinks),
                 logit_scale=as_numpy(contract.logit_scale))
    if contract.positions is not None:
        terms["query_positions"], terms["key_positions"] = (p.numpy() for p in contract.positions)
    return terms


def _run(backend, q, k, v, contract):
    out, _ = kernels.attention(q, k, v, contract, backend=backend)
    return out


def _with_grad(contract: Contract) -> Contract:
    return contract.replace(**{name: getattr(contract, name).clone().requires_grad_()
                               for name in LEARNED if getattr(contract, name) is not None})


@given(contracts(), st.sampled_from(EXACT))
def test_every_backend_equals_the_reference_forward_and_gradients(case, backend):
    q, k, v, contract = case
    try:
        kernels.choose_backend(backend, q, k, v, contract)
        refused = False
    except ValueError:
        refused = True
    if refused:  # a backend that cannot honour the contract says so, and computes nothing else
        with pytest.raises(ValueError, match="cannot run this call"):
            _run(backend, q, k, v, contract)
        return
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    contract = _with_grad(contract)
    out = _run(backend, q, k, v, contract)
    terms = _oracle_terms(contract.replace(**{name: _detached(getattr(contract, name)) for name in LEARNED}))
    arrays = [t.detach().numpy() for t in (q, k, v)]
    want, _ = oracle.contract_attention(*arrays, **terms)
    assert_close(out.detach().numpy(), want, chain=True)
    grad_out = torch.randn_like(out)
    wanted = oracle.contract_attention_vjp(*arrays, grad_out.numpy(), **terms)
    inputs = {"q": q, "k": k, "v": v, **dict(zip(LEARNED, contract.learned))}
    inputs = {name: t for name, t in inputs.items() if t is not None}
    if out.numel() == 0:
        return
    grads = torch.autograd.grad(out, list(inputs.values()), grad_out, allow_unused=True)
    for (name, t), got in zip(inputs.items(), grads):
        got = torch.zeros_like(t) if got is None else got
        np.testing.assert_allclose(got.numpy(), wanted[name], atol=1e-9, rtol=0, err_msg=name)


def _detached(t):
    return None if t is None else t.detach()


def test_the_reference_gradients_equal_finite_differences():
    g = torch.Generator().manual_seed(0)
    q, k, v = _tensor((1, 2, 3, 4), g), _tensor((1, 2, 5, 4), g), _tensor((1, 2, 5, 3), g)
    terms = dict(band=Band(2, 0), offset=2, alibi_slopes=np.array([0.5, 0.25]), softcap=2.0,
                 sinks=np.array([0.3, -1.0]), key_valid=np.array([[True, True, False, True, True]]))
    grad_out = np.random.default_rng(1).standard_normal((1, 2, 3, 3))
    arrays = {"q": q.numpy(), "k": k.numpy(), "v": v.numpy()}
    grads = oracle.contract_attention_vjp(*arrays.values(), grad_out, **terms)

    def loss(name, value):
        args = {**arrays, name: value} if name in arrays else arrays
        extra = {} if name in arrays else {name: value}
        out, _ = oracle.contract_attention(*args.values(), **{**terms, **extra})
        return np.sum(out * grad_out)

    for name in ("q", "k", "v", "alibi_slopes", "sinks"):
        x = arrays[name] if name in arrays else terms[name]
        numeric = np.zeros_like(x)
        for index in np.ndindex(x.shape):
            step = np.zeros_like(x)
            step[index] = 1e-6
            numeric[index] = (loss(name, x + step) - loss(name, x - step)) / 2e-6
        np.testing.assert_allclose(grads[name], numeric, atol=1e-7, err_msg=name)


# -- what padding and causality promise ------------------------------------------------------------


@pytest.mark.parametrize("backend", EXACT)
@pytest.mark.parametrize("terms", [dict(), dict(band=Band(None, 0)), dict(band=Band(3, 0), alibi_slopes=True),
                                   dict(softcap=5.0, sinks=True)], ids=str)
def test_a_padded_key_changes_nothing(backend, terms):
    """Keys marked padding may hold anything (here values that would dominate every softmax): the
    output and the real keys' gradients are those without them, and the padded keys' gradients
    are exactly zero."""
    g = torch.Generator().manual_seed(3)
    q, k, v = _tensor((2, 2, 6, 4), g), _tensor((2, 2, 9, 4), g), _tensor((2, 2, 9, 4), g)
    terms = {**terms, "alibi_slopes": torch.tensor([0.5, 0.1], dtype=torch.float64) if terms.get("alibi_slopes") else None,
             "sinks": torch.zeros(2, dtype=torch.float64) if terms.get("sinks") else None}
    k2, v2 = torch.cat([k, 1e4 * q[:, :, :3]], 2), torch.cat([v, 1e30 * v[:, :, :3]], 2)
    valid = torch.ones(2, 12, dtype=torch.bool)
    valid[:, 9:] = False
    offset = 3  # bottom-right for the 9 real keys, so both calls put the queries at the same positions
    if backend == "sdpa" and (terms.get("band") or terms.get("softcap")):
        return  # sdpa declines padding beside causality, and softcap (tested above)
    plain = _run(backend, q, k, v, Contract(offset=offset, **terms))
    k2.requires_grad_()
    v2.requires_grad_()
    padded = _run(backend, q, k2, v2, Contract(offset=offset, key_valid=valid, **terms))
    assert_close(padded, plain)
    dk, dv = torch.autograd.grad(padded.sum(), (k2, v2))
    assert torch.all(dk[:, :, 9:] == 0) and torch.all(dv[:, :, 9:] == 0)


CAUSAL_VARIANTS = {
    "exact-math": lambda q, k, v: _run("math", q, k, v, Contract(band=Band(None, 0))),
    "exact-flash": lambda q, k, v: _run("flash", q, k, v, Contract(band=Band(None, 0))),
    "exact-sdpa": lambda q, k, v: _run("sdpa", q, k, v, Contract(band=Band(None, 0))),
    "exact-sdpa-bottom-right": lambda q, k, v: _run("sdpa", q[:, :, 4:], k, v, Contract(band=Band(None, 0), offset=4)),
    "alibi-window-softcap-sinks": lambda q, k, v: _run("auto", q, k, v, Contract(
        band=Band(5, 0), alibi_slopes=torch.tensor([0.3, 0.7], dtype=q.dtype), softcap=4.0,
        sinks=torch.tensor([0.0, 1.0], dtype=q.dtype))),
}


def _efficient(name, **options):
    from mha import efficient

    variant = efficient.make(name, **options)
    return lambda q, k, v: variant(q, k, v, is_causal=True)


CAUSAL_VARIANTS.update({
    "local": _efficient("local", window=4), "strided": _efficient("strided", stride=3),
    "fixed": _efficient("fixed", block=4, summary=2), "linear": _efficient("linear", chunk=5),
    "performer": _efficient("performer", head_dim=8, features=16, chunk=5, generator_seed=0),
})


@pytest.mark.parametrize("name", list(CAUSAL_VARIANTS))
def test_causal_variants_never_see_the_future(name):
    """Changing future keys and values leaves every earlier output bit for bit, and their
    gradients from earlier outputs are exactly zero (exact and efficient variants alike)."""
    attend = CAUSAL_VARIANTS[name]
    g = torch.Generator().manual_seed(5)
    q, k, v = (_tensor((1, 2, 20, 8), g) for _ in range(3))
    offset = 4 if name.endswith("bottom-right") else 0  # that variant's queries are the last 16
    out = attend(q, k, v)
    for t in (6, 13):
        future_k, future_v = k.clone(), v.clone()
        future_k[:, :, t + 1:] = 50 * _tensor(future_k[:, :, t + 1:].shape, g)  # large: a max-based shift would move
        future_v[:, :, t + 1:] = 50 * _tensor(future_v[:, :, t + 1:].shape, g)
        changed = attend(q, future_k, future_v)
        rows = slice(0, t + 1 - offset)
        assert torch.equal(changed[:, :, rows], out[:, :, rows]), f"rows up to {t} moved"
        kk, vv = k.clone().requires_grad_(), v.clone().requires_grad_()
        dk, dv = torch.autograd.grad(attend(q, kk, vv)[:, :, rows].sum(), (kk, vv))
        assert torch.all(dk[:, :, t + 1:] == 0) and torch.all(dv[:, :, t + 1:] == 0)


@pytest.mark.parametrize("backend", EXACT)
def test_a_nan_in_a_future_key_leaves_earlier_rows_finite(backend):
    g = torch.Generator().manual_seed(6)
    q, k, v = (_tensor((1, 2, 10, 4), g) for _ in range(3))
    clean = _run(backend, q, k, v, Contract(band=Band(None, 0)))
    k[:, :, 7] = float("nan")
    poisoned = _run(backend, q, k, v, Contract(band=Band(None, 0)))
    torch.testing.assert_close(poisoned[:, :, :7], clean[:, :, :7], atol=1e-14, rtol=0)
    assert torch.isnan(poisoned[:, :, 7:]).all()


# -- dispatch: O(T) memory by construction -------------------------------------------------------------

Q = K = V = torch.randn(1, 2, 64, 4)  # q, k and v hold 1,536 elements; a 64 x 64 mask 4,096
SMALL = torch.randn(1, 2, 8, 4)  # 192 elements; an 8 x 8 mask 64
VALID = torch.ones(1, 64, dtype=torch.bool)
DISPATCH = [  # (contract, need_weights, dropout_p, backend auto picks)
    (Contract(), False, 0.0, "sdpa"),
    (Contract(band=Band(None, 0)), False, 0.0, "sdpa"),
    (Contract(band=Band(None, 0), offset=5), False, 0.0, "sdpa"),  # bottom-right: split at the diagonal
    (Contract(band=Band(None, 0), offset=-3), False, 0.0, "sdpa"),
    (Contract(key_valid=VALID), False, 0.0, "sdpa"),  # a (B, 1, 1, S) mask
    (Contract(mask=torch.ones(64, 64, dtype=torch.bool), band=Band(None, 0)), False, 0.0, "sdpa"),  # the caller's L x S
    (Contract(mask=torch.ones(1, 64, dtype=torch.bool), band=Band(None, 0)), False, 0.0, TILED),
    (Contract(key_valid=VALID, band=Band(None, 0)), False, 0.0, TILED),
    (Contract(band=Band(3, 0)), False, 0.0, TILED),
    (Contract(alibi_slopes=torch.ones(2)), False, 0.0, TILED),
    (Contract(softcap=3.0), False, 0.0, TILED),
    (Contract(sinks=torch.zeros(2)), False, 0.0, TILED),
    (Contract(band=Band(None, 0), positions=(torch.zeros(1, 64, dtype=torch.long),) * 2), False, 0.0, TILED),
    (Contract(), False, 0.1, "flash"),  # torch's CPU kernel builds the (B, H, L, S) weights for dropout
    (Contract(band=Band(3, 0)), True, 0.0, "native" if NATIVE else "math"),  # weights, nothing to differentiate
    (Contract(band=Band(3, 0)), True, 0.1, "math"),  # weights after dropout
]


@pytest.mark.parametrize("contract", [Contract(band=Band(3, 0)), Contract(key_valid=VALID[:, :8], band=Band(None, 0)),
                                      Contract(alibi_slopes=torch.ones(2)), Contract(band=Band(2, 1), offset=-2)],
                         ids=repr)
def test_short_calls_fold_into_one_mask_no_larger_than_the_inputs(contract):
    """At short T a dense mask is smaller than q, k and v: torch's kernel runs it (the fastest there)."""
    name, reason = kernels.choose_backend("auto", SMALL, SMALL, SMALL, contract)
    assert name == "sdpa", reason
    out = kernels.sdpa_attention(SMALL, SMALL, SMALL, contract)
    torch.testing.assert_close(out, kernels.math_attention(SMALL, SMALL, SMALL, contract)[0])


@pytest.mark.parametrize("contract, need_weights, dropout_p, expected", DISPATCH, ids=repr)
def test_auto_picks_a_backend_that_builds_no_score_matrix(contract, need_weights, dropout_p, expected):
    name, reason = kernels.choose_backend("auto", Q, K, V, contract, need_weights=need_weights, dropout_p=dropout_p)
    assert name == expected, reason
    assert reason


def test_a_backend_that_cannot_says_why():
    with pytest.raises(ValueError, match=r"sdpa.*\(64, 64\) mask, more than q, k and v hold"):
        kernels.choose_backend("sdpa", Q, K, V, Contract(band=Band(3, 0)))
    with pytest.raises(ValueError, match="sdpa.*softcap"):
        kernels.choose_backend("sdpa", Q, K, V, Contract(softcap=1.0))
    with pytest.raises(ValueError, match="flash.*attn_mask"):
        kernels.choose_backend("flash", Q, K, V, Contract(mask=torch.zeros(8, 8, requires_grad=True)))
    with pytest.raises(TypeError, match="Contract"):
        kernels.flash_attention(Q, K, V, torch.zeros(8, 8))


# -- flash's own dropout ---------------------------------------------------------------------------------------


def test_flash_dropout_drops_whole_weights_and_rescales_the_rest():
    """With one-hot values, each output row is its dropped weights: each is 0 or P / (1 - p)."""
    g = torch.Generator().manual_seed(7)
    q, k = _tensor((1, 2, 40, 8), g), _tensor((1, 2, 40, 8), g)
    v = torch.eye(40, dtype=torch.float64).expand(1, 2, 40, 40)
    torch.manual_seed(0)
    dropped = kernels.flash_attention_with_lse(q, k, v, Contract(band=Band(None, 0)), dropout_p=0.25,
                                               block_q=16, block_k=16)[0]
    _, weights = kernels.math_attention(q, k, v, Contract(band=Band(None, 0)))
    kept = dropped != 0
    assert_close(dropped[kept], weights[kept] / 0.75)
    visible = weights > 0
    share = (kept & visible).sum() / visible.sum()
    assert 0.7 < share < 0.8  # 75% kept, of 1640 visible weights


def test_flash_dropout_gradients_match_its_own_draws():
    g = torch.Generator().manual_seed(8)
    q, k, v = (_tensor((1, 1, 12, 3), g).requires_grad_() for _ in range(3))
    contract = Contract(band=Band(None, 0), softcap=3.0)

    def seeded(q, k, v):
        torch.manual_seed(1)  # the same draws at every call
        return kernels.flash_attention_with_lse(q, k, v, contract, dropout_p=0.3, block_q=5, block_k=4)[0]

    assert torch.autograd.gradcheck(seeded, (q, k, v))
    torch.manual_seed(2)
    a = kernels.flash_attention(q, k, v, contract, dropout_p=0.3)
    b = kernels.flash_attention(q, k, v, contract, dropout_p=0.3)
    assert not torch.equal(a, b)  # fresh draws at every call


# -- the positional path of mha.GeneralAttention against the same reference ----------------------------


@st.composite
def positional_modules(draw):
    """A float64 general module with random positional options, and its input with padding."""
    import mha

    H = draw(st.sampled_from([2, 4]))
    hkv = draw(st.sampled_from([h for h in (1, 2, H) if H % h == 0]))
    D, E = 4, 8
    options = dict(num_kv_heads=hkv, alibi=draw(st.booleans()),
                   window=draw(st.sampled_from([None, (2, 0), (3, 1), (-1, 2)])),
                   softcap=draw(st.sampled_from([None, 2.0])), sinks=draw(st.booleans()))
    if draw(st.booleans()):
        options["rope"] = mha.RotaryEmbedding(draw(st.sampled_from([2, 4])), interleaved=draw(st.booleans()))
    torch.manual_seed(draw(st.integers(0, 1000)))
    module = mha.GeneralAttention(E, E, E, D, D, E, H, dtype=torch.float64, **options).eval()
    if module.sinks is not None:
        torch.nn.init.normal_(module.sinks)
    B, L, S = draw(st.integers(1, 2)), draw(st.integers(1, 9)), draw(st.integers(1, 11))
    lengths = [draw(st.integers(1, S)) for _ in range(B)]
    padding = torch.arange(S)[None, :] >= torch.tensor(lengths)[:, None]  # (B, S) right padding
    x_q, x_kv = torch.randn(B, L, E, dtype=torch.float64), torch.randn(B, S, E, dtype=torch.float64)
    return module, x_q, x_kv, padding, draw(st.booleans())


def _module_reference(m, x_q, x_kv, padding, is_causal):
    """The module's formula by hand: projections, RoPE at positions 0.., GQA by repetition, then
    the NumPy contract with the same positions (query i at i, key j at j)."""
    B, L, _ = x_q.shape
    S = x_kv.shape[1]
    heads = lambda x, n: x.view(B, x.shape[1], n, -1).transpose(1, 2)  # noqa: E731  (B, T, n*D) -> (B, n, T, D)
    q, k, v = heads(m.q_proj(x_q), m.h), heads(m.k_proj(x_kv), m.num_kv_heads), heads(m.v_proj(x_kv), m.num_kv_heads)
    if m.rope is not None:
        q, k = m.rope(q, torch.arange(L)), m.rope(k, torch.arange(S))
    k, v = (t.repeat_interleave(m.h // m.num_kv_heads, dim=1) for t in (k, v))
    arrays = [t.detach().numpy() for t in (q, k, v)]
    as_numpy = lambda t: None if t is None else t.detach().numpy()  # noqa: E731
    out, _ = oracle.contract_attention(*arrays, band=positions.band(is_causal, m.window), key_valid=~padding.numpy(),
                                       alibi_slopes=as_numpy(m.alibi_slopes), softcap=m.softcap,
                                       sinks=as_numpy(m.sinks))
    o = torch.from_numpy(out).transpose(1, 2).reshape(B, L, -1)  # (B, H, L, Dv) -> (B, L, H*Dv)
    return m.out_proj(o)


@given(positional_modules(), st.sampled_from(["auto", "flash", "math"]))
def test_the_module_positional_path_equals_the_reference(case, backend):
    m, x_q, x_kv, padding, is_causal = case
    with torch.no_grad():
        got = m(x_q, x_kv, x_kv, key_padding_mask=padding, is_causal=is_causal, backend=backend)
        want = _module_reference(m, x_q, x_kv, padding, is_causal)
    assert_close(got, want, chain=True)


@given(positional_modules(), st.lists(st.integers(1, 4), min_size=1, max_size=4))
def test_decoding_in_chunks_equals_the_full_causal_forward(case, chunks):
    """Prefill and chunks of any size through a KVCache: the same rows as one causal forward."""
    import mha

    m, x, _, _, _ = case
    T = x.shape[1]
    with torch.no_grad():
        full = m(x, x, x, is_causal=True)
        cache, pieces, start = mha.KVCache(), [], 0
        for size in [*chunks, T]:
            if start >= T:
                break
            part = x[:, start:start + size]
            pieces.append(m(part, part, part, is_causal=True, cache=cache))
            start += size
    assert_close(torch.cat(pieces, dim=1), full, chain=True)


# -- the dispatch decision, pinned: each choice and its reason, exactly ---------------------------------------


def _f32(*shape):
    return torch.randn(*shape)


_QKV = (_f32(1, 2, 64, 4), _f32(1, 2, 64, 4), _f32(1, 2, 64, 4))
_NOT_SDPA = "not sdpa ({}): " + TILED_REASON
_BUILDS = "torch's kernel would build the attention weights ({}): 8,192 elements, more than q, k and v hold ({})"
DECISIONS = {  # name: (q, k, v, contract, options, (backend, reason))
    "plain": (*_QKV, Contract(), {}, ("sdpa", "torch's fused kernel takes the whole contract")),
    "3-D": (_f32(2, 64, 4), _f32(2, 64, 4), _f32(2, 64, 4), Contract(), {},  # torch's math path, as torch runs 3-D
            (TILED, _NOT_SDPA.format(_BUILDS.format("q, k and v that are not all 4-D", "1,536")))),
    "short 3-D": (_f32(2, 8, 4), _f32(2, 8, 4), _f32(2, 8, 4), Contract(), {},  # its weights fit in q, k, v
                  ("sdpa", "torch's fused kernel takes the whole contract")),
    "shifted causal": (_f32(1, 2, 16, 4), *_QKV[1:], Contract(band=Band(None, 0), offset=48), {},
                       ("sdpa", "torch's fused kernel takes the whole contract")),
    "softcap": (*_QKV, Contract(softcap=5.0), {}, (TILED, _NOT_SDPA.format("torch's kernel does not take softcap"))),
    "sinks": (*_QKV, Contract(sinks=torch.zeros(2)), {},
              (TILED, _NOT_SDPA.format("torch's kernel does not take sinks"))),
    "dropout": (*_QKV, Contract(), dict(dropout_p=0.1),  # the native kernel has no dropout
                ("flash", "not sdpa ({}): flash applies every term tile by tile".format(_BUILDS.format("dropout", "1,536")))),
    "fewer kv heads (GQA)": (_QKV[0], _f32(1, 1, 64, 4), _f32(1, 1, 64, 4), Contract(), {},
                             ("sdpa", "torch's fused kernel takes the whole contract")),
    "broadcast batch": (_f32(2, 2, 64, 4), *_QKV[1:], Contract(), {},
                        (TILED, _NOT_SDPA.format("torch's kernel would build the attention weights (q, k and v of "
                                                   "different batch or head counts): 16,384 elements, more than q, "
                                                   "k and v hold (2,048)"))),
    "5-D": (_f32(1, 1, 2, 64, 4), _f32(1, 1, 2, 64, 4), _f32(1, 1, 2, 64, 4), Contract(), {},
            (TILED, _NOT_SDPA.format(_BUILDS.format("q, k and v that are not all 4-D", "1,536")))),
    "value width": (*_QKV[:2], _f32(1, 2, 64, 8), Contract(), {},
                    (TILED, _NOT_SDPA.format(_BUILDS.format("a value head dim unlike the query's", "2,048")))),
    "mixed dtypes": (_QKV[0], _QKV[1].double(), _QKV[2], Contract(), {},  # the native kernel takes one dtype
                     ("flash", "not sdpa ({}): flash applies every term tile by tile".format(
                         _BUILDS.format("dtype torch.float32", "1,536")))),
    "strided rows": (_QKV[0], _f32(1, 2, 4, 64).transpose(-1, -2), _QKV[2], Contract(), {},
                     (TILED, _NOT_SDPA.format(_BUILDS.format("rows that are not contiguous", "1,536")))),
    "window": (*_QKV, Contract(band=Band(3, 0)), {},
               (TILED, _NOT_SDPA.format("torch's kernel would need the band, ALiBi or padding as a (64, 64) mask, "
                                          "more than q, k and v hold (1,536 elements)"))),
    "keys carry the batch": (_f32(1, 1, 16, 4), _f32(4, 1, 16, 4), _f32(4, 1, 16, 4), Contract(), {},
                             (TILED, _NOT_SDPA.format("torch's kernel would build the attention weights (q, k and v "
                                                        "of different batch or head counts): 1,024 elements, more "
                                                        "than q, k and v hold (576)"))),
    "weights": (*_QKV, Contract(), dict(need_weights=True),
                ("native", "attention weights requested, nothing to differentiate: native computes them") if NATIVE
                else ("math", "attention weights requested: the math backend returns them")),
}


@pytest.mark.parametrize("name", list(DECISIONS))
def test_dispatch_decisions_and_their_reasons(name, caplog):
    q, k, v, contract, options, expected = DECISIONS[name]
    with caplog.at_level("DEBUG", logger="mha.dispatch"):
        assert kernels.choose_backend("auto", q, k, v, contract, **options) == expected
    assert caplog.messages == [f"backend {expected[0]}: {expected[1]}"]
    assert kernels.choose_backend(expected[0], q, k, v, contract, **options) == (
        expected[0], expected[1] if options.get("need_weights") else "requested explicitly")


@pytest.mark.parametrize("tangent_on", [0, 1, 2])
def test_dispatch_under_forward_mode_ad_picks_math(tangent_on):
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        qkv = list(_QKV)
        qkv[tangent_on] = fwAD.make_dual(qkv[tangent_on], torch.ones_like(qkv[tangent_on]))
        assert kernels.choose_backend("auto", *qkv, Contract()) == (
            "math", "not sdpa (torch's kernel has no forward-mode AD (jvp)), not flash (it has no forward-mode AD "
                    "(jvp); use backend='math')")


def test_dispatch_refusals_are_exact():
    def refused(backend, reason, **options):
        return raises_exactly(ValueError, f"backend={backend!r} {reason}")

    assert kernels.choose_backend("auto", *_QKV, None) == kernels.choose_backend("auto", *_QKV, Contract())  # None: no term
    assert kernels.choose_lse_backend("auto", *_QKV) == kernels.choose_lse_backend("auto", *_QKV, Contract())
    with refused("flash", "does not return attention weights; use backend='math' (or 'native', without gradients "
                          "or dropout) or need_weights=False"):
        kernels.choose_backend("flash", *_QKV, Contract(), need_weights=True)
    with refused("sdpa", "cannot run this call: torch's kernel does not take softcap"):
        kernels.choose_backend("sdpa", *_QKV, Contract(softcap=1.0))
    with raises_exactly(ValueError, "backend must be one of ('auto', 'math', 'sdpa', 'flash', 'native', 'flex'), "
                                                         "got 'warp'"):
        kernels.choose_backend("warp", *_QKV, Contract())
    with raises_exactly(ValueError, "the sdpa backend cannot run this call: torch's kernel does not "
                                                         "take softcap; use backend='flash' or 'math'"):
        kernels.sdpa_attention(*_QKV, Contract(softcap=1.0))
    with raises_exactly(TypeError, "contract must be an mha.kernels.Contract or None, got "
                                                        "dict"):
        kernels.flash_attention(*_QKV, {})


def test_the_memory_budget_is_inclusive():
    """A folded mask, or torch's weights, exactly as large as q, k and v together is within budget."""
    q = k = v = _f32(1, 1, 12, 4)  # budget 3 * 48 = 144 = 12 * 12
    assert kernels.choose_backend("auto", q, k, v, Contract(band=Band(3, 0)))[0] == "sdpa"
    assert kernels.choose_backend("auto", q, k, v, Contract(), dropout_p=0.1)[0] == "sdpa"
    q = k = v = _f32(1, 1, 13, 4)  # 169 > 156
    assert kernels.choose_backend("auto", q, k, v, Contract(band=Band(3, 0)))[0] == TILED


def test_contract_of_keeps_every_term_and_repr_shows_them():
    from mha.kernels import contract as contract_module

    slopes, sinks = torch.ones(2), torch.zeros(2)
    valid, mask = torch.ones(1, 5, dtype=torch.bool), torch.zeros(3, 5)
    pos = (torch.arange(3)[None], torch.arange(5)[None])
    terms = dict(band=Band(2, 0), offset=2, positions=pos, key_valid=valid, mask=mask, alibi_slopes=slopes,
                 scale=0.5, softcap=3.0, sinks=sinks)
    contract = contract_module.contract_of(**terms)
    assert all(getattr(contract, name) is value for name, value in terms.items())
    assert contract_module.contract_of(offset=3) is contract_module.NONE  # an offset alone changes nothing
    assert repr(contract) == ("Contract(band=Band(left=2, right=0), offset=2, positions=(<(1, 3)>, <(1, 5)>), "
                              "key_valid=<(1, 5) torch.bool>, mask=<(3, 5) torch.float32>, "
                              "alibi_slopes=<(2,) torch.float32>, scale=0.5, softcap=3.0, sinks=<(2,) torch.float32>)")
    assert repr(Contract()) == "Contract()"


_VALID_2x7 = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
SDPA_PATHS = {  # name: (L, S, contract terms): every way the sdpa backend hands a call to torch
    "folded window": (6, 6, dict(band=Band(2, 0))),
    "native mask": (5, 7, dict(mask=torch.randn(5, 7, dtype=torch.float64))),
    "native causal": (6, 6, dict(band=Band(None, 0))),
    "causal into a bool mask": (6, 6, dict(band=Band(None, 0), mask=torch.rand(6, 6) < 0.8)),
    "causal into a float mask": (6, 6, dict(band=Band(None, 0), mask=torch.randn(6, 6, dtype=torch.float64))),
    "every key visible": (3, 7, dict(band=Band(None, 0), offset=6)),
    "first queries see nothing": (7, 4, dict(band=Band(None, 0), offset=-3)),
    "prefix then causal": (4, 9, dict(band=Band(None, 0), offset=5)),
    "batched bool mask and padding": (5, 7, dict(mask=torch.rand(2, 1, 5, 7) < 0.8, key_valid=_VALID_2x7)),
    "batched float mask and padding": (5, 7, dict(mask=torch.randn(2, 1, 5, 7, dtype=torch.float64),
                                                  key_valid=_VALID_2x7)),
    "mask and padding folded": (5, 7, dict(mask=torch.randn(5, 7, dtype=torch.float64), key_valid=_VALID_2x7)),
    "batched mask folded with a window": (6, 6, dict(mask=torch.randn(2, 1, 6, 6, dtype=torch.float64),
                                                     band=Band(2, 0))),
}
BATCH_OF_2 = {"batched bool mask and padding", "batched float mask and padding", "mask and padding folded",
              "batched mask folded with a window"}


@pytest.mark.parametrize("name, rank", [(name, rank) for name in SDPA_PATHS for rank in (3, 4, 5)
                                        if not (name in BATCH_OF_2 and rank == 3)])  # a batch of 2 needs a batch dim
def test_the_sdpa_backend_keeps_the_scale_on_every_path(name, rank):
    """A scale other than 1/sqrt(D), forward and gradients, against math_attention in float64."""
    L, S, terms = SDPA_PATHS[name]
    g = torch.Generator().manual_seed(9)
    lead = {3: (3,), 4: (2, 3), 5: (2, 2, 3)}[rank]
    q, k, v = (torch.randn(*lead, n, 4, generator=g, dtype=torch.float64, requires_grad=True) for n in (L, S, S))
    contract = Contract(scale=0.37, **terms)
    assert kernels.choose_backend("auto", q, k, v, contract)[0] == "sdpa"
    out = kernels.sdpa_attention(q, k, v, contract)
    want, _ = kernels.math_attention(q, k, v, contract)
    assert_close(out, want)
    upstream = torch.randn(out.shape, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad((out * upstream).sum(), (q, k, v)),
                    torch.autograd.grad((want * upstream).sum(), (q, k, v))):
        assert_close(a, b)


@pytest.mark.parametrize("name", ["folded window", "native mask", "native causal", "batched float mask and padding"])
def test_the_sdpa_backend_applies_dropout_on_every_path(name):
    """With one-hot values each output row is its dropped weights: 0 or weight / (1 - p)."""
    L, S, terms = SDPA_PATHS[name]
    B = 2 if name in BATCH_OF_2 else 1
    q, k = torch.randn(B, 1, L, 4, dtype=torch.float64), torch.randn(B, 1, S, 4, dtype=torch.float64)
    v = torch.eye(S, dtype=torch.float64).expand(B, 1, S, S)
    contract = Contract(**terms)
    _, weights = kernels.math_attention(q, k, v, contract)
    torch.manual_seed(3)
    dropped = torch.stack([kernels.sdpa_attention(q, k, v, contract, dropout_p=0.5) for _ in range(20)])
    kept = dropped != 0
    assert kept.any() and (~kept & (weights > 0)).any()  # some weights dropped, some kept
    assert_close(dropped[kept], (weights.expand_as(dropped) * 2)[kept])


@pytest.mark.parametrize("only", ["k", "mask", "slopes"])
def test_math_gradients_reach_whichever_single_input_needs_them(only):
    """The math backend works in place only when nothing differentiates through its inputs: a
    gradient asked for k alone, or the mask alone, still flows (and equals torch's autograd)."""
    g = torch.Generator().manual_seed(10)
    q, k, v = (torch.randn(1, 2, n, 4, generator=g, dtype=torch.float64) for n in (5, 6, 6))
    mask, slopes = torch.randn(5, 6, generator=g, dtype=torch.float64), torch.tensor([0.5, 0.25], dtype=torch.float64)
    leaf = {"k": k, "mask": mask, "slopes": slopes}[only].requires_grad_()
    contract = Contract(mask=mask, alibi_slopes=slopes, softcap=4.0, band=Band(None, 0), offset=1)
    out, _ = kernels.math_attention(q, k, v, contract)
    (grad,) = torch.autograd.grad(out.sum(), leaf)
    fresh = [t.detach().clone().requires_grad_(t is leaf) for t in (q, k, v, mask, slopes)]
    i, j = torch.arange(5)[:, None], torch.arange(6)[None, :]
    scores = 4.0 * torch.tanh(fresh[0] @ fresh[1].transpose(-1, -2) / 2 / 4.0)
    scores = scores - fresh[4][:, None, None] * (j - i - 1).abs() + fresh[3]
    want = torch.softmax(scores.masked_fill(j > i + 1, float("-inf")), dim=-1) @ fresh[2]
    (want_grad,) = torch.autograd.grad(want.sum(), [t for t in fresh if t.requires_grad])
    assert_close(out, want.detach())
    assert_close(grad, want_grad)


def test_math_rows_with_a_single_hidden_key_are_zero():
    q, k, v = (torch.randn(1, 1, n, 4, dtype=torch.float64, requires_grad=True) for n in (3, 1, 1))
    out, weights = kernels.math_attention(q, k, v, Contract(mask=torch.tensor([[True], [False], [True]])))
    assert weights[0, 0, :, 0].tolist() == [1.0, 0.0, 1.0] and torch.equal(out[0, 0, 1], torch.zeros(4, dtype=torch.float64))
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_math_low_precision_is_computed_in_float32(dtype):
    """float16/bfloat16: q k^T, the shaping, the softmax and the weights' product with v in float32
    (as torch's math path on CPU), the weights and the output rounded once, at the end."""
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g).to(dtype) for n in (32, 200, 200))
    contract = Contract(band=Band(None, 0), offset=168, alibi_slopes=torch.tensor([0.1, 0.01]))
    out, weights = kernels.math_attention(q, k, v, contract)
    assert out.dtype == weights.dtype == dtype
    scores = q.float() * 0.25 @ k.float().transpose(-1, -2)  # no rounding to dtype on the way
    wide = torch.softmax(contract.shape_scores(scores, range(32), range(200), inplace=False), dim=-1)
    for ours, exact in ((weights, wide), (out, wide @ v.float())):
        ulp = torch.finfo(dtype).eps * exact.abs().clamp_min(torch.finfo(dtype).tiny)  # one step at each value
        assert ((ours.float() - exact).abs() <= ulp / 2 + 1e-7).all()  # rounded once (half a step)


def test_math_without_dropout_draws_nothing():
    state = torch.get_rng_state()
    kernels.math_attention(*_QKV, Contract(), dropout_p=0.0)
    assert torch.equal(torch.get_rng_state(), state)


def test_safe_softmax_by_default_copies_and_zeroes_empty_rows():
    from mha.kernels.math import safe_softmax

    scores = torch.tensor([[0.0, 1.0], [float("-inf"), float("-inf")]], dtype=torch.float64)
    kept = scores.clone()
    weights = safe_softmax(scores)
    torch.testing.assert_close(weights, torch.tensor([[1 / (1 + math.e), math.e / (1 + math.e)], [0.0, 0.0]],
                                                     dtype=torch.float64), atol=1e-15, rtol=0)
    assert torch.equal(scores, kept)  # not in place unless asked


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("columns", [1, 255, 256, 257])  # 128 rows: 32768 scores (where in place writes over them)
def test_safe_softmax_either_side_of_the_in_place_threshold(inplace, columns):
    from mha.kernels.math import _OUT_OF_PLACE_BELOW, safe_softmax

    scores = torch.randn(128, columns, generator=torch.Generator().manual_seed(columns), dtype=torch.float64)
    scores[5] = float("-inf")  # an empty row
    expected = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    weights = safe_softmax(scores.clone(), inplace=inplace)
    torch.testing.assert_close(weights, expected, atol=1e-15, rtol=0)
    assert (scores.numel() >= _OUT_OF_PLACE_BELOW) == (columns >= 256)


@pytest.mark.parametrize("inplace", [False, True])
def test_safe_softmax_zeroes_an_empty_row_beside_a_nan_row(inplace):
    """The empty-row check reads the least row maximum; NaN, which min() propagates, must not hide
    an empty row (fuzz seed 251125: a masked NaN key in one head, an empty row in another)."""
    from mha.kernels.math import safe_softmax

    scores = torch.tensor([[float("nan"), 0.0], [float("-inf"), float("-inf")], [0.0, 0.0]])
    weights = safe_softmax(scores, inplace=inplace)
    assert torch.isnan(weights[0]).all()
    assert torch.equal(weights[1], torch.zeros(2)) and torch.equal(weights[2], torch.full((2,), 0.5))


@pytest.mark.parametrize("backend", ["math", "auto"])
def test_vmap_over_attention_that_hides_keys(backend):
    """Under torch.func transforms nothing branches on tensor values (the empty-row check of the
    softmax included): vmap over a call with a mask and a band equals the per-sample loop."""
    g = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(3, 2, 5, 4, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.rand(5, 5, generator=g) < 0.7
    mask[0] = False  # a row that sees nothing
    contract = Contract(mask=mask, band=Band(None, 0))

    def one(q, k, v):
        return kernels.attention(q, k, v, contract, backend=backend)[0]

    assert_close(torch.func.vmap(one)(q, k, v), torch.stack([one(*x) for x in zip(q, k, v)]))


SHIFTED = {  # (L, S, offset): causal bands too large to fold into a mask, on torch's fused kernels
    "zero queries put first": (48, 80, 32),
    "first queries see nothing": (40, 40, -5),
    "every key visible": (16, 80, 79),
}


@pytest.mark.parametrize("name", list(SHIFTED))
def test_shifted_causal_on_torchs_kernels_equals_the_reference(name):
    L, S, offset = SHIFTED[name]
    g = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(1, 1, n, 4, generator=g, dtype=torch.float64, requires_grad=True) for n in (L, S, S))
    contract = Contract(band=Band(None, 0), offset=offset, scale=0.37)
    assert kernels.choose_backend("auto", q, k, v, contract) == ("sdpa", "torch's fused kernel takes the whole contract")
    out = kernels.sdpa_attention(q, k, v, contract)
    i, j = torch.arange(L)[:, None], torch.arange(S)[None, :]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=j <= i + offset, scale=0.37)
    visible_rows = (j <= i + offset).any(-1)[:, None]
    want = want * visible_rows  # a row that sees no key is zero
    assert_close(out, want)
    upstream = torch.randn(out.shape, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad((out * upstream).sum(), (q, k, v)),
                    torch.autograd.grad((want * upstream).sum(), (q, k, v))):
        assert_close(a, b)


def test_shifted_causal_on_torchs_kernels_is_as_precise_as_torch_at_large_scores():
    """Fuzz seed 31337: keys split at the diagonal and merged by torch's float32 log-sum-exp lost
    |score| x eps (out error 9e-5 at scores near 1e4, torch's 3e-7)."""
    g = torch.Generator().manual_seed(31337)
    q, k, v = (30 * torch.randn(1, 1, n, 64, generator=g) for n in (6, 62, 62))
    out = kernels.sdpa_attention(q, k, v, Contract(band=Band(None, 0), offset=56))
    visible = torch.ones(6, 62, dtype=torch.bool).tril(56)
    want = F.scaled_dot_product_attention(*(x.double() for x in (q, k, v)), attn_mask=visible)
    torch_own = F.scaled_dot_product_attention(q, k, v, attn_mask=visible)
    assert_within_torch_error(out, torch_own, want, floor=0.0)


def test_a_shifted_causal_band_too_large_to_fold_is_declined_by_torchs_kernels():
    """offset > L: no padding (it would cost S / 2L times the work) and a mask larger than q, k, v."""
    q, k, v = (torch.randn(1, 1, n, 4) for n in (16, 80, 80))
    with raises_exactly(ValueError, "the sdpa backend cannot run this call: torch's kernel would need the band, "
                                    "ALiBi or padding as a (16, 80) mask, more than q, k and v hold "
                                    "(704 elements); use backend='flash' or 'math'"):
        kernels.sdpa_attention(q, k, v, Contract(band=Band(None, 0), offset=64))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_shifted_causal_on_torchs_kernels_keeps_a_low_precision_dtype(dtype):
    g = torch.Generator().manual_seed(14)
    q, k, v = (torch.randn(1, 1, n, 4, generator=g).to(dtype) for n in (48, 80, 80))
    contract = Contract(band=Band(None, 0), offset=32)
    out = kernels.sdpa_attention(q, k, v, contract)
    want = kernels.math_attention(q.float(), k.float(), v.float(), contract)[0]
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), want, atol=2 * torch.finfo(dtype).eps, rtol=0)


@pytest.mark.parametrize("tangent_on", [0, 1, 2])
def test_an_explicit_flash_under_forward_mode_ad_is_refused_by_dispatch(tangent_on):
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        qkv = list(_QKV)
        qkv[tangent_on] = fwAD.make_dual(qkv[tangent_on], torch.ones_like(qkv[tangent_on]))
        with raises_exactly(ValueError, "backend='flash' cannot run this call: it has no "
                                                             "forward-mode AD (jvp); use backend='math'"):
            kernels.attention(*qkv, Contract(), backend="flash")


def test_weights_only_when_asked_even_from_math():
    out, weights = kernels.attention(*_QKV, Contract(), backend="math")
    assert weights is None
    out_w, weights = kernels.attention(*_QKV, Contract(), backend="math", need_weights=True)
    assert torch.equal(out, out_w) and weights.shape == (1, 2, 64, 64)


def test_query_positions_shared_by_the_batch_fold_with_per_sequence_key_positions():
    """Query positions (1, L) beside key positions (B, S): the folded mask takes the batch of
    either (it took the queries' and failed)."""
    g = torch.Generator().manual_seed(15)
    q, k, v = (torch.randn(2, 1, n, 4, generator=g, dtype=torch.float64) for n in (5, 7, 7))
    key_positions = torch.stack([torch.arange(7), 2 * torch.arange(7)])
    contract = Contract(band=Band(None, 0), positions=(torch.arange(2, 7)[None], key_positions))
    out = kernels.sdpa_attention(q, k, v, contract)
    visible = key_positions[:, None, None, :] <= torch.arange(2, 7)[None, None, :, None]  # key <= query position
    assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=visible))


def test_contract_repr_skips_each_unset_term():
    assert repr(Contract(band=Band(2, 0), softcap=3.0)) == "Contract(band=Band(left=2, right=0), softcap=3.0)"


@pytest.mark.parametrize("mask_shape", [(9, 1), (1, 1, 9, 1), (1, 2, 9, 1), (1, 12), (1, 1, 1, 12)])
def test_flash_broadcasts_a_mask_with_size_one_dims_across_tiles(mask_shape):
    """A bool mask of one column (per query) or one row (per key), tile by tile."""
    g = torch.Generator().manual_seed(16)
    q, k, v = (torch.randn(1, 2, n, 4, generator=g, dtype=torch.float64) for n in (9, 12, 12))
    mask = torch.rand(mask_shape, generator=g) < 0.6
    out, _ = kernels.flash_attention_with_lse(q, k, v, Contract(mask=mask), block_q=4, block_k=4)
    want, _ = kernels.math_attention(q, k, v, Contract(mask=mask))
    assert_close(out, want)


def test_forward_mode_under_torch_func_jvp_equals_the_math_backend():
    g = torch.Generator().manual_seed(17)
    q, k, v, t = (torch.randn(1, 2, 6, 4, generator=g, dtype=torch.float64) for _ in range(4))
    contract = Contract(band=Band(None, 0))
    auto = torch.func.jvp(lambda q: kernels.attention(q, k, v, contract)[0], (q,), (t,))
    math_ = torch.func.jvp(lambda q: kernels.attention(q, k, v, contract, backend="math")[0], (q,), (t,))
    for a, b in zip(auto, math_):
        assert_close(a, b)


@dataclasses.dataclass(frozen=True, eq=False)
class _Extended(Contract):
    """The contract with one more field, as the next score term would add it."""
    novel: float | None = None


def test_a_new_contract_field_is_refused_by_every_backend_until_one_declares_it(monkeypatch):
    """Every backend, every path (dense, with log-sum-exp, its gradient, weights, paged), refuses a
    term it does not declare, by name; declaring it in one backend's TAKES lets that one take it."""
    q = torch.randn(1, 2, 8, 4)
    novel = _Extended(novel=2.0)
    assert novel.terms == {"novel"}
    for name in kernels.dispatch.BACKENDS:
        assert "does not take novel" in kernels.dispatch.refusal(name, q, q, q, novel), name
        with pytest.raises(ValueError, match=f"backend='{name}' cannot run this call: .*does not take novel"):
            kernels.attention(q, q, q, novel, backend=name)
    with pytest.raises(ValueError, match="no backend can run this call: math, the last resort, does not take novel"):
        kernels.attention(q, q, q, novel)
    with pytest.raises(ValueError, match="the attention weights of this call cannot be computed: math, which returns "
                                         "them, does not take novel"):
        kernels.attention(q, q, q, novel, need_weights=True)
    with pytest.raises(ValueError, match="does not take novel"):
        kernels.attention_with_lse(q, q, q, novel)
    with pytest.raises(ValueError, match="no backend computes the gradients of this part: flash cannot .*novel"):
        kernels.dispatch.backward_with_lse(q, q, q, novel, q, q[..., 0], q)
    pages, table, cu, lengths = torch.randn(2, 2, 4, 4), torch.tensor([[0, 1]]), torch.tensor([0, 1]), torch.tensor([8])
    with torch.no_grad(), pytest.raises(ValueError, match="paged math does not take novel"):
        kernels.paged.attend_pages(q[0, :, :1].transpose(0, 1), pages, pages, table, cu, lengths, novel)
    monkeypatch.setattr(kernels.math, "TAKES", kernels.math.TAKES | {"novel"})
    assert kernels.dispatch.refusal("math", q, q, q, novel) is None
    assert kernels.choose_backend("auto", q, q, q, novel)[0] == "math"
