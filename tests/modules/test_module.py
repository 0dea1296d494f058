"""mha.nn.MultiheadAttention as a drop-in: parameters, state_dict, init, constructor errors, dropout."""

import copy
import io
import itertools
import warnings

import pytest
import torch

import mha

CONFIGS = [dict(bias=b, add_bias_kv=kv, add_zero_attn=z, kdim=kd, vdim=vd)
           for b, kv, z, (kd, vd) in itertools.product(
               [True, False], [False, True], [False, True], [(None, None), (5, 7), (12, None)])]


def _pair(seed=0, **options):
    torch.manual_seed(seed)
    theirs = torch.nn.MultiheadAttention(12, 3, **options)
    torch.manual_seed(seed)
    ours = mha.nn.MultiheadAttention(12, 3, **options)
    return theirs, ours


@pytest.mark.parametrize("options", CONFIGS, ids=str)
def test_state_dict_keys_shapes_and_seeded_init_equal_torch(options):
    theirs, ours = _pair(**options)
    t, o = theirs.state_dict(), ours.state_dict()
    assert list(t) == list(o)
    for name in t:
        assert t[name].shape == o[name].shape, name
        assert torch.equal(t[name], o[name]), f"{name}: same seed must give the same initial values"
    assert [n for n, _ in theirs.named_parameters()] == [n for n, _ in ours.named_parameters()]
    for attr in ("embed_dim", "kdim", "vdim", "num_heads", "head_dim", "dropout", "batch_first",
                 "_qkv_same_embed_dim", "add_zero_attn"):
        assert getattr(theirs, attr) == getattr(ours, attr), attr  # by value, not only presence
    for attr in ("in_proj_weight", "q_proj_weight", "bias_k"):
        assert (getattr(theirs, attr) is None) == (getattr(ours, attr) is None), attr


@pytest.mark.parametrize("options", CONFIGS, ids=str)
def test_load_state_dict_both_directions_gives_the_same_outputs(options):
    theirs, _ = _pair(seed=1, **options)
    _, ours = _pair(seed=2, **options)
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_()
    ours.load_state_dict(theirs.state_dict())
    back = torch.nn.MultiheadAttention(12, 3, **options)
    back.load_state_dict(ours.state_dict())
    q = torch.randn(4, 2, 12)
    k = torch.randn(6, 2, options["kdim"] or 12)
    v = torch.randn(6, 2, options["vdim"] or 12)
    want, want_w = theirs(q, k, v)
    got, got_w = ours(q, k, v)
    again, _ = back(q, k, v)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_w, want_w)
    torch.testing.assert_close(again, want)


def test_initialisation_distributions_match_torch():
    """Beyond equal seeded values: xavier_uniform_ bound on the packed weight, zero biases."""
    m = mha.nn.MultiheadAttention(64, 4, add_bias_kv=True)
    bound = (6 / (3 * 64 + 64)) ** 0.5
    assert m.in_proj_weight.abs().max() <= bound and m.in_proj_weight.abs().max() > 0.9 * bound
    assert torch.all(m.in_proj_bias == 0) and torch.all(m.out_proj.bias == 0)
    assert m.bias_k.std() > 0 and m.bias_v.std() > 0


@pytest.mark.parametrize("args", [(0, 2), (8, 0), (-4, 2), (10, 3)])
def test_constructor_errors_have_torch_types(args):
    """The type torch raises (AssertionError for divisibility), and always a ValueError."""
    with pytest.raises(Exception) as theirs:
        torch.nn.MultiheadAttention(*args)
    with pytest.raises(type(theirs.value)):
        mha.nn.MultiheadAttention(*args)
    with pytest.raises(ValueError, match="embed_dim"):
        mha.nn.MultiheadAttention(*args)


def test_constructor_rejects_bad_argument_types_and_values():
    with pytest.raises(TypeError, match="embed_dim"):
        mha.nn.MultiheadAttention(8.0, 2)
    with pytest.raises(ValueError, match="dropout"):
        mha.nn.MultiheadAttention(8, 2, dropout=1.5)
    with pytest.raises(ValueError, match="kdim"):
        mha.nn.MultiheadAttention(8, 2, kdim=0)
    with pytest.raises(ValueError, match="embed_dim=10 and num_heads=3"):
        mha.nn.MultiheadAttention(10, 3)


def test_device_and_dtype_arguments():
    m = mha.nn.MultiheadAttention(8, 2, dtype=torch.float64, device="cpu")
    assert all(p.dtype == torch.float64 for p in m.parameters())
    out, _ = m(*(torch.randn(3, 8, dtype=torch.float64),) * 3)
    assert out.dtype == torch.float64


@pytest.mark.parametrize("options", [dict(kdim=5, vdim=7, add_bias_kv=True), dict(add_bias_kv=True, bias=False)],
                         ids=str)
@pytest.mark.parametrize("factory", [dict(dtype=torch.float64), dict(device="meta"),
                                     dict(dtype=torch.float16, device="meta")], ids=str)
def test_every_parameter_takes_the_dtype_and_device_arguments_as_torch(options, factory):
    theirs = torch.nn.MultiheadAttention(12, 3, **options, **factory)
    ours = mha.nn.MultiheadAttention(12, 3, **options, **factory)
    want = [(name, p.shape, p.dtype, p.device) for name, p in theirs.named_parameters()]
    assert [(name, p.shape, p.dtype, p.device) for name, p in ours.named_parameters()] == want
    assert {p.dtype for p in ours.parameters()} == {factory.get("dtype", torch.float32)}


def test_one_head_of_width_one_matches_torch():
    """The smallest valid module: embed_dim=1, num_heads=1 (both > 0 is the only bound)."""
    torch.manual_seed(3)
    theirs = torch.nn.MultiheadAttention(1, 1)
    torch.manual_seed(3)
    ours = mha.nn.MultiheadAttention(1, 1)
    q, kv = torch.randn(4, 2, 1), torch.randn(5, 2, 1)
    want, want_w = theirs(q, kv, kv)
    got, got_w = ours(q, kv, kv)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_w, want_w)


def test_merge_masks_matches_torch():
    """torch's helper for its layers' fused path: (mask, type); both masks given: one (B, H, L, L)
    additive mask, -inf where torch's merged bool mask is True (masked out), else 0."""
    theirs, ours = _pair()
    B, L = 2, 4
    query = torch.randn(B, L, 12)
    attn = torch.rand(L, L, generator=torch.Generator().manual_seed(1)) < 0.3
    padding = torch.tensor([[False, False, True, False], [False, True, True, False]])
    assert ours.merge_masks(None, None, query) == theirs.merge_masks(None, None, query) == (None, None)
    mask, kind = ours.merge_masks(None, padding, query)
    assert kind == 1 and mask is padding
    for attn_mask in (attn, attn[None].expand(B * 3, L, L).clone()):  # (L, L) and (B*H, L, L)
        want, want_kind = theirs.merge_masks(attn_mask, padding, query)
        got, got_kind = ours.merge_masks(attn_mask, padding, query)
        assert got_kind == want_kind == 2 and got.shape == want.shape == (B, 3, L, L)
        assert torch.equal(got, torch.zeros(B, 3, L, L).masked_fill(want, float("-inf")))


def test_module_pickled_before_the_backend_setting_runs_on_auto():
    """A module unpickled from a version without ``backend`` runs as backend="auto"."""
    _, m = _pair()
    x = torch.randn(3, 2, 12)
    want, want_w = m(x, x, x)
    state = dict(m.__dict__)
    del state["backend"]
    old = mha.nn.MultiheadAttention.__new__(mha.nn.MultiheadAttention)
    old.__setstate__(state)
    got, got_w = old(x, x, x)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    torch.testing.assert_close(got_w, want_w, atol=0, rtol=0)


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("average", [True, False])
def test_weights_returned_while_capturing_are_torch_weights(batched, average):
    """Inside mha.capture_attention the module computes per-head weights; it still returns what
    the caller asked for, as torch would."""
    theirs, ours = _pair()
    x = torch.randn(4, 2, 12) if batched else torch.randn(4, 12)
    want, want_w = theirs(x, x, x, average_attn_weights=average)
    with mha.capture_attention(ours) as maps:
        got, got_w = ours(x, x, x, average_attn_weights=average)
        _, no_w = ours(x, x, x, need_weights=False)
    assert got_w.shape == want_w.shape and no_w is None
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_w, want_w)
    per_head = theirs(x, x, x, average_attn_weights=False)[1]
    torch.testing.assert_close(maps["MultiheadAttention"][0], per_head if batched else per_head[None])


def test_pickle_deepcopy_and_old_state():
    _, m = _pair()
    buffer = io.BytesIO()
    torch.save(m, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    x = torch.randn(3, 2, 12)
    torch.testing.assert_close(loaded(x, x, x)[0], m(x, x, x)[0])
    torch.testing.assert_close(copy.deepcopy(m)(x, x, x)[0], m(x, x, x)[0])
    state = dict(m.__dict__)
    del state["_qkv_same_embed_dim"]
    fresh = mha.nn.MultiheadAttention.__new__(mha.nn.MultiheadAttention)
    fresh.__setstate__(state)
    assert fresh._qkv_same_embed_dim is True


@pytest.mark.parametrize("batch_first, batched", [(False, True), (True, True), (False, False)])
@pytest.mark.parametrize("average", [True, False])
def test_return_shapes(batch_first, batched, average):
    m = mha.nn.MultiheadAttention(12, 3, batch_first=batch_first, kdim=5)
    N, L, S = 2, 4, 6
    shape = (lambda T, e: (N, T, e) if batch_first else (T, N, e)) if batched else (lambda T, e: (T, e))
    out, w = m(torch.randn(shape(L, 12)), torch.randn(shape(S, 5)), torch.randn(shape(S, 12)),
               average_attn_weights=average)
    assert out.shape == shape(L, 12)
    heads = () if average else (3,)
    assert w.shape == ((N,) if batched else ()) + heads + (L, S)
    assert m(torch.randn(shape(L, 12)), torch.randn(shape(S, 5)), torch.randn(shape(S, 12)),
             need_weights=False)[1] is None


def test_dropout_only_in_training_and_on_the_weights():
    torch.manual_seed(0)
    m = mha.nn.MultiheadAttention(16, 4, dropout=0.5)
    x = torch.randn(5, 2, 16)
    m.eval()
    a, wa = m(x, x, x, average_attn_weights=False)
    b, wb = m(x, x, x, average_attn_weights=False)
    assert torch.equal(a, b) and torch.allclose(wa.sum(-1), torch.ones(()))
    m.train()
    _, w = m(x, x, x, average_attn_weights=False)
    assert (w == 0).any(), "dropout zeroes weights in training"
    kept = w[w != 0]
    dense = wa[w != 0]
    torch.testing.assert_close(kept, dense * 2)  # survivors are scaled by 1 / (1 - p)


def test_dropout_draws_match_torch_with_the_same_seed():
    """Weights path: same op order and shapes as torch, so the same random draws. (Without
    weights, dropout runs tile by tile in flash: O(T) memory, other draws; see test_contract.)"""
    theirs, ours = _pair(dropout=0.3)
    theirs.train()
    ours.train()
    x = torch.randn(5, 2, 12)
    torch.manual_seed(11)
    want, want_w = theirs(x, x, x, need_weights=True)
    torch.manual_seed(11)
    got, got_w = ours(x, x, x, need_weights=True)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_w, want_w)


def test_same_outputs_in_train_and_eval_without_dropout():
    _, m = _pair(batch_first=True)
    x = torch.randn(2, 5, 12)
    with torch.no_grad():
        m.eval()
        a = m(x, x, x, need_weights=False)[0]
        m.train()
        b = m(x, x, x, need_weights=False)[0]
    torch.testing.assert_close(a, b)


def test_low_precision_inputs_run_and_stay_close():
    _, m = _pair()
    x = torch.randn(4, 2, 12)
    want, want_w = m(x, x, x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        half = copy.deepcopy(m).to(torch.bfloat16)
    got, got_w = half(*(x.to(torch.bfloat16),) * 3)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(got_w.float(), want_w, atol=2e-2, rtol=2e-2)


def test_pruned_and_parametrized_parameters_are_used():
    """The call path reads parameters from their dicts for speed; wrapped ones still take effect."""
    from torch.nn.utils import parametrize, prune

    torch.manual_seed(0)
    x = torch.randn(3, 2, 8)
    m = mha.nn.MultiheadAttention(8, 2, add_bias_kv=True).eval()
    reference = torch.nn.MultiheadAttention(8, 2, add_bias_kv=True).eval()
    reference.load_state_dict(m.state_dict())
    prune.l1_unstructured(m.out_proj, "weight", amount=0.5)
    prune.l1_unstructured(reference.out_proj, "weight", amount=0.5)

    class Double(torch.nn.Module):
        def forward(self, w):
            return 2 * w

    for module in (m, reference):
        parametrize.register_parametrization(module, "in_proj_weight", Double())
        parametrize.register_parametrization(module, "bias_k", Double())
    with torch.no_grad():
        torch.testing.assert_close(m(x, x, x)[0], reference(x, x, x)[0], atol=1e-6, rtol=1e-5)
    general = mha.GeneralAttention(8, 8, 8, 4, 4, 8, 2, sinks=True, rope=mha.RotaryEmbedding(4)).eval()
    with torch.no_grad():
        plain = general(x.transpose(0, 1), x.transpose(0, 1), x.transpose(0, 1))
        parametrize.register_parametrization(general, "sinks", Double())
        torch.nn.init.constant_(general.parametrizations.sinks.original, 3.0)  # sinks = 6 now
        assert not torch.allclose(general(x.transpose(0, 1), x.transpose(0, 1), x.transpose(0, 1)), plain)
