"""The per-call fast path of mha.functional.scaled_dot_product_attention and of the dispatch
(mha.kernels.dispatch.plain_call):
the same bits as the full path wherever it is taken, and not taken where the full path does
something else."""

import pytest
import torch
from torch.autograd import forward_ad

import mha
from mha import functional
from mha.kernels import dispatch, native, tuning
from mha.positions import CAUSAL, Band

sdpa = functional.scaled_dot_product_attention


@pytest.fixture(params=["compiled", "python"], autouse=True)
def fast_path(request, monkeypatch):
    """Every test runs on both fast paths: the native kernel's plain_sdpa (its checks in C++, once the
    kernel is loaded) and dispatch.plain_call in Python (no compiler, CUDA, torch.compile)."""
    if request.param == "python":
        monkeypatch.setattr(native, "loaded", None)
        monkeypatch.setattr(native, "load_if_built", lambda: None)  # (else the first call loads it)
    elif not native.native_available():
        pytest.skip("the native kernel does not build here: the Python fast path only")
    return request.param


def full_path(monkeypatch, *args, **kwargs):
    with monkeypatch.context() as patch:
        patch.setattr(dispatch, "plain_sdpa", lambda *a, **kw: None)
        return sdpa(*args, **kwargs)


def took_fast_path(monkeypatch, *args, **kwargs) -> bool:
    outs = []
    real = dispatch.plain_sdpa
    with monkeypatch.context() as patch:
        patch.setattr(dispatch, "plain_sdpa", lambda *a, **kw: outs.append(real(*a, **kw)) or outs[-1])
        sdpa(*args, **kwargs)
    return bool(outs) and outs[0] is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("L, S, H, Hkv", [(1, 1, 2, 2), (5, 17, 4, 4), (17, 5, 4, 4), (1, 64, 8, 2), (33, 33, 6, 3),
                                         (1, 1024, 8, 2)])  # (the last a decoding step native is measured faster on)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_the_fast_path_gives_the_full_paths_bits_and_gradients(monkeypatch, dtype, L, S, H, Hkv, is_causal, scale):
    torch.manual_seed(L * 100 + S)
    q = torch.randn(2, H, L, 16, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(2, Hkv, S, 16, dtype=dtype, requires_grad=True) for _ in range(2))
    gqa = H != Hkv
    assert took_fast_path(monkeypatch, q, k, v, is_causal=is_causal, enable_gqa=gqa, scale=scale) != (S == 1024)
    fast = sdpa(q, k, v, is_causal=is_causal, enable_gqa=gqa, scale=scale)
    fast_grads = torch.autograd.grad(fast.float().square().sum(), (q, k, v))
    full = full_path(monkeypatch, q, k, v, is_causal=is_causal, enable_gqa=gqa, scale=scale)
    full_grads = torch.autograd.grad(full.float().square().sum(), (q, k, v))
    assert torch.equal(fast, full)
    for a, b in zip(fast_grads, full_grads):
        assert torch.equal(a, b)
    with torch.no_grad():  # no gradient: the fast path calls native itself where it is measured faster (S = 1024)
        assert took_fast_path(monkeypatch, q, k, v, is_causal=is_causal, enable_gqa=gqa, scale=scale) or (
            S == 1024 and not native.native_available())
        assert torch.equal(sdpa(q, k, v, is_causal=is_causal, enable_gqa=gqa, scale=scale),
                           full_path(monkeypatch, q, k, v, is_causal=is_causal, enable_gqa=gqa, scale=scale))


def test_nan_goes_where_the_full_path_puts_it(monkeypatch):
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    k[0, 1, 3, 5] = float("nan")
    fast, full = sdpa(q, k, v, is_causal=True), full_path(monkeypatch, q, k, v, is_causal=True)
    assert torch.equal(fast.isnan(), full.isnan()) and fast.isnan().any()
    assert torch.equal(fast.nan_to_num(), full.nan_to_num())


def _q(*shape, **kw):
    return torch.randn(*shape, **kw)


@pytest.mark.parametrize("name, make, kwargs", [
    ("a mask beside causality", lambda: [_q(1, 2, 4, 8)] * 3, dict(attn_mask=torch.ones(4, 4, dtype=torch.bool),
                                                                   is_causal=True)),
    ("a bfloat16 mask", lambda: [_q(1, 2, 4, 8)] * 3, dict(attn_mask=torch.zeros(4, 4, dtype=torch.bfloat16))),
    ("a float64 mask", lambda: [_q(1, 2, 4, 8)] * 3, dict(attn_mask=torch.zeros(4, 4, dtype=torch.float64))),
    ("a mask of one dim", lambda: [_q(1, 2, 4, 8)] * 3, dict(attn_mask=torch.ones(4, dtype=torch.bool))),
    ("a mask of five dims", lambda: [_q(1, 2, 4, 8)] * 3, dict(attn_mask=torch.ones(1, 1, 1, 4, 4, dtype=torch.bool))),
    ("a mask of another batch", lambda: [_q(2, 2, 4, 8)] * 3, dict(attn_mask=torch.ones(3, 1, 4, 4, dtype=torch.bool))),
    ("a mask of more keys", lambda: [_q(1, 2, 4, 8)] * 3, dict(attn_mask=torch.ones(4, 5, dtype=torch.bool))),
    ("a mask subclass", lambda: [_q(1, 2, 4, 8)] * 3, dict(attn_mask=torch.nn.Parameter(torch.zeros(4, 4)))),
    ("a negative scale", lambda: [_q(1, 2, 4, 8)] * 3, dict(scale=-0.5)),
    ("a zero scale", lambda: [_q(1, 2, 4, 8)] * 3, dict(scale=0.0)),
    ("an infinite scale", lambda: [_q(1, 2, 4, 8)] * 3, dict(scale=float("inf"))),
    ("a NaN scale", lambda: [_q(1, 2, 4, 8)] * 3, dict(scale=float("nan"))),
    ("dropout", lambda: [_q(1, 2, 4, 8)] * 3, dict(dropout_p=0.5)),
    ("a window", lambda: [_q(1, 2, 4, 8)] * 3, dict(window=(1, 0))),
    ("a backend", lambda: [_q(1, 2, 4, 8)] * 3, dict(backend="math")),
    ("3-D", lambda: [_q(2, 4, 8)] * 3, {}),
    ("float64", lambda: [_q(1, 2, 4, 8, dtype=torch.float64)] * 3, {}),
    ("no keys", lambda: [_q(1, 2, 4, 8), _q(1, 2, 0, 8), _q(1, 2, 0, 8)], {}),
    ("no rows", lambda: [_q(1, 2, 0, 8), _q(1, 2, 4, 8), _q(1, 2, 4, 8)], {}),
    ("strided rows", lambda: [_q(1, 2, 8, 4).mT] * 3, {}),
    ("a value width of its own", lambda: [_q(1, 2, 4, 8), _q(1, 2, 4, 8), _q(1, 2, 4, 6)], {}),
    ("fewer kv heads without enable_gqa", lambda: [_q(1, 4, 4, 8), _q(1, 2, 4, 8), _q(1, 2, 4, 8)], {}),
    ("broadcast batch", lambda: [_q(2, 2, 4, 8), _q(1, 2, 4, 8), _q(1, 2, 4, 8)], {}),
    ("a tensor subclass", lambda: [torch.nn.Parameter(_q(1, 2, 4, 8))] * 3, {}),
])
def test_anything_else_takes_the_full_path(monkeypatch, name, make, kwargs):
    q, k, v = make()
    try:
        assert not took_fast_path(monkeypatch, q, k, v, **kwargs), name
    except ValueError:  # refused by the full path's checks: not taken either
        pass


def test_a_nested_tensor_skips_the_fast_path():
    """The fast path never reads a nested tensor's shape: sdpa packs it (varlen, tests/modules/
    test_nested.py); the dispatch itself takes dense tensors only."""
    parts = [torch.randn(2, 3, 8), torch.randn(2, 5, 8)]
    nested = torch.nested.nested_tensor(parts)
    out = sdpa(nested, nested, nested)
    for got, x in zip(out.unbind(), parts):
        torch.testing.assert_close(got, torch.nn.functional.scaled_dot_product_attention(x, x, x))
    with pytest.raises(TypeError, match="nested tensor"):
        mha.kernels.attention(nested, nested, nested, mha.kernels.Contract())


@pytest.mark.skipif(native.loaded is None and not native.native_available(), reason="the native kernel is not built here")
def test_the_kernel_refuses_subclasses_and_tangents_itself():
    """The C++ fast path reads what dispatch.plain_sdpa no longer reads in Python: q, k, v or a mask
    that is not a plain torch.Tensor (a subclass, a Parameter, a list) is Python's to decide (Ellipsis);
    a tangent on any of them (forward AD) is the full path's (None); under a dual level, tensors without
    one are a plain call (torch's bits). And the crossovers come from the dict it is handed, by dtype."""
    kernel = native._kernel()
    q = _q(1, 2, 5, 8)
    resolved = {torch.float32: (-1, (-1, -1), (-1, -1))}  # torch's kernel always

    class Sub(torch.Tensor):
        pass

    def ask(*tensors, mask=None):
        return kernel.plain_sdpa(*tensors, False, False, 16, resolved, None, None, mask)

    want = torch.nn.functional.scaled_dot_product_attention(q, q, q)
    assert torch.equal(ask(q, q, q), want)
    for odd in (torch.nn.Parameter(q.clone()), q.clone().as_subclass(Sub), q.tolist(), None):
        for place in range(3):
            assert ask(*[odd if i == place else q for i in range(3)]) is Ellipsis
    assert ask(q, q, q, mask=torch.nn.Parameter(torch.ones(5, 5))) is Ellipsis
    assert ask(q, q, q, mask=[[True] * 5] * 5) is Ellipsis
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(q, torch.ones_like(q))
        for place in range(3):
            assert ask(*[dual if i == place else q for i in range(3)]) is None
        tangent_mask = forward_ad.make_dual(torch.zeros(5, 5), torch.ones(5, 5))
        assert ask(q, q, q, mask=tangent_mask) is None
        assert torch.equal(ask(q, q, q), want)
    assert ask(q.bfloat16(), q.bfloat16(), q.bfloat16()) == torch.get_num_threads()  # no bfloat16 crossovers given
    with pytest.raises(TypeError, match="resolved must be a dict"):
        kernel.plain_sdpa(q, q, q, False, False, 16, [], None, None, None)
    # its binding (CPython's calling convention, no pybind loaders) names what is wrong
    for args, match in [((q, q, q, False, False, 16, resolved), r"8 to 10 positional arguments \(7 given\)"),
                        ((q, q, q, 1, False, 16, resolved, None), "must be bools"),
                        ((q, q, q, False, False, 16, resolved, None, [True]), "key_valid must be a Tensor"),
                        ((q, q, q, False, False, 16, {torch.float32: (2, (1, 2))}, None), r"must be \(threads"),
                        ((q, q, q, False, False, 16, {torch.float32: (-1, (1, 2), (1.5, 2))}, None), r"must be \(threads")]:
        with pytest.raises(TypeError, match=match):
            kernel.plain_sdpa(*args)
    with pytest.raises(TypeError):
        kernel.plain_sdpa(q, q, q, False, False, 16, resolved, None, mask=None)  # (positional only)
    scaled = torch.nn.functional.scaled_dot_product_attention(q, q, q, scale=0.125)
    assert torch.equal(kernel.plain_sdpa(q, q, q, False, False, 16, resolved, 0.125), scaled)


def test_autocast_forward_ad_and_native_calls_take_the_full_path(monkeypatch):
    q = torch.randn(1, 2, 4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not took_fast_path(monkeypatch, q, q, q)
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(q, torch.ones_like(q))
        assert not took_fast_path(monkeypatch, dual, q, q)
    monkeypatch.setattr(tuning, "crossovers", lambda dtype: tuning.Crossover(1, 1))  # the full path's native faster
    monkeypatch.setattr(tuning, "resolved_ints", {})
    assert not took_fast_path(monkeypatch, q.requires_grad_(), q, q)


def test_a_call_that_needs_no_gradient_takes_native_on_the_fast_path_where_measured_faster(monkeypatch, fast_path):
    """The native kernel's plain_sdpa runs the kernel itself on a call without gradients where the
    fast path's call was measured faster (plain_ crossovers), its output native's full path's bits;
    a call that needs a gradient follows the full path's crossovers: torch's call where they say torch
    (its autograd graph), the full path (native's autograd function) where they say native."""
    monkeypatch.setattr(tuning, "crossovers", lambda dtype: tuning.Crossover(None, None, 1, 1))
    monkeypatch.setattr(tuning, "resolved_ints", {})
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    out = dispatch.plain_sdpa(q, k, v, is_causal=True, enable_gqa=True, scale=0.7)
    torch_out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=0.7)
    if fast_path == "python":  # plain_call asks the full path's crossovers (and never runs the kernel itself)
        assert torch.equal(out, torch_out)
        return
    expected = native.native_attention(q, k, v, mha.kernels.Contract(band=CAUSAL, scale=0.7))
    assert out.grad_fn is None and torch.equal(out, expected) and not torch.equal(out, torch_out)
    learned = q.clone().requires_grad_()
    with_grad = dispatch.plain_sdpa(learned, k, v, is_causal=True, enable_gqa=True, scale=0.7)
    assert with_grad.grad_fn is not None and torch.equal(with_grad, torch_out)
    with torch.no_grad():
        assert torch.equal(dispatch.plain_sdpa(learned, k, v, is_causal=True, enable_gqa=True, scale=0.7), expected)
    monkeypatch.setattr(tuning, "crossovers", lambda dtype: tuning.Crossover(1, 1, 1, 1))
    monkeypatch.setattr(tuning, "resolved_ints", {})
    assert dispatch.plain_sdpa(learned, k, v, is_causal=True, enable_gqa=True, scale=0.7) is None  # the full path


@pytest.mark.parametrize("H, Hkv", [(8, 8), (8, 2), (8, 1)])  # 1, 4 and 8 query heads per key/value head
@pytest.mark.parametrize("more", [0, 1])
def test_a_gqa_decoding_step_counts_its_rows_per_key_value_head(monkeypatch, fast_path, H, Hkv, more):
    """A decoding step is at most dispatch.NATIVE_DECODE_ROWS (16) query rows per key/value head,
    L * H / Hkv (not L, not L * H): on one over enough keys (1024, the pinned crossover) native is
    measured faster, so the fast path runs native itself (the C++ fast path, no gradient) or declines it
    and the dispatch picks native (the Python one); one query more and it is a prefill torch's kernel
    takes, on the fast path."""
    group = H // Hkv
    # 16 rows per kv head, then 16 + group (without GQA 15 and 16: 16 query rows are a prompt's, below)
    L = min(dispatch.NATIVE_DECODE_ROWS // group, dispatch.NATIVE_PROMPT_ROWS - 1) + more
    decoding = more == 0
    torch.manual_seed(L)
    q, k, v = torch.randn(1, H, L, 16), torch.randn(1, Hkv, 1024, 16), torch.randn(1, Hkv, 1024, 16)
    assert dispatch.native_pays(q, k) == decoding
    assert dispatch.plain_call(q, k, v, enable_gqa=H != Hkv) == (not decoding)
    out = dispatch.plain_sdpa(q, k, v, is_causal=True, enable_gqa=H != Hkv)
    assert (out is not None) == (not decoding or fast_path == "compiled")
    if out is not None:
        torch_out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=H != Hkv)
        native_out = native.native_attention(q, k, v, mha.kernels.Contract(band=CAUSAL)) if decoding else torch_out
        assert torch.equal(out, native_out)
    if mha.kernels.native.ready():
        chosen = mha.kernels.choose_backend("auto", q, k, v, mha.kernels.Contract())[0]
        assert chosen == ("native" if decoding else "sdpa")


def test_the_kernel_counts_a_prompts_rows_as_the_dispatch_does():
    if not native.native_available():
        pytest.skip("the native kernel does not build here")
    assert native._kernel().PROMPT_ROWS == dispatch.NATIVE_PROMPT_ROWS == tuning.PREFILL_LENGTHS[0]


@pytest.mark.parametrize("L", [15, 16])
def test_sixteen_query_rows_are_a_prompt_whatever_their_rows_per_kv_head(monkeypatch, fast_path, L):
    """A call of L >= dispatch.NATIVE_PROMPT_ROWS (16) query rows is judged by the prefill crossover (the
    tuning's prefill grid measured L = S = 16; its decoding steps, one row a head): with native measured
    faster on steps from one key and on prompts from L = S = 64, 16 rows of one head over 1024 keys are
    torch's (min(L, S) = 16 < 64), 15 native's, on both fast paths and in the dispatch."""
    monkeypatch.setattr(tuning, "crossovers", lambda dtype: tuning.Crossover(64 * 64, 1, 64 * 64, 1))
    monkeypatch.setattr(tuning, "resolved_ints", {})
    torch.manual_seed(L)
    q, k, v = torch.randn(1, 4, L, 16), torch.randn(1, 4, 1024, 16), torch.randn(1, 4, 1024, 16)
    decoding = L < dispatch.NATIVE_PROMPT_ROWS
    assert dispatch.native_pays(q, k) == decoding
    assert dispatch.plain_call(q, k, v, enable_gqa=False) == (not decoding)
    out = dispatch.plain_sdpa(q, k, v, is_causal=True, enable_gqa=False)
    assert (out is not None) == (not decoding or fast_path == "compiled")
    if out is not None:
        expected = (native.native_attention(q, k, v, mha.kernels.Contract(band=CAUSAL)) if decoding
                    else torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
        assert torch.equal(out, expected)


def test_crossovers_of_another_thread_count_are_resolved_again(monkeypatch, fast_path):
    """The fast path hands the kernel the crossovers last resolved and the thread count they are for; the
    kernel answers with the count now in use where it differs (a caller's torch.set_num_threads), and the
    dispatch resolves them for it and asks again: torch's call here (native never faster), not a stale
    table's native."""
    if fast_path == "python":
        pytest.skip("the native kernel's own check")
    monkeypatch.setattr(tuning, "crossovers", lambda dtype: tuning.NEVER)
    threads = torch.get_num_threads()
    monkeypatch.setattr(tuning, "resolved_ints", {torch.float32: (threads + 1, (0, 0), (0, 0))})  # "always native"
    q, k, v = (torch.randn(1, 2, 40, 16) for _ in range(3))
    assert native.loaded.plain_sdpa(q, k, v, True, False, 16, tuning.resolved_ints, None, None) == threads
    out = dispatch.plain_sdpa(q, k, v, True, False)
    assert torch.equal(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert tuning.resolved_ints[torch.float32] == (threads, (-1, -1), (-1, -1))


def test_under_vmap_the_full_path_runs(monkeypatch):
    q = torch.randn(3, 1, 2, 4, 8)
    got = torch.vmap(lambda x: sdpa(x, x, x, is_causal=True))(q)
    expected = torch.stack([sdpa(x, x, x, is_causal=True, backend="math") for x in q])
    torch.testing.assert_close(got, expected)
    assert mha.kernels.choose_backend("auto", q[0], q[0], q[0], mha.kernels.Contract())[0] in ("sdpa", "native")


def test_a_head_dim_of_one_with_another_stride_takes_the_full_path(monkeypatch):
    """is_contiguous() ignores the stride of a size-1 dim; torch's fused kernel (and the full path's
    check) do not: found by review, 1.8e-7 apart before."""
    q, k, v = (torch.randn(1, 2, 1, T).mT for T in (40, 30, 30))  # (1, 2, T, 1), last stride T
    assert q.is_contiguous() and q.stride(-1) != 1
    assert not took_fast_path(monkeypatch, q, k, v)
    assert torch.equal(sdpa(q, k, v), full_path(monkeypatch, q, k, v))


CASES = [
    (lambda: [_q(2, 4, 5, 16), _q(2, 4, 7, 16), _q(2, 4, 7, 16)], False),
    (lambda: [_q(2, 4, 5, 16), _q(2, 2, 7, 16), _q(2, 2, 7, 16)], True),
    (lambda: [_q(2, 4, 5, 16), _q(2, 3, 7, 16), _q(2, 3, 7, 16)], True),  # 3 does not divide 4
    (lambda: [_q(2, 4, 5, 16), _q(2, 2, 7, 16), _q(2, 2, 7, 16)], False),  # fewer kv heads, no enable_gqa
    (lambda: [_q(1, 2, 1, 1), _q(1, 2, 1, 1), _q(1, 2, 1, 1)], False),  # D = 1
    (lambda: [t.mT for t in (_q(1, 2, 1, 9), _q(1, 2, 1, 7), _q(1, 2, 1, 7))], False),  # D = 1, last stride not 1
    (lambda: [_q(1, 2, 8, 4).mT] * 3, False),
    (lambda: [_q(1, 2, 4, 8), _q(1, 2, 4, 8), _q(1, 2, 4, 8, dtype=torch.float64)], False),
    (lambda: [_q(1, 2, 4, 8, dtype=torch.float16)] * 3, False),
    (lambda: [_q(1, 2, 4, 8, dtype=torch.bfloat16)] * 3, True),
    (lambda: [_q(1, 2, 4, 8, dtype=torch.float64)] * 3, False),
    (lambda: [_q(1, 0, 4, 8)] * 3, False),
    (lambda: [_q(1, 2, 4, 8), _q(1, 0, 4, 8), _q(1, 0, 4, 8)], True),
    (lambda: [_q(1, 2, 4, 0)] * 3, False),
    (lambda: [_q(1, 2, 4, 8), _q(1, 2, 4, 8), _q(1, 2, 4, 6)], False),
    (lambda: [_q(1, 2, 4, 8), _q(1, 2, 4, 8), _q(1, 2, 5, 8)], False),
    (lambda: [_q(2, 2, 4, 8), _q(1, 2, 4, 8), _q(1, 2, 4, 8)], False),
    (lambda: [_q(2, 4, 8)] * 3, False),
    (lambda: [_q(1, 1, 2, 4, 8)] * 3, False),
    (lambda: [_q(1, 2, 4, 8)[:, :, ::2]] * 3, False),  # rows apart: still unit last stride
    (lambda: [_q(1, 2, 1, 64), _q(1, 2, 4096, 64), _q(1, 2, 4096, 64)], False),  # a decoding step
    (lambda: [_q(1, 2, 16, 64), _q(1, 2, 4096, 64), _q(1, 2, 4096, 64)], False),  # 16 rows a head: a prompt's
    (lambda: [_q(1, 8, 512, 16)] * 3, False),  # a long prefill
]


@pytest.mark.parametrize("fast_path", ["compiled"], indirect=True)
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("crossover", [tuning.Crossover(None, None), tuning.Crossover(64 * 64, 1024, 64 * 64, 1024),
                                       tuning.Crossover(1, 1, 1, 1)])
def test_the_native_and_python_fast_paths_take_the_same_calls(monkeypatch, fast_path, case, crossover):
    """The native kernel's plain_sdpa repeats dispatch.plain_call's conditions in C++: on every call
    here (accepted, refused for each condition, and native measured faster or not) they agree on the
    calls that are plain; where native is measured faster the C++ one runs it (no gradient here), the
    Python one declines; where taken the output is torch's own call's, or native's full path's, bitwise."""
    make, gqa = CASES[case]
    q, k, v = make()
    monkeypatch.setattr(tuning, "crossovers", lambda dtype: tuning.NEVER)
    monkeypatch.setattr(tuning, "resolved_ints", {})
    plain = dispatch.plain_call(q, k, v, gqa)  # the conditions alone
    monkeypatch.setattr(tuning, "crossovers", lambda dtype: crossover)
    monkeypatch.setattr(tuning, "resolved_ints", {})
    in_python = dispatch.plain_call(q, k, v, gqa)
    out = dispatch.plain_sdpa(q, k, v, is_causal=True, enable_gqa=gqa)
    assert (out is not None) == (in_python if fast_path == "python" else plain)
    if in_python:
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                    enable_gqa=gqa and k.shape[1] != q.shape[1])
        assert torch.equal(out, expected)
    elif out is not None:  # measured faster: the kernel's own output
        assert torch.equal(out, native.native_attention(q, k, v, mha.kernels.Contract(band=CAUSAL)))


def test_the_native_fast_path_keeps_autograd_and_autocast_apart(monkeypatch, fast_path):
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    out = dispatch.plain_sdpa(q, q, q, is_causal=False, enable_gqa=False)
    (grad,) = torch.autograd.grad(out.sum(), q)
    expected = torch.nn.functional.scaled_dot_product_attention(q, q, q)
    assert torch.equal(grad, torch.autograd.grad(expected.sum(), q)[0])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert dispatch.plain_sdpa(q, q, q, is_causal=False, enable_gqa=False) is None


def test_a_torch_function_mode_sees_torchs_call_on_the_fast_path(monkeypatch, fast_path):
    """The native fast path calls torch's kernel from C++, where a TorchFunctionMode (a tracer, a
    logger) would not see it: under a mode the Python path runs, and the mode sees the call."""
    from torch.overrides import TorchFunctionMode

    class Seen(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.names.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    q = torch.randn(1, 2, 4, 8)
    with Seen() as seen:
        out = sdpa(q, q, q, is_causal=True)
    assert "scaled_dot_product_attention" in seen.names
    assert torch.equal(out, torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True))


_VALID = torch.ones(1, 4, dtype=torch.bool)


@pytest.mark.parametrize("contract, form", [
    (mha.kernels.Contract(), (False, None, None, None)),
    (mha.kernels.Contract(scale=0.25), (False, 0.25, None, None)),
    (mha.kernels.Contract(scale=0.25, offset=7), (False, 0.25, None, None)),  # an offset alone places nothing
    (mha.kernels.Contract(band=CAUSAL, scale=0.25), (True, 0.25, None, None)),
    (mha.kernels.Contract(band=Band(None, 0)), (True, None, None, None)),  # causality equal to CAUSAL, not the object
    (mha.kernels.Contract(band=CAUSAL, offset=3), None),  # bottom-right: not torch's is_causal
    (mha.kernels.Contract(band=Band(2, 0)), None),
    (mha.kernels.Contract(scale=-0.25), None),
    (mha.kernels.Contract(band=CAUSAL, scale=-0.25), None),
    (mha.kernels.Contract(softcap=5.0), None),
    (mha.kernels.Contract(key_valid=_VALID), (False, None, _VALID, None)),  # key padding: the native kernel's fast path only
    (mha.kernels.Contract(key_valid=_VALID, band=CAUSAL, offset=3), None),
    (mha.kernels.Contract(mask=_VALID, scale=0.5), (False, 0.5, None, _VALID)),  # a mask: the C++ fast path's torch call
    (mha.kernels.Contract(key_valid=_VALID, mask=_VALID), (False, None, _VALID, _VALID)),  # (plain_sdpa refuses both)
    (mha.kernels.Contract(mask=_VALID, band=CAUSAL, offset=1), None),
], ids=repr)
def test_the_contracts_the_fast_path_takes_as_its_arguments(contract, form):
    assert dispatch._plain_form(contract) == form


@pytest.mark.parametrize("L, S, band, offset", [(1, 9, None, 8), (6, 6, CAUSAL, 0), (4, 9, None, 5)])
def test_a_scale_and_an_offset_take_the_fast_path_with_the_full_paths_bits(monkeypatch, L, S, band, offset):
    """What transformers' bridge builds for a decoding step (its scaling, the new token's offset, no
    band): torch's call with the scale, bitwise the full path's (which folds nothing into a mask)."""
    g = torch.Generator().manual_seed(S)
    q, k, v = torch.randn(1, 8, L, 16, generator=g), torch.randn(1, 2, S, 16, generator=g), torch.randn(1, 2, S, 16, generator=g)
    contract = mha.kernels.Contract(band=band, offset=offset, scale=0.3)
    calls = []
    real = dispatch.plain_sdpa
    monkeypatch.setattr(dispatch, "plain_sdpa", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    fast, _ = mha.kernels.attention(q, k, v, contract)
    assert calls == [dict(is_causal=band is not None, enable_gqa=True, scale=0.3, key_valid=None, mask=None)]
    monkeypatch.setattr(dispatch, "plain_sdpa", lambda *a, **kw: None)
    full, _ = mha.kernels.attention(q, k, v, contract)
    assert torch.equal(fast, full)


@pytest.mark.parametrize("scale", [True, "0.5"])
def test_a_scale_the_full_path_refuses_is_refused_on_the_fast_path_too(monkeypatch, scale):
    q = _q(1, 2, 4, 8)
    assert dispatch.plain_causality(None, 0, scale) is None and not dispatch.plain_scale(scale)
    with pytest.raises(TypeError, match="scale must be a real number"):
        sdpa(q, q, q, scale=scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("is_causal, scale", [(False, None), (True, 0.3)])
def test_the_weights_fast_path_gives_the_full_paths_bits(monkeypatch, fast_path, dtype, is_causal, scale):
    """dispatch.plain_weights: a plain call that asks for its weights, with nothing to differentiate,
    takes native's output and weights in one call into the kernel, the full path's bits (GQA here);
    a gradient, or no kernel loaded (the Python fast path), leaves it to the full path."""
    torch.manual_seed(3)
    q, k, v = torch.randn(2, 4, 5, 8, dtype=dtype), torch.randn(2, 2, 7, 8, dtype=dtype), torch.randn(2, 2, 7, 8, dtype=dtype)
    contract = mha.kernels.Contract(band=CAUSAL if is_causal else None, scale=scale)
    taken = dispatch.plain_weights(q, k, v, is_causal=is_causal, scale=scale)  # (before the full path loads the kernel)
    assert (taken is not None) == (fast_path == "compiled")
    got = mha.kernels.attention(q, k, v, contract, need_weights=True)
    with monkeypatch.context() as patch:
        patch.setattr(dispatch, "plain_weights", lambda *a, **kw: None)
        want = mha.kernels.attention(q, k, v, contract, need_weights=True)
    assert got[1].dtype == dtype and got[1].shape == (2, 4, 5, 7)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    if taken is not None:
        assert torch.equal(taken[0], got[0]) and torch.equal(taken[1], got[1])
        assert dispatch.plain_weights(q.requires_grad_(), k, v, is_causal=is_causal, scale=scale) is None
        with torch.no_grad():
            assert dispatch.plain_weights(q, k, v, is_causal=is_causal, scale=scale) is not None


def test_key_padding_takes_the_kernels_own_call_where_native_is_measured_faster(monkeypatch, fast_path):
    """Key padding (B|1, S) bool beside a plain call: the native kernel's fast path runs it (where its
    call is measured faster, nothing to differentiate) with native's full-path bits, a sequence that
    is all padding zeros; anything else is the full path's (None here): torch's kernel beside padding
    (its blocked rows are planned there), a gradient, padding of another shape or dtype."""
    monkeypatch.setattr(tuning, "crossovers", lambda dtype: tuning.Crossover(None, None, None, 1))
    monkeypatch.setattr(tuning, "resolved_ints", {})
    torch.manual_seed(2)
    q, k, v = torch.randn(3, 4, 5, 8), torch.randn(3, 2, 6, 8), torch.randn(3, 2, 6, 8)
    valid = torch.rand(3, 6) > 0.3
    valid[1] = False  # a sequence that is all padding
    contract = mha.kernels.Contract(key_valid=valid, band=CAUSAL)
    out = dispatch.plain_sdpa(q, k, v, is_causal=True, enable_gqa=True, key_valid=valid)
    both = dispatch.plain_weights(q, k, v, is_causal=True, key_valid=valid)
    if fast_path == "python":
        assert out is None and both is None
        return
    assert torch.equal(out, native.native_attention(q, k, v, contract)) and not out[1].any()
    assert torch.equal(mha.kernels.attention(q, k, v, contract)[0], out)  # the dispatch's fast path
    expected = native.native_attention_weights(q, k, v, contract)
    assert torch.equal(both[0], expected[0]) and torch.equal(both[1], expected[1]) and not both[1][1].any()
    shared = valid[:1]  # one row of padding for every sequence
    assert torch.equal(dispatch.plain_sdpa(q, k, v, is_causal=True, enable_gqa=True, key_valid=shared),
                       native.native_attention(q, k, v, contract.replace(key_valid=shared)))
    for wrong in (valid[:, :5], valid.float(), valid[:2]):  # another length, dtype, batch
        assert dispatch.plain_sdpa(q, k, v, is_causal=True, enable_gqa=True, key_valid=wrong) is None
    assert dispatch.plain_sdpa(q.requires_grad_(), k, v, is_causal=True, enable_gqa=True, key_valid=valid) is None
    monkeypatch.setattr(tuning, "crossovers", lambda dtype: tuning.NEVER)
    monkeypatch.setattr(tuning, "resolved_ints", {})
    with torch.no_grad():
        assert dispatch.plain_sdpa(q, k, v, is_causal=True, enable_gqa=True, key_valid=valid) is None
        assert dispatch.plain_sdpa(q, k, v, is_causal=True, enable_gqa=True) is not None  # (torch's, unpadded)


@pytest.mark.parametrize("keys", [1023, 1024])
def test_the_fast_paths_own_native_call_starts_at_its_crossover_key(monkeypatch, fast_path, keys):
    """plain_decode_keys is where the C++ fast path starts running native: at 1024 keys under a
    crossover of 1024 it gives native's bits, one key fewer torch's."""
    monkeypatch.setattr(tuning, "crossovers", lambda dtype: tuning.Crossover(None, None, None, 1024))
    monkeypatch.setattr(tuning, "resolved_ints", {})
    torch.manual_seed(keys)
    q, k, v = torch.randn(1, 8, 1, 16), torch.randn(1, 2, keys, 16), torch.randn(1, 2, keys, 16)
    out = dispatch.plain_sdpa(q, k, v, is_causal=False, enable_gqa=True)
    torch_out = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    native_out = native.native_attention(q, k, v) if native.native_available() else torch_out
    on_native = fast_path == "compiled" and keys >= 1024
    assert torch.equal(out, native_out if on_native else torch_out)
    if native.native_available():  # (the two kernels' bits differ here: the test tells them apart)
        assert not torch.equal(native_out, torch_out)


def _mask_cases():
    g = torch.Generator().manual_seed(4)
    B, H, L, S = 2, 4, 5, 17
    additive = torch.randn(L, S, generator=g)
    additive[2] = float("-inf")  # a row that sees nothing: zeros, as the full path gives
    blocked = torch.rand(B, 1, L, S, generator=g) > 0.3
    blocked[1, 0, 3] = False
    return {
        "bool (L, S)": torch.rand(L, S, generator=g) > 0.4,
        "bool (B, 1, L, S), blocked rows": blocked,
        "bool (1, H, 1, S)": torch.rand(1, H, 1, S, generator=g) > 0.2,
        "float32 (L, S), a row all -inf": additive,
        "float32 (B, H, L, S)": torch.randn(B, H, L, S, generator=g),
        "float32 (H, L, S), expanded": torch.randn(1, L, 1, generator=g).expand(H, L, S),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mask_name", list(_mask_cases()))
@pytest.mark.parametrize("Hkv", [4, 2])
def test_an_attn_mask_takes_torchs_call_on_the_fast_path_with_the_full_paths_bits(monkeypatch, fast_path, dtype,
                                                                                 mask_name, Hkv):
    """An attn_mask the full path hands to torch's kernel as it is (bool, or float32: the dtype masks are
    added in) runs there from the C++ fast path, bitwise the full path's output and gradients (of the
    mask too); the Python fast path leaves every mask to the full path."""
    monkeypatch.setattr(tuning, "crossovers", lambda dtype: tuning.NEVER)  # torch's kernel on both paths
    monkeypatch.setattr(tuning, "resolved_ints", {})
    mask = _mask_cases()[mask_name]
    torch.manual_seed(Hkv)
    q = torch.randn(2, 4, 5, 16, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(2, Hkv, 17, 16, dtype=dtype, requires_grad=True) for _ in range(2))
    grad_mask = mask.detach().clone().requires_grad_() if mask.is_floating_point() else mask
    kwargs = dict(attn_mask=grad_mask, enable_gqa=Hkv != 4, scale=0.4)
    assert took_fast_path(monkeypatch, q, k, v, **kwargs) == (fast_path == "compiled")
    inputs = (q, k, v, grad_mask) if mask.is_floating_point() else (q, k, v)
    fast = sdpa(q, k, v, **kwargs)
    full = full_path(monkeypatch, q, k, v, **kwargs)
    assert torch.equal(fast, full)
    if mask_name.endswith("-inf"):
        assert not fast[:, :, 2].any()
    for a, b in zip(torch.autograd.grad(fast.float().square().sum(), inputs),
                    torch.autograd.grad(full.float().square().sum(), inputs)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("L, S", [(16, 16), (1, 64)])  # a prompt, a decoding step
def test_a_mask_is_left_to_the_full_path_where_its_crossovers_pick_native(monkeypatch, fast_path, L, S):
    """Where the full path's crossovers pick native, it runs native beside the mask (its bits): the
    fast path declines the call. The fast path's own crossovers (native called from C++ on plain
    calls) leave a masked call on torch's kernel, which is the full path's there: the same bits."""
    q, k = torch.randn(1, 2, L, 8), torch.randn(1, 2, S, 8)
    mask = torch.rand(L, S) > 0.5
    for found, declined in ((tuning.Crossover(1, 1), True), (tuning.Crossover(1, None), True),
                            (tuning.Crossover(None, 1), L == 1), (tuning.Crossover(None, None, 1, 1), False),
                            (tuning.NEVER, False)):
        monkeypatch.setattr(tuning, "crossovers", lambda dtype, found=found: found)
        monkeypatch.setattr(tuning, "resolved_ints", {})
        with torch.no_grad():
            taken = dispatch.plain_sdpa(q, k, k, False, False, None, None, mask)
            assert (taken is not None) == (fast_path == "compiled" and not declined), found
            if taken is not None:
                assert torch.equal(taken, full_path(monkeypatch, q, k, k, attn_mask=mask))


def test_a_mask_that_does_not_broadcast_is_named_by_the_full_path(monkeypatch, fast_path):
    q = torch.randn(2, 4, 5, 8)
    for mask in (torch.ones(3, 1, 5, 6, dtype=torch.bool), torch.ones(4, 5, dtype=torch.bool), torch.zeros(2, 5, 6)):
        with pytest.raises(ValueError, match=r"attn_mask of shape .* does not broadcast to the attention scores' shape"):
            sdpa(q, q, q, attn_mask=mask)
    with pytest.raises(TypeError, match="attn_mask must be a torch.Tensor, got list"):
        sdpa(q, q, q, attn_mask=[[True] * 5] * 5)  # (never handed to the kernel's call)
