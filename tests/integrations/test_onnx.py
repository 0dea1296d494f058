"""torch.onnx.export(dynamo=True) of the drop-ins and the general module: onnxruntime gives eager's
numbers within 1e-5, on the example's shapes and, where exported with dynamic batch and length, on
others."""

import warnings

import pytest
import torch

import mha
from helpers.tolerance import assert_close

pytest.importorskip("onnxscript")
pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

E, H = 32, 4


class Call(torch.nn.Module):
    """One call of an attention module on (x, key_padding_mask), as the exported graph."""

    def __init__(self, module, call):
        super().__init__()
        self.module, self.call = module.eval(), call

    def forward(self, x, padding):
        return self.call(self.module, x, padding)


def inputs(B, T):
    x = torch.randn(B, T, E)
    padding = torch.zeros(B, T, dtype=torch.bool)  # True = padding (torch's key_padding_mask)
    padding[0, T - 2:] = True
    return x, padding


def causal_mask(T):
    return torch.nn.Transformer.generate_square_subsequent_mask(T)


def cases():
    torch.manual_seed(0)
    dropin = mha.nn.MultiheadAttention(E, H, batch_first=True)
    general = mha.GeneralAttention(E, E, E, 8, 8, E, H)
    positional = mha.GeneralAttention(E, E, E, 8, 8, E, H, num_kv_heads=2, rope=mha.RotaryEmbedding(8),
                                        window=(3, 0))
    encoder = mha.nn.TransformerEncoderLayer(E, H, 64, dropout=0.0, batch_first=True)
    return {  # name: (module, call, exported with dynamic batch and length)
        "drop-in, default call (weights too)": (dropin, lambda m, x, p: m(x, x, x), True),
        "drop-in, key padding": (dropin, lambda m, x, p: m(x, x, x, key_padding_mask=p, need_weights=False)[0],
                                 True),
        "drop-in, causal": (dropin, lambda m, x, p: m(x, x, x, attn_mask=causal_mask(x.shape[1]), is_causal=True,
                                                      need_weights=False)[0], False),
        "general, causal": (general, lambda m, x, p: m(x, x, x, is_causal=True), True),
        "general, key padding": (general, lambda m, x, p: m(x, x, x, key_padding_mask=p), True),
        "general, GQA + RoPE + window": (positional, lambda m, x, p: m(x, x, x, is_causal=True), False),
        "encoder layer, key padding": (encoder, lambda m, x, p: m(x, src_key_padding_mask=p), True),
    }


CASES = cases()
FAST = "drop-in, causal"


# one export in the fast set (the quickest), the others slow (each takes about a second)
@pytest.mark.parametrize("name", [name if name == FAST else pytest.param(name, marks=pytest.mark.slow) for name in CASES])
def test_exported_graph_in_onnxruntime_equals_eager(name):
    module, call, dynamic = CASES[name]
    model = Call(module, call)
    example = inputs(2, 7)
    shapes = None
    if dynamic:
        batch, length = torch.export.Dim("batch"), torch.export.Dim("length")
        shapes = {"x": {0: batch, 1: length}, "padding": {0: batch, 1: length}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(model, example, dynamo=True, dynamic_shapes=shapes, verbose=False)
    session = ort.InferenceSession(program.model_proto.SerializeToString())
    for x, padding in [example, inputs(3, 11)] if dynamic else [example]:
        feeds = {i.name: a.numpy() for i, a in zip(session.get_inputs(), (x, padding), strict=True)}
        got = session.run(None, feeds)
        with torch.no_grad():
            expected = model(x, padding)
        expected = [e for e in (expected if isinstance(expected, tuple) else (expected,)) if e is not None]
        assert len(got) == len(expected)
        for mine, theirs in zip(got, expected):
            assert_close(torch.from_numpy(mine), theirs, chain=True)
