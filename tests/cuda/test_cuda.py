"""mha on a CUDA device: every public entry in float32, float16 and bfloat16 against the float64
reference (mha's math backend in float64 on the CPU), forward and gradients, by DESIGN's rule: an
error at most twice torch's own for the same call where torch has one, else twice the larger of
mha's math backend's in that dtype and torch's own kernel's on the plain call of the same inputs
(plus 1e-6). (Why the larger: a fused half-precision kernel rounds its probabilities before their
product with the values, the math backend computes in float32 and rounds its output alone; torch's
own fused CPU kernel is 2.01x math's error on dv in float16, measured.) Skipped without a CUDA
device; scripts/device-check.sh runs them on a lent GPU machine. MHA_TEST_DEVICE=cpu runs them on
the CPU (a dry run of the tests themselves: the CPU takes other paths).

Sizes follow issue 42's measurement: B2 H8 over 2 kv heads, L96 S160 D64.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import mha
from mha import kernels
from mha.functional import scaled_dot_product_attention as sdpa
from mha.kernels import Contract, flex
from mha.kernels.contract import LEARNED
from mha.kernels.varlen import varlen_attention

DEVICE = os.environ.get("MHA_TEST_DEVICE", "cuda")
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device")]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
B, H, HKV, L, S, D = 2, 8, 2, 96, 160, 64


@pytest.fixture(autouse=True)
def _compiled_kernels_only(monkeypatch):
    """Every flex call here a compiled kernel: past dynamo's recompile limit (8 per code object, and
    FlexAttention compiles once per dtype, grad mode and set of terms) torch would fall back to its
    unfused implementation and these tests would check that instead; here the limit is raised and
    hitting it is an error."""
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 256, raising=False)
    monkeypatch.setattr(torch._dynamo.config, "fail_on_recompile_limit_hit", True, raising=False)


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|, in float64 on the CPU."""
    got, want = (x.detach().to(device="cpu", dtype=torch.float64) for x in (got, want))
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def assert_within_rule(got, want, yardstick, what="", *, floor: float = 0.0):
    """DESIGN's rule: ours at most twice the yardstick's error (torch's own call, or math in this dtype;
    ``floor``: a kernel's own error on the plain call, when larger), + 1e-6."""
    ours, theirs = _error(got, want), max(_error(yardstick, want), floor)
    assert ours <= 2 * theirs + 1e-6, f"{what}: error {ours:.3g} against {theirs:.3g} (twice: {2 * theirs:.3g})"


def _leaves(dtype, *, seed=0, L=L, S=S, D=D, Dv=D):
    g = torch.Generator().manual_seed(seed)
    shapes = ((B, H, L, D), (B, HKV, S, D), (B, HKV, S, Dv))
    cpu = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    return cpu, [x.to(device=DEVICE, dtype=dtype).requires_grad_() for x in cpu]


def _cases():
    """name -> (keyword options of scaled_dot_product_attention with float64 CPU tensors, torch has the call)."""
    g = torch.Generator().manual_seed(7)
    additive = torch.zeros(L, S, dtype=torch.float64)
    additive[:, ::3] = -1e4
    with_empty_row = torch.rand(B, 1, L, S, generator=g) < 0.8
    with_empty_row[0, 0, 5] = False
    padding = torch.ones(B, 1, 1, S, dtype=torch.bool)
    padding[1, ..., 120:] = False
    slopes = torch.exp2(-8.0 * torch.arange(1, H + 1, dtype=torch.float64) / H)
    return {
        "plain": ({}, True),
        "causal": ({"is_causal": True}, True),
        "float mask 0 / -1e4": ({"attn_mask": additive}, True),
        "bool mask, a row sees nothing": ({"attn_mask": with_empty_row}, False),
        "key padding": ({"attn_mask": padding, "is_causal": False}, True),
        "window (32, 0) bottom-right": ({"window": (32, 0)}, False),
        "window (32, 0) top-left": ({"window": (32, 0), "causal_alignment": "top_left"}, False),
        "alibi": ({"alibi_slopes": slopes}, False),
        "softcap": ({"softcap": 20.0, "is_causal": True}, False),
        "sinks": ({"sinks": torch.linspace(-1.0, 1.0, H, dtype=torch.float64), "is_causal": True}, False),
        "logit_scale": ({"logit_scale": torch.linspace(-1.0, 3.0, H, dtype=torch.float64), "is_causal": True}, False),
        "everything": ({"window": (40, 0), "alibi_slopes": slopes, "softcap": 20.0, "attn_mask": padding,
                        "sinks": torch.linspace(-1.0, 1.0, H, dtype=torch.float64)}, False),
    }


def _on_device(options: dict, dtype) -> dict:
    """The options moved: bool masks as they are, float masks in the query's dtype (as torch's own call
    needs them), slopes and sinks in float32, trainable."""
    moved = {}
    for key, x in options.items():
        if not isinstance(x, torch.Tensor):
            moved[key] = x
        elif x.dtype == torch.bool:
            moved[key] = x.to(DEVICE)
        elif key in LEARNED:
            moved[key] = x.to(device=DEVICE, dtype=torch.float32).requires_grad_()
        else:
            moved[key] = x.to(device=DEVICE, dtype=dtype)
    return moved


def _grads(out, inputs, cotangent):
    return torch.autograd.grad(out, inputs, cotangent.to(out.dtype), allow_unused=True)


def _torch_call(leaves, options: dict):
    """torch's own call on the shared heads as mha hands them to it: repeated off the CPU (torch's CUDA
    kernels beside a mask take no shared heads: their math path would run), shared on the CPU."""
    q, k, v = leaves
    if DEVICE == "cpu":
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **options)
    k, v = (x.repeat_interleave(H // HKV, dim=1) for x in (k, v))
    return F.scaled_dot_product_attention(q, k, v, **options)


def _plain_errors(dtype, cotangent) -> list[float]:
    """torch's own kernel's error on the plain call of _leaves' inputs: output, dq, dk, dv (the floor
    of a fused kernel's rounding in this dtype)."""
    (q, k, v), leaves = _leaves(dtype)
    inputs = [x.requires_grad_() for x in (q, k, v)]
    want = sdpa(*inputs, enable_gqa=True, backend="math")
    theirs = F.scaled_dot_product_attention(*leaves, enable_gqa=True)
    wants = [want, *torch.autograd.grad(want, inputs, cotangent)]
    gots = [theirs, *_grads(theirs, leaves, cotangent.to(DEVICE))]
    return [_error(a, b) for a, b in zip(gots, wants)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(_cases()))
def test_sdpa_forward_and_gradients_within_the_rule(case, dtype):
    """auto (the default), in every dtype: torch's kernel or FlexAttention, whichever runs it."""
    options, torch_has_it = _cases()[case]
    (q, k, v), leaves = _leaves(dtype)
    want = sdpa(q, k, v, enable_gqa=True, backend="math", **options)
    cotangent = torch.randn(want.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    learned = {key: x for key, x in options.items() if key in LEARNED}
    want_grads = torch.autograd.grad(sdpa(*(x.requires_grad_() for x in (q, k, v)), enable_gqa=True, backend="math",
                                          **{**options, **{n: x.requires_grad_() for n, x in learned.items()}}),
                                     (q, k, v, *learned.values()), cotangent)
    moved = _on_device(options, dtype)
    ours = sdpa(*leaves, enable_gqa=True, **moved)
    floors = [0.0] * 6
    if torch_has_it:  # torch's own call, the mask in the query's dtype
        theirs = _torch_call(leaves, moved)
    else:
        theirs = sdpa(*leaves, enable_gqa=True, backend="math", **moved)
        plain = _plain_errors(dtype, cotangent)
        # learned terms: no floor, but logit_scale, which torch's kernel takes folded into q: its gradient is
        # sum(q * torch's dq), as rounded as dq itself
        floors = plain + [plain[1] if n == "logit_scale" else 0.0 for n in learned]
    assert ours.dtype == dtype and torch.isfinite(ours).all()
    assert_within_rule(ours, want, theirs, f"{case} {dtype} forward", floor=floors[0])
    if case == "bool mask, a row sees nothing":
        assert not ours[0, :, 5].any()  # zeros, in every dtype
    inputs = (*leaves, *(moved[n] for n in learned))
    for name, a, b, w, floor in zip(("dq", "dk", "dv", *learned), _grads(ours, inputs, cotangent.to(DEVICE)),
                                    _grads(theirs, inputs, cotangent.to(DEVICE)), want_grads, floors[1:]):
        assert torch.isfinite(a).all(), name
        assert_within_rule(a, w, b, f"{case} {dtype} {name}", floor=floor)


REFUSED = {"sdpa": {"softcap", "sinks", "everything"}, "flex": set(), "flash": set(), "math": set()}
HALF_REFUSED = {"sdpa": {"alibi"}}  # ALiBi is not folded into a float16 or bfloat16 mask off the CPU


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", ["sdpa", "flex", "flash", "math"])
def test_every_backend_on_the_calls_it_takes(backend, dtype):
    """Each backend named, on the cases it takes (a ValueError naming why for exactly the others), in
    the rule against math in this dtype (floored by torch's own kernel's error on the plain call)."""
    cotangent = torch.zeros(B, H, L, D, dtype=torch.float64)
    floor = _plain_errors(dtype, cotangent)[0]
    refused = set()
    for case, (options, _) in _cases().items():
        (q, k, v), leaves = _leaves(dtype)
        moved = _on_device(options, dtype)
        try:
            ours = sdpa(*leaves, enable_gqa=True, backend=backend, **moved)
        except ValueError as error:
            assert "cannot run this call" in str(error)
            refused.add(case)
            continue
        want = sdpa(q, k, v, enable_gqa=True, backend="math", **options)
        yardstick = sdpa(*leaves, enable_gqa=True, backend="math", **moved)
        assert_within_rule(ours, want, yardstick, f"{backend} {case} {dtype}", floor=floor)
    if DEVICE == "cuda":  # (the CPU's flex refuses gradients)
        assert refused == REFUSED[backend] | (HALF_REFUSED.get(backend, set()) if dtype != torch.float32 else set())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_float32_mask_beside_half_queries_is_right(dtype):
    """mha keeps a float mask in float32 for half queries; it reaches torch's kernel in the query's dtype."""
    (q, k, v), leaves = _leaves(dtype)
    mask = torch.randn(L, S, dtype=torch.float64)
    want = sdpa(q, k, v, attn_mask=mask, enable_gqa=True, backend="math")
    ours = sdpa(*leaves, attn_mask=mask.to(device=DEVICE, dtype=torch.float32), enable_gqa=True)
    theirs = _torch_call(leaves, {"attn_mask": mask.to(device=DEVICE, dtype=dtype)})
    assert_within_rule(ours, want, theirs, str(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_plain_calls_are_torchs_result_bitwise(causal, dtype):
    _, (q, k, v) = _leaves(dtype)
    with torch.no_grad():
        for hkv in (H, HKV):
            kk, vv = k[:, :1].expand(B, hkv, S, D).contiguous(), v[:, :1].expand(B, hkv, S, D).contiguous()
            theirs = F.scaled_dot_product_attention(q, kk, vv, is_causal=causal, enable_gqa=hkv != H)
            assert torch.equal(sdpa(q, kk, vv, is_causal=causal, enable_gqa=hkv != H), theirs)


@pytest.mark.parametrize("term", ["every term at once", "a float mask"])
def test_compile_fullgraph_takes_every_term(term):
    """torch.compile(fullgraph=True) of scaled_dot_product_attention with every term at once (window,
    softcap, ALiBi, sinks, padding, a score_mod: FlexAttention), and with a float mask (torch's
    kernel), forward and backward, equal to the eager call."""
    _, (q, k, v) = _leaves(torch.bfloat16)
    table = torch.randn(H, 512, device=DEVICE)
    padding = torch.ones(B, 1, 1, S, dtype=torch.bool, device=DEVICE)
    padding[1, ..., 120:] = False
    slopes = torch.exp2(-torch.arange(1.0, H + 1)).to(DEVICE)
    options = {"every term at once": dict(window=(32, 0), softcap=20.0, alibi_slopes=slopes,
                                          sinks=torch.zeros(H, device=DEVICE), attn_mask=padding,
                                          score_mod=lambda s, b, h, i, j: s + table[h, (i - j) % 512]),
               "a float mask": dict(attn_mask=torch.randn(L, S, device=DEVICE, dtype=torch.bfloat16))}[term]

    def call(q, k, v):
        return sdpa(q, k, v, enable_gqa=True, **options)

    torch._dynamo.reset()
    compiled = torch.compile(call, fullgraph=True)
    if DEVICE == "cpu":  # the compiled CPU kernels run inference only
        with torch.no_grad():
            torch.testing.assert_close(compiled(q, k, v), call(q, k, v), atol=2e-2, rtol=2e-2)
        return
    got, want = compiled(q, k, v), call(q, k, v)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    grads = torch.autograd.grad(got.float().sum(), (q, k, v))
    for a, b in zip(grads, torch.autograd.grad(want.float().sum(), (q, k, v))):
        torch.testing.assert_close(a, b, atol=5e-2, rtol=5e-2)


# -- FlexAttention compiled: the mapping on the real kernel --------------------------------------------

@pytest.mark.skipif(DEVICE != "cuda", reason="the compiled FlexAttention with gradients runs on CUDA only")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [L, 4], ids=["block mask", "decoding rows"])
def test_flex_compiled_equals_math_forward_and_gradients(rows, dtype):
    """Every term at once (window, offset, ALiBi, logit_scale, softcap, sinks, padding, a score_mod over a learned
    table, a mask_mod), GQA and Dv != D, on the compiled kernel against float64."""
    (q, k, v), leaves = _leaves(dtype, L=rows, Dv=32)
    g = torch.Generator().manual_seed(3)
    slopes, sinks = torch.rand(H, generator=g, dtype=torch.float64), torch.randn(H, generator=g, dtype=torch.float64)
    factors = torch.linspace(0.5, 2.0, H, dtype=torch.float64)
    table = torch.randn(H, 512, generator=g, dtype=torch.float64)
    padding = torch.rand(B, S, generator=g) < 0.9

    def contract_on(device, dtype_of_terms):
        t, s, a, f = (x.to(device=device, dtype=dtype_of_terms).requires_grad_() for x in (table, sinks, slopes, factors))
        return Contract(band=mha.positions.Band(48, 0), offset=S - rows, alibi_slopes=a, sinks=s, softcap=15.0,
                        logit_scale=f,
                        key_valid=padding.to(device), score_mod=lambda x, b, h, i, j: x + t[h, (i - j) % 512],
                        mask_mod=lambda b, h, i, j: (i + j) % 7 != 3), (t, s, a, f)

    reference, ref_terms = contract_on("cpu", torch.float64)
    want = kernels.attention(q, k, v, reference, backend="math")[0]
    contract, terms = contract_on(DEVICE, torch.float32)
    ours = kernels.attention(*leaves, contract, backend="flex")[0]
    yardstick = kernels.attention(*leaves, contract, backend="math")[0]
    cotangent = torch.randn(want.shape, generator=g, dtype=torch.float64)
    floors = _plain_errors(dtype, torch.randn(B, H, L, D, generator=g, dtype=torch.float64)) + [0.0] * 4
    assert_within_rule(ours, want, yardstick, f"flex {dtype}", floor=floors[0])
    want_grads = torch.autograd.grad(kernels.attention(*(x.requires_grad_() for x in (q, k, v)), reference,
                                                       backend="math")[0], (q, k, v, *ref_terms), cotangent)
    for name, a, b, w, floor in zip(("dq", "dk", "dv", "table", "sinks", "slopes", "logit_scale"),
                                    _grads(ours, (*leaves, *terms), cotangent.to(DEVICE)),
                                    _grads(yardstick, (*leaves, *terms), cotangent.to(DEVICE)), want_grads, floors[1:]):
        assert_within_rule(a, w, b, f"flex {dtype} {name}", floor=floor)


@pytest.mark.skipif(DEVICE != "cuda", reason="counts CUDA compilations")
def test_a_decoding_loop_builds_no_block_mask_and_compiles_at_most_twice():
    """A window over a growing cache, one row a step: the offset and the key count change every
    step; no block mask is built and the kernel compiles once for the first shape, once dynamic."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    flex.BLOCK_MASKS.clear()
    built, graphs = flex.BLOCK_MASKS.built, counters["stats"]["unique_graphs"]
    q = torch.randn(1, 8, 1, 64, device=DEVICE, dtype=torch.bfloat16)
    kv = torch.randn(1, 8, 600, 64, device=DEVICE, dtype=torch.bfloat16)
    with torch.no_grad():
        for n in range(500, 540):
            out = sdpa(q, kv[:, :, :n], kv[:, :, :n], window=(100, 0), softcap=30.0)
            want = sdpa(q, kv[:, :, :n], kv[:, :, :n], window=(100, 0), softcap=30.0, backend="math")
            assert _error(out, want) < 2e-2
    assert flex.BLOCK_MASKS.built == built
    assert counters["stats"]["unique_graphs"] - graphs <= 2


# -- the modules ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_drop_in_equals_torchs_module_within_the_rule(dtype):
    """mha.nn.MultiheadAttention against torch.nn.MultiheadAttention with a key padding mask, output
    and input gradients, against the float64 module on the CPU."""
    torch.manual_seed(0)
    theirs = torch.nn.MultiheadAttention(64, 8, batch_first=True)
    ours = mha.nn.MultiheadAttention(64, 8, batch_first=True)
    ours.load_state_dict(theirs.state_dict())
    reference = mha.nn.MultiheadAttention(64, 8, batch_first=True).double()
    reference.load_state_dict(theirs.state_dict())
    x = torch.randn(3, 40, 64, dtype=torch.float64)
    padding = torch.zeros(3, 40, dtype=torch.bool)
    padding[1, 30:] = True
    want = reference(x, x, x, key_padding_mask=padding, need_weights=False)[0]
    theirs, ours = theirs.to(DEVICE, dtype), ours.to(DEVICE, dtype)
    xd = x.to(DEVICE, dtype)
    got = ours(xd, xd, xd, key_padding_mask=padding.to(DEVICE), need_weights=False)[0]
    yardstick = theirs(xd, xd, xd, key_padding_mask=padding.to(DEVICE), need_weights=False)[0]
    assert_within_rule(got, want, yardstick, f"drop-in {dtype}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_transformer_layers_equal_torchs_within_the_rule(dtype):
    torch.manual_seed(0)
    kw = dict(d_model=64, nhead=4, dim_feedforward=96, dropout=0.0, batch_first=True)
    for theirs_cls, ours_cls in ((torch.nn.TransformerEncoderLayer, mha.nn.TransformerEncoderLayer),
                                 (torch.nn.TransformerDecoderLayer, mha.nn.TransformerDecoderLayer)):
        theirs, ours, reference = theirs_cls(**kw), ours_cls(**kw), ours_cls(**kw).double()
        ours.load_state_dict(theirs.state_dict())
        reference.load_state_dict(theirs.state_dict())
        x = torch.randn(2, 24, 64, dtype=torch.float64)
        inputs = (x,) if ours_cls is mha.nn.TransformerEncoderLayer else (x, x[:, :16])
        want = reference(*inputs)
        moved = [t.to(DEVICE, dtype) for t in inputs]
        got = ours.to(DEVICE, dtype)(*moved)
        assert_within_rule(got, want, theirs.to(DEVICE, dtype)(*moved), f"{ours_cls.__name__} {dtype}")


def _tolerance(dtype, quantize) -> float:
    """A cache's decoding against the full forward: the dtype's rounding, or int8's (1/127 of each row's
    largest value: measured ~5e-3 relative on these inputs)."""
    return 2e-2 if quantize else {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 5e-2}[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("quantize", [None, "int8"])
def test_general_attention_decoding_from_a_cache_equals_the_full_forward(quantize, dtype):
    torch.manual_seed(0)
    module = mha.GeneralAttention(64, 64, 64, 16, 16, 64, h=4, num_kv_heads=2, rope=mha.RotaryEmbedding(16),
                                  window=(12, 0)).to(DEVICE, dtype)
    x = torch.randn(2, 20, 64, device=DEVICE, dtype=dtype)
    with torch.no_grad():
        full = module(x, x, x, is_causal=True)
        cache = mha.KVCache(quantize=quantize)
        steps = [module(x[:, :14], x[:, :14], x[:, :14], is_causal=True, cache=cache)]
        for t in range(14, 20):
            steps.append(module(x[:, t:t + 1], x[:, t:t + 1], x[:, t:t + 1], is_causal=True, cache=cache))
    assert _error(torch.cat(steps, 1), full) < _tolerance(dtype, quantize)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", ["auto", "math", "flex"])
def test_varlen_equals_each_sequence_alone(backend, dtype):
    lengths = [17, 64, 5, 150]
    cu = F.pad(torch.tensor(lengths).cumsum(0), (1, 0))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(lengths), 4, 32, generator=g, dtype=torch.float64) for _ in range(3))
    moved = [x.to(DEVICE, dtype) for x in (q, k, v)]
    got = varlen_attention(*moved, cu, cu, is_causal=True, window=(20, 0), backend=backend)
    yardstick = varlen_attention(*moved, cu, cu, is_causal=True, window=(20, 0), backend="math")
    want = varlen_attention(q, k, v, cu, cu, is_causal=True, window=(20, 0), backend="math")
    floor = _plain_errors(dtype, torch.zeros(B, H, L, D, dtype=torch.float64))[0]
    assert_within_rule(got, want, yardstick, f"varlen {backend} {dtype}", floor=floor)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("quantize", [None, "int8"])
def test_paged_attention_over_a_paged_cache(quantize, dtype):
    cache = mha.PagedKVCache(num_blocks=16, block_size=8, num_kv_heads=2, head_dim=16, dtype=dtype, device=DEVICE,
                             quantize=quantize)
    a, _ = cache.add()
    b, _ = cache.add()
    slots = cache.reserve([a, b], [19, 7])
    g = torch.Generator().manual_seed(0)
    k64, v64 = (torch.randn(26, 2, 16, generator=g, dtype=torch.float64) for _ in range(2))
    cache.write(0, slots, k64.to(DEVICE, dtype), v64.to(DEVICE, dtype))
    q64 = torch.randn(2, 4, 16, generator=g, dtype=torch.float64)  # the last row of each sequence
    cu = torch.tensor([0, 1, 2])
    with torch.no_grad():
        got = kernels.paged_attention(q64.to(DEVICE, dtype), *cache.pages(0), cache.block_table([a, b]), cu,
                                      cache.lengths([a, b]), window=(10, 0))
    for row, (start, n) in enumerate(((0, 19), (19, 7))):
        keys, values = (x[start:start + n].transpose(0, 1) for x in (k64, v64))  # (n, Hkv, D) -> (Hkv, n, D)
        want = sdpa(q64[row][:, None], keys, values, window=(10, 0), enable_gqa=True, backend="math")
        assert _error(got[row], want[:, 0]) < _tolerance(dtype, quantize)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_exact_efficient_variants(dtype):
    """The variants whose parts are exact attention (each a call of the dispatch): on the device within
    the rule, the yardstick the same variant on the CPU in the same dtype."""
    from mha import efficient
    (q, k, v), _ = _leaves(torch.float64, L=64, S=64)
    k, v = (x.repeat_interleave(H // HKV, 1) for x in (k, v))
    for name, options in (("exact", {}), ("local", {"window": 1000}), ("strided", {"stride": 8}), ("fixed", {"block": 8})):
        variant = efficient.make(name, **options)
        want = variant(q, k, v, is_causal=True)
        got = variant(*(x.to(DEVICE, dtype) for x in (q, k, v)), is_causal=True)
        yardstick = variant(*(x.to(dtype) for x in (q, k, v)), is_causal=True)
        assert_within_rule(got, want, yardstick, f"{name} {dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_transformers_llama_padded_batch(dtype):
    """A tiny Llama (q/k sharpened, o_proj amplified) on a left-padded batch: logits of
    attn_implementation="mha" against "sdpa" on the device, within the rule against float64 sdpa on
    the CPU (transformers' eager gives NaN in float64)."""
    pytest.importorskip("transformers")
    import mha.integrations.transformers
    from helpers.tiny_decoders import left_padded_batch, tiny_model
    model = tiny_model("llama")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(3.0)
            layer.self_attn.k_proj.weight.mul_(3.0)
            layer.self_attn.o_proj.weight.mul_(4.0)
    ids, attention_mask = left_padded_batch()
    mha.integrations.transformers.register()
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        want = model.double()(input_ids=ids, attention_mask=attention_mask).logits
    model = model.to(DEVICE, dtype)
    logits = {}
    for implementation in ("mha", "sdpa"):
        model.set_attn_implementation(implementation)
        with torch.no_grad():
            logits[implementation] = model(input_ids=ids.to(DEVICE), attention_mask=attention_mask.to(DEVICE)).logits
    real = attention_mask.bool()
    assert_within_rule(logits["mha"][real.to(DEVICE)], want[real], logits["sdpa"][real.to(DEVICE)], f"llama {dtype}")


def test_ring_and_ulysses_in_a_world_of_one():
    """What one GPU runs of sequence parallelism: a world of one process (no process group), CUDA
    tensors, against dense attention; gloo with CUDA tensors across ranks: test_ring_over_gloo."""
    from mha.distributed import SequenceLayout, ring_attention, ulysses_attention
    (q, k, v), leaves = _leaves(torch.float32, L=S, S=S)
    layout = SequenceLayout(S)
    want = sdpa(q, k, v, is_causal=True, enable_gqa=True, window=(50, 0), backend="math")
    for fn in (ring_attention, ulysses_attention):
        got = fn(*(layout.shard(x, dim=2) for x in leaves), layout, is_causal=True, enable_gqa=True, window=(50, 0))
        assert _error(layout.unshard(got, dim=2), want) < 1e-5, fn.__name__


def rank_ring_over_gloo() -> dict:
    """A spawned rank: ring attention over gloo with this rank's shards on the one CUDA device."""
    import torch.distributed as dist

    from mha.distributed import SequenceLayout, ring_attention
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 64, 32, generator=g, dtype=torch.float64) for _ in range(3))
    layout = SequenceLayout(64)
    try:
        shards = [layout.shard(x, dim=2).to(DEVICE, torch.float32) for x in (q, k, v)]
        out = layout.unshard(ring_attention(*shards, layout, is_causal=True), dim=2)
        want = sdpa(q, k, v, is_causal=True, backend="math")
        return {"rank": dist.get_rank(), "error": _error(out, want)}
    except Exception as error:  # gloo may refuse CUDA tensors: the test reports it
        return {"rank": dist.get_rank(), "refused": f"{type(error).__name__}: {error}"[:300]}


def test_ring_over_gloo_with_cuda_tensors():
    from mha.tools.launch import spawn
    results = spawn(rank_ring_over_gloo, 2, timeout=120)
    refused = [r["refused"] for r in results if "refused" in r]
    if refused:
        pytest.skip(f"gloo with CUDA tensors across two ranks: {refused[0]}")
    assert all(r["error"] < 1e-5 for r in results), results


# -- bad input names the argument ------------------------------------------------------------------------

@pytest.mark.skipif(DEVICE != "cuda", reason="mixes CUDA and CPU tensors")
def test_mixed_devices_are_refused_naming_the_argument():
    q = torch.randn(1, 2, 4, 16, device=DEVICE)
    cpu = torch.randn(1, 2, 4, 16)
    with pytest.raises(ValueError, match="^key is on device cpu but query is on cuda"):
        sdpa(q, cpu, q)
    with pytest.raises(ValueError, match="^attn_mask is on device cpu but query is on cuda"):
        sdpa(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="^alibi_slopes is on device cpu but query is on cuda"):
        sdpa(q, q, q, alibi_slopes=torch.ones(2))
    with pytest.raises(TypeError, match="^query must have a floating point dtype, got torch.int64"):
        sdpa(q.long(), q, q)
    module = mha.nn.MultiheadAttention(32, 2)
    x = torch.randn(3, 1, 32, device=DEVICE)
    with pytest.raises(ValueError, match="on device"):
        module(x, x, x)
