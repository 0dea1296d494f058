"""logit_scale: each head's factor of its scaled scores, s = (q . k) * scale * logit_scale_h (an
inverse temperature per head), the score term added by following docs/architecture.md's recipe.

Every backend that declares it (math and flash in their score shaping, flex in its score_mod; sdpa
and native by folding it into q) against the float64 NumPy oracle, forward and gradients (its own
included), at zero and negative factors, with every other term; low precision against float64;
the entry points (functional, varlen, nested, GeneralAttention); paged attention (folded into q),
a module pickled before it existed; the explorer's breakdown refuses it (tests/modules/test_capture.py)."""

import pytest
import torch

import mha
from helpers.backends import NATIVE
from helpers.tolerance import assert_close, max_error, tolerance
from mha import numpy as oracle
from mha.kernels import Contract, flex
from mha.positions import CAUSAL, Band

BACKENDS = ["math", "flash", "sdpa", "auto"] + (["native"] if NATIVE else [])
SHAPES = {  # (B, H, Hkv, L, S, D, Dv)
    "GQA 4/2, Dv != D": (2, 4, 2, 37, 300, 8, 5),
    "GQA 4/2": (2, 4, 2, 37, 300, 8, 8),
    "decoding, keys past two tiles": (1, 4, 1, 1, 513, 16, 16),
    "tile edges": (1, 2, 2, 257, 257, 4, 4),
}
FACTORS = [0.5, 2.0, -1.0, 0.0]  # per head (cycled): a sharper head, a flatter one, reversed, uniform
TERMS = {
    "alone": {},
    "causal": dict(band=CAUSAL),
    "window, ALiBi": dict(band=Band(30, 0), alibi_slopes="H"),
    "softcap, sinks": dict(softcap=3.0, sinks="H"),
    "everything": dict(band=Band(50, 3), scale=0.3, softcap=5.0, sinks="H", alibi_slopes="H"),
}


def _case(shape: str, terms: str, *, dtype=torch.float64, seed: int = 0):
    """q, k, v (float64 values in ``dtype``) and the contract, its per-head tensors drawn for H heads."""
    B, H, Hkv, L, S, D, Dv = SHAPES[shape]
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(shape_, generator=g, dtype=torch.float64).to(dtype)
               for shape_ in ((B, H, L, D), (B, Hkv, S, D), (B, Hkv, S, Dv)))
    drawn = {name: (torch.rand(H, generator=g, dtype=torch.float64) if value == "H" else value)
             for name, value in TERMS[terms].items()}
    factors = torch.tensor([FACTORS[h % len(FACTORS)] for h in range(H)], dtype=torch.float64)
    return q, k, v, Contract(offset=S - L, logit_scale=factors, **drawn)


def _oracle(q, k, v, contract: Contract, grad_out=None):
    """(output, gradients or None) of the float64 oracle: shared heads repeated, the gradients of k and
    v summed back over their groups."""
    group = q.shape[1] // k.shape[1]
    arrays = [x.detach().double().numpy() for x in (q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))]
    terms = {name: (value.detach().double().numpy() if isinstance(value, torch.Tensor) else value) for name, value in
             dict(band=contract.band, offset=contract.offset, alibi_slopes=contract.alibi_slopes, scale=contract.scale,
                  softcap=contract.softcap, sinks=contract.sinks, logit_scale=contract.logit_scale).items()}
    out, _ = oracle.contract_attention(*arrays, **terms)
    if grad_out is None:
        return torch.from_numpy(out), None
    grads = oracle.contract_attention_vjp(*arrays, grad_out.numpy(), **terms)
    for name in ("k", "v"):
        grads[name] = grads[name].reshape(k.shape[0], k.shape[1], group, *grads[name].shape[2:]).sum(2)
    return torch.from_numpy(out), {name: torch.from_numpy(g) for name, g in grads.items()}


def _learned(contract: Contract) -> Contract:
    return contract.replace(**{name: getattr(contract, name).clone().requires_grad_()
                               for name in ("alibi_slopes", "sinks", "logit_scale") if getattr(contract, name) is not None})


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("terms", list(TERMS))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_backend_that_declares_it_equals_the_oracle_forward_and_gradients(backend, terms, shape):
    q, k, v, contract = _case(shape, terms)
    if backend != "auto" and (reason := mha.kernels.dispatch.refusal(backend, q, k, v, contract)):
        assert "logit_scale" not in reason  # refused for another term, never for this one
        return
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    contract = _learned(contract)
    out, _ = mha.kernels.attention(q, k, v, contract, backend=backend)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want, wanted = _oracle(q, k, v, contract, grad_out)
    assert_close(out, want)
    inputs = {"q": q, "k": k, "v": v, **{name: getattr(contract, name) for name in ("alibi_slopes", "sinks",
                                                                                    "logit_scale")}}
    inputs = {name: x for name, x in inputs.items() if x is not None}
    for name, got in zip(inputs, torch.autograd.grad(out, list(inputs.values()), grad_out)):
        assert_close(got, wanted[name], chain=True, err_msg=name)


@pytest.mark.parametrize("terms", ["alone", "causal", "window, ALiBi", "softcap, sinks"])
@torch.no_grad()
def test_flex_scores_each_head_by_its_factor(terms):
    """flex's score_mod (torch's uncompiled FlexAttention on CPU: its reference) against the oracle;
    gradients through flex run on CUDA only (tests/cuda)."""
    q, k, v, contract = _case("GQA 4/2, Dv != D", terms, dtype=torch.float32)
    contract = contract.replace(**{name: getattr(contract, name).float() for name in ("alibi_slopes", "sinks",
                                                                                     "logit_scale")
                                   if getattr(contract, name) is not None})
    with flex.eager():
        out, _ = mha.kernels.attention(q, k, v, contract, backend="flex")
    assert_close(out, _oracle(q, k, v, contract)[0].float())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@torch.no_grad()
def test_low_precision_stays_within_its_dtypes_rounding_of_float64(backend, dtype):
    """The fold into q (sdpa, native) rounds q times the factor once, in the query's dtype: no further
    from float64 than a step's tolerance, as math's and flash's float32 scaling."""
    q, k, v, contract = _case("GQA 4/2", "causal", dtype=dtype)
    contract = contract.replace(logit_scale=contract.logit_scale.to(dtype))
    out, _ = mha.kernels.attention(q, k, v, contract, backend=backend)
    assert out.dtype == dtype
    want, _ = _oracle(q, k, v, contract)
    assert max_error(out, want) <= tolerance(dtype), max_error(out, want)


@pytest.mark.parametrize("backend", BACKENDS)
@torch.no_grad()
def test_ones_change_nothing_and_one_factor_for_all_heads_is_the_scale(backend):
    """logit_scale = 1 gives the call without it; c for every head gives scale * c: the factor
    multiplies the scaled scores, nothing else."""
    q, k, v, _ = _case("GQA 4/2", "alone", dtype=torch.float32)
    base = mha.kernels.attention(q, k, v, Contract(band=CAUSAL), backend=backend)[0]
    ones = mha.kernels.attention(q, k, v, Contract(band=CAUSAL, logit_scale=torch.ones(4)), backend=backend)[0]
    assert_close(ones, base)
    scaled = mha.kernels.attention(q, k, v, Contract(band=CAUSAL, scale=0.7), backend=backend)[0]
    factor = 0.7 * 8 ** 0.5  # scale 0.7 = 1/sqrt(8) * factor
    by_heads = mha.kernels.attention(q, k, v, Contract(band=CAUSAL, logit_scale=torch.full((4,), factor)),
                                     backend=backend)[0]
    assert_close(by_heads, scaled)
    assert max_error(by_heads, base) > 0.05  # (the factor matters: a term dropped would fail the line above)


def test_the_entry_points_take_it_and_check_it():
    """functional, varlen (each sequence as its own call) and nested calls; bad values named."""
    g = torch.Generator().manual_seed(3)
    factors = torch.tensor([2.0, -0.5, 1.5])
    q, k, v = (torch.randn(2, 3, 9, 8, generator=g) for _ in range(3))
    sdpa = mha.functional.scaled_dot_product_attention
    out = sdpa(q, k, v, is_causal=True, logit_scale=factors)
    assert_close(out, _oracle(q, k, v, Contract(band=CAUSAL, logit_scale=factors.double()))[0].float())
    packed = [x.transpose(1, 2).reshape(18, 3, 8) for x in (q, k, v)]  # (2, 3, 9, 8) -> (18, 3, 8)
    cu = torch.tensor([0, 9, 18])
    got = mha.kernels.varlen_attention(*packed, cu, cu, is_causal=True, logit_scale=factors)
    assert_close(got.view(2, 9, 3, 8).transpose(1, 2), out)
    nested = [torch.nested.nested_tensor([x[0], x[1, :, :5]], layout=torch.jagged) for x in (q, k, v)]
    got = sdpa(*nested, is_causal=True, logit_scale=factors).unbind()
    assert_close(got[1], sdpa(q[1:, :, :5], k[1:, :, :5], v[1:, :, :5], is_causal=True, logit_scale=factors)[0])
    for bad, error, message in ((torch.ones(2), ValueError, r"logit_scale must have shape \(3,\)"),
                                (torch.ones(3, dtype=torch.long), TypeError,
                                 "logit_scale must have a floating point dtype, got torch.int64"),
                                ([1.0, 1.0, 1.0], TypeError, "logit_scale must be a")):
        with pytest.raises(error, match=message):
            sdpa(q, k, v, logit_scale=bad)


def test_general_attention_learns_one_factor_per_head():
    """GeneralAttention(logit_scale=True): ones at the start (the module without it), then each head's
    factor gets its gradient, equal to the oracle's through the same projections."""
    torch.manual_seed(0)
    plain = mha.GeneralAttention(16, 16, 16, 4, 4, 16, 4, num_kv_heads=2)
    scaled = mha.GeneralAttention(16, 16, 16, 4, 4, 16, 4, num_kv_heads=2, logit_scale=True)
    scaled.load_state_dict({**plain.state_dict(), "logit_scale": torch.ones(4)})
    assert "logit_scale=True" in repr(scaled) and scaled.logit_scale.shape == (4,)
    x = torch.randn(2, 6, 16)
    assert_close(scaled(x, x, x, is_causal=True), plain(x, x, x, is_causal=True))
    with torch.no_grad():
        scaled.logit_scale.copy_(torch.tensor([3.0, 0.5, -1.0, 2.0]))
    for backend in BACKENDS:
        scaled.zero_grad()
        scaled(x, x, x, is_causal=True, backend=backend).square().sum().backward()
        if backend == "math":
            reference = scaled.logit_scale.grad.clone()
        assert_close(scaled.logit_scale.grad, reference, chain=True, err_msg=backend)
    assert reference.abs().min() > 0


@torch.no_grad()
def test_caches_read_as_pages_take_it_folded_into_the_queries():
    """A PagedKVCache step and an 8-bit KVCache (attention over pages, where it is folded into q)
    decode like the module's full forward (the 8-bit cache within its rounding)."""
    torch.manual_seed(0)
    module = mha.GeneralAttention(16, 16, 16, 8, 8, 16, 4, num_kv_heads=2, logit_scale=True).eval()
    module.logit_scale.copy_(torch.tensor([3.0, 0.5, -1.0, 2.0]))
    x = torch.randn(2, 7, 16)
    full = module(x, x, x, is_causal=True)
    paged = mha.PagedKVCache(num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8)
    ids = [paged.add()[0] for _ in range(2)]
    prompt = module(x[:, :5], x[:, :5], x[:, :5], is_causal=True, cache=paged.step(ids, [5, 5]))
    steps = [module(x[:, t:t + 1], x[:, t:t + 1], x[:, t:t + 1], is_causal=True, cache=paged.step(ids, [1, 1]))
             for t in (5, 6)]
    assert_close(torch.cat([prompt, *steps], 1), full)
    int8 = mha.KVCache(quantize="int8")
    got = torch.cat([module(x[:, :5], x[:, :5], x[:, :5], is_causal=True, cache=int8),
                     *(module(x[:, t:t + 1], x[:, t:t + 1], x[:, t:t + 1], is_causal=True, cache=int8) for t in (5, 6))], 1)
    assert max_error(got, full) < 0.05 * full.abs().max()
    unscaled = mha.GeneralAttention(16, 16, 16, 8, 8, 16, 4, num_kv_heads=2).eval()
    unscaled.load_state_dict({n: p for n, p in module.state_dict().items() if n != "logit_scale"})
    assert max_error(unscaled(x, x, x, is_causal=True), full) > 0.05  # (the factors matter here)


def test_a_module_pickled_before_it_existed_loads_without_it(tmp_path):
    """A GeneralAttention saved whole by an mha without logit_scale (its __dict__ lacks the entry)."""
    module, x = mha.GeneralAttention(8, 8, 8, 4, 4, 8, 2), torch.randn(1, 3, 8)
    want = module(x, x, x)
    del module.__dict__["logit_scale"]  # as an older mha pickled it
    torch.save(module, tmp_path / "old.pt")
    loaded = torch.load(tmp_path / "old.pt", weights_only=False)
    assert loaded.logit_scale is None and "logit_scale" not in repr(loaded)
    assert_close(loaded(x, x, x), want)
