"""Per-call cost of mha's default path against torch's, measured as interleaved A/B pairs.

    python scripts/per_call_ab.py                 # mha's sdpa, the dispatch's fast path and the native
                                                  # kernel's plain_sdpa alone, each against torch's SDPA
    python scripts/per_call_ab.py --generate 512  # a Llama's prefill and 32-token generation, mha vs sdpa
    python scripts/per_call_ab.py --bridge 512    # the transformers bridge's attention call at a decoding
                                                  # step over 512 keys against transformers' sdpa's
    python scripts/per_call_ab.py --dropin 256    # the drop-in module (E512 H8) against torch's, with and
                                                  # without the weights, B1 and B4
    python scripts/per_call_ab.py --paged 16      # paged_attention's layers over the kernel alone: a
                                                  # decoding step over 16 keys, one thread
    python scripts/per_call_ab.py --int8 1024     # a step over an 8-bit cache of 1024 keys (the fast path,
                                                  # the full path) against one over a bfloat16 cache
    python scripts/per_call_ab.py --int8-generate 4096  # a bfloat16 Llama generating after 4096 tokens with
                                                  # transformers' Int8Cache against its bfloat16 cache
    python scripts/per_call_ab.py --cache-layers 16384  # transformers cache layers' decoding step (the
                                                  # update and mha's attention over it) at 16384 keys, GQA 32/8,
                                                  # D 128: Int8Layer, it concatenating (as before), bfloat16
                                                  # BufferedLayer and DynamicLayer
    python scripts/per_call_ab.py --heads         # auto against torch on a projection's heads, (B, T, H, D)
                                                  # seen as (B, H, T, D): single calls alternated

Where a call takes microseconds and the machine's own speed drifts (a shared machine: the same torch
call took 8.6 us in one run and 19 us in another here), a best-of ratio misleads: this times
``pairs`` pairs of ``n`` calls of A and of B, in alternating order, and prints the median of the
pairs' ratios beside the median times. mha bench measures the targets; this says where the time goes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from mha.tools.bench import paired_times


def pair_ratio(a, b, *, n: int = 50, pairs: int = 200) -> tuple[float, float, float]:
    """(median of A/B over the pairs, A's median us, B's median us): bench.paired_times, n calls a sample."""
    for _ in range(20):
        a(), b()
    t = paired_times({"a": a, "b": b}, pairs, calls=n)
    ratios = [x / y for x, y in zip(t["a"], t["b"])]
    return statistics.median(ratios), statistics.median(t["a"]) * 1e6, statistics.median(t["b"]) * 1e6


def calls() -> None:
    from mha.functional import scaled_dot_product_attention as sdpa
    from mha.kernels import dispatch, native, tuning
    native.native_available()
    cases = [("T1 causal", (1, 8, 1), (1, 8, 1), True), ("T16 causal", (1, 8, 16), (1, 8, 16), True),
             ("T64 causal", (1, 8, 64), (1, 8, 64), True), ("decode S1024", (1, 8, 1), (1, 2, 1024), False)]
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            for name, qs, ks, causal in cases:
                q, k, v = (torch.randn(*shape, 64).to(dtype) for shape in (qs, ks, ks))
                gqa = qs[1] != ks[1]
                ways = {"mha sdpa": lambda: sdpa(q, k, v, is_causal=causal, enable_gqa=gqa),
                        "dispatch.plain_sdpa": lambda: dispatch.plain_sdpa(q, k, v, is_causal=causal, enable_gqa=gqa)}
                if native.loaded is not None:
                    ways["native plain_sdpa alone"] = lambda: native.loaded.plain_sdpa(
                        q, k, v, causal, gqa, dispatch.NATIVE_DECODE_ROWS, {dtype: tuning.crossover_ints(dtype)}, None)
                for way, call in ways.items():
                    r, ta, tb = pair_ratio(call, lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                                         enable_gqa=gqa),
                                           n=50 if ks[2] < 1000 else 10)
                    print(f"{str(dtype)[6:]:9s} {name:13s} {way:24s} {ta:8.2f} us, torch {tb:8.2f} us: {r:.3f}")


def bridge(S: int) -> None:
    """The bridge's attention call at a Llama's decoding step (8 query heads over 2 of 64, its mask
    as mha's mask function builds it) against transformers' sdpa's on the same inputs."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from mha.integrations import transformers as hf
    layer = torch.nn.Module()
    layer.num_key_value_groups, layer.is_causal = 4, True
    layer.eval()
    g = torch.Generator().manual_seed(S)
    q, k, v = torch.randn(1, 8, 1, 64, generator=g), torch.randn(1, 2, S, 64, generator=g), torch.randn(1, 2, S, 64, generator=g)
    mask = hf.mask_forward(batch_size=1, q_length=1, kv_length=S, q_offset=S - 1)
    with torch.no_grad():
        r, ta, tb = pair_ratio(lambda: hf.attention_forward(layer, q, k, v, mask, scaling=0.125),
                               lambda: sdpa_attention_forward(layer, q, k, v, None, scaling=0.125))
    print(f"decoding step S{S}: the bridge {ta:.1f} us, transformers' sdpa {tb:.1f} us: {r:.3f}")


def paged(S: int) -> None:
    """paged_attention's layers at a decoding step (one sequence, Hq32/Hkv8 D128, float32, pages of
    16) over the kernel's own call, one thread: what the Python around it costs."""
    from mha.kernels import contract as contracts
    from mha.kernels import dispatch, native
    from mha.kernels import paged as pages
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(S)
    q = torch.randn(1, 32, 128, generator=g)
    k, v = (torch.randn((S + 15) // 16, 8, 16, 128, generator=g) for _ in range(2))
    table, cu, lengths = torch.arange(k.shape[0])[None, :], torch.tensor([0, 1]), torch.tensor([S])
    terms = contracts.from_keywords(q, 32, is_causal=True, head_dim="1", query="q")
    kernel = native._kernel()
    bare = native._terms(terms, 128, q.dtype)
    layers = {"paged_attention": lambda: pages.paged_attention(q, k, v, table, cu, lengths),
              "attend_pages": lambda: pages.attend_pages(q, k, v, table, cu, lengths, terms),
              "dispatch.paged_attention": lambda: dispatch.paged_attention(q, k, v, table, cu, lengths, terms),
              "paged_attention_native": lambda: native.paged_attention_native(q, k, v, table, cu, lengths, terms)}
    with torch.no_grad():
        for name, call in layers.items():
            r, ta, tb = pair_ratio(call, lambda: kernel.paged_forward(q, k, v, table, cu, lengths, bare, None, None))
            print(f"S{S} {name:26s} {ta:8.2f} us, the kernel alone {tb:8.2f} us: {r:.2f}")


def int8(S: int) -> None:
    """A decoding step over S keys kept in 8 bits (B1, Hq8/Hkv8, D64, bfloat16 queries: an 8-bit
    KVCache's step in a bfloat16 module) through batch_paged_attention's fast path (dispatch.plain_pages),
    its full path (attend_pages) and the kernel's call alone, each against the same step over a
    bfloat16 cache through the dispatch's fast path (plain_sdpa)."""
    from mha.kernels import dispatch, native, storage
    from mha.kernels.contract import NONE
    from mha.kernels.paged import batch_paged_attention
    g = torch.Generator().manual_seed(S)
    q = torch.randn(1, 8, 1, 64, generator=g).bfloat16()
    k, v = (torch.randn(1, 8, S, 64, generator=g).bfloat16() for _ in range(2))
    k8, v8 = storage.store(k, True), storage.store(v, True)
    kernel, bare = native._kernel(), native._terms(NONE, 64, q.dtype)
    steps = {"fast path": lambda: batch_paged_attention(q, k8, v8, NONE),
             "full path": lambda: batch_paged_attention(q, k8, v8, NONE, backend="native"),
             "kernel.plain_pages": lambda: kernel.plain_pages(q, k8, v8, bare)}
    with torch.no_grad():
        for name, step in steps.items():
            r, ta, tb = pair_ratio(step, lambda: dispatch.plain_sdpa(q, k, v, is_causal=False, enable_gqa=True))
            print(f"S{S} int8 {name:20s} {ta:8.2f} us, bfloat16 {tb:8.2f} us: {r:.2f}")


def dropin(T: int) -> None:
    """The drop-in module's call (E512 H8, eval, batch first) against torch's, with and without the
    weights, B1 and B4 at T tokens."""
    import mha
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(512, 8, batch_first=True).eval()
    ours = mha.nn.MultiheadAttention(512, 8, batch_first=True).eval()
    ours.load_state_dict(ref.state_dict())
    with torch.no_grad():
        for B in (1, 4):
            x = torch.randn(B, T, 512)
            for weights in (True, False):
                ratio, a, b = pair_ratio(lambda: ours(x, x, x, need_weights=weights),
                                         lambda: ref(x, x, x, need_weights=weights), n=3, pairs=30)
                print(f"drop-in B{B} T{T} need_weights={weights}: ours/torch {ratio:.2f} ({a:.0f} vs {b:.0f} us)")


def generate(T: int, rounds: int = 7) -> None:
    """A float32 Llama's prefill of a prompt of T and its 32-token generation, mha against sdpa, in
    rounds that alternate which goes first: each round's ratios, then their medians."""
    from mha.tools import bench_hf
    models = {i: bench_hf.llama(i) for i in ("mha", "sdpa")}
    prompt = torch.randint(0, 8000, (1, T), generator=torch.Generator().manual_seed(T))
    prefills, generations = [], []
    with torch.no_grad():
        for m in models.values():
            m(prompt)
        for round_ in range(rounds):
            took = {}
            for i in ("mha", "sdpa") if round_ % 2 == 0 else ("sdpa", "mha"):
                start = time.perf_counter()
                models[i](prompt)
                middle = time.perf_counter()
                bench_hf.generate(models[i], prompt, 32)
                took[i] = (middle - start, time.perf_counter() - middle)
            prefills.append(took["mha"][0] / took["sdpa"][0])
            generations.append(took["mha"][1] / took["sdpa"][1])
            print(f"prompt {T}: prefill mha/sdpa {prefills[-1]:.2f}, generate 32 mha/sdpa {generations[-1]:.2f}")
    print(f"prompt {T}, medians of {rounds} rounds: prefill mha/sdpa {statistics.median(prefills):.2f}, "
          f"generate 32 mha/sdpa {statistics.median(generations):.2f}")


def int8_generate(T: int, rounds: int = 5) -> None:
    """A bfloat16 Llama (attn_implementation "mha") generating 32 tokens after a prompt of T, with
    transformers' Int8Cache against its default (bfloat16) cache, in turn: the best time of each."""
    from mha.integrations.transformers import Int8Cache
    from mha.tools import bench_hf
    model = bench_hf.llama("mha", torch.bfloat16)
    prompt = torch.randint(0, 8000, (1, T), generator=torch.Generator().manual_seed(T))

    def run(cache):
        with torch.no_grad():
            model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=32, min_new_tokens=32,
                           do_sample=False, past_key_values=cache)

    took = {"bf16": [], "int8": []}
    for i in range(rounds + 1):
        for name in took:
            start = time.perf_counter()
            run(Int8Cache() if name == "int8" else None)
            if i:  # (the first round warms up)
                took[name].append(time.perf_counter() - start)
    best = {name: min(t) * 1e3 for name, t in took.items()}
    print(f"prompt {T} + 32: bf16 cache {best['bf16']:.1f} ms, Int8Cache {best['int8']:.1f} ms, "
          f"int8/bf16 {best['int8'] / best['bf16']:.3f}")


def cache_layers(S: int, rounds: int = 5, steps: int = 16) -> None:
    """A decoding step of one transformers cache layer (update, then mha's attention_forward over what it
    returns) after S keys, Hq 32 / Hkv 8, D 128: Int8Layer (buffers with room), the same layer
    concatenating its cache every step (DynamicLayer's update: the layer before), a bfloat16
    BufferedLayer and a bfloat16 DynamicLayer, each layer's steps in turn: the median of the rounds'
    mean step."""
    from types import SimpleNamespace

    from transformers.cache_utils import DynamicLayer

    import mha.integrations.transformers as hf
    from mha.kernels import storage

    class ConcatenatingInt8Layer(hf.Int8Layer):
        def update(self, key_states, value_states, *args, **kwargs):
            return DynamicLayer.update(self, storage.store(key_states, True), storage.store(value_states, True))

    Hq, Hkv, D = 32, 8, 128
    module = SimpleNamespace(training=False, is_causal=True)
    g = torch.Generator().manual_seed(S)
    prompt = [torch.randn(1, Hkv, S, D, generator=g).bfloat16() for _ in range(2)]
    tokens = [[torch.randn(1, h, 1, D, generator=g).bfloat16() for h in (Hq, Hkv, Hkv)] for _ in range(steps)]

    def step_time(layer_class) -> float:
        layer = layer_class()
        layer.update(*prompt)
        start = time.perf_counter()
        for q, k, v in tokens:
            hf.attention_forward(module, q, *layer.update(k, v), None, scaling=D ** -0.5)
        return (time.perf_counter() - start) / steps

    layers = {"Int8Layer": hf.Int8Layer, "concatenating": ConcatenatingInt8Layer, "bf16 BufferedLayer": hf.BufferedLayer,
              "bf16 DynamicLayer": DynamicLayer}
    took = {name: [] for name in layers}
    with torch.no_grad():
        for i in range(rounds + 1):
            for name, layer_class in layers.items():
                t = step_time(layer_class)
                if i:  # (the first round warms up)
                    took[name].append(t)
    ms = {name: statistics.median(t) * 1e3 for name, t in took.items()}
    print(f"S {S}: step {', '.join(f'{name} {t:.2f} ms' for name, t in ms.items())}; Int8Layer/concatenating "
          f"{ms['Int8Layer'] / ms['concatenating']:.3f}, Int8Layer/bf16 BufferedLayer "
          f"{ms['Int8Layer'] / ms['bf16 BufferedLayer']:.3f}, BufferedLayer/DynamicLayer "
          f"{ms['bf16 BufferedLayer'] / ms['bf16 DynamicLayer']:.3f}")


def heads(rounds: int = 15) -> None:
    """backend="auto" against torch's SDPA, causal, on q, k, v as a model's projections hand them over
    ((B, T, H, D) seen as (B, H, T, D)), single calls alternated (tuning.alternated_samples): the median
    of the rounds' ratios, at four shapes, fp32 and bf16."""
    from mha.functional import scaled_dot_product_attention as sdpa
    from mha.kernels import tuning
    for B, H, T, D in [(1, 8, 256, 64), (1, 8, 1024, 64), (4, 8, 256, 64), (32, 12, 128, 32)]:
        for dtype in (torch.float32, torch.bfloat16):
            q, k, v = (torch.randn(B, T, H, D).to(dtype).transpose(1, 2) for _ in range(3))
            fns = {"auto": lambda: sdpa(q, k, v, is_causal=True),
                   "torch": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)}
            with torch.no_grad():
                alone = tuning.alternated_samples(fns, rounds)
            ratio = statistics.median(a / b for a, b in zip(alone["auto"], alone["torch"]))
            print(f"B{B} H{H} T{T} D{D} {str(dtype).removeprefix('torch.')}: auto "
                  f"{statistics.median(alone['auto']) * 1e3:.2f} ms, torch {statistics.median(alone['torch']) * 1e3:.2f} ms, "
                  f"auto/torch {ratio:.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--generate", type=int, metavar="T", help="time generation after a prompt of T tokens")
    parser.add_argument("--bridge", type=int, metavar="S", help="the transformers bridge at a decoding step over S keys")
    parser.add_argument("--dropin", type=int, metavar="T", help="the drop-in module's call at T tokens, with and without weights")
    parser.add_argument("--paged", type=int, metavar="S", help="paged_attention's layers at a decoding step over S keys")
    parser.add_argument("--int8", type=int, metavar="S", help="a step over an 8-bit cache of S keys against a bfloat16 one")
    parser.add_argument("--int8-generate", type=int, metavar="T", help="a Llama's generation after T tokens, Int8Cache vs bf16")
    parser.add_argument("--cache-layers", type=int, metavar="S", help="transformers cache layers' steps over S keys")
    parser.add_argument("--heads", action="store_true", help="auto against torch on a projection's heads, alternated")
    args = parser.parse_args()
    if args.generate:
        generate(args.generate)
    elif args.bridge:
        bridge(args.bridge)
    elif args.dropin:
        dropin(args.dropin)
    elif args.paged:
        paged(args.paged)
    elif args.int8:
        int8(args.int8)
    elif args.int8_generate:
        int8_generate(args.int8_generate)
    elif args.cache_layers:
        cache_layers(args.cache_layers)
    elif args.heads:
        heads()
    else:
        calls()
