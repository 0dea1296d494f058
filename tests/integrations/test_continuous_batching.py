"""transformers' continuous batching (generate_batch) on mha's attention: greedy tokens equal plain
generate's, prompt by prompt, on tiny Llama, Qwen3, Gemma-2 (softcap, sliding + full layers) and
GPT-OSS (sinks, sliding) models whose attention decides the tokens (q/k sharpened, the output
projection amplified, the MLPs silenced): dropping a term changes the tokens, and a test here
shows it."""

import logging
import sys
import warnings

import pytest
import torch

import mha

transformers = pytest.importorskip("transformers")
mt = pytest.importorskip("mha.integrations.transformers")

from transformers import GenerationConfig  # noqa: E402
from transformers import modeling_flash_attention_utils as flash_utils  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402

logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
GREEDY = dict(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
SMALL_CACHE = dict(num_blocks=16, max_batch_tokens=128, page_size=16)  # tokens of the 4 prompts and their answers


def _model(kind: str, **overrides):
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=300, max_position_embeddings=256)
    if kind == "llama":
        config = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    elif kind == "qwen3":
        config = transformers.Qwen3Config(**common, head_dim=16)
        cls = transformers.Qwen3ForCausalLM
    elif kind == "gemma2":
        config = transformers.Gemma2Config(**common, head_dim=16, attn_logit_softcapping=2.0, final_logit_softcapping=None,
                                           sliding_window=8, query_pre_attn_scalar=16)
        cls = transformers.Gemma2ForCausalLM
    else:
        config = transformers.GptOssConfig(**{**common, "intermediate_size": 64}, head_dim=16, num_local_experts=2,
                                           num_experts_per_tok=1, sliding_window=8)
        cls = transformers.GptOssForCausalLM
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = cls(config).eval()
    model.generation_config.eos_token_id = None  # every answer runs its 8 tokens, as in continuous batching
    with torch.no_grad():  # attention decides the next token
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(6)
            layer.self_attn.k_proj.weight.mul_(6)
            layer.self_attn.o_proj.weight.mul_(8)
            if hasattr(layer.self_attn, "sinks"):
                layer.self_attn.sinks.normal_(0, 2)
            if hasattr(layer.mlp, "down_proj"):
                layer.mlp.down_proj.weight.zero_()
    return model


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 300, (n,), generator=g).tolist() for n in (5, 17, 33, 9)]


def _generate(model, prompts):
    config = GenerationConfig(**GREEDY)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [model.generate(torch.tensor([p]), generation_config=config)[0, len(p):].tolist() for p in prompts]


def _generate_batch(model, prompts):
    with warnings.catch_warnings(), mt.enable_continuous_batching(model):
        warnings.simplefilter("ignore")
        results = model.generate_batch(prompts, generation_config=GenerationConfig(**GREEDY),
                                       continuous_batching_config=ContinuousBatchingConfig(**SMALL_CACHE), warmup=False)
    return [results[f"req_{i}"].generated_tokens for i in range(len(prompts))]


@pytest.mark.slow  # 2-5 s each: continuous batching's manager thread
@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma2", "gpt-oss"])
def test_generate_batch_on_mha_gives_generates_tokens(kind):
    model = _model(kind)
    prompts = _prompts()
    assert _generate_batch(model, prompts) == _generate(model, prompts)
    assert model.config._attn_implementation != mt.CONTINUOUS_BATCHING_NAME  # undone after the block


def _plain_logprobs(model, prompt):
    """log p(token) of plain generate's greedy tokens, in float64 from its logits."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(torch.tensor([prompt]), **GREEDY, output_logits=True, return_dict_in_generate=True)
    chosen = out.sequences[0, len(prompt):]
    return [torch.log_softmax(step[0].double(), -1)[token].item() for step, token in zip(out.logits, chosen)]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_manager_logprobs_equal_plain_generate(kind):
    """init_continuous_batching's manager (requests added one by one, results read back) on mha: the
    tokens and their log-probabilities (continuous batching's return_logprobs) equal plain generate's."""
    model, prompts = _model(kind), _prompts()
    config = ContinuousBatchingConfig(**SMALL_CACHE, return_logprobs=True)
    with warnings.catch_warnings(), mt.enable_continuous_batching(model):
        warnings.simplefilter("ignore")
        manager = model.init_continuous_batching(generation_config=GenerationConfig(**GREEDY),
                                                 continuous_batching_config=config)
        manager.start()
        try:
            ids = [manager.add_request(p, max_new_tokens=GREEDY["max_new_tokens"]) for p in prompts]
            results = {}
            while len(results) < len(ids):
                result = manager.get_result(timeout=30)
                assert result is not None, "the manager stopped answering"
                if result.is_finished():
                    results[result.request_id] = result
        finally:
            manager.stop(block=True, timeout=30)
    for request, prompt in zip(ids, prompts):
        want = _plain_logprobs(model, prompt)
        assert results[request].generated_tokens == _generate(model, [prompt])[0]
        assert max(abs(a - b) for a, b in zip(results[request].logprobs, want)) < 2e-5


@pytest.mark.slow
def test_full_attention_cache_is_read_in_place(monkeypatch):
    """On a Llama (full attention only) the keys are read where transformers' cache holds them:
    its cache.update (which gathers every sequence's keys) is never called; on a Gemma-2, only its
    sliding layers call it (a ring the step may overwrite)."""
    from transformers.generation.continuous_batching import PagedAttentionCache

    calls = []
    real = PagedAttentionCache.update
    monkeypatch.setattr(PagedAttentionCache, "update",
                        lambda self, *a, **kw: calls.append(kw["layer_idx"]) or real(self, *a, **kw))
    model, prompts = _model("llama"), _prompts()
    assert _generate_batch(model, prompts) == _generate(model, prompts)
    assert calls == []
    model = _model("gemma2")
    _generate_batch(model, prompts)
    sliding = {i for i, kind in enumerate(model.config.layer_types) if kind == "sliding_attention"}
    assert calls and set(calls) == sliding


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "term", "drop"), [
    ("gemma2", "softcap", dict(attn_logit_softcapping=None)),
    ("gpt-oss", "sliding window", dict(sliding_window=10 ** 6)),
    ("gemma2", "sliding window", dict(sliding_window=10 ** 6)),
])
def test_the_terms_decide_the_tokens_here(kind, term, drop):
    """The models are ones where the term matters: without it, plain generate's tokens change (so
    the equality above would catch continuous batching dropping it, as transformers' paged|eager
    drops Gemma-2's softcap)."""
    prompts = _prompts()
    assert _generate(_model(kind), prompts) != _generate(_model(kind, **drop), prompts), term


@pytest.mark.slow
def test_dropping_a_term_in_our_attention_is_caught(monkeypatch):
    """The planted defect: continuous batching's attention without the softcap (or the sinks)."""
    real = mt.continuous_batching.attend_pages
    for kind, term in (("gemma2", "softcap"), ("gpt-oss", "sinks")):
        model, prompts = _model(kind), _prompts()
        want = _generate(model, prompts)
        monkeypatch.setattr(mt.continuous_batching, "attend_pages",
                            lambda *a, term=term, **kw: real(*a[:-1], a[-1].replace(**{term: None}), **kw))
        assert _generate_batch(model, prompts) != want, term
        monkeypatch.setattr(mt.continuous_batching, "attend_pages", real)


def test_enabling_is_explicit_and_undone():
    model = _model("gpt-oss")  # its class lists the flash implementations it accepts
    before = (model.config._attn_implementation, flash_utils._loaded_implementation)
    handle = mt.enable_continuous_batching(model)
    assert model.config._attn_implementation == mt.CONTINUOUS_BATCHING_NAME
    assert flash_utils._loaded_implementation == mt.CONTINUOUS_BATCHING_NAME
    assert mt.CONTINUOUS_BATCHING_NAME in model._compatible_flash_implementations
    handle.undo()
    assert (model.config._attn_implementation, flash_utils._loaded_implementation) == before
    assert mt.CONTINUOUS_BATCHING_NAME not in transformers.AttentionInterface._global_mapping
    assert mt.CONTINUOUS_BATCHING_NAME not in model._compatible_flash_implementations


def test_what_it_does_not_know_is_refused(monkeypatch):
    model = _model("llama")
    with pytest.raises(ValueError, match="name must be a str containing 'flash'"):
        mt.enable_continuous_batching(model, name="mha")
    with pytest.raises(TypeError, match="model must be a transformers PreTrainedModel"):
        mt.enable_continuous_batching(object())
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "6.0.0")  # (the module transformers imports as)
    with pytest.raises(RuntimeError, match="transformers 6.0.0 does not have or mha does not follow there "
                                           r"\(mha follows transformers 5.x"):
        mt.enable_continuous_batching(model)
    monkeypatch.undo()
    with mt.enable_continuous_batching(model), pytest.raises(ValueError, match="serves continuous batching"):
        model(torch.tensor([[1, 2, 3]]))  # a plain forward: no paged cache


class _Passthrough(__import__("transformers.generation.continuous_batching", fromlist=["x"]).PagedAttentionCache):
    """A paged cache that returns the step's keys as they are (each sequence's keys = its new tokens)."""

    def __init__(self):  # nothing to allocate
        pass

    def update(self, key_states, value_states, layer_idx, kwargs):
        return key_states, value_states


@pytest.mark.parametrize("sliding_window", [None, 1, 3, 4])
def test_one_step_equals_each_sequence_alone_with_every_term(sliding_window):
    """continuous_batching_forward on packed sequences of 5, 1 and 7 tokens equals
    scaled_dot_product_attention per sequence: flash-attn's sliding window (the last
    ``sliding_window`` keys, the query's own included: window (w - 1, 0)), softcap, sinks, GQA, scaling."""
    g = torch.Generator().manual_seed(0)
    lengths, H, Hkv, D = [5, 1, 7], 4, 2, 8
    q = torch.randn(1, H, sum(lengths), D, generator=g) * 3
    k, v = (torch.randn(1, Hkv, sum(lengths), D, generator=g) * 3 for _ in range(2))
    sinks = torch.randn(H, generator=g)
    cu = torch.tensor([0, 5, 6, 13])
    layer = torch.nn.Module()
    layer.layer_idx = 0
    out, _ = mt.continuous_batching_forward(layer, q, k, v, None, scaling=0.3, sliding_window=sliding_window,
                                            softcap=2.0, s_aux=sinks, cache=_Passthrough(), cu_seq_lens_q=cu,
                                            cu_seq_lens_k=cu)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        x = [t[..., a:b, :] for t in (q, k, v)]
        window = None if sliding_window is None else (sliding_window - 1, 0)
        alone = mha.functional.scaled_dot_product_attention(*x, is_causal=True, scale=0.3, enable_gqa=True,
                                                            window=window, softcap=2.0, sinks=sinks, backend="math")
        torch.testing.assert_close(out[0, a:b], alone[0].transpose(0, 1), atol=2e-5, rtol=1e-5)
