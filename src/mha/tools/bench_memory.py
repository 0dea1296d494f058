"""Worker of ``mha bench --sections memory``: peak memory of one default path, in a fresh process.

    python -m mha.tools.bench_memory NAME T     prints {"growth_mib": ..., "seconds": ...}

Each case in :data:`MEMORY_CASES` builds one no-grad call at length T (B=1, H=8, D=64); its peak
resident-set growth is compared with a torch baseline on the same shape. Peak RSS only rises, so
one process measures one call.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from ..functional import scaled_dot_product_attention
from ..kernels import native
from ..modules.general import GeneralAttention
from ..modules.rope import RotaryEmbedding
from ..nn import MultiheadAttention

HEADS, HEAD_DIM = 8, 64


def attention_inputs(T: int, L: int | None = None):
    torch.manual_seed(0)
    return (torch.randn(1, HEADS, L or T, HEAD_DIM), torch.randn(1, HEADS, T, HEAD_DIM),
            torch.randn(1, HEADS, T, HEAD_DIM))


def _functional_case(T: int, L: int | None = None, **options):
    q, k, v = attention_inputs(T, L)
    return lambda: scaled_dot_product_attention(q, k, v, **options)


def _module_case(T: int, padded: bool = False, dv: int = HEAD_DIM, **options):
    torch.manual_seed(0)
    E = HEADS * HEAD_DIM
    module = GeneralAttention(E, E, E, HEAD_DIM, dv, E, HEADS, **options).eval()
    x = torch.randn(1, T, E)
    padding = torch.zeros(1, T, dtype=torch.bool)
    padding[:, -T // 16:] = padded  # the last keys are padding
    return lambda: module(x, x, x, is_causal=True, key_padding_mask=padding if padded else None)


def _torch_module_case(T: int):
    """torch's own pipeline on the module's shape: projections, causal SDPA, out-projection."""
    torch.manual_seed(0)
    E = HEADS * HEAD_DIM
    q_proj, k_proj, v_proj, out_proj = (torch.nn.Linear(E, E) for _ in range(4))
    x = torch.randn(1, T, E)

    def heads(t):
        return t.view(1, T, HEADS, HEAD_DIM).transpose(1, 2)  # (1, T, E) -> (1, H, T, D)

    def run():
        o = torch.nn.functional.scaled_dot_product_attention(heads(q_proj(x)), heads(k_proj(x)), heads(v_proj(x)),
                                                             is_causal=True)
        return out_proj(o.transpose(1, 2).reshape(1, T, E))  # (1, H, T, D) -> (1, T, E)
    return run


def _drop_in_case(T: int):
    torch.manual_seed(0)
    module = MultiheadAttention(HEADS * HEAD_DIM, HEADS, batch_first=True).eval()
    x = torch.randn(1, T, HEADS * HEAD_DIM)
    padding = torch.zeros(1, T, dtype=torch.bool)
    padding[:, -T // 16:] = True
    return lambda: module(x, x, x, key_padding_mask=padding, need_weights=False, is_causal=True)[0]


def _torch_causal_case(T: int):
    q, k, v = attention_inputs(T)
    return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


# name: (builder of the call at length T, the torch baseline it is compared with)
MEMORY_CASES = {
    "torch causal SDPA": (_torch_causal_case, None),
    "causal": (lambda T: _functional_case(T, is_causal=True), "torch causal SDPA"),
    "causal bottom-right, L = T/2": (lambda T: _functional_case(T, T // 2, is_causal=True,
                                                               causal_alignment="bottom_right"), "torch causal SDPA"),
    "causal + key padding mask": (lambda T: _functional_case(T, attn_mask=torch.ones(1, 1, 1, T, dtype=torch.bool),
                                                            is_causal=True), "torch causal SDPA"),
    "window (256, 0)": (lambda T: _functional_case(T, window=(256, 0)), "torch causal SDPA"),
    "ALiBi causal": (lambda T: _functional_case(T, is_causal=True, alibi_slopes=torch.ones(HEADS)),
                     "torch causal SDPA"),
    "softcap causal": (lambda T: _functional_case(T, is_causal=True, softcap=30.0), "torch causal SDPA"),
    "sinks causal": (lambda T: _functional_case(T, is_causal=True, sinks=torch.zeros(HEADS)), "torch causal SDPA"),
    "torch module pipeline": (_torch_module_case, None),
    "module causal": (lambda T: _module_case(T), "torch module pipeline"),
    "module RoPE": (lambda T: _module_case(T, rope=_rope()), "torch module pipeline"),
    "module ALiBi": (lambda T: _module_case(T, alibi=True), "torch module pipeline"),
    "module window (256, 0)": (lambda T: _module_case(T, window=(256, 0)), "torch module pipeline"),
    "module RoPE + padding": (lambda T: _module_case(T, padded=True, rope=_rope()), "torch module pipeline"),
    "module dv = dk / 2": (lambda T: _module_case(T, dv=HEAD_DIM // 2), "torch module pipeline"),
    "drop-in causal + padding": (_drop_in_case, "torch module pipeline"),
}


def _rope():
    return RotaryEmbedding(HEAD_DIM)


def peak_rss_mib() -> float:
    """This process's peak resident set size (VmHWM) in MiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def memory_case(name: str, T: int) -> tuple[float, float]:
    """(peak RSS growth in MiB, seconds) of one no_grad call, after a warm-up at a small length
    and a first call of the native kernel (so that one-time allocations of the kernels do not count:
    at 256 auto may run torch's kernel, and the native one's first call, about 40 MiB of one-time
    allocations, would land in the timed call). Run it in a fresh process."""
    build = MEMORY_CASES[name][0]
    with torch.no_grad():
        if native.ready():  # loaded and run once: its first call in a process costs 40 MiB here, whichever path
            native.native_attention(*attention_inputs(256))
        build(256)()
        call = build(T)
        before = peak_rss_mib()
        start = time.perf_counter()
        out = call()
        seconds = time.perf_counter() - start
    if not torch.isfinite(out).all():
        raise RuntimeError(f"memory case {name!r} gave non-finite values")
    return peak_rss_mib() - before, seconds


def main(argv: list[str]) -> None:
    name, T = argv
    growth, seconds = memory_case(name, int(T))
    print(json.dumps({"growth_mib": growth, "seconds": seconds}))


if __name__ == "__main__":
    main(sys.argv[1:])
