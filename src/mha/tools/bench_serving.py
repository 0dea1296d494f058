"""Tokens per second of many generations at once (transformers' continuous batching) on a small
Llama built from its config (hidden 512, 4 layers, 8 heads over 2 KV heads, vocab 8000, random
weights, greedy): generate_batch with mha's attention, with "sdpa" and with "paged|eager", and plain
generate one prompt at a time. Used by `mha bench --sections serving` (the hf extra)."""

from __future__ import annotations

import logging
import time
import warnings

import torch

__all__ = ["WORKLOADS", "generate_rates"]

# (prompts, shortest and longest prompt, new tokens per prompt)
WORKLOADS = {"16 x 64-512 x 32": (16, 64, 512, 32), "32 x 256-1536 x 64": (32, 256, 1536, 64),
             "64 x 256-2048 x 128": (64, 256, 2048, 128)}


def _model(dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=8000, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(dtype).eval()
    model.generation_config.eos_token_id = None  # every prompt generates all its tokens
    return model


def generate_rates(workload: str, dtype: torch.dtype, *, sequential: bool = True) -> dict[str, float]:
    """{way: generated tokens per second} for one workload of WORKLOADS."""
    from transformers import GenerationConfig

    count, shortest, longest, new = WORKLOADS[workload]
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(shortest, longest + 1, (count,), generator=g).tolist()
    prompts = [torch.randint(0, 8000, (n,), generator=g).tolist() for n in lengths]
    greedy = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    model, rates = _model(dtype), {}
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        warm = GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0)
        for way in ("mha", "sdpa", "paged|eager"):
            _batch(model, way, prompts[:2], warm)  # the first call's thread and allocations, untimed
            start = time.perf_counter()
            _batch(model, way, prompts, greedy)
            rates[f"generate_batch {way}"] = count * new / (time.perf_counter() - start)
        if sequential:
            model.set_attn_implementation("sdpa")
            model.generate(torch.tensor([prompts[0]]), generation_config=warm)
            start = time.perf_counter()
            for prompt in prompts:
                model.generate(torch.tensor([prompt]), generation_config=greedy)
            rates["generate, one at a time"] = count * new / (time.perf_counter() - start)
    return rates


def _batch(model, way: str, prompts, config, **options) -> None:
    """generate_batch with the attention ``way`` ("mha": mha's continuous batching, switched back after)."""
    from ..integrations import transformers as hf

    if way == "mha":
        with hf.enable_continuous_batching(model):
            model.generate_batch(prompts, generation_config=config, warmup=False, **options)
    else:
        model.set_attn_implementation(way)
        model.generate_batch(prompts, generation_config=config, warmup=False, **options)
