"""One dispatch: every choice of backend in mha is made in mha.kernels.dispatch, which logs why.

The plain call's fast path (mha.functional asks it too), the log-sum-exp path (ring attention's
parts, the efficient variants' exact parts) and the packed varlen layout all ask the dispatch; a
test here fails if one of them chooses on its own again.
"""

import logging

import pytest
import torch

import mha
from mha import efficient, positions
from mha.kernels import Contract, dispatch
from mha.positions import Band


def _qkv(L=6, S=6, H=2, D=4, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, H, L, D, generator=g, dtype=dtype), torch.randn(1, H, S, D, generator=g, dtype=dtype),
            torch.randn(1, H, S, D, generator=g, dtype=dtype))


def test_a_contract_of_none_is_the_empty_contract():
    q, k, v = _qkv()
    out, weights = mha.kernels.attention(q, k, v, None, backend="math")
    want, _ = mha.kernels.attention(q, k, v, Contract(), backend="math")
    assert weights is None and torch.equal(out, want)
    with pytest.raises(TypeError, match="contract must be an mha.kernels.Contract or None, got dict"):
        mha.kernels.attention(q, k, v, {})


def test_the_functional_fast_path_is_the_dispatchs(monkeypatch):
    q, k, v = _qkv()
    asked = []
    monkeypatch.setattr(dispatch, "plain_sdpa", lambda *a, **kw: asked.append(a[3:]) or torch.full((1, 2, 6, 4), 7.0))
    out = mha.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert asked == [(True, False, None, None, None)] and bool((out == 7).all())  # (is_causal, enable_gqa, scale,
    mask = torch.ones(6, 6, dtype=torch.bool)  # key_valid, mask), by position; an attn_mask goes as the mask
    mha.functional.scaled_dot_product_attention(q, k, v, mask, scale=0.5)
    assert asked[1] == (False, False, 0.5, None, mask)
    monkeypatch.setattr(dispatch, "plain_sdpa", lambda *a, **kw: None)  # the dispatch declines: the full path
    out = mha.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    want, _ = mha.kernels.attention(q, k, v, Contract(band=positions.CAUSAL), backend="math")
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize(("contract", "name"), [
    (Contract(), "sdpa"), (Contract(band=positions.CAUSAL), "sdpa"), (Contract(band=Band(None, -2)), "sdpa"),
    (Contract(band=Band(2, 0)), None), (Contract(softcap=3.0), None), (Contract(alibi_slopes=torch.ones(2)), None)])
def test_the_lse_path_is_chosen_by_the_dispatch_and_logged(contract, name, caplog):
    q, k, v = _qkv()
    chosen, why = dispatch.choose_lse_backend("auto", q, k, v, contract)
    assert chosen == name or (name is None and chosen in ("native", "flash")), (chosen, why)
    with caplog.at_level(logging.DEBUG, logger="mha.dispatch"):
        out, lse = dispatch.attention_with_lse(q, k, v, contract)
    assert f"backend {chosen} (with lse): {why}" in caplog.text
    want, weights = mha.kernels.attention(q, k, v, contract, backend="math", need_weights=True)
    torch.testing.assert_close(out, want)
    with pytest.raises(ValueError, match="backend='sdpa' cannot run this call"):
        dispatch.attention_with_lse(q, k, v, Contract(softcap=3.0), backend="sdpa")


def test_the_efficient_variants_exact_parts_ask_the_dispatch(monkeypatch):
    q, k, v = _qkv(L=16, S=16)
    calls = []
    real = dispatch.choose_lse_backend
    monkeypatch.setattr(dispatch, "choose_lse_backend", lambda *a: calls.append(a[0]) or real(*a))
    efficient.Strided(4)(q, k, v, is_causal=True)
    efficient.Fixed(4)(q, k, v, is_causal=True)
    assert len(calls) == 4  # strided: local + strided columns; fixed: own block + summaries


def test_varlen_is_one_call_of_the_dispatch(caplog):
    q = torch.randn(7, 2, 4)
    cu = torch.tensor([0, 3, 7])
    with caplog.at_level(logging.DEBUG, logger="mha.dispatch"):
        out = mha.kernels.varlen_attention(q, q, q, cu, cu, is_causal=True, backend="math")
    assert caplog.text.count("backend math: requested explicitly") == 1
    for a, b in ((0, 3), (3, 7)):  # each sequence alone
        alone = mha.functional.scaled_dot_product_attention(*(q[a:b].transpose(0, 1),) * 3, is_causal=True)
        torch.testing.assert_close(out[a:b], alone.transpose(0, 1))


@pytest.mark.parametrize("condition", [None, "a tensor subclass", "an observer", "a dual level", "torch.compile"])
def test_the_fast_paths_python_checks_refuse_alike(monkeypatch, condition):
    """_kernel_fast_path_allowed (plain_weights' checks) refuses under each condition and allows without
    them. plain_sdpa writes out what only Python can check (no observer, not compiling: its kernel never
    asked under them); the tensors' classes and forward AD's tangents are its kernel's own checks
    (test_the_kernel_refuses_subclasses_and_tangents_itself)."""
    from torch.autograd import forward_ad

    from mha.kernels import native

    asked = []

    class Kernel:  # (records whether the kernel's own fast path was reached)
        def plain_sdpa(self, *args):
            asked.append(args)
            return None

    monkeypatch.setattr(native, "loaded", Kernel())
    q, k, v = _qkv()
    if condition == "a tensor subclass":
        q = torch.nn.Parameter(q, requires_grad=False)
    elif condition == "an observer":
        monkeypatch.setattr(dispatch, "OBSERVERS", [object()])
    elif condition == "torch.compile":
        monkeypatch.setattr(dispatch, "_compiling", lambda: True)
    with forward_ad.dual_level() if condition == "a dual level" else torch.no_grad():
        allowed = dispatch._kernel_fast_path_allowed(q, k, v)
        dispatch.plain_sdpa(q, k, v, False, False)
    assert allowed == (condition is None)
    assert bool(asked) == (condition in (None, "a tensor subclass", "a dual level"))
