"""mha.nn.TransformerEncoderLayer / TransformerDecoderLayer against torch's, and the NumPy block."""

import itertools

import numpy as np
import pytest
import torch

import mha
from helpers.exact import raises_exactly
from helpers.tolerance import assert_close
from mha import numpy as oracle

D, H, FF = 12, 3, 20
VARIANTS = list(itertools.product([False, True], ["relu", "gelu", torch.nn.functional.silu], [True, False]))


def _pair(cls_torch, cls_ours, **options):
    torch.manual_seed(0)
    theirs = cls_torch(D, H, FF, **options)
    torch.manual_seed(0)
    ours = cls_ours(D, H, FF, **options)
    return theirs, ours


def _masks(T, N):
    causal = torch.nn.Transformer.generate_square_subsequent_mask(T)
    padding = torch.zeros(N, T, dtype=torch.bool)
    padding[1, -2:] = True
    return causal, padding


@pytest.mark.parametrize("norm_first, activation, bias", VARIANTS,
                         ids=lambda x: getattr(x, "__name__", str(x)))  # a function by name, not its address
@pytest.mark.parametrize("training", [True, False])
def test_encoder_layer_equals_torch(norm_first, activation, bias, training):
    theirs, ours = _pair(torch.nn.TransformerEncoderLayer, mha.nn.TransformerEncoderLayer, dropout=0.0,
                         activation=activation, norm_first=norm_first, bias=bias, batch_first=True)
    assert list(theirs.state_dict()) == list(ours.state_dict())
    for a, b in zip(theirs.state_dict().values(), ours.state_dict().values()):
        assert torch.equal(a, b)  # same seed, same initial values
    theirs.train(training)
    ours.train(training)
    x = torch.randn(2, 5, D, requires_grad=True)
    causal, padding = _masks(5, 2)
    with torch.no_grad():
        want = theirs(x, src_mask=causal, src_key_padding_mask=padding)
    got = ours(x, src_mask=causal, src_key_padding_mask=padding)
    torch.testing.assert_close(got, want, equal_nan=True)
    _assert_same_gradients(theirs, ours, (x,), lambda layer, x: layer(x, src_mask=causal, src_key_padding_mask=padding))
    torch.testing.assert_close(ours(x, is_causal=True), theirs(x, src_mask=causal, is_causal=True))


def _assert_same_gradients(theirs, ours, inputs, call):
    """The gradients of every input and parameter equal torch's for the same upstream gradient
    (rows torch leaves NaN, every key padded, are compared where torch is finite)."""
    g = torch.Generator().manual_seed(1)
    results = []
    for layer in (theirs, ours):
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        out = call(layer, *leaves)
        upstream = torch.randn(out.shape, generator=g.manual_seed(1))
        params = list(layer.parameters())
        results.append(torch.autograd.grad((out.nan_to_num() * upstream).sum(), leaves + params, allow_unused=True))
    for want, got in zip(*results):
        assert got is not None and want is not None
        finite = want.isfinite()
        torch.testing.assert_close(got[finite], want[finite])


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("training", [True, False])
def test_decoder_layer_equals_torch(norm_first, training):
    theirs, ours = _pair(torch.nn.TransformerDecoderLayer, mha.nn.TransformerDecoderLayer, dropout=0.0,
                         norm_first=norm_first, activation="gelu")
    assert list(theirs.state_dict()) == list(ours.state_dict())
    theirs.train(training)
    ours.train(training)
    tgt, memory = torch.randn(4, 2, D), torch.randn(6, 2, D)
    causal, _ = _masks(4, 2)
    memory_padding = torch.zeros(2, 6, dtype=torch.bool)
    memory_padding[0, -1] = True
    kwargs = dict(tgt_mask=causal, memory_key_padding_mask=memory_padding)
    torch.testing.assert_close(ours(tgt, memory, **kwargs), theirs(tgt, memory, **kwargs))
    torch.testing.assert_close(ours(tgt, memory, tgt_is_causal=True, memory_key_padding_mask=memory_padding),
                               theirs(tgt, memory, **kwargs, tgt_is_causal=True))
    _assert_same_gradients(theirs, ours, (tgt, memory), lambda layer, tgt, memory: layer(tgt, memory, **kwargs))


def test_layers_load_torch_state_dicts_and_stack_in_torch_containers():
    torch.manual_seed(1)
    theirs = torch.nn.TransformerEncoderLayer(D, H, FF, dropout=0.0, batch_first=True).eval()
    ours = mha.nn.TransformerEncoderLayer(D, H, FF, dropout=0.0, batch_first=True).eval()
    ours.load_state_dict(theirs.state_dict())
    encoder = torch.nn.TransformerEncoder(ours, num_layers=2, enable_nested_tensor=False)
    reference = torch.nn.TransformerEncoder(theirs, num_layers=2, enable_nested_tensor=False)
    x = torch.randn(2, 5, D)
    with torch.no_grad():
        torch.testing.assert_close(encoder(x), reference(x))


def test_unknown_activation_is_a_clear_error():
    with pytest.raises(ValueError, match="activation"):
        mha.nn.TransformerEncoderLayer(D, H, activation="swish")
    with pytest.raises(TypeError, match="activation"):
        mha.nn.TransformerDecoderLayer(D, H, activation=3)


@pytest.mark.parametrize("norm_first, activation", [(False, "relu"), (True, "gelu")])
@pytest.mark.parametrize("batch_first", [True, False])
def test_numpy_encoder_block_equals_torch_layer(norm_first, activation, batch_first):
    torch.manual_seed(2)
    layer = torch.nn.TransformerEncoderLayer(D, H, FF, dropout=0.0, activation=activation,
                                             norm_first=norm_first, batch_first=batch_first,
                                             dtype=torch.float64).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.1 * torch.randn_like(p))  # non-trivial norms and biases
    x = torch.randn((2, 5, D) if batch_first else (5, 2, D), dtype=torch.float64)
    causal, padding = _masks(5, 2)
    with torch.no_grad():
        want = layer(x, src_mask=causal, src_key_padding_mask=padding)
    params = {k: v.numpy() for k, v in layer.state_dict().items()}
    got = oracle.transformer_encoder_layer(x.numpy(), params, H, src_mask=causal.numpy(),
                                           src_key_padding_mask=padding.numpy(), norm_first=norm_first,
                                           activation=activation, batch_first=batch_first)
    assert_close(got, want.numpy())


def test_numpy_layer_norm_and_gelu():
    x = np.random.default_rng(0).normal(size=(3, 7))
    t = torch.from_numpy(x)
    assert_close(oracle.layer_norm(x), torch.nn.functional.layer_norm(t, (7,)).numpy())
    assert_close(oracle.gelu(x), torch.nn.functional.gelu(t).numpy())


@pytest.mark.parametrize("activation, code", [("relu", 1), ("gelu", 2), (torch.nn.GELU(), 2), (torch.tanh, 0)])
def test_encoder_records_activation_kind_like_torch(activation, code):
    assert mha.nn.TransformerEncoderLayer(D, H, activation=activation).activation_relu_or_gelu == code
    assert torch.nn.TransformerEncoderLayer(D, H, activation=activation).activation_relu_or_gelu == code


@pytest.mark.parametrize("cls", [mha.nn.TransformerEncoderLayer, mha.nn.TransformerDecoderLayer])
@pytest.mark.parametrize("args, kwargs, error, message", [
    ((0, H), {}, ValueError, "d_model must be greater than 0, got 0"),
    ((D, 0), {}, ValueError, "nhead must be greater than 0, got 0"),
    ((D, H), dict(dim_feedforward=-1), ValueError, "dim_feedforward must be greater than 0, got -1"),
    ((D, H), dict(layer_norm_eps="x"), ValueError, "layer_norm_eps must be a non-negative float, got 'x'"),
    ((D, H), dict(dropout=2.0), ValueError, "dropout must be in [0, 1], got 2.0"),
    ((D, H), dict(activation=3), TypeError, "activation must be 'relu', 'gelu' or a callable, got int"),
    ((D, H), dict(activation="swish"), ValueError, "activation must be 'relu', 'gelu' or a callable, got 'swish'"),
])
def test_layer_constructor_errors(cls, args, kwargs, error, message):

    with raises_exactly(error, message):
        cls(*args, **kwargs)


def test_numpy_block_unknown_activation():
    with pytest.raises(ValueError, match="activation"):
        oracle.transformer_encoder_layer(np.zeros((2, D)), {}, H, activation="tanh")


LAYERS = [(torch.nn.TransformerEncoderLayer, mha.nn.TransformerEncoderLayer),
          (torch.nn.TransformerDecoderLayer, mha.nn.TransformerDecoderLayer)]


@pytest.mark.parametrize("theirs, ours", LAYERS, ids=["encoder", "decoder"])
def test_layer_signatures_and_submodules_equal_torch(theirs, ours):
    """The same defaults (constructor and forward), and every option reaches the submodule torch
    gives it: dropout, layer_norm_eps, bias, batch_first, dtype."""
    import inspect

    for method in ("__init__", "forward"):
        want = {n: p.default for n, p in inspect.signature(getattr(theirs, method)).parameters.items()}
        got = {n: p.default for n, p in inspect.signature(getattr(ours, method)).parameters.items()}
        assert got == want
    options = dict(dropout=0.3, layer_norm_eps=1e-3, bias=False, batch_first=True, dtype=torch.float64)
    t, o = theirs(D, H, FF, **options), ours(D, H, FF, **options)
    described = lambda m: {name: (type(sub).__name__, getattr(sub, "p", None), getattr(sub, "eps", None),  # noqa: E731
                                  getattr(sub, "batch_first", None), getattr(sub, "dropout", None))
                           for name, sub in m.named_modules() if name}
    assert described(o) == described(t)
    assert {p.dtype for p in o.parameters()} == {torch.float64}
    assert [(n, p.shape) for n, p in o.named_parameters()] == [(n, p.shape) for n, p in t.named_parameters()]
    theirs(D, H, layer_norm_eps=0.0), ours(D, H, layer_norm_eps=0.0)  # torch accepts eps = 0


@pytest.mark.parametrize("memory_is_causal", [False, True])
def test_decoder_layer_honours_every_mask(memory_is_causal):
    theirs, ours = _pair(torch.nn.TransformerDecoderLayer, mha.nn.TransformerDecoderLayer, dropout=0.0,
                         batch_first=True)
    tgt, memory = torch.randn(2, 5, D), torch.randn(2, 5, D)
    causal, tgt_padding = _masks(5, 2)
    memory_mask = torch.randn(5, 5)
    memory_padding = torch.zeros(2, 5, dtype=torch.bool)
    memory_padding[0, 0] = True
    if memory_is_causal:  # torch takes the mask as given; is_causal is a hint that it is causal
        memory_mask = causal
    kwargs = dict(tgt_mask=causal, memory_mask=memory_mask, tgt_key_padding_mask=tgt_padding,
                  memory_key_padding_mask=memory_padding)
    with torch.no_grad():
        want = theirs(tgt, memory, **kwargs, tgt_is_causal=True, memory_is_causal=memory_is_causal)
        got = ours(tgt, memory, **kwargs, tgt_is_causal=True, memory_is_causal=memory_is_causal)
    torch.testing.assert_close(got, want)
    if memory_is_causal:  # ours honours the flag alone
        torch.testing.assert_close(ours(tgt, memory, tgt_mask=causal, tgt_key_padding_mask=tgt_padding,
                                        memory_key_padding_mask=memory_padding, tgt_is_causal=True,
                                        memory_is_causal=True), want)


@pytest.mark.parametrize("training", [False, True])
def test_layers_never_compute_attention_weights(monkeypatch, training):
    from mha import kernels

    def refuse(*args, **kwargs):
        raise AssertionError("a layer computed attention weights it never returns")

    monkeypatch.setitem(kernels.BACKENDS, "math", refuse)
    x = torch.randn(2, 5, D)
    encoder = mha.nn.TransformerEncoderLayer(D, H, FF, batch_first=True).train(training)
    decoder = mha.nn.TransformerDecoderLayer(D, H, FF, batch_first=True).train(training)
    causal, padding = _masks(5, 2)
    encoder(x, src_mask=causal, src_key_padding_mask=padding)
    decoder(x, x, tgt_mask=causal, memory_key_padding_mask=padding)


def test_numpy_encoder_block_defaults_and_options_equal_torch():
    """The oracle's defaults are torch's layer's; is_causal, a callable activation and
    layer_norm_eps reach the computation."""
    import inspect

    defaults = {n: p.default for n, p in inspect.signature(oracle.transformer_encoder_layer).parameters.items()
                if p.default is not inspect.Parameter.empty}
    torch_defaults = {**{n: p.default for n, p in inspect.signature(torch.nn.TransformerEncoderLayer).parameters.items()},
                      **{n: p.default for n, p in inspect.signature(torch.nn.TransformerEncoderLayer.forward).parameters.items()}}
    assert defaults.pop("activation") == "relu" and torch_defaults["activation"] is torch.nn.functional.relu
    assert all(torch_defaults[n] == value for n, value in defaults.items()), defaults
    torch.manual_seed(3)
    layer = torch.nn.TransformerEncoderLayer(D, H, FF, dropout=0.0, activation=torch.tanh, layer_norm_eps=0.5,
                                             dtype=torch.float64).eval()
    x = torch.randn(5, 2, D, dtype=torch.float64)
    causal, _ = _masks(5, 2)
    with torch.no_grad():
        want = layer(x, src_mask=causal.double(), is_causal=True)
    params = {k: v.numpy() for k, v in layer.state_dict().items()}
    got = oracle.transformer_encoder_layer(x.numpy(), params, H, is_causal=True, activation=np.tanh, layer_norm_eps=0.5)
    assert_close(got, want.numpy())
    assert oracle.gelu(np.ones(3, dtype=np.float32)).dtype == np.float32
