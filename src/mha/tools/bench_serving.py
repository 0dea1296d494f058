"""Tokens per second and peak memory of many generations at once (transformers' continuous
batching) on a small Llama built from its config (hidden 512, 4 layers, 8 heads over 2 KV heads,
vocab 8000, random weights, greedy): generate_batch with mha's attention, with "sdpa" and with
"paged|eager", and plain generate one prompt at a time. Used by `mha bench --sections serving`
(the hf extra); each way runs in a fresh process:

    python -m mha.tools.bench_serving WORKLOAD DTYPE WAY    prints {"tokens_per_s": ..., "peak_mib": ..., ...}

generate_batch's paged cache is sized to the workload (ContinuousBatchingConfig(num_blocks=...):
every prompt and its answer, in pages of 256 tokens), as a server sizes it. Left to its default on
a CPU, transformers sizes the cache from the machine's memory (most of it) and fills it with zeros
at every generate_batch: the way "mha, default cache" measures that.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
import warnings

import torch

from .bench_memory import peak_rss_mib

__all__ = ["WAYS", "WORKLOADS", "measure_way", "ways_of"]

# (prompts, shortest and longest prompt, new tokens per prompt)
WORKLOADS = {"16 x 64-512 x 32": (16, 64, 512, 32), "32 x 256-1536 x 64": (32, 256, 1536, 64),
             "64 x 256-2048 x 128": (64, 256, 2048, 128)}
WAYS = ("mha", "sdpa", "paged|eager", "sequential", "mha, default cache")
PAGE = 256  # tokens per page of transformers' paged cache (its default)


def ways_of(workload: str, dtype: str) -> tuple[str, ...]:
    """The ways `mha bench` measures on a workload: mha, sdpa and sequential everywhere; paged|eager
    (which holds every layer's scores: 4.6 tok/s and a 14.7 GB peak at 32 x 256-1536 in float32 on
    2 cores) on the 16-prompt workload in float32 only; mha with transformers' default cache there too."""
    if workload == next(iter(WORKLOADS)) and dtype == "float32":
        return WAYS
    return ("mha", "sdpa", "sequential")


def _model(dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=8000, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(dtype).eval()
    model.generation_config.eos_token_id = None  # every prompt generates all its tokens
    return model


def _prompts(workload: str) -> list[list[int]]:
    count, shortest, longest, _ = WORKLOADS[workload]
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(shortest, longest + 1, (count,), generator=g).tolist()
    return [torch.randint(0, 8000, (n,), generator=g).tolist() for n in lengths]


def measure_way(workload: str, dtype: torch.dtype, way: str) -> dict[str, float]:
    """{tokens_per_s, peak_mib (the process's), before_mib (its peak before the timed run), seconds}
    of one way on one workload, after an untimed warm-up of 2 prompts x 2 tokens (the first
    generate_batch of a process pays its thread and allocations). Run it in a fresh process."""
    from transformers import GenerationConfig

    if way not in WAYS:
        raise ValueError(f"way must be one of {WAYS}, got {way!r}")
    prompts, new = _prompts(workload), WORKLOADS[workload][3]
    greedy = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    warm = GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0)
    model = _model(dtype)
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        _run(model, way, prompts[:2], warm, 2)
        before = peak_rss_mib()
        start = time.perf_counter()
        _run(model, way, prompts, greedy, new)
        seconds = time.perf_counter() - start
    return {"tokens_per_s": len(prompts) * new / seconds, "peak_mib": peak_rss_mib(), "before_mib": before,
            "seconds": seconds}


def _run(model, way: str, prompts, config, new: int) -> None:
    from transformers import ContinuousBatchingConfig

    from ..integrations import transformers as hf

    if way == "sequential":
        model.set_attn_implementation("sdpa")
        for prompt in prompts:
            model.generate(torch.tensor([prompt]), generation_config=config)
        return
    pages = sum(math.ceil((len(p) + new) / PAGE) for p in prompts)
    sized = {} if way == "mha, default cache" else {"continuous_batching_config": ContinuousBatchingConfig(
        num_blocks=pages, page_size=PAGE)}
    if way.startswith("mha"):
        with hf.enable_continuous_batching(model):
            model.generate_batch(prompts, generation_config=config, warmup=False, **sized)
    else:
        model.set_attn_implementation(way)
        model.generate_batch(prompts, generation_config=config, warmup=False, **sized)


def main(argv: list[str]) -> None:
    workload, dtype, way = argv
    print(json.dumps(measure_way(workload, getattr(torch, dtype), way)))


if __name__ == "__main__":
    main(sys.argv[1:])
