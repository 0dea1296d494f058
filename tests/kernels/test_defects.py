"""Issue 26's fifteen defects, each pinned by a test that failed before its fix, grouped by behaviour:
empty inputs, NaN, scale and softcap, precision, GQA, decoding and ragged batches, refusals and
devices. Each section's header names the defects it holds; each test's docstring says what went wrong.

Native calls that once crashed the process run in a child process (mha.tools.fuzz.driver.Isolated):
a crash is then a failed test, not the end of the run.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import mha
from helpers.backends import ALL, NATIVE
from helpers.exact import raises_exactly
from helpers.tolerance import assert_within_torch_error
from mha import numpy as oracle
from mha.functional import scaled_dot_product_attention as sdpa
from mha.kernels import Contract, native, varlen_attention
from mha.positions import CAUSAL
from mha.tools.fuzz import Case, check
from mha.tools.fuzz.driver import Isolated
from mha.tools.fuzz.reference import tolerance

BACKENDS = (*ALL, "auto")
native_only = pytest.mark.skipif(not NATIVE, reason="the native kernel does not build here (no compiler)")


@pytest.fixture(scope="module")
def isolated():
    child = Isolated(timeout=600)
    yield child
    child.close()


def _grads(out, *inputs):
    return torch.autograd.grad(out, inputs, torch.ones_like(out), allow_unused=True)


# -- empty inputs: a zero-sized dim, no heads, head dim 0, no rows (defects 1, 11, 13) -----------------


EMPTY = {"batch": ((0, 2, 16, 8),) * 3, "heads": ((2, 0, 16, 8),) * 3, "queries": ((2, 2, 0, 8), (2, 2, 16, 8), (2, 2, 16, 8)),
         "keys": ((2, 2, 16, 8), (2, 2, 0, 8), (2, 2, 0, 8)), "head dims": ((2, 2, 16, 0),) * 3,
         "value dim": ((2, 2, 16, 8), (2, 2, 16, 8), (2, 2, 16, 0))}


def _torch_empty(q, k, v, **options):
    """torch's own result for a call with an empty dim, on its math path: torch's fused CPU op dies of
    SIGFPE at 0 heads or 0 rows (it divides its work by them: measured, torch 2.13); torch 2.13's
    scaled_dot_product_attention returns before calling it, torch 2.11's did not (issue 42: the fast
    set died here)."""
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, **options)


def _seeded(shapes) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g, requires_grad=True) for s in shapes]


def _empty_on(backend: str, shapes) -> list:
    """(output, dq, dk, dv) of a call with a zero-sized dim, causal and not, in this process."""
    q, k, v = _seeded(shapes)
    results = []
    for causal in (False, True):
        out = sdpa(q, k, v, is_causal=causal, backend=backend)
        results.append([out.detach(), *_grads(out, q, k, v)])
    return results


@pytest.mark.parametrize("dims", list(EMPTY))
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_zero_sized_dim_gives_torchs_empty_result_forward_and_backward(backend, dims, isolated):
    """native backward with B = 0 died of SIGFPE (a division by zero in the work split)."""
    got = isolated(_empty_on, backend, EMPTY[dims]) if backend in ("native", "auto") else _empty_on(backend, EMPTY[dims])
    q, k, v = _seeded(EMPTY[dims])
    for causal, (out, *grads) in zip((False, True), got):
        want = _torch_empty(q, k, v, is_causal=causal)
        torch.testing.assert_close(out, want.detach())  # zeros where there are no keys, torch's mean of v at D = 0
        for grad, x in zip(grads, (q, k, v)):
            assert grad is not None and grad.shape == x.shape and torch.isfinite(grad).all()


@pytest.mark.parametrize("shape", [(2, 0, 4, 8), (2, 2, 4, 0)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_heads_and_head_dim_zero_give_torchs_result(backend, shape):
    """(2, 0, 4, 8): ZeroDivisionError on math/sdpa/auto, RuntimeError on native; (2, 2, 4, 0):
    ZeroDivisionError on math/flash/native (the default scale 1 / sqrt(0))."""
    q = torch.randn(shape, requires_grad=True)
    out = sdpa(q, q, q, backend=backend)
    torch.testing.assert_close(out, _torch_empty(q, q, q))
    (grad,) = _grads(out, q)
    assert grad.shape == q.shape
    k, v = torch.randn(2, 2, 5, 0), torch.randn(2, 2, 5, 3)  # D = 0 with values: every score 0, the mean of v
    if backend == "sdpa":  # torch's math path builds the (4, 5) weights, more than q, k and v hold: sdpa declines
        with pytest.raises(ValueError, match="cannot run this call"):
            sdpa(torch.randn(2, 2, 4, 0), k, v, backend=backend)
        return
    torch.testing.assert_close(sdpa(torch.randn(2, 2, 4, 0), k, v, backend=backend), v.mean(-2, keepdim=True).expand(2, 2, 4, 3))


def _lse_on_empty(shape):
    """attention_with_lse and its backward (ring attention's parts) on q, k, v of ``shape``."""
    q = torch.randn(shape, requires_grad=True)
    out, lse = mha.kernels.attention_with_lse(q, q, q, Contract(band=CAUSAL))
    grads = mha.kernels.dispatch.backward_with_lse(q, q, q, Contract(band=CAUSAL), out.detach(), lse, torch.ones_like(out))
    return out.shape, lse.shape, [None if g is None else g.shape for g in grads]


@pytest.mark.parametrize("shape", [(2, 0, 7, 16), (2, 2, 0, 16), (0, 2, 7, 16), (2, 2, 7, 0)],
                         ids=["no heads", "no rows", "no batch", "head dim 0"])
def test_the_lse_path_never_crashes_at_a_zero_sized_dim(shape, isolated):
    """attention_with_lse handed 0 heads or 0 rows to torch's fused CPU op, which died of SIGFPE
    (issue 42, found by reading whose call divides: torch's op, also on torch 2.13)."""
    out, lse, grads = isolated(_lse_on_empty, shape)
    assert out == shape and lse == shape[:-1] and grads[:3] == [shape] * 3


def test_mha_never_hands_an_empty_tensor_to_torchs_fused_kernels(monkeypatch):
    """Every entry that reaches torch's kernels, with each dim empty in turn: torch's fused CPU op and
    its scaled_dot_product_attention are never called with an empty tensor (torch before 2.13 passes
    those to the op that dies of SIGFPE)."""
    def refuse_empty(real):
        def call(*args, **kwargs):
            assert all(x.numel() for x in args[:3]), f"an empty tensor reached torch: {[tuple(x.shape) for x in args[:3]]}"
            return real(*args, **kwargs)
        return call
    monkeypatch.setattr(F, "scaled_dot_product_attention", refuse_empty(F.scaled_dot_product_attention))
    monkeypatch.setattr(mha.kernels.sdpa, "_FUSED", refuse_empty(mha.kernels.sdpa._FUSED))
    monkeypatch.setattr(mha.kernels.sdpa, "_FUSED_BACKWARD", refuse_empty(mha.kernels.sdpa._FUSED_BACKWARD))
    for name, shapes in EMPTY.items():
        q, k, v = _seeded(shapes)
        for backend in ("auto", "sdpa"):
            for causal in (False, True):
                if backend == "sdpa" and name == "head dims":
                    continue  # declined: torch's math path would build weights larger than q, k and v
                sdpa(q, k, v, is_causal=causal, backend=backend).sum().backward()
        if q.shape[-1] == v.shape[-1]:
            mha.kernels.attention_with_lse(q, k, v, Contract(band=CAUSAL))


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_rows_with_broadcast_batch_dims_keeps_the_broadcast_shape(backend):
    """q (1, 2, 0, 16), k/v (2, 2, 12, 16), causal: auto and sdpa gave (1, 2, 0, 16), the query's batch
    dims (as torch 2.13 itself does; the broadcast rule, and torch for L > 0, give (2, 2, ...))."""
    q, k = torch.randn(1, 2, 0, 16, requires_grad=True), torch.randn(2, 2, 12, 16, requires_grad=True)
    out = sdpa(q, k, k, is_causal=True, backend=backend)
    assert out.shape == (2, 2, 0, 16)
    assert sdpa(torch.randn(1, 2, 1, 16), k, k, backend=backend).shape == (2, 2, 1, 16)  # as with one row
    assert all(g.shape == x.shape for g, x in zip(_grads(out, q, k), (q, k)))


# -- NaN inputs: NaN out where torch gives it (defect 3) -----------------------------------------------


@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_nan_input_gives_nan_where_torch_gives_it(backend, where):
    """native gave finite outputs for a NaN in q or k (its exponential clamped NaN to a number)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 20, 8, generator=g) for _ in range(3))
    {"q": q, "k": k, "v": v}[where][0, 0, 3, 2] = math.nan
    want = F.scaled_dot_product_attention(q, k, v)
    assert torch.equal(sdpa(q, k, v, backend=backend).isnan(), want.isnan())


# -- scale and softcap: causal at scale 0 or below, a cap too large to bite (defects 5, 4) -------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_with_scale_zero_or_negative_is_finite(backend, dtype):
    """is_causal with scale=0.0 gave NaN outputs and gradients on auto and sdpa (torch's causal
    kernel scales after masking: -inf times 0): scale 0 is uniform weights over the visible keys."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 20, 8, generator=g).to(dtype).requires_grad_() for _ in range(3))
    visible = torch.ones(20, 20, dtype=torch.bool).tril()
    for scale in (0.0, -0.5):
        out = sdpa(q, k, v, is_causal=True, scale=scale, backend=backend)
        want = sdpa(q, k, v, attn_mask=visible, scale=scale, backend="math")
        torch.testing.assert_close(out, want, **({"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {}))
        assert all(torch.isfinite(grad).all() for grad in _grads(out, q, k, v))
    uniform = v.detach().double().cumsum(-2) / torch.arange(1, 21, dtype=torch.float64)[:, None]  # the mean of keys 0..i
    torch.testing.assert_close(sdpa(q, k, v, is_causal=True, scale=0.0, backend=backend).double(), uniform,
                               **({"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {}))


@pytest.mark.parametrize("shape", [(1, 2, 20, 8), (1, 2, 64, 32)])
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "sdpa"])
def test_a_large_softcap_equals_no_cap_forward_and_backward(backend, shape):
    """native at cap 1e6 was off by 5-8e-2 in fp32 (output) and 4e-2 (gradients): its tanh lost
    everything to cancellation where tanh(y) ~ y."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=g, requires_grad=True) for _ in range(3))
    plain = F.scaled_dot_product_attention(q, k, v)
    plain_grads = _grads(plain, q, k, v)
    for cap in (1e4, 1e6):
        capped = sdpa(q, k, v, softcap=cap, backend=backend)
        torch.testing.assert_close(capped, plain, atol=2e-6, rtol=1e-5)
        for ours, theirs in zip(_grads(capped, q, k, v), plain_grads):
            torch.testing.assert_close(ours, theirs, atol=5e-6, rtol=1e-5)


# -- precision: large logits, half precision accumulated in float32 (defects 8, 7) ---------------------


LARGE_LOGITS = {  # fuzz cases (mha.tools.fuzz): q_lead (1,) is 3-D input (1, L, D)
    "issue's, causal, scale 1e3": Case(q_lead=(1,), k_lead=(1,), v_lead=(1,), L=2, S=3, D=32, Dv=32, is_causal=True,
                                      scale=1e3),
    "tiled backward, scale 1e3": Case(q_lead=(1, 4), k_lead=(1, 4), v_lead=(1, 4), L=40, S=300, D=16, Dv=16, scale=1e3),
    "causal, negative scale": Case(q_lead=(1, 4), k_lead=(1, 4), v_lead=(1, 4), L=40, S=300, D=16, Dv=16,
                                   is_causal=True, scale=-30.0),
    "inputs x 30, a float mask": Case(q_lead=(1, 2), k_lead=(1, 2), v_lead=(1, 2), L=40, S=40, D=16, Dv=16,
                                      magnitude=30.0, mask="float"),
    "inputs x 30, sinks": Case(q_lead=(1, 2), k_lead=(1, 2), v_lead=(1, 2), L=40, S=70, D=16, Dv=16,
                               magnitude=30.0, sinks=True),
    "inputs x 100, bf16, causal": Case(dtype="bfloat16", q_lead=(2, 2), k_lead=(2, 2), v_lead=(2, 2), L=129, S=129,
                                       D=64, Dv=64, magnitude=100.0, is_causal=True),
}


@pytest.mark.parametrize("name", list(LARGE_LOGITS))
@pytest.mark.parametrize("seed", [0, 1])
def test_large_logits_stay_within_twice_torchs_error(name, seed, isolated):
    """native, causal, scale 1e3, q (1, 2, 32), k/v (1, 3, 32): dv relative error 1.2e-3 where torch's
    was 3.5e-8 (its backward's scores were a rounding away from its forward's); outputs with a float
    mask and inputs x 30: 2e-5 where torch's was 3.4e-7 (an exponential that rounded x log2 e);
    gradients with sinks or negative scales. P = e^(s - lse) also carried lse's rounding (|s| eps)
    into every weight: the backward now takes each row's max and sum. Every backend, output and
    gradients, by the fuzz driver's tolerance (mha.tools.fuzz.reference)."""
    found = isolated(_equal_findings, LARGE_LOGITS[name].replace(seed=seed))
    assert found == [], found


def _equal_findings(case: Case) -> list[str]:
    return [f"{f.signature}: {f.detail}" for f in check(case, properties=("equal", "raises", "repeat"))]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_math_computes_half_precision_in_float32(dtype):
    """math in bf16 computed QK^T and the softmax in bf16: causal, q x 100, L=20, S=30 was off by
    0.21 where torch was off by 0.001; float16 at scale 1e4 gave inf."""
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(1, 2, 20, 16, generator=g) * 100).to(dtype)
    k, v = (torch.randn(1, 2, 30, 16, generator=g).to(dtype) for _ in range(2))
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    theirs = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    ours = sdpa(q, k, v, is_causal=True, backend="math")
    assert_within_torch_error(ours, theirs, exact, floor=torch.finfo(dtype).eps)
    big = sdpa(q / 100, k, v, scale=1e4, backend="math")
    exact = F.scaled_dot_product_attention((q / 100).double(), k.double(), v.double(), scale=1e4)
    assert torch.isfinite(big).all() and (big.double() - exact).abs().max() < 1e-2


# -- GQA: keys and values with their own head counts, a transposed query (defects 9, 10) ---------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_enable_gqa_takes_keys_and_values_with_their_own_head_counts(backend):
    """q (2, 6, 8, 32), k (2, 6, 17, 32), v (2, 2, 17, 32): torch repeats each to 6 heads; auto,
    sdpa and flash raised a RuntimeError from inside torch."""
    g = torch.Generator().manual_seed(0)
    for k_heads, v_heads in ((6, 2), (3, 2), (1, 3)):
        q = torch.randn(2, 6, 8, 32, generator=g, requires_grad=True)
        k = torch.randn(2, k_heads, 17, 32, generator=g, requires_grad=True)
        v = torch.randn(2, v_heads, 17, 32, generator=g, requires_grad=True)
        want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        got = sdpa(q, k, v, enable_gqa=True, backend=backend)
        torch.testing.assert_close(got, want)
        for ours, theirs in zip(_grads(got, q, k, v), _grads(want, q, k, v)):
            torch.testing.assert_close(ours, theirs)


def test_flash_backward_with_gqa_a_transposed_query_and_257_rows():
    """flash backward, GQA, a transposed q, L = 257, a window: "more than one element of the written-to
    tensor refers to a single memory location" (the last block's one row per head was a view of dq)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 257, 8, 16, generator=g).transpose(1, 2).requires_grad_()
    k, v = (torch.randn(1, 2, 257, 16, generator=g, requires_grad=True) for _ in range(2))
    cotangent = torch.randn(1, 8, 16, 257, generator=g).transpose(-1, -2)  # a transposed gradient too
    grads = {}
    for backend in ("flash", "math"):
        out = sdpa(q, k, v, enable_gqa=True, window=(5, 5), backend=backend)
        grads[backend] = torch.autograd.grad(out, (q, k, v), cotangent)
    for ours, want in zip(grads["flash"], grads["math"]):
        torch.testing.assert_close(ours, want)


# -- decoding and ragged batches: per-sequence cache positions, varlen in bf16 (defect 2) --------------


def _cache_positions_case():
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, L, S, D = 3, 4, 1, 5, 33, 3
    q = torch.randn(B, H, L, D, generator=g).bfloat16()
    k, v = (torch.randn(B, Hkv, S, D, generator=g).bfloat16() for _ in range(2))
    lengths = torch.tensor([33, 20, 7])
    k_pos = torch.stack([torch.arange(S) - (S - n) for n in lengths])  # left padding at negative positions
    contract = Contract(band=CAUSAL, positions=(k_pos[:, S - L:], k_pos), key_valid=k_pos >= 0)
    return q, k, v, contract


def _cache_positions_on(backend):
    q, k, v, contract = _cache_positions_case()
    return mha.kernels.attention(q, k, v, contract, backend=backend)[0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_sequence_positions_in_bfloat16_match_the_oracle(backend, isolated):
    """A KV cache after left-padded prompts (per-sequence positions and padding), bf16, B=3, H=4,
    Hkv=1, L=5, S=33, D=3, causal: relative error 0.22 against the oracle on native and auto."""
    out = isolated(_cache_positions_on, backend) if backend in ("native", "auto") else _cache_positions_on(backend)
    q, k, v, contract = _cache_positions_case()
    q_pos, k_pos = contract.positions
    visible = (k_pos[:, None, None, :] <= q_pos[:, None, :, None]) & contract.key_valid[:, None, None, :]  # (B, 1, L, S)
    exact = torch.from_numpy(oracle.scaled_dot_product_attention(
        q.double().numpy(), k.double().repeat_interleave(4, 1).numpy(), v.double().repeat_interleave(4, 1).numpy(),
        attn_mask=visible.numpy())[0])
    relative = ((out.double() - exact).norm() / exact.norm()).item()
    assert relative < 1e-2, relative  # bf16's rounding of the inputs and output: ~3e-3 on every backend


def _varlen_repeats(seed: int, times: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(125, 8, 64, generator=g).bfloat16() for _ in range(3))
    cu = torch.tensor([0, 48, 114, 125], dtype=torch.int32)
    return [varlen_attention(q, k, v, cu, cu, is_causal=True, backend="native") for _ in range(times)]


@native_only
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_varlen_bfloat16_reads_only_its_own_rows_and_repeats_bit_for_bit(seed, isolated):
    """lengths [48, 66, 11], 8 heads, D = 64, causal, bf16: the 11-row sequence was off by up to 1.08
    about one call in three, and repeated calls differed (reads past the keys of the last tile)."""
    outs = isolated(_varlen_repeats, seed, 5)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(125, 8, 64, generator=g).bfloat16() for _ in range(3))
    for start, end in ((0, 48), (48, 114), (114, 125)):
        rows = [x[start:end].transpose(0, 1) for x in (q, k, v)]  # (T, H, D) -> (H, T, D)
        exact = F.scaled_dot_product_attention(*(x.double() for x in rows), is_causal=True)
        theirs = (F.scaled_dot_product_attention(*rows, is_causal=True).double() - exact).abs().max().item()
        ours = (outs[0][start:end].transpose(0, 1).double() - exact).abs().max().item()
        assert ours <= tolerance(theirs, (1.0, 0.0), torch.bfloat16, end - start), (start, ours, theirs)


# -- refusals and devices: bad scale, double backward, varlen flag, meta (defects 12, 6, 15, 14) -------


@pytest.mark.parametrize("scale", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_non_finite_scale_is_refused_naming_scale(backend, scale):
    q = torch.randn(1, 2, 4, 8)
    with raises_exactly(ValueError, f"scale must be a finite number, got {scale}"):
        sdpa(q, q, q, scale=scale, backend=backend)
    with raises_exactly(ValueError, f"scale must be a finite number, got {scale}"):
        Contract(scale=scale)


@pytest.mark.parametrize("term, length", [("sinks", 3), ("alibi_slopes", 5), ("logit_scale", 1)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_contracts_per_head_tensor_of_another_length_is_refused_naming_it(backend, term, length):
    """A Contract built by hand with 3 sinks (or 5 slopes, 1 logit scale) for 4 query heads: a ValueError
    naming the term, at every kernel entry; the native kernel read past the sinks' end (AddressSanitizer)
    and the math backend failed in a broadcast deep in torch."""
    q, k = torch.randn(1, 4, 15, 16), torch.randn(1, 2, 40, 16)
    contract = Contract(**{term: torch.rand(length) + 0.5})
    message = (f"{term} must have shape (4,) (num_heads,): one value per query head (dim -3 of query), "
               f"got ({length},)")
    with raises_exactly(ValueError, message):
        mha.kernels.attention(q, k, k, contract, backend=backend)
    if backend in ("auto", "math", "flash", "native"):  # (the backends with a log-sum-exp)
        with raises_exactly(ValueError, message):
            mha.kernels.attention_with_lse(q, k, k, contract, backend=backend)
    if backend == "native":
        for entry in (native.native_attention, native.native_attention_with_lse, native.native_attention_weights):
            with raises_exactly(ValueError, message):
                entry(q, k, k, contract)


@native_only
def test_native_refuses_a_double_backward_as_flash_does():
    """create_graph=True then a second backward silently gave first-order results (wrong
    Hessian-vector products)."""
    q = torch.randn(1, 2, 20, 8, dtype=torch.float64, requires_grad=True)
    out = native.native_attention(q, q, q)
    with raises_exactly(RuntimeError, "the native backend has no double backward (create_graph=True); "
                                      "use backend='math' for higher derivatives"):
        torch.autograd.grad(out.square().sum(), q, create_graph=True)
    hvp = sdpa(q, q, q, backend="math")  # the backend that has it
    (g,) = torch.autograd.grad(hvp.square().sum(), q, create_graph=True)
    (h,) = torch.autograd.grad(g.sum(), q)
    assert torch.isfinite(h).all() and h.abs().sum() > 0


@native_only
@pytest.mark.parametrize("flag", ["no", 1, None])
def test_varlen_refuses_a_flag_that_is_not_a_bool(flag):
    q, cu = torch.randn(10, 2, 8), torch.tensor([0, 10])
    with raises_exactly(TypeError, f"is_causal must be a bool, got {type(flag).__name__} ({flag!r})"):
        varlen_attention(q, q, q, cu, cu, is_causal=flag, backend="native")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_query_on_the_meta_device_infers_the_shape_or_native_says_it_takes_cpu_only(backend):
    """The message said "unknown device type for autocast" (torch's, from deep inside): math, sdpa,
    flash and auto infer shapes on meta as torch does; native says what it takes."""
    q = torch.randn(1, 2, 4, 8, device="meta")
    if backend == "native":
        with raises_exactly(ValueError, "backend='native' cannot run this call: it runs on CPU tensors only (got meta)"):
            sdpa(q, q, q, backend=backend)
    else:
        out = sdpa(q, q, q, is_causal=True, backend=backend)
        assert out.shape == (1, 2, 4, 8) and out.device.type == "meta"
