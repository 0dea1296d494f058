"""mha.functional against torch.nn.functional and the oracle; the backend dispatch.

Every comparison has a subject distinct from its reference. On the calls below, auto runs torch's
own kernel as it is (dispatch.py's fast path for a plain float32 call; the sdpa backend, torch's kernel
with the caller's arguments, otherwise; measured: bit for bit F.scaled_dot_product_attention), so auto
is compared with the math backend (mha's softmax(QK^T)V in torch ops, itself compared with torch
here) and the float64 oracle, never with torch's kernel.
"""

import itertools
import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import mha
from helpers.tolerance import assert_close
from mha import kernels
from mha import numpy as oracle
from mha.functional import multi_head_attention_forward, scaled_dot_product_attention

BACKENDS = ["auto", "sdpa", "math"]


def _math(*args, **kwargs):
    """The math backend, called as F.scaled_dot_product_attention: auto's reference."""
    return scaled_dot_product_attention(*args, **kwargs, backend="math")


# What each backend is compared with, besides the oracle. sdpa: torch's function with the caller's own
# arguments checks mha's translation of the call (masks, causality, scale); math: torch, a distinct
# kernel; auto: the math backend, as auto is torch's kernel itself on these calls (module docstring).
REFERENCE = {"auto": _math, "sdpa": F.scaled_dot_product_attention, "math": F.scaled_dot_product_attention}


def _qkv(shape_q, shape_k, dv=None, dtype=torch.float64, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    shape_v = (*shape_k[:-1], dv or shape_k[-1])
    return [torch.randn(s, generator=g, dtype=dtype).requires_grad_(grad) for s in (shape_q, shape_k, shape_v)]


def _mask(kind, shape, seed=1):
    g = torch.Generator().manual_seed(seed)
    if kind == "none":
        return None
    attend = torch.rand(shape, generator=g) > 0.3
    attend[..., 0] = True
    if kind == "bool":
        return attend
    return torch.randn(shape, generator=g, dtype=torch.float64).masked_fill(~attend, float("-inf"))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_kind, mask_shape", [("none", None), ("bool", (5, 7)), ("float", (2, 1, 5, 7)),
                                                   ("bool", (2, 3, 5, 7)), ("float", (7,))])
@pytest.mark.parametrize("is_causal, scale", [(False, None), (True, None), (False, 0.2)])
def test_sdpa_matches_its_reference_and_the_oracle_forward_and_gradients(backend, mask_kind, mask_shape, is_causal, scale):
    q, k, v = _qkv((2, 3, 5, 4), (2, 3, 7, 4), dv=6, grad=True)
    mask = _mask(mask_kind, mask_shape)
    out = scaled_dot_product_attention(q, k, v, mask, is_causal=is_causal, scale=scale, backend=backend)
    want, _ = oracle.scaled_dot_product_attention(*(t.detach().numpy() for t in (q, k, v)),
                                                  None if mask is None else mask.numpy(), is_causal, scale)
    assert_close(out.detach().numpy(), want)
    torch_mask = mask if mask is None or mask.dim() >= 2 else mask.expand(5, 7)  # torch refuses 1-D
    reference = REFERENCE[backend]
    if not is_causal:  # torch refuses a mask together with is_causal
        torch.testing.assert_close(out, reference(q, k, v, torch_mask, scale=scale))
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref_mask = torch_mask
    if is_causal:  # fold the causal mask in by hand (True = attend)
        causal = torch.ones(5, 7, dtype=torch.bool).tril()
        ref_mask = (causal if mask is None else torch_mask & causal if mask.dtype == torch.bool
                    else torch_mask.masked_fill(~causal, float("-inf")))
    ref = reference(q2, k2, v2, ref_mask, scale=scale)
    for got, want_g in zip(grads, torch.autograd.grad(ref.sum(), (q2, k2, v2))):
        assert_close(got, want_g, chain=True)


@pytest.mark.parametrize("backend", ["math", "flash"])  # mha's own kernels (auto and sdpa: the next test)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sdpa_float32_error_within_twice_torch(backend, dtype):
    q, k, v = _qkv((3, 9, 8), (3, 11, 8), dtype=torch.float64, seed=4)
    want, _ = oracle.scaled_dot_product_attention(q.numpy(), k.numpy(), v.numpy(), is_causal=True)
    lo = [t.to(dtype) for t in (q, k, v)]
    ours = np.abs(scaled_dot_product_attention(*lo, is_causal=True, backend=backend).double().numpy() - want).max()
    theirs = np.abs(F.scaled_dot_product_attention(*lo, is_causal=True).double().numpy() - want).max()
    limit = 1e-10 if dtype == torch.float64 else 2 * theirs + 1e-6
    assert ours <= limit


@pytest.mark.parametrize("backend", ["auto", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sdpa_torchs_kernel_through_auto_and_sdpa_within_the_dtype_tolerance_of_the_oracle(backend, dtype):
    """auto and sdpa run torch's kernel here (bit for bit torch's result: 2x torch's own error would hold
    trivially): their error against the float64 oracle is held to the dtype's step (helpers.tolerance)."""
    q, k, v = _qkv((3, 9, 8), (3, 11, 8), dtype=torch.float64, seed=4)
    want, _ = oracle.scaled_dot_product_attention(q.numpy(), k.numpy(), v.numpy(), is_causal=True)
    lo = [t.to(dtype) for t in (q, k, v)]
    assert_close(scaled_dot_product_attention(*lo, is_causal=True, backend=backend), want, dtype)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["H=Hkv", "GQA"])
def test_sdpa_auto_on_a_plain_call_matches_the_math_backend_and_the_oracle(is_causal, kv_heads):
    """A plain float32 (B, H, L, D) call, the one auto hands to torch's kernel as it is (dispatch's fast
    path): forward against the float64 oracle and the math backend, gradients against the math backend."""
    q, k, v = _qkv((2, 4, 9, 8), (2, kv_heads, 11, 8), dv=8, seed=8)
    groups = 4 // kv_heads  # query head h reads key/value head h // groups
    want, _ = oracle.scaled_dot_product_attention(q.numpy(), *(np.repeat(t.numpy(), groups, axis=1) for t in (k, v)),
                                                  is_causal=is_causal)
    lo = [t.float().requires_grad_() for t in (q, k, v)]
    assert kernels.dispatch.plain_call(*lo, enable_gqa=True)  # the fast path's case, not the dispatch's
    got = scaled_dot_product_attention(*lo, is_causal=is_causal, enable_gqa=kv_heads != 4)
    ref = _math(*lo, is_causal=is_causal, enable_gqa=kv_heads != 4)
    assert_close(got, want, torch.float32)
    assert_close(got, ref)
    for ours, theirs in zip(torch.autograd.grad(got.sum(), lo), torch.autograd.grad(ref.sum(), lo)):
        assert_close(ours, theirs, chain=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sdpa_grouped_query_attention_matches_its_reference(backend):
    q, k, v = _qkv((2, 6, 5, 4), (2, 2, 7, 4), seed=2)
    reference = REFERENCE[backend]
    got = scaled_dot_product_attention(q, k, v, enable_gqa=True, backend=backend)
    torch.testing.assert_close(got, reference(q, k, v, enable_gqa=True))
    # query head h reads kv head h // 3
    torch.testing.assert_close(got[:, 4], reference(q[:, 4], k[:, 1], v[:, 1]))
    mask = _mask("bool", (2, 6, 5, 7))  # one mask per (batch, query head): broadcast shape (B, H, L, S)
    got = scaled_dot_product_attention(q, k, v, mask, enable_gqa=True, backend=backend)
    assert_close(got, reference(q, k, v, mask, enable_gqa=True))
    q3, k3, v3 = q[0], k[0], v[0]  # 3-D (heads, length, dim): dim -3 is still the heads
    got = scaled_dot_product_attention(q3, k3, v3, enable_gqa=True, backend=backend)
    assert got.shape == (6, 5, 4)
    assert_close(got, reference(q3, k3, v3, enable_gqa=True))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape_q, shape_k", [((2, 3, 6), (2, 5, 6)), ((3, 6), (5, 6))], ids=["3-D", "2-D"])
@pytest.mark.parametrize("mask_kind, is_causal", [("float", False), ("bool", False), ("none", True)])
def test_sdpa_three_and_two_dimensional_inputs_match_their_reference(backend, shape_q, shape_k, mask_kind, is_causal):
    """(B, L, D) and unbatched (L, D) inputs (L, S and D all different), output of the same rank as torch's."""
    q, k, v = _qkv(shape_q, shape_k, dv=7, seed=6)
    mask = _mask(mask_kind, (3, 5))
    got = scaled_dot_product_attention(q, k, v, mask, is_causal=is_causal, backend=backend)
    want = REFERENCE[backend](q, k, v, mask, is_causal=is_causal)
    assert got.shape == want.shape == (*shape_q[:-1], 7)
    assert_close(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, L, D", [(torch.float64, 3, 4), (torch.float32, 256, 64),
                                         (torch.bfloat16, 256, 64)])  # small: math; large: torch's flash
def test_sdpa_all_masked_row_is_zero_with_finite_gradients(backend, dtype, L, D):
    q, k, v = _qkv((1, 2, L, D), (1, 2, L + 2, D), dtype=dtype, grad=True)
    attend = torch.ones(L, L + 2, dtype=torch.bool)
    attend[2] = False
    out = scaled_dot_product_attention(q, k, v, attend, backend=backend)
    assert torch.all(out[..., 2, :] == 0) and torch.isfinite(out).all()
    out.float().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_sdpa_dropout_is_applied_and_scaled():
    q, k, v = _qkv((1, 1, 64, 8), (1, 1, 64, 8))
    v = torch.ones_like(v)
    torch.manual_seed(0)
    out = scaled_dot_product_attention(q, k, v, dropout_p=0.5, backend="math")
    assert not torch.allclose(out, torch.ones_like(out))
    assert abs(out.mean().item() - 1.0) < 0.1  # survivors scaled by 1 / (1 - p): mean stays 1


# --- multi_head_attention_forward: torch's functional signature ---------------------------------

FUNCTIONAL_CASES = list(itertools.product([False, True], [False, True], [False, True]))


@pytest.mark.parametrize("separate, bias_kv, zero_attn", FUNCTIONAL_CASES)
def test_multi_head_attention_forward_matches_torch(separate, bias_kv, zero_attn):
    E, H, L, S, N = 12, 3, 4, 6, 2
    g = torch.Generator().manual_seed(3)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True)  # noqa: E731
    kd, vd = (5, 7) if separate else (E, E)
    query, key, value = r(L, N, E), r(S, N, kd), r(S, N, vd)
    weights = dict(in_proj_weight=None if separate else r(3 * E, E), in_proj_bias=r(3 * E),
                   bias_k=r(1, 1, E) if bias_kv else None, bias_v=r(1, 1, E) if bias_kv else None,
                   add_zero_attn=zero_attn, dropout_p=0.0, out_proj_weight=r(E, E), out_proj_bias=r(E))
    extra = dict(use_separate_proj_weight=separate, q_proj_weight=r(E, E), k_proj_weight=r(E, kd),
                 v_proj_weight=r(E, vd), key_padding_mask=torch.tensor([[False] * 5 + [True]] * N),
                 attn_mask=torch.randn(L, S, generator=g, dtype=torch.float64), average_attn_weights=False)
    args = (query, key, value, E, H)
    got, got_w = multi_head_attention_forward(*args, **weights, **extra)
    want, want_w = F.multi_head_attention_forward(*args, **weights, **extra)
    assert_close(got, want)
    assert_close(got_w, want_w)
    leaves = [t for t in (query, key, value, *weights.values(), *extra.values())
              if isinstance(t, torch.Tensor) and t.requires_grad]
    for a, b in zip(torch.autograd.grad(got.sum() + got_w.sum(), leaves, allow_unused=True),
                    torch.autograd.grad(want.sum() + want_w.sum(), leaves, allow_unused=True)):
        if a is None or b is None:
            assert a is None and b is None  # a weight this configuration does not use
        else:
            assert_close(a, b, chain=True)


def test_multi_head_attention_forward_static_kv_matches_torch():
    E, H, L, S, N = 8, 2, 3, 5, 2
    g = torch.Generator().manual_seed(5)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    args = (r(L, N, E), r(4, N, E), r(4, N, E), E, H, r(3 * E, E), r(3 * E), None, None, False, 0.0,
            r(E, E), r(E))
    static = dict(static_k=r(N * H, S, E // H), static_v=r(N * H, S, E // H))
    got, got_w = multi_head_attention_forward(*args, **static)
    want, want_w = F.multi_head_attention_forward(*args, **static)
    assert_close(got, want)
    assert_close(got_w, want_w)


def _mha_case(case):
    """(args, kwargs) of one multi_head_attention_forward call, float64, seeded."""
    E, H, L, S, N = 8, 2, 3, 5, 2
    g = torch.Generator().manual_seed(7)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    if case == "batch of one":
        N = 1
    if case == "query length one":
        L = 1
    query, key, value = r(L, N, E), r(S, N, E), r(S, N, E)
    if case == "unbatched":
        query, key, value = query[:, 0], key[:, 0], value[:, 0]
    if case.startswith("self-attention"):
        key = value = query
    if case == "query is key, value differs":
        key = query
        value = r(L, N, E)
    weights = [r(3 * E, E), r(3 * E), None, None, False, 0.0, r(E, E), r(E)]
    kwargs = dict(average_attn_weights=False)
    if case == "self-attention, separate weights":
        weights[0] = None
        kwargs.update(use_separate_proj_weight=True, q_proj_weight=r(E, E), k_proj_weight=r(E, E),
                      v_proj_weight=r(E, E))
    if case == "no biases":
        weights[1] = weights[7] = None
    if case.startswith("not training"):
        weights[5] = 1.5 if "out of range" in case else 0.9
        kwargs.update(training=False)
    if case == "bool attn_mask per batch and head":
        kwargs.update(attn_mask=torch.rand(N * H, L, S, generator=g) < 0.3, average_attn_weights=True)
    return (query, key, value, E, H, *weights), kwargs


@pytest.mark.parametrize("case", ["batch of one", "query length one", "unbatched", "self-attention, packed",
                                  "self-attention, separate weights", "query is key, value differs", "no biases",
                                  "not training: dropout_p unused", "not training: dropout_p unused, out of range",
                                  "bool attn_mask per batch and head"])
def test_multi_head_attention_forward_cases_match_torch(case):
    """Output and weights, shapes included, against torch's functional with the same arguments (as
    torch, dropout_p is ignored when training=False, even one outside [0, 1])."""
    args, kwargs = _mha_case(case)
    got, got_w = multi_head_attention_forward(*args, **kwargs)
    want, want_w = F.multi_head_attention_forward(*args, **kwargs)
    assert got.shape == want.shape and got_w.shape == want_w.shape
    assert_close(got, want)
    assert_close(got_w, want_w)


def test_self_attention_projects_query_key_and_value_with_one_packed_matmul():
    """query is key is value with a packed in_proj_weight: one (3E, E) F.linear, as torch's
    _in_projection_packed, then the (E, E) output projection; cross-attention: three (E, E) chunks."""
    from torch.overrides import TorchFunctionMode

    class LinearWeights(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is F.linear:
                self.shapes.append(tuple((kwargs["weight"] if "weight" in kwargs else args[1]).shape))
            return func(*args, **kwargs)

    args, kwargs = _mha_case("self-attention, packed")
    with LinearWeights() as seen:
        multi_head_attention_forward(*args, **kwargs)
    assert seen.shapes == [(24, 8), (8, 8)]
    args, kwargs = _mha_case("query is key, value differs")
    with LinearWeights() as seen:
        multi_head_attention_forward(*args, **kwargs)
    assert seen.shapes == [(8, 8)] * 4


def test_in_proj_bias_of_another_dtype_is_added_in_the_query_dtype():
    """A float64 in_proj_bias with float32 everything else: converted to float32 first (the reference
    converts it by hand; torch's functional refuses the mix)."""
    args, kwargs = _mha_case("batch of one")
    args = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
    wide_bias = args[6].double()
    got, got_w = multi_head_attention_forward(*args[:6], wide_bias, *args[7:], **kwargs)
    want, want_w = F.multi_head_attention_forward(*args[:6], wide_bias.float(), *args[7:], **kwargs)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_w, want_w)


def test_multi_head_attention_forward_batch_first_equals_seq_first():
    E, H = 8, 2
    m = mha.nn.MultiheadAttention(E, H)
    x = torch.randn(5, 3, E)
    params = (m.in_proj_weight, m.in_proj_bias, None, None, False, 0.0, m.out_proj.weight, m.out_proj.bias)
    seq, _ = multi_head_attention_forward(x, x, x, E, H, *params)
    xb = x.transpose(0, 1)
    bf, _ = multi_head_attention_forward(xb, xb, xb, E, H, *params, batch_first=True)
    torch.testing.assert_close(bf.transpose(0, 1), seq)


# --- dispatch ---------------------------------------------------------------------------------


def test_choose_backend_explains_and_can_be_overridden(caplog):
    q = k = v = torch.randn(1, 2, 4, 8)
    plain = kernels.Contract()
    with caplog.at_level(logging.DEBUG, logger="mha.dispatch"):
        assert kernels.choose_backend("auto", q, k, v, plain, need_weights=True)[0] == (
            "native" if kernels.native.ready() else "math")  # (nothing to differentiate here)
        assert kernels.choose_backend("auto", q, k, v, plain)[0] == "sdpa"
        assert kernels.choose_backend("math", q, k, v, plain)[0] == "math"
    assert "backend math" in caplog.text and "backend sdpa" in caplog.text
    with pytest.raises(ValueError, match="backend"):
        kernels.choose_backend("fast", q, k, v, plain)
    with pytest.raises(ValueError, match="weights"):
        kernels.choose_backend("sdpa", q, k, v, plain, need_weights=True)


def test_multi_head_attention_forward_backend_override():
    E, H = 8, 2
    m = mha.nn.MultiheadAttention(E, H)
    x = torch.randn(5, 3, E)
    params = (m.in_proj_weight, m.in_proj_bias, None, None, False, 0.0, m.out_proj.weight, m.out_proj.bias)
    a, _ = multi_head_attention_forward(x, x, x, E, H, *params, need_weights=False, backend="math")
    b, _ = multi_head_attention_forward(x, x, x, E, H, *params, need_weights=False, backend="sdpa")
    torch.testing.assert_close(a, b)


def test_a_window_that_bounds_nothing_keeps_torchs_causal_alignment():
    """window=(-1, -1) beside is_causal with L < S flipped the alignment to bottom-right (a window's
    default) while hiding nothing: the call then differed from is_causal alone."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 2, 3, 8, generator=g), torch.randn(1, 2, 7, 8, generator=g), torch.randn(1, 2, 7, 8, generator=g)
    causal = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    for window in ((-1, -1), (-1, 4)):  # with is_causal the right side is 0 anyway
        torch.testing.assert_close(mha.functional.scaled_dot_product_attention(q, k, v, is_causal=True, window=window),
                                   causal)
    bounded = mha.functional.scaled_dot_product_attention(q, k, v, is_causal=True, window=(2, 0))  # bottom-right
    rows = torch.arange(3)[:, None] + 4
    keep = (torch.arange(7) <= rows) & (torch.arange(7) >= rows - 2)
    torch.testing.assert_close(bounded, F.scaled_dot_product_attention(q, k, v, attn_mask=keep))
