"""BufferedCache: transformers' generate over layers that grow in buffers with room
(mha.kernels.storage.append) gives what DynamicCache gives, under mha's attention and torch's, and
writes each step into the same buffers; under autograd it concatenates as DynamicLayer does."""

import pytest
import torch

from helpers.tiny_decoders import TINY, left_padded_batch, tiny_model

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("mha.integrations.transformers")

from transformers.cache_utils import DynamicCache, DynamicLayer  # noqa: E402

from mha.kernels import storage  # noqa: E402

hf.register()


def _generate(model, ids, cache, attention_mask=None):
    out = model.generate(ids, attention_mask=attention_mask, past_key_values=cache, max_new_tokens=10, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits)


@pytest.mark.parametrize("implementation", ["mha", "eager"])
@pytest.mark.parametrize("kind", ["llama", "gpt_oss", "gemma2"])
def test_generate_over_a_buffered_cache_gives_the_dynamic_caches_tokens_and_logits(kind, implementation):
    """A left-padded batch (padding keys, sliding windows, sinks, softcap): the same tokens, logits within
    float32's rounding (the attention reads the keys as views of the buffers, strided along the heads)."""
    model = tiny_model(kind)
    with torch.no_grad():
        for layer in model.model.layers:  # sharpened: attention decides the logits
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.o_proj.weight.mul_(8.0)
    model.set_attn_implementation(implementation)
    ids, attention_mask = left_padded_batch()
    tokens, logits = _generate(model, ids, hf.BufferedCache(), attention_mask)
    expected_tokens, expected = _generate(model, ids, DynamicCache(config=model.config), attention_mask)
    assert torch.equal(tokens, expected_tokens)
    assert (logits - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_each_step_writes_into_the_layers_buffers():
    model = tiny_model("llama")
    model.set_attn_implementation("mha")
    cache = hf.BufferedCache()
    ids = torch.randint(1, TINY["vocab_size"], (1, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
        buffers = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers]
        for token in range(1, 6):
            model(torch.tensor([[token]]), past_key_values=cache, use_cache=True)
    assert [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers] == buffers
    layer = cache.layers[0]
    assert layer.keys.shape == (1, TINY["num_key_value_heads"], 12, TINY["head_dim"])
    assert layer.keys.stride(1) == storage.capacity(7) * TINY["head_dim"]  # 12 slots in the prompt's 14


def test_under_autograd_a_layer_concatenates_and_gradients_flow_as_through_a_dynamic_layer():
    torch.manual_seed(4)
    k0, v0, k1, v1 = (torch.randn(1, 2, n, 8, requires_grad=True) for n in (3, 3, 1, 1))
    grads = []
    for layer in (hf.BufferedLayer(), DynamicLayer()):
        first = layer.update(k0, v0)[0].square().sum()  # (saves the first keys: an in-place step would break it)
        keys, values = layer.update(k1, v1)
        (first + keys.square().sum() + 3 * values.sum()).backward()
        grads.append([x.grad.clone() for x in (k0, v0, k1, v1)])
        for x in (k0, v0, k1, v1):
            x.grad = None
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    with torch.no_grad():  # and without gradients, the buffers again
        layer = hf.BufferedLayer()
        layer.update(k0, v0)
        assert layer.keys.stride(1) == storage.capacity(3) * 8


def test_gradients_of_the_queries_alone_flow_through_a_layers_steps():
    """Grad enabled, only the queries requiring it (a LoRA on q_proj): attention saves the keys it read,
    so the next update must not write into them (it concatenates)."""
    torch.manual_seed(7)
    q = torch.randn(1, 2, 1, 8, requires_grad=True)
    layer = hf.BufferedLayer()
    keys, values = layer.update(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8))
    first = torch.nn.functional.scaled_dot_product_attention(q, keys, values)
    keys, values = layer.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8))
    (first.sum() + torch.nn.functional.scaled_dot_product_attention(q, keys, values).sum()).backward()
    assert q.grad is not None and q.grad.isfinite().all()


def test_a_reset_layer_lets_its_buffers_go():
    layer = hf.BufferedLayer()
    with torch.no_grad():
        layer.update(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8))
        assert layer.rooms[0].buffer is not None
        layer.reset()
        assert layer.rooms[0].buffer is None and not layer.is_initialized


def test_new_states_that_do_not_follow_the_layers_are_refused_by_name():
    layer = hf.BufferedLayer()
    with torch.no_grad():
        layer.update(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8))
        with pytest.raises(ValueError, match=r"new rows \(1, 3, 1, 8\) torch.float32 on cpu do not follow the kept"):
            layer.update(torch.zeros(1, 3, 1, 8), torch.zeros(1, 3, 1, 8))
