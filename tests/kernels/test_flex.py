"""The flex backend (torch's FlexAttention) and the caller's score_mod / mask_mod.

The mapping of the contract onto FlexAttention's functions is checked on CPU against the math
backend in float64, through torch's uncompiled FlexAttention (flex.eager(): its reference
implementation, which takes float64 and returns the log-sum-exp on CPU); its gradients through the
same reference, with torch's CPU refusal lifted for the test (torch's wrapper refuses CPU gradients
because its compiled CPU kernel has none; its reference backward runs anywhere). The compiled CPU
kernel (forward) runs in a few tests; CUDA in tests/cuda.
"""

import math
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

import mha
from helpers.exact import raises_exactly
from helpers.tolerance import assert_close
from mha import kernels
from mha.functional import scaled_dot_product_attention as sdpa
from mha.kernels import Contract, dispatch, flex, mods
from mha.kernels.varlen import varlen_attention
from mha.positions import CAUSAL, Band

warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")

pytestmark = pytest.mark.skipif(not flex.available(), reason="this torch has no FlexAttention")


@pytest.fixture
def reference_backward(monkeypatch):
    """torch's reference FlexAttention backward on CPU (its wrapper refuses CPU gradients: no compiled
    backward there)."""
    from torch.nn.attention import flex_attention as torch_flex
    monkeypatch.setattr(torch_flex, "_validate_device", lambda *args: None)


def _inputs(B=2, H=4, Hkv=2, L=150, S=170, D=16, Dv=8, dtype=torch.float64, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=g, dtype=dtype).requires_grad_(grad)  # noqa: E731
    return make(B, H, L, D), make(B, Hkv, S, D), make(B, Hkv, S, Dv)


def _bool(*shape, p=0.7, seed=1):
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) < p


def _contracts(B, H, L, S):
    g = torch.Generator().manual_seed(3)
    positions = (torch.stack([torch.arange(L) + 5, torch.arange(L) + S - L]), torch.arange(S).expand(B, S))
    bias = torch.randn(H, L, S, generator=g, dtype=torch.float64)
    return {
        "none": Contract(),
        "causal": Contract(band=CAUSAL),
        "causal, bottom-right": Contract(band=CAUSAL, offset=S - L),
        "window, offset": Contract(band=Band(20, 3), offset=7),
        "window, right only": Contract(band=Band(None, -4), offset=11),
        "alibi": Contract(alibi_slopes=torch.rand(H, generator=g, dtype=torch.float64), offset=S - L),
        "softcap, scale": Contract(softcap=2.0, scale=0.9),
        "sinks": Contract(sinks=torch.randn(H, generator=g, dtype=torch.float64)),
        "positions": Contract(band=Band(30, 0), positions=positions),
        "key padding": Contract(key_valid=_bool(B, S)),
        "bool mask": Contract(mask=_bool(B, 1, L, S)),
        "bool mask per head": Contract(mask=_bool(1, H, 1, S)),
        "additive mask": Contract(mask=torch.randn(1, H, L, S, generator=g, dtype=torch.float64)),
        "score_mod": Contract(score_mod=lambda s, b, h, q_idx, kv_idx: s + bias[h, q_idx, kv_idx]),
        "mask_mod": Contract(mask_mod=lambda b, h, q_idx, kv_idx: (q_idx + kv_idx + b) % 3 != 0),
        "everything": Contract(band=Band(40, 0), offset=S - L, alibi_slopes=torch.rand(H, generator=g, dtype=torch.float64),
                               softcap=5.0, sinks=torch.randn(H, generator=g, dtype=torch.float64),
                               key_valid=_bool(B, S, p=0.9), mask=torch.randn(B, 1, 1, S, generator=g, dtype=torch.float64),
                               score_mod=lambda s, b, h, q_idx, kv_idx: s * 1.5 + bias[h, q_idx, kv_idx],
                               mask_mod=lambda b, h, q_idx, kv_idx: kv_idx != q_idx + 1),
    }


_NAMES = list(_contracts(2, 4, 150, 170))


@pytest.mark.parametrize("L", [150, 5], ids=["block mask", "decoding rows"])
@pytest.mark.parametrize("name", _NAMES)
def test_every_term_equals_math_in_float64(name, L):
    """L = 150 builds a block mask (L > DECODE_ROWS), L = 5 takes the hiding terms in score_mod."""
    q, k, v = _inputs(L=L)
    contract = _contracts(2, 4, 150, 170)[name]
    if contract.positions is not None:
        contract = contract.replace(positions=(contract.positions[0][:, :L], contract.positions[1]))
    if contract.mask is not None and contract.mask.shape[-2] > 1:
        contract = contract.replace(mask=contract.mask[..., :L, :])
    want, _ = kernels.attention(q, k, v, contract, backend="math")
    want_lse = _math_lse(q, k, contract)
    with flex.eager():
        out, lse = kernels.attention_with_lse(q, k, v, contract, backend="flex")
    assert_close(out, want)
    assert_close(lse, want_lse)


def _math_lse(q, k, contract):
    """The log-sum-exp of each row from the math backend's scores (sinks included), by hand."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = (q @ k.transpose(-1, -2)) * contract.scale_for(q.shape[-1])
    s = contract.modified(s, range(q.shape[-2]), range(k.shape[-2]))
    s, _ = contract.cap(s, inplace=False)
    s = contract.shape_scores(s, range(q.shape[-2]), range(k.shape[-2]), inplace=False)
    if contract.sinks is not None:
        s = torch.cat([s, contract.sinks[:, None, None].expand(*s.shape[:-1], 1)], -1)
    return torch.logsumexp(s, -1)


@pytest.mark.parametrize("L", [150, 5], ids=["block mask", "decoding rows"])
def test_gradients_of_every_term_equal_math(L, reference_backward):
    """q, k, v, ALiBi slopes, sinks and a bias table a score_mod closes over, through torch's
    reference backward (sinks: through the log-sum-exp)."""
    q, k, v = _inputs(L=L, grad=True)
    g = torch.Generator().manual_seed(5)
    slopes, sinks = (torch.rand(4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    table = torch.randn(4, 400, generator=g, dtype=torch.float64, requires_grad=True)
    contract = Contract(band=Band(60, 0), offset=170 - L, alibi_slopes=slopes, sinks=sinks, softcap=4.0,
                        key_valid=_bool(2, 170, p=0.9),
                        score_mod=lambda s, b, h, q_idx, kv_idx: s + table[h, q_idx - kv_idx + 200])
    leaves = (q, k, v, slopes, sinks, table)
    cotangent = torch.randn(2, 4, L, 8, generator=g, dtype=torch.float64)
    want = torch.autograd.grad(kernels.attention(q, k, v, contract, backend="math")[0], leaves, cotangent)
    with flex.eager():
        got = torch.autograd.grad(kernels.attention(q, k, v, contract, backend="flex")[0], leaves, cotangent)
    for name, a, b in zip(("q", "k", "v", "slopes", "sinks", "table"), got, want):
        assert_close(a, b, chain=True, err_msg=name)


@pytest.mark.parametrize("shapes", [((4, 30, 16), (2, 40, 16), (2, 40, 8)),  # 3-D: (H, L, D), GQA
                                    ((2, 3, 4, 30, 16), (2, 3, 4, 40, 16), (2, 3, 4, 40, 16)),  # two batch dims
                                    ((3, 4, 30, 16), (1, 4, 40, 16), (1, 4, 40, 16))],  # k, v broadcast over the batch
                         ids=["3-D with GQA", "5-D", "broadcast batch"])
def test_leading_dims_are_flattened_into_flexattentions_batch(shapes):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, generator=g, dtype=torch.float64) for s in shapes)
    table = torch.randn(64, generator=g, dtype=torch.float64)
    mask = torch.rand(*shapes[0][:-3], 1, 30, 40, generator=g) < 0.8  # per batch, broadcast over the heads
    contract = Contract(band=Band(10, 2), mask=mask, score_mod=lambda s, b, h, q_idx, kv_idx: s + table[(b * 7 + h) % 64])
    with flex.eager():
        out = kernels.attention(q, k, v, contract, backend="flex")[0]
    assert_close(out, kernels.attention(q, k, v, contract, backend="math")[0])


def test_empty_calls_give_zeros_without_a_call():
    for shapes in [((2, 4, 0, 16), (2, 4, 7, 16)), ((2, 4, 5, 16), (2, 4, 0, 16)), ((0, 4, 5, 16), (0, 4, 7, 16))]:
        q, k = torch.randn(shapes[0]), torch.randn(shapes[1])
        with flex.eager():
            out, lse = flex.flex_attention_with_lse(q, k, k, Contract(band=CAUSAL))
        assert out.shape == (*q.shape[:-1], 16) and not out.any() and (lse == float("-inf")).all()


# -- the caller's functions ---------------------------------------------------------------------------

def _by_hand(q, k, v, score=None, hidden=None):
    """softmax(q k^T / sqrt(D) shaped by hand) v in float64; score(s) -> s, hidden: bool (True = hidden)."""
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if score is not None:
        s = score(s)
    if hidden is not None:
        s = s.masked_fill(hidden, float("-inf"))
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("backend", ["math", "flex"])
def test_a_per_head_bias_table_and_a_document_mask_in_sdpa(backend, reference_backward):
    """score_mod closing over a per-head relative-position table, mask_mod over a document-id vector:
    equal to the same terms written by hand, forward and gradients (table included); dropping either
    changes the result."""
    B, H, L, D = 2, 3, 40, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    table = torch.randn(H, 2 * L - 1, generator=g, dtype=torch.float64, requires_grad=True)
    document = torch.repeat_interleave(torch.arange(4), torch.tensor([5, 12, 20, 3]))  # (L,)

    def bias(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + L - 1]

    def same_document(b, h, q_idx, kv_idx):
        return document[q_idx] == document[kv_idx]

    rel = torch.arange(L)[:, None] - torch.arange(L)[None, :] + L - 1  # (L, L)
    hidden = document[:, None] != document[None, :]
    want = _by_hand(q, k, v, score=lambda s: s + table[:, rel], hidden=hidden)
    with flex.eager():
        got = sdpa(q, k, v, score_mod=bias, mask_mod=same_document, backend=backend)
        assert not torch.allclose(got, sdpa(q, k, v, score_mod=bias, backend=backend))  # the mask matters
        assert not torch.allclose(got, sdpa(q, k, v, mask_mod=same_document, backend=backend))  # the bias matters
    assert_close(got, want)
    cotangent = torch.randn(want.shape, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(got, (q, k, v, table), cotangent),
                    torch.autograd.grad(want, (q, k, v, table), cotangent)):
        assert_close(a, b, chain=True)


@pytest.mark.parametrize("backend", ["math", "flex"])
def test_the_callers_functions_combine_with_mhas_terms_in_order(backend):
    """score_mod sees the scaled score (before softcap, ALiBi and attn_mask); mask_mod hides beside
    is_causal: the order written in mha.kernels.contract."""
    B, H, L, D = 1, 2, 24, 16
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, L, D, generator=g, dtype=torch.float64) * 2 for _ in range(3))
    slopes, mask = torch.tensor([0.5, 0.25], dtype=torch.float64), torch.randn(L, L, generator=g, dtype=torch.float64)
    with flex.eager():
        got = sdpa(q, k, v, attn_mask=mask, is_causal=True, softcap=3.0, alibi_slopes=slopes,
                   causal_alignment="top_left", score_mod=lambda s, b, h, q_idx, kv_idx: s * 4.0,
                   mask_mod=lambda b, h, q_idx, kv_idx: kv_idx % 5 != 1, backend=backend)
    rel = (torch.arange(L)[None, :] - torch.arange(L)[:, None]).to(torch.float64)
    keep = (rel <= 0) & (torch.arange(L)[None, :] % 5 != 1)
    want = _by_hand(q, k, v, score=lambda s: 3.0 * torch.tanh(s * 4.0 / 3.0) - slopes[:, None, None] * rel.abs() + mask,
                    hidden=~keep)
    assert_close(got, want)


@pytest.mark.parametrize("backend", ["math", "flex"])
def test_varlen_indices_are_rows_of_the_packed_batch(backend):
    """In varlen_attention q_idx and kv_idx index the packed rows: a segment-id vector over them
    splits each sequence further; equal to each sequence alone with its part of the vector."""
    lengths = [7, 13, 4]
    cu = torch.tensor([0, 7, 20, 24])
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(24, 2, 16, generator=g, dtype=torch.float64) for _ in range(3))
    segment = torch.randint(0, 2, (24,), generator=g)
    with flex.eager():
        got = varlen_attention(q, k, v, cu, cu, is_causal=True, backend=backend,
                               mask_mod=lambda b, h, q_idx, kv_idx: segment[q_idx] == segment[kv_idx])
    start = 0
    for n in lengths:
        rows = slice(start, start + n)
        x = [t[rows].transpose(0, 1) for t in (q, k, v)]  # (n, H, D) -> (H, n, D)
        seg = segment[rows]
        hidden = (seg[:, None] != seg[None, :]) | torch.ones(n, n, dtype=torch.bool).triu(1)
        want = torch.nan_to_num(_by_hand(*x, hidden=hidden))  # a row whose segment starts later sees only itself
        assert_close(got[rows].transpose(0, 1), want)
        start += n


def test_the_callers_functions_are_checked():
    q = torch.randn(1, 2, 4, 8)
    with raises_exactly(TypeError, "score_mod must be a function score_mod(score, b, h, q_idx, kv_idx) -> score "
                                   "(FlexAttention's signature), got int"):
        sdpa(q, q, q, score_mod=3)
    with raises_exactly(TypeError, "mask_mod must take 4 arguments, mask_mod(b, h, q_idx, kv_idx) -> bool "
                                   "(FlexAttention's signature), got a function of 5"):
        sdpa(q, q, q, mask_mod=lambda s, b, h, q_idx, kv_idx: True)
    with raises_exactly(TypeError, "mask_mod must return a bool tensor (True = attend), got torch.int32"):
        sdpa(q, q, q, mask_mod=lambda b, h, q_idx, kv_idx: q_idx - kv_idx, backend="math")
    elsewhere = q.to("meta")
    table = torch.ones(4)
    for backend in ("math", "flex"):
        with raises_exactly(ValueError, "score_mod closes over a tensor on cpu but query is on meta; move the "
                                        "tensors it reads to the query's device"):
            kernels.attention(elsewhere, elsewhere, elsewhere, Contract(score_mod=lambda s, b, h, i, j: s + table[i]),
                              backend=backend)


@pytest.mark.parametrize("backend", ["sdpa", "flash", *(["native"] if kernels.native_available() else [])])
def test_backends_that_cannot_take_the_callers_functions_refuse_them_by_name(backend):
    q = torch.randn(1, 2, 4, 8)
    theirs = "torch's kernel" if backend == "sdpa" else "it"
    with raises_exactly(ValueError, f"backend={backend!r} cannot run this call: {theirs} does not take mask_mod, "
                                    "score_mod"):
        sdpa(q, q, q, score_mod=lambda s, b, h, i, j: s, mask_mod=lambda b, h, i, j: i >= j, backend=backend)


# -- every backend refuses a term it does not declare ---------------------------------------------------

def test_a_new_contract_field_is_refused_by_every_backend_until_one_declares_it():
    """A term added to the Contract (here a per-head temperature) reaches no backend that has not
    said it takes it: each refuses it by name, and auto finds none."""
    import dataclasses

    @dataclasses.dataclass(frozen=True, eq=False)
    class WithTemperature(Contract):
        temperature: torch.Tensor | None = None

    contract = WithTemperature(temperature=torch.ones(2))
    q = torch.randn(1, 2, 4, 8)
    for name in dispatch.BACKENDS:
        reason = dispatch.refusal(name, q, q, q, contract)
        assert reason is not None and reason.endswith("does not take temperature"), (name, reason)
    with pytest.raises(ValueError, match="does not take temperature"):
        kernels.attention(q, q, q, contract)
    with pytest.raises(ValueError, match="does not take temperature"):
        kernels.attention_with_lse(q, q, q, contract)


# -- what flex refuses ------------------------------------------------------------------------------

def test_flex_refuses_what_it_cannot_run_by_name():
    q = torch.randn(1, 2, 4, 16)
    with raises_exactly(ValueError, "backend='flex' cannot run this call: FlexAttention has no dropout"):
        sdpa(q, q, q, dropout_p=0.5, backend="flex")
    x = q.double()
    with raises_exactly(ValueError, "backend='flex' cannot run this call: FlexAttention compiles float32, float16 and "
                                    "bfloat16 (got torch.float64, torch.float64, torch.float64)"):
        sdpa(x, x, x, backend="flex")
    with raises_exactly(ValueError, "backend='flex' cannot run this call: torch's compiled FlexAttention returns no "
                                    "log-sum-exp on CPU (sinks and the lse path need it)"):
        sdpa(q, q, q, sinks=torch.zeros(2), backend="flex")
    g = q.clone().requires_grad_()
    with pytest.raises(ValueError, match="^backend='flex' cannot run this call: torch refuses: FlexAttention does not "
                                         "support backward on CPU"):
        sdpa(g, g, g, backend="flex")
    with raises_exactly(ValueError, "backend='flex' cannot run this call: it does not differentiate through attn_mask; "
                                    "use backend='math'"):
        sdpa(q, q, q, attn_mask=torch.zeros(4, 4, requires_grad=True), backend="flex")


def test_a_cpu_gradient_is_refused_as_torch_refuses_it(monkeypatch):
    """The refusal is torch's own check, asked: a torch that lifts it is taken."""
    from torch.nn.attention import flex_attention as torch_flex
    q = torch.randn(1, 2, 4, 16, requires_grad=True)
    assert flex.unsupported(q, q, q, Contract()) is not None
    monkeypatch.setattr(torch_flex, "_validate_device", lambda *args: None)
    assert flex.unsupported(q, q, q, Contract()) is None


# -- block masks: built once per (shapes, terms) ----------------------------------------------------

def test_a_repeated_call_builds_its_block_mask_once_and_a_decoding_loop_builds_none():
    flex.BLOCK_MASKS.clear()
    built = flex.BLOCK_MASKS.built
    q, k, v = _inputs(L=200, S=200, Hkv=4, dtype=torch.float32)
    padding = _bool(2, 200, p=0.9)
    with flex.eager(), torch.no_grad():
        for _ in range(3):  # a training loop: one build
            sdpa(q, k, v, is_causal=True, window=(50, 0), backend="flex")
            varlen_attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                             torch.tensor([0, 80, 200]), torch.tensor([0, 80, 200]), is_causal=True, backend="flex")
            kernels.attention(q, k, v, Contract(band=CAUSAL, key_valid=padding), backend="flex")
        assert flex.BLOCK_MASKS.built == built + 3
        padding[0, 0] = not padding[0, 0]  # changed in place: its version moves, the mask is built anew
        kernels.attention(q, k, v, Contract(band=CAUSAL, key_valid=padding), backend="flex")
        assert flex.BLOCK_MASKS.built == built + 4
        for S in range(150, 160):  # decoding steps of one row over a window: nothing built
            kernels.attention(q[:, :, :1], k[:, :, :S], v[:, :, :S], Contract(band=Band(50, 0), offset=S - 1),
                              backend="flex")
        assert flex.BLOCK_MASKS.built == built + 4


def test_a_mask_function_is_known_by_its_code_and_what_it_closes_over():
    flex.BLOCK_MASKS.clear()
    q, k, v = _inputs(L=200, S=200, Hkv=4, dtype=torch.float32)
    document = torch.arange(200) // 50
    built = flex.BLOCK_MASKS.built

    def call(doc):
        def same(b, h, q_idx, kv_idx):  # a new closure each call, over the same vector
            return doc[q_idx] == doc[kv_idx]
        return sdpa(q, k, v, mask_mod=same, backend="flex")

    with flex.eager(), torch.no_grad():
        call(document), call(document)
        assert flex.BLOCK_MASKS.built == built + 1
        call(document.clone())  # another tensor: built anew
        assert flex.BLOCK_MASKS.built == built + 2


DOCUMENT = torch.arange(200) // 50  # read as a global by _same_document


def _same_document(b, h, q_idx, kv_idx):
    return DOCUMENT[q_idx] == DOCUMENT[kv_idx]


def test_a_mask_function_is_keyed_by_the_globals_defaults_and_objects_it_reads(monkeypatch):
    """A global reassigned, a default changed, a list or an object read: never a stale block mask
    (what cannot be keyed is built per call); an inference-mode tensor is not cached (no version)."""
    flex.BLOCK_MASKS.clear()
    q, k, v = _inputs(L=200, S=200, Hkv=4, dtype=torch.float32)
    shift = [0]

    def reads_a_list(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx + shift[0]

    def with_default(b, h, q_idx, kv_idx, width=10):
        return (q_idx - kv_idx).abs() <= width

    def check(mask_mod):
        with flex.eager(), torch.no_grad():
            got = sdpa(q, k, v, mask_mod=mask_mod, backend="flex")
        assert_close(got, sdpa(q, k, v, mask_mod=mask_mod, backend="math"), torch.float32)

    check(_same_document)
    monkeypatch.setattr(sys.modules[__name__], "DOCUMENT", torch.arange(200) // 20)
    check(_same_document)  # the global is another tensor now: another block mask
    check(reads_a_list)
    shift[0] = 60
    check(reads_a_list)  # the list changed in place: its mask was never cached
    check(with_default)
    with_default.__defaults__ = (70,)
    check(with_default)
    with torch.inference_mode():
        padding = _bool(2, 200, p=0.9)
        for _ in range(2):
            kernels.attention(q, k, v, Contract(band=CAUSAL, key_valid=padding), backend="flex")
    lengths = torch.tensor([0, 80, 200])
    with torch.inference_mode(), flex.eager():  # varlen's cached positions, made in inference mode first
        varlen_attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), lengths, lengths,
                         is_causal=True, backend="flex")
    with flex.eager(), torch.no_grad():
        varlen_attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), lengths, lengths,
                         is_causal=True, backend="flex")


def test_rows_that_see_no_key_have_the_sinks_log_sum_exp_and_dv_0_keeps_the_keys():
    q, k, v = _inputs(L=3, S=0, Dv=8)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)
    with flex.eager():
        out, lse = flex.flex_attention_with_lse(q, k, v, Contract(sinks=sinks))
        assert not out.any() and torch.equal(lse, sinks[:, None].expand(2, 4, 3))
        q, k, v = _inputs(L=3, S=5, Dv=0)
        out, lse = flex.flex_attention_with_lse(q, k, v, Contract())
    assert out.shape == (2, 4, 3, 0)
    assert_close(lse, _math_lse(q, k, Contract()))


def test_a_decoding_step_reads_only_the_keys_its_window_sees(monkeypatch):
    """A few rows over a window of a long cache: FlexAttention is handed the window's keys alone
    (the offset, padding and mask moved with them), and equals math."""
    seen = []
    real = flex._call
    monkeypatch.setattr(flex, "_call", lambda q4, k4, *args, **kw: seen.append(k4.shape[-2]) or real(q4, k4, *args, **kw))
    q, k, v = _inputs(L=2, S=300)
    contract = Contract(band=Band(40, 0), offset=298, key_valid=_bool(2, 300, p=0.9), mask=torch.randn(1, 1, 2, 300,
                        dtype=torch.float64), alibi_slopes=torch.rand(4, dtype=torch.float64))
    with flex.eager():
        got = kernels.attention(q, k, v, contract, backend="flex")[0]
    assert seen == [42]  # keys 258..299
    assert_close(got, kernels.attention(q, k, v, contract, backend="math")[0])


def test_a_mask_function_that_ignores_batch_and_head_gets_one_shared_block_mask():
    document = torch.arange(256) // 64
    heads = torch.tensor([True, False, False, True])
    assert not flex._reads_batch_or_head(lambda b, h, q_idx, kv_idx: document[q_idx] == document[kv_idx])
    assert flex._reads_batch_or_head(lambda b, h, q_idx, kv_idx: heads[h] | (q_idx >= kv_idx))
    assert flex._reads_batch_or_head(lambda b, h, q_idx, kv_idx: (b == 0) | (q_idx >= kv_idx))
    q, k, v = _inputs(L=256, S=256, dtype=torch.float32)
    with flex.eager(), torch.no_grad():
        functions = flex._Functions(Contract(mask_mod=lambda b, h, q_idx, kv_idx: heads[h] | (q_idx >= kv_idx)),
                                    (2, 4), 256, 256, q.device)
        assert functions.block_mask.shape[:2] == (2, 4)
        functions = flex._Functions(Contract(mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= kv_idx), (2, 4), 256, 256, q.device)
        assert functions.block_mask.shape[:2] == (1, 1)


def test_a_large_block_mask_is_built_compiled(monkeypatch):
    """Past _EAGER_BUILD mask elements the block mask is built by torch.compile(create_block_mask),
    which never holds the (B, H, L, S) mask; up to it, eagerly."""
    calls = []
    monkeypatch.setattr(flex, "_compiled_block_mask", lambda: lambda *args, **kw: calls.append(args[1:5]) or "built")
    functions = flex._Functions.__new__(flex._Functions)
    functions.contract, functions.device, functions.mask_batch, functions.mask_heads = Contract(band=CAUSAL), "cpu", 1, 1
    functions.mask_mod = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
    side = math.isqrt(flex._EAGER_BUILD)
    cache = flex.BlockMasks()
    assert cache.get(functions, side, side) != "built" and calls == []
    assert cache.get(functions, side, side + 1) == "built" and calls == [(1, 1, side, side + 1)]


# -- auto's choices ------------------------------------------------------------------------------------

def test_auto_runs_the_callers_functions_on_math_on_cpu_at_small_scores_and_on_flex_past_them(monkeypatch):
    mod = lambda s, b, h, q_idx, kv_idx: s  # noqa: E731
    q = torch.randn(1, 1, 64, 16)
    contract = Contract(score_mod=mod)
    assert kernels.choose_backend("auto", q, q, q, contract)[0] == "math"
    monkeypatch.setattr(dispatch, "SMALL_SCORES", 64 * 64 - 1)
    assert kernels.choose_backend("auto", q, q, q, contract) == (
        "flex", "the caller's score or mask function: FlexAttention compiles it into its kernel")
    g = q.clone().requires_grad_()  # no CPU backward in FlexAttention: math
    name, why = kernels.choose_backend("auto", g, g, g, contract)
    assert name == "math" and why.startswith("the caller's score or mask function, not flex (torch refuses")
    monkeypatch.setattr(dispatch, "SMALL_SCORES", 64 * 64)
    assert kernels.choose_backend("auto", q, q, q, contract)[0] == "math"


def test_auto_off_the_cpu_takes_sdpa_as_it_is_then_flex(monkeypatch):
    """On the meta device (off the CPU, like CUDA; flex declared able for the test): a plain or causal
    call is torch's kernel, a window or softcap FlexAttention, a call flex refuses torch's kernel with
    one folded mask."""
    monkeypatch.setattr(flex, "unsupported", lambda q, k, v, contract, dropout_p=0.0, need_lse=False:
                        "dropout" if dropout_p else None)
    monkeypatch.setitem(dispatch._UNSUPPORTED, "flex", flex.unsupported)
    q = torch.randn(1, 2, 64, 16, device="meta")
    choose = lambda contract, p=0.0: kernels.choose_backend("auto", q, q, q, contract, dropout_p=p)  # noqa: E731
    assert choose(Contract(band=CAUSAL)) == ("sdpa", "torch's fused kernel takes the whole contract as it is")
    assert choose(Contract(band=Band(8, 0), offset=0)) == (
        "flex", "not sdpa as it is (it would need the terms folded into one mask): FlexAttention compiles every term "
                "into one kernel")
    assert choose(Contract(softcap=3.0))[0] == "flex"
    assert choose(Contract(band=Band(8, 0)), p=0.1) == (
        "sdpa", "not flex (dropout): torch's fused kernel with the terms folded into one mask")
    assert choose(Contract(softcap=3.0), p=0.1)[0] == "math"  # small scores
    monkeypatch.setattr(dispatch, "SMALL_SCORES", 0)
    assert choose(Contract(softcap=3.0), p=0.1)[0] == "flash"  # past them: the tiles


# -- the compiled CPU kernel ---------------------------------------------------------------------------

def test_the_compiled_cpu_kernel_equals_math_forward():
    """torch.compile(flex_attention) on CPU (inference): a window, softcap, ALiBi, padding and a
    score_mod at once, against math in float32 (DESIGN's float32 rule against the float64 math)."""
    q, k, v = _inputs(B=1, H=2, Hkv=1, L=160, S=200, D=16, Dv=16, dtype=torch.float32)
    table = torch.randn(2, 400, generator=torch.Generator().manual_seed(0))
    contract = Contract(band=Band(64, 0), offset=40, softcap=20.0, alibi_slopes=torch.tensor([0.1, 0.01]),
                        key_valid=_bool(1, 200, p=0.9), score_mod=lambda s, b, h, i, j: s + table[h, i - j + 200])
    with torch.no_grad():
        got = kernels.attention(q, k, v, contract, backend="flex")[0]
    want = kernels.attention(q.double(), k.double(), v.double(), contract, backend="math")[0]
    theirs = kernels.attention(q, k, v, contract, backend="math")[0]
    assert (got - want).abs().max() <= 2 * (theirs - want).abs().max() + 1e-6


def test_mha_terms_reach_torch_in_the_querys_dtype_off_the_cpu(monkeypatch):
    """sdpa.guarded (the call off the CPU, run here on CPU tensors): an additive float32 mask beside
    float16 queries reaches torch's kernel as float16; a row that sees nothing gives zeros and zero
    gradients, the others equal math."""
    seen = []
    real = F.scaled_dot_product_attention

    def recording(*args, attn_mask=None, **kw):
        seen.append(attn_mask.dtype)
        return real(*args, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 6, 8, generator=g, dtype=torch.float16, requires_grad=True) for _ in range(3))
    mask = torch.randn(6, 6, generator=g)
    mask[2] = float("-inf")  # row 2 sees nothing
    out = kernels.sdpa.guarded(q, k, v, mask)
    assert seen == [torch.float16]
    assert not out[:, :, 2].any()
    want = kernels.attention(q.float(), k.float(), v.float(), Contract(mask=mask), backend="math")[0]
    assert_close(out.float(), want, torch.float16)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.isfinite(x).all() for x in grads) and not grads[0][:, :, 2].any()
    bool_mask = torch.ones(6, 6, dtype=torch.bool)
    bool_mask[4] = False
    out = kernels.sdpa.guarded(q, k, v, bool_mask)
    assert not out[:, :, 4].any() and out[:, :, 3].abs().sum() > 0


def test_alibi_is_not_folded_into_a_half_precision_mask_off_the_cpu():
    q = torch.randn(1, 2, 16, 16, device="meta", dtype=torch.bfloat16)
    folded, reason = kernels.sdpa.plan(q, q, q, Contract(alibi_slopes=torch.ones(2, device="meta")), 0.0)
    assert folded is None and reason.startswith("ALiBi would reach torch's kernel in a torch.bfloat16 mask")
    x = q.float()
    assert kernels.sdpa.plan(x, x, x, Contract(alibi_slopes=torch.ones(2, device="meta")), 0.0)[1] is None


def test_mha_reexports():
    assert mha.kernels.flex is flex and mods.check("score_mod", None) is None
