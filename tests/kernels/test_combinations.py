"""Where features combine: each defect found by random and adversarial testing, pinned by a test
that failed before it was fixed (the contract's own properties are in test_contract.py)."""


import pytest
import torch
import torch.nn.functional as F

import mha
from helpers.backends import TILED
from helpers.exact import raises_exactly
from helpers.tolerance import assert_close
from mha import kernels, positions
from mha.functional import scaled_dot_product_attention as sdpa
from mha.kernels import Contract
from mha.positions import Band

E, H, D = 16, 4, 4


def _module(**options):
    torch.manual_seed(0)
    return mha.GeneralAttention(E, E, E, D, D, E, H, dtype=torch.float64, **options).eval()


@pytest.mark.parametrize("options", [dict(window=(2, 0)), dict(alibi=True), dict(window=(1, 1), alibi=True)], ids=str)
def test_padding_a_key_keeps_the_alignment_of_windows_and_alibi(options):
    """L != S: padding the last key gives the output of the call without that key (the window
    and ALiBi used to flip from bottom-right to top-left as soon as a key was padded)."""
    m = _module(**options)
    x_q, x_kv = torch.randn(2, 4, E, dtype=torch.float64), torch.randn(2, 7, E, dtype=torch.float64)
    padding = torch.zeros(2, 7, dtype=torch.bool)
    padding[:, -1] = True
    with torch.no_grad():
        padded = m(x_q, x_kv, x_kv, key_padding_mask=padding, is_causal=True)
        shorter = m(x_q, x_kv[:, :-1], x_kv[:, :-1], is_causal=True)
    assert_close(padded, shorter)


def test_flash_gives_alibi_slopes_their_gradient():
    q, k, v = (torch.randn(1, 2, 9, 4, dtype=torch.float64) for _ in range(3))
    grads = {}
    for backend in ("math", "flash"):
        slopes = torch.tensor([0.5, 0.125], dtype=torch.float64, requires_grad=True)
        out = sdpa(q, k, v, is_causal=True, alibi_slopes=slopes, backend=backend)
        grads[backend] = torch.autograd.grad(out.square().sum(), slopes)[0]
    assert_close(grads["flash"], grads["math"])
    assert grads["flash"].abs().min() > 0


def test_math_with_differentiable_slopes_and_plain_inputs():
    """Only the ALiBi slopes require grad: the math backend must not soft-max in place."""
    q, k, v = (torch.randn(1, 2, 5, 4) for _ in range(3))
    slopes = torch.tensor([0.5, 0.25], requires_grad=True)
    out = sdpa(q, k, v, alibi_slopes=slopes, backend="math")
    (grad,) = torch.autograd.grad(out.sum() + out.square().sum(), slopes)
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0


@pytest.mark.parametrize("backend", ["flash", "math", "sdpa", "auto"])
@pytest.mark.parametrize("L, S", [(0, 5), (4, 0), (0, 0)])
def test_empty_queries_or_keys_give_zeros_like_torch(backend, L, S):
    q, k, v = torch.randn(2, 3, L, 4, requires_grad=True), torch.randn(2, 3, S, 4), torch.randn(2, 3, S, 6)
    out = sdpa(q, k, v, backend=backend)
    assert out.shape == (2, 3, L, 6) and torch.all(out == 0)
    out.sum().backward()
    assert q.grad.shape == q.shape


def test_flash_broadcasts_key_and_value_batches_as_torch():
    q = torch.randn(1, 3, 6, 4, requires_grad=True)
    k, v = torch.randn(2, 3, 7, 4, requires_grad=True), torch.randn(2, 1, 7, 5, requires_grad=True)
    out = sdpa(q, k, v, backend="flash")
    want = F.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(out, want)
    got = torch.autograd.grad(out.sum(), (q, k, v))
    for a, b in zip(got, torch.autograd.grad(want.sum(), (q, k, v))):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("terms", [dict(is_causal=True), dict(window=(3, 0)), dict(softcap=5.0)], ids=str)
def test_autocast_casts_like_torch(terms):
    q = torch.randn(1, 2, 8, 16)
    k, v = torch.randn(1, 2, 8, 16).bfloat16(), torch.randn(1, 2, 8, 16)  # mixed, as autocast code has them
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = sdpa(q, k, v, backend="flash", **terms)
        reference = sdpa(q.bfloat16(), k, v.bfloat16(), backend="math", **terms)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, reference, atol=2e-2, rtol=2e-2)


def test_flash_refuses_double_backward_and_transforms_clearly():
    q, k, v = (torch.randn(1, 1, 4, 3, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = sdpa(q, k, v, window=(1, 0), backend="flash")
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(ValueError, match="torch.func"):
        torch.func.vmap(lambda x: sdpa(x, x, x, window=(1, 0), backend="flash"))(q.detach())
    with pytest.raises(ValueError, match="jvp"):
        torch.func.jvp(lambda x: sdpa(x, x, x, window=(1, 0), backend="flash"), (q.detach(),), (q.detach(),))
    import torch.autograd.forward_ad as fwad

    with fwad.dual_level(), pytest.raises(ValueError, match="forward-mode"):
        dual = fwad.make_dual(q.detach(), torch.ones_like(q))
        sdpa(dual, dual, dual, window=(1, 0), backend="flash")


def test_auto_under_transforms_runs_what_can_run_there():
    """vmap, jvp and double backward through auto: sdpa where torch's kernel takes the call, else math."""
    x = torch.randn(3, 1, 2, 5, 4, dtype=torch.float64)
    windowed = torch.func.vmap(lambda t: sdpa(t, t, t, window=(2, 0)))(x)
    dense = torch.stack([sdpa(t, t, t, window=(2, 0), backend="math") for t in x])
    torch.testing.assert_close(windowed, dense)
    _, tangent = torch.func.jvp(lambda t: sdpa(t, t, t, is_causal=True, softcap=3.0), (x[0],), (torch.ones_like(x[0]),))
    assert torch.isfinite(tangent).all()


@pytest.mark.parametrize("call, error, words", [
    (lambda q: sdpa(q, q, q, is_causal="yes"), TypeError, ["is_causal", "bool"]),
    (lambda q: sdpa(q, q, q, is_causal=None), TypeError, ["is_causal"]),
    (lambda q: sdpa(q, q, q, window=(True, 0)), ValueError, ["window"]),
    (lambda q: sdpa(q, q, q, causal_alignment="middle"), ValueError, ["alignment"]),
    (lambda q: sdpa(q, q[:, :0], q[:, :0], enable_gqa=True), ValueError, ["enable_gqa", "heads"]),
    (lambda q: sdpa(q, q, q, enable_gqa="no"), TypeError, ["enable_gqa"]),
    (lambda q: sdpa(q, q, q, softcap=0.0), ValueError, ["softcap"]),
    (lambda q: sdpa(q, q, q, softcap="1"), TypeError, ["softcap"]),
    (lambda q: sdpa(q, q, q, sinks=torch.zeros(3)), ValueError, ["sinks", "(2,)"]),
    (lambda q: sdpa(q, q, q, sinks=torch.zeros(2, dtype=torch.long)), TypeError, ["sinks"]),
    (lambda q: sdpa(q, q, q, scale="big"), TypeError, ["scale"]),
    (lambda q: mha.RotaryEmbedding(4, base=0), ValueError, ["base"]),
    (lambda q: mha.RotaryEmbedding(4, base=-10000.0), ValueError, ["base"]),
    (lambda q: mha.RotaryEmbedding(4, interleaved="yes"), TypeError, ["interleaved"]),
    (lambda q: mha.GeneralAttention(8, 8, 8, 4, 4, 8, 2, sinks="yes"), TypeError, ["sinks"]),
    (lambda q: mha.GeneralAttention(8, 8, 8, 4, 4, 8, 2, softcap=-1.0), ValueError, ["softcap"]),
    (lambda q: mha.GeneralAttention(8, 8, 8, 4, 4, 8, 2, window=(True, 0)), ValueError, ["window"]),
    (lambda q: mha.nn.MultiheadAttention(8, 2)(q[0], q[0], q[0], is_causal="yes"), TypeError, ["is_causal"]),
], ids=lambda x: x if isinstance(x, str) else "")
def test_bad_arguments_are_named(call, error, words):
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(error) as info:
        call(q)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_causal_alignment_applies_to_windows_and_alibi_too():
    """One alignment per call: the window and ALiBi follow causal_alignment (once ignored beside a window)."""
    q, k, v = torch.randn(1, 2, 3, 4, dtype=torch.float64), *(torch.randn(1, 2, 7, 4, dtype=torch.float64) for _ in range(2))
    slopes = torch.tensor([0.5, 0.25], dtype=torch.float64)
    for alignment, offset in (("top_left", 0), ("bottom_right", 4)):
        got = sdpa(q, k, v, window=(1, 0), alibi_slopes=slopes, causal_alignment=alignment)
        want, _ = kernels.math_attention(q, k, v, Contract(band=Band(1, 0), offset=offset, alibi_slopes=slopes))
        assert_close(got, want)
    default = sdpa(q, k, v, window=(1, 0))  # flash-attn's convention: bottom-right
    torch.testing.assert_close(default, sdpa(q, k, v, window=(1, 0), causal_alignment="bottom_right"))


# -- the KV cache: wrong uses are refused ----------------------------------------------------------------------


def test_a_rolling_cache_narrower_than_the_window_israises_exactly():
    x = torch.randn(1, 3, E, dtype=torch.float64)
    for options, words in ((dict(window=(5, 0)), ["window=4", "(5, 0)"]), (dict(), ["window=4", "no sliding window"])):
        with torch.no_grad(), pytest.raises(ValueError) as info:
            _module(**options)(x, x, x, is_causal=True, cache=mha.KVCache(window=4))
        assert all(w in str(info.value) for w in words), str(info.value)
    with torch.no_grad():  # wide enough: fine
        _module(window=(4, 0))(x, x, x, is_causal=True, cache=mha.KVCache(window=4))


def test_a_cache_serves_one_module():
    x = torch.randn(1, 3, E, dtype=torch.float64)
    cache, first, second = mha.KVCache(), _module(), _module()
    with torch.no_grad():
        first(x, x, x, is_causal=True, cache=cache)
        with pytest.raises(ValueError, match="another attention module"):
            second(x, x, x, is_causal=True, cache=cache)


def test_a_cache_refuses_keys_of_another_width_or_dtype():
    x = torch.randn(1, 3, E, dtype=torch.float64)
    cache = mha.KVCache()
    m = _module()
    with torch.no_grad():
        m(x, x, x, is_causal=True, cache=cache)
        cache._owner = None  # as if another module, of other widths, took it over
        wide = mha.GeneralAttention(E, E, E, 2 * D, D, E, H, dtype=torch.float64).eval()
        with pytest.raises(ValueError, match="keys of shape"):
            wide(x, x, x, is_causal=True, cache=cache)
        cache._owner = None
        with pytest.raises(ValueError, match="dtype"):
            m.float()(x.float(), x.float(), x.float(), is_causal=True, cache=cache)


def test_cache_must_be_a_kv_cache():
    x = torch.randn(1, 3, E, dtype=torch.float64)
    with pytest.raises(TypeError, match="KVCache"):
        _module()(x, x, x, cache={})


def test_module_softcap_and_sinks_equal_the_functional_form():
    m = _module(softcap=2.0, sinks=True, num_kv_heads=2)
    torch.nn.init.normal_(m.sinks)
    x = torch.randn(2, 6, E, dtype=torch.float64, requires_grad=True)
    out = m(x, x, x, is_causal=True)
    q = m.q_proj(x).view(2, 6, H, D).transpose(1, 2)
    k, v = (p(x).view(2, 6, 2, D).transpose(1, 2) for p in (m.k_proj, m.v_proj))
    o = sdpa(q, k, v, is_causal=True, enable_gqa=True, softcap=2.0, sinks=m.sinks, backend="math")
    assert_close(out, m.out_proj(o.transpose(1, 2).reshape(2, 6, H * D)))
    (grad,) = torch.autograd.grad(out.sum(), m.sinks)
    assert grad.abs().min() > 0
    assert "softcap=2.0" in repr(m) and "sinks=True" in repr(m)


def test_positions_is_the_only_home_of_the_rule():
    """ALiBi's bias and the band read the same distances (key - query)."""
    rel = positions.relative(torch.arange(3) + 2, torch.arange(5))  # offset 2
    assert rel.tolist() == [[-2, -1, 0, 1, 2], [-3, -2, -1, 0, 1], [-4, -3, -2, -1, 0]]
    assert Band(1, 0).allowed(rel).tolist() == [[False, True, True, False, False], [False, False, True, True, False],
                                              [False, False, False, True, True]]
    torch.testing.assert_close(positions.alibi_bias(torch.tensor([0.5]), rel), -0.5 * rel.abs()[None].float())


@pytest.mark.parametrize("backend", ["sdpa", "auto"])
def test_bottom_right_causal_with_value_width_unlike_key_width(backend):
    """torch's CPU flash op (the split of a shifted causal band) wants Dv == D: found by the long
    random run; the call now folds (short) or goes to flash instead."""
    q, k, v = torch.randn(1, 1, 2, 1, dtype=torch.float64), torch.randn(1, 1, 3, 1, dtype=torch.float64), \
        torch.randn(1, 1, 3, 3, dtype=torch.float64)
    got = kernels.attention(q, k, v, Contract(band=Band(None, 0), offset=1), backend=backend)[0]
    want, _ = kernels.math_attention(q, k, v, Contract(band=Band(None, 0), offset=1))
    assert_close(got, want)


def test_a_left_padded_prefill_continues_at_the_right_positions():
    """Left padding takes no positions: the sequence alone, unpadded, gives the same rows (found
    in review: positions came from the slots while lengths counted the valid tokens)."""
    m = _module(rope=mha.RotaryEmbedding(D), alibi=True)
    x, new = torch.randn(1, 5, E, dtype=torch.float64), torch.randn(1, 2, E, dtype=torch.float64)
    padding = torch.tensor([[True, True, False, False, False]])
    cache = mha.KVCache()
    with torch.no_grad():
        prefill = m(x, x, x, key_padding_mask=padding, is_causal=True, cache=cache)
        steps = [m(new[:, t:t + 1], new[:, t:t + 1], new[:, t:t + 1], is_causal=True, cache=cache) for t in range(2)]
        alone = torch.cat([x[:, 2:], new], dim=1)
        want = m(alone, alone, alone, is_causal=True)
    assert_close(prefill[:, 2:], want[:, :3])
    assert_close(torch.cat(steps, 1), want[:, 3:])


@pytest.mark.parametrize("transform", ["vmap", "grad", "jvp"])
@pytest.mark.parametrize("backend", ["auto", "sdpa"])
def test_bottom_right_causal_under_torch_func(transform, backend):
    """The split of a shifted causal band is an autograd.Function without transform rules: under
    torch.func, sdpa folds (short) or declines; auto runs what can run (found in review)."""
    q = torch.randn(2, 1, 3, 4, dtype=torch.float64)
    kv = torch.randn(1, 6, 4, dtype=torch.float64)

    def attend(x):
        return sdpa(x, kv, kv, is_causal=True, causal_alignment="bottom_right", backend=backend)

    want = torch.stack([sdpa(x, kv, kv, is_causal=True, causal_alignment="bottom_right", backend="math") for x in q])
    if transform == "vmap":
        torch.testing.assert_close(torch.func.vmap(attend)(q), want)
    elif transform == "grad":
        got = torch.func.grad(lambda x: attend(x).sum())(q[0])
        x = q[0].clone().requires_grad_()
        (ref,) = torch.autograd.grad(sdpa(x, kv, kv, is_causal=True, causal_alignment="bottom_right",
                                          backend="math").sum(), x)
        torch.testing.assert_close(got, ref)
    elif backend == "sdpa":
        with pytest.raises(ValueError, match="forward-mode"):
            torch.func.jvp(attend, (q[0],), (torch.ones_like(q[0]),))
    else:
        out, tangent = torch.func.jvp(attend, (q[0],), (torch.ones_like(q[0]),))
        torch.testing.assert_close(out, want[0])
        assert torch.isfinite(tangent).all()


@pytest.mark.parametrize("shapes", [
    ((8, 256, 16), (8, 256, 16), (8, 256, 16)),  # 3-D: no head dim
    ((2, 4, 256, 16), (1, 4, 256, 16), (1, 4, 256, 16)),  # key/value batch broadcast
    ((1, 4, 256, 16), (1, 4, 256, 16), (1, 4, 256, 8)),  # Dv != D
], ids=["3-D", "broadcast", "Dv != D"])
def test_shapes_torch_would_compute_densely_go_to_flash(shapes):
    """torch's CPU kernel falls back to building the (B, H, L, S) weights for these shapes (3-D too:
    torch runs them on its math path, and so does the sdpa backend): auto keeps them off it at long T
    (found in review: 1.27 GiB at T = 4096)."""
    q, k, v = (torch.randn(s) for s in shapes)
    name, reason = kernels.choose_backend("auto", q, k, v, Contract(band=Band(None, 0)))
    assert name == TILED and "weights" in reason, reason
    torch.testing.assert_close(kernels.attention(q, k, v, Contract(band=Band(None, 0)))[0],
                               kernels.math_attention(q, k, v, Contract(band=Band(None, 0)))[0])


# -- shared machinery: defaults, GQA, devices --------------------------------------------------------------------


def test_gqa_with_three_dim_inputs_shares_key_heads_like_torch():
    """(H, L, D) inputs: dim -3 holds the heads, and enable_gqa repeats key/value heads there."""
    q = torch.randn(4, 3, 5, dtype=torch.float64)
    k, v = torch.randn(2, 6, 5, dtype=torch.float64), torch.randn(2, 6, 7, dtype=torch.float64)
    want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    for backend in ("auto", "math", "flash"):
        assert_close(sdpa(q, k, v, enable_gqa=True, backend=backend), want)


GQA_CALLS = {  # name: keyword arguments of sdpa; every one runs on torch's kernel
    "plain": {},
    "causal": dict(is_causal=True),
    "causal bottom-right (zero queries put first)": dict(is_causal=True, causal_alignment="bottom_right"),
    "padding mask": dict(attn_mask=torch.tensor([True] * 9 + [False] * 3)),
    "window (folded into one mask)": dict(window=(2, 0)),
}


@pytest.mark.parametrize("name", GQA_CALLS)
def test_gqa_on_torchs_kernel_reads_the_shared_heads_as_they_are(name, monkeypatch):
    """Fewer key/value heads reach torch's kernel unrepeated, forward and backward equal to
    repeating them."""
    options = GQA_CALLS[name]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 7, 4, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 12, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    heads_seen = []  # the key heads each call of torch's kernels receives

    def spy(kernel):
        return lambda *args, **kwargs: heads_seen.append(args[1].shape[-3]) or kernel(*args, **kwargs)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy(F.scaled_dot_product_attention))
    out = sdpa(q, k, v, enable_gqa=True, backend="sdpa", **options)
    assert heads_seen and set(heads_seen) == {2}
    want = sdpa(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), backend="math", **options)
    assert_close(out, want)
    grad = torch.randn_like(out)
    assert_close(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad))


def test_attend_defaults_are_plain_batched_attention_without_weights():
    """mha.modules.pipeline.attend(q, k, v): no causal mask, no dropout, no extra key, no weights, batched masks."""
    from mha.modules.pipeline import attend

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, 4, generator=g, dtype=torch.float64) for n in (5, 6, 6))
    out, weights = attend(q, k, v)
    assert weights is None
    assert_close(out, F.scaled_dot_product_attention(q, k, v))
    masked_out = torch.rand(2 * 3, 5, 6, generator=g) < 0.3  # (B*H, L, S), torch.nn.MultiheadAttention's form
    masked_out[..., 0] = False
    out, _ = attend(q, k, v, attn_mask=masked_out)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=~masked_out.view(2, 3, 5, 6))
    assert_close(out, want)


def test_attend_positional_defaults_are_plain_attention_without_weights():
    """mha.modules.pipeline.attend_positional on heads (B, H, T, D): no causal band, no dropout, no weights."""
    from mha.modules.pipeline import attend_positional

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, 4, generator=g, dtype=torch.float64) for n in (5, 6, 6))
    out, weights = attend_positional(q, k, v)
    assert weights is None
    assert_close(out, F.scaled_dot_product_attention(q, k, v))


def test_attention_with_appended_keys_and_positions_runs_on_the_meta_device():
    """Shape inference on the meta device: every tensor the machinery makes (key positions of the
    appended keys, RoPE's positions, a cache's positions) is made on the query's device."""
    from mha.modules.pipeline import attend

    q = torch.empty(2, 3, 4, 8, device="meta")
    out, _ = attend(q, q, q, add_zero_attn=True, is_causal=True)
    assert out.shape == (2, 3, 4, 8) and out.device.type == "meta"
    m = mha.GeneralAttention(E, E, E, D, D, E, H, rope=mha.RotaryEmbedding(D), device="meta")
    x = torch.empty(2, 3, E, device="meta")
    assert m(x, x, x, is_causal=True).device.type == "meta"
    cache = mha.KVCache()
    m(x, x, x, is_causal=True, cache=cache)
    step = m(x[:, :1], x[:, :1], x[:, :1], is_causal=True, cache=cache)
    assert step.shape == (2, 1, E) and step.device.type == "meta" and cache.size == 4


# -- the KV cache and the band ------------------------------------------------------------------------------------


def _by_hand(m, x_q, x_kv, allowed):
    """The module's formula written out: projections, heads, softmax over the keys ``allowed`` (L, S)
    (True = visible), out-projection. No positional terms other than the mask."""
    B, L, S = x_q.shape[0], x_q.shape[1], x_kv.shape[1]
    q = (x_q @ m.q_proj.weight.T + m.q_proj.bias).view(B, L, m.h, m.dk).transpose(1, 2)
    k = (x_kv @ m.k_proj.weight.T + m.k_proj.bias).view(B, S, m.num_kv_heads, m.dk).transpose(1, 2)
    v = (x_kv @ m.v_proj.weight.T + m.v_proj.bias).view(B, S, m.num_kv_heads, m.dv).transpose(1, 2)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
    return o.transpose(1, 2).reshape(B, L, m.h * m.dv) @ m.out_proj.weight.T + m.out_proj.bias


def test_a_window_wider_than_the_sequence_leaves_nothing_to_apply():
    """A band that hides no key is dropped: torch's kernel takes the call (a (64, 64) band mask would
    be larger than q, k and v, which backend='sdpa' refuses)."""
    m = _module(window=(100, 100))
    x = torch.randn(1, 64, E, dtype=torch.float64)
    with torch.no_grad():
        out = m(x, x, x, backend="sdpa")
        want = _by_hand(m, x, x, torch.ones(64, 64, dtype=torch.bool))
    assert_close(out, want)


def test_a_decode_step_keeps_a_window_that_looks_ahead():
    """Non-causal window (1, 8): the new query at position 4 sees keys 3 and 4 only, although the
    window's right side reaches past every key (the band sits at the cache's offset)."""
    m = _module(window=(1, 8))
    x = torch.randn(2, 5, E, dtype=torch.float64)
    cache = mha.KVCache()
    with torch.no_grad():
        m(x[:, :4], x[:, :4], x[:, :4], cache=cache)
        step = m(x[:, 4:], x[:, 4:], x[:, 4:], cache=cache)
        i, j = torch.arange(5)[:, None], torch.arange(5)[None, :]
        want = _by_hand(m, x, x, (j - i >= -1) & (j - i <= 8))[:, 4:]
    assert_close(step, want)


def test_a_cache_refuses_new_tokens_of_another_length_or_batch():
    x = torch.randn(1, 3, E, dtype=torch.float64)
    m = _module()
    with torch.no_grad():
        message = "with a cache, query and key are the same new tokens: got lengths 3 and 2"
        with raises_exactly(ValueError, message):
            m(x, x[:, :2], x[:, :2], is_causal=True, cache=mha.KVCache())
        cache = mha.KVCache()
        m(x, x, x, is_causal=True, cache=cache)
        two = torch.randn(2, 1, E, dtype=torch.float64)
        message = ("the cache holds keys of shape (B, Hkv, S, D) = (1, 4, S, 4), got new keys of shape (2, 4, 1, 4): "
                   "a cache serves one module and one batch")
        with raises_exactly(ValueError, message):
            m(two, two, two, is_causal=True, cache=cache)
    assert cache.size == 3


# -- static keys and values (torch's multi_head_attention_forward) -----------------------------------------------


def _static_call(fn, static_k=None, static_v=None, dtype=torch.float64):
    """multi_head_attention_forward, B=2, H=2, E=8 (head_dim 4), L=3, S=5 (static tensors (B*H, S', 4))."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 2, 8, generator=g, dtype=dtype)
    kv = torch.randn(5, 2, 8, generator=g, dtype=dtype)
    w_in, b_in = torch.randn(24, 8, generator=g, dtype=dtype), torch.randn(24, generator=g, dtype=dtype)
    w_out, b_out = torch.randn(8, 8, generator=g, dtype=dtype), torch.randn(8, generator=g, dtype=dtype)
    return fn(q, kv, kv, 8, 2, w_in, b_in, None, None, False, 0.0, w_out, b_out, training=False,
              static_k=static_k, static_v=static_v, average_attn_weights=False)


@pytest.mark.parametrize("which", ["static_k", "static_v", "both"])
def test_static_keys_or_values_alone_equal_torch(which):
    g = torch.Generator().manual_seed(1)
    given = {name: torch.randn(4, 5, 4, generator=g, dtype=torch.float64) for name in ("static_k", "static_v")
             if which in (name, "both")}
    out, w = _static_call(mha.functional.multi_head_attention_forward, **given)
    want, want_w = _static_call(F.multi_head_attention_forward, **given)
    assert_close(out, want)
    assert_close(w, want_w)


@pytest.mark.parametrize("given, error, message", [
    (dict(static_k=torch.zeros(4, 5, 4, dtype=torch.long)), TypeError,
     "static_k must have a floating point dtype, got torch.int64"),
    (dict(static_v=torch.zeros(4, 5, 4, dtype=torch.long)), TypeError,
     "static_v must have a floating point dtype, got torch.int64"),
    (dict(static_k=torch.zeros(4, 5, 4)), TypeError,
     "static_k has dtype torch.float32 but query has dtype torch.float64; they must match (convert one with .to(dtype))"),
    (dict(static_v=torch.zeros(4, 5, 4)), TypeError,
     "static_v has dtype torch.float32 but query has dtype torch.float64; they must match (convert one with .to(dtype))"),
    (dict(static_k=torch.zeros(5, 4, dtype=torch.float64)), ValueError,
     "static_k must be 3-D (N*num_heads, S, head_dim), got 2-D with shape (5, 4)"),
    (dict(static_v=torch.zeros(5, 4, dtype=torch.float64)), ValueError,
     "static_v must be 3-D (N*num_heads, S, head_dim), got 2-D with shape (5, 4)"),
    (dict(static_v=torch.zeros(2, 5, 4, dtype=torch.float64)), ValueError,
     "static_v must have shape (4, S, 4) = (N*num_heads, S, head_dim), got (2, 5, 4)"),
    (dict(static_k=torch.zeros(4, 3, 4, dtype=torch.float64), static_v=torch.zeros(4, 6, 4, dtype=torch.float64)),
     ValueError, "keys and values must have the same length, got 3 and 6 (check static_k / static_v)"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_bad_static_keys_and_values_are_named(given, error, message):
    with raises_exactly(error, message):
        _static_call(mha.functional.multi_head_attention_forward, **given)
