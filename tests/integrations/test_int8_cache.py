"""Int8Cache: transformers' generate with 8-bit keys and values read in place by mha's attention,
against the same model attending over the keys and values dequantized (the reference), and bad
input refused."""

import pytest
import torch

from helpers.exact import raises_exactly
from helpers.tiny_decoders import TINY, left_padded_batch, tiny_model

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("mha.integrations.transformers")

from transformers.cache_utils import Cache, DynamicLayer  # noqa: E402

from mha.kernels import storage  # noqa: E402
from mha.kernels.quantize import dequantize, quantize_int8  # noqa: E402

hf.register()

NEW_TOKENS = 12


class DequantizedLayer(DynamicLayer):
    """The reference: keys and values rounded to int8 and back, kept in float, attended as usual."""

    def update(self, key_states, value_states, *args, **kwargs):
        return super().update(dequantize(*quantize_int8(key_states), key_states.dtype),
                              dequantize(*quantize_int8(value_states), value_states.dtype))


def sharpened(kind: str):
    """A tiny model whose attention decides its logits: q and k sharpened, the output projection amplified."""
    model = tiny_model(kind)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
            layer.self_attn.o_proj.weight.mul_(8.0)
    model.set_attn_implementation("mha")
    return model


def generate(model, ids, cache):
    out = model.generate(ids, past_key_values=cache, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits)  # (steps, B, vocab)


@pytest.mark.parametrize("kind", ["llama", "gpt_oss", "gemma2"])
def test_generate_over_int8_keys_equals_attention_over_them_dequantized(kind):
    model = sharpened(kind)
    torch.manual_seed(2)
    ids = torch.randint(1, TINY["vocab_size"], (2, 9))  # two prompts of one length: past the sliding window of 6
    cache = hf.Int8Cache()
    tokens, logits = generate(model, ids, cache)
    expected_tokens, expected = generate(model, ids, Cache(layer_class_to_replicate=DequantizedLayer))
    _, exact = generate(model, ids, None)  # transformers' float cache
    assert torch.equal(tokens, expected_tokens)
    error = (logits - expected).abs().max() / expected.abs().max()
    assert error < 1e-5
    # the int8 rounding itself moves the logits far more than the kernel's rounding: the comparison above
    # would see a dropped scale or a misplaced key
    assert (exact - expected).abs().max() / expected.abs().max() > 100 * error
    for layer in cache.layers:  # int8 rows of head_dim values and their float32 scales, one tensor
        assert layer.keys.dtype == torch.int8 and layer.keys.shape[-2:] == (9 + NEW_TOKENS - 1, TINY["head_dim"] + 4)


def test_the_cache_stores_about_half_a_bfloat16_cache():
    model = sharpened("llama")
    cache = hf.Int8Cache()
    generate(model, torch.randint(1, TINY["vocab_size"], (1, 5)), cache)
    layer = cache.layers[0]
    D = TINY["head_dim"]
    assert layer.keys.numel() + layer.values.numel() == 2 * layer.keys.shape[2] * TINY["num_key_value_heads"] * (D + 4)


def test_decoding_steps_write_into_the_layers_buffers_not_a_copy_of_the_cache():
    """Each step's rows go into the buffers the prompt's update made (DynamicLayer concatenated the
    whole cache every step): the same buffers while the prompt's has room (storage.capacity), the same rows
    as a concatenation, and the buffers' bytes at most twice the filled slots'; after a
    crop, the next update copies into new buffers."""
    torch.manual_seed(4)
    with torch.no_grad():  # (generate's: under autograd a layer concatenates)
        layer, joined = hf.Int8Layer(), None
        for step in range(10):  # 9 + 9 slots: the prompt's buffer of storage.capacity(9) = 18
            k, v = torch.randn(1, 2, 9 if step == 0 else 1, 16), torch.randn(1, 2, 9 if step == 0 else 1, 8)
            keys, values = layer.update(k, v)
            joined = [storage.store(x, True) if joined is None else torch.cat([joined[i], storage.store(x, True)], dim=2)
                      for i, x in enumerate((k, v))]
            assert torch.equal(keys, joined[0]) and torch.equal(values, joined[1])
            if step == 0:
                buffers = keys.data_ptr(), values.data_ptr()
            assert (keys.data_ptr(), values.data_ptr()) == buffers
        for kept in (layer.keys, layer.values):
            assert kept.untyped_storage().nbytes() <= 2 * kept.numel()
        layer.crop(-3)  # a crop is copied once at the next update (views of the slots it dropped may live on)
        keys, _ = layer.update(torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 8))
        assert keys.shape[2] == 16 and keys.data_ptr() != buffers[0] and torch.equal(keys[:, :, :15], joined[0][:, :, :15])


def test_a_cache_cropped_and_reordered_keeps_rows_and_scales_together():
    torch.manual_seed(3)
    layer = hf.Int8Layer()
    k, v = torch.randn(2, 2, 7, 16), torch.randn(2, 2, 7, 8)
    layer.update(k, v)
    layer.crop(-2)
    layer.batch_select_indices(torch.tensor([1]))
    rows, scales = storage.split(layer.keys)
    assert torch.equal(dequantize(rows, scales, torch.float32), dequantize(*quantize_int8(k[1:, :, :5]), torch.float32))
    rows, scales = storage.split(layer.values)
    assert rows.shape == (1, 2, 5, 8)
    k2, v2 = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 8)  # and the selected batch grows from there
    keys, _ = layer.update(k2, v2)
    assert torch.equal(keys, torch.cat([storage.store(k[1:, :, :5], True), storage.store(k2, True)], dim=2))


def test_refusals_name_what_is_wrong():
    model = sharpened("llama")
    ids, attention_mask = left_padded_batch()
    with pytest.raises(ValueError, match="padding keys"):
        model.generate(ids, attention_mask=attention_mask, past_key_values=hf.Int8Cache(), max_new_tokens=2,
                       do_sample=False)
    q = torch.randn(1, 4, 1, 16)
    k8 = torch.zeros(1, 2, 3, 20, dtype=torch.int8)
    module = model.model.layers[0].self_attn
    with raises_exactly(TypeError, "key is int8 (an Int8Cache's) but value is torch.float32: both come from the same cache"):
        hf.attention_forward(module, q, k8, torch.zeros(1, 2, 3, 16), None)
    with pytest.raises(ValueError, match=r"an Int8Cache keeps \(batch, kv heads, length, head_dim \+ 4\)"):
        hf.attention_forward(module, q, k8[..., :3], k8[..., :3], None)
    with pytest.raises(ValueError, match="no output_attentions"):
        hf.attention_forward(module, q, k8, k8, None, output_attentions=True)
    with pytest.raises(TypeError, match="key_states"):
        hf.Int8Layer().update(torch.zeros(1, 2, 3, 4, dtype=torch.int64), torch.zeros(1, 2, 3, 4))


@pytest.mark.parametrize(("D", "Dv"), [(1, 1), (6, 5), (17, 16), (64, 63)])
@pytest.mark.parametrize(("L", "S"), [(1, 1), (1, 9), (3, 17)])
def test_attention_over_the_layer_equals_attention_over_its_rows_dequantized(D, Dv, L, S):
    """Head dims whose scale bytes fall off a float's alignment (D + 4 not a multiple of 4: the scales
    are copied out) and ones that do (read as a view), decoding and prefill rows bottom-right, GQA 2,
    against math attention over the int8 rows turned back into floats."""
    from types import SimpleNamespace

    from mha.kernels import math_attention
    from mha.kernels.contract import Contract
    from mha.positions import CAUSAL

    torch.manual_seed(D * 100 + S)
    layer = hf.Int8Layer()
    k, v = torch.randn(2, 2, S, D).transpose(2, 3).contiguous().transpose(2, 3), torch.randn(2, 2, S, Dv)  # k strided
    keys, values = layer.update(k, v)
    q = torch.randn(2, 4, L, D)
    module = SimpleNamespace(training=False, is_causal=True)
    with torch.no_grad():
        out, weights = hf.attention_forward(module, q, keys, values, None)
        kd, vd = (dequantize(*quantize_int8(x), torch.float64).repeat_interleave(2, 1) for x in (k, v))
        exact, _ = math_attention(q.double(), kd, vd, Contract(band=CAUSAL if L > 1 else None, offset=S - L))
    assert weights is None and out.shape == (2, L, 4, Dv)
    assert (out.transpose(1, 2).double() - exact).abs().max() < 1e-5
