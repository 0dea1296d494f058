"""Benchmarks: mha against torch, measured as ratios in one run on the same inputs.

Every timing is the best of ``repeat`` rounds in which the compared functions run in turn (so
drift in the machine's speed hits them alike). Sections:

    module    forward, need_weights=False, batch_first self-attention, fp32, no_grad:
              mha.nn.MultiheadAttention vs torch's training path and its default eval path
    causal    the same with a causal mask (ours: is_causal=True; torch: the causal attn_mask)
    overhead  per call at tiny shapes (the drop-in against torch's eval path) and one decode step of
              the general module on a preallocated KVCache against a bare torch step; that step
              from float32, bfloat16 and 8-bit caches (int8/bf16, bf16/fp32)
    backends  the attention core (B=1, H=8, D=64): sdpa, flash, math, numpy blocked, in GFLOP/s
              (4*B*H*L*S*D / time, halved when causal) beside a matmul's GFLOP/s
    training  forward + backward of the module vs torch's
    memory    peak RSS growth of every default path (causal, bottom-right, padding, windows, ALiBi,
              softcap, sinks; the general module with RoPE / ALiBi / window / padding; the drop-in)
              at T and T/2, each in a fresh process (python -m mha.tools.bench_memory), against
              torch's causal SDPA (functional cases) or torch's projections + causal SDPA pipeline
              (module cases) on the same shape
    contract  time of mha's SDPA against torch's on the same call (torch given a dense mask where
              it has no fused form)
    modern    KV-cache decoding vs recomputation, per-token latency; sliding window vs dense causal
    variants  the efficient variants: time and peak memory at each T (each in a fresh process:
              python -m mha.tools.bench_variants), and with them their quality on all-MiniLM-L6-v2's
              real attention (mha.tools.bench_quality: per-head error, embedding cosine, neighbours)
    auto      backend="auto" against torch's SDPA at every length (1 .. 8192, causal), beside a
              bool mask (up to 1024) and on decoding steps, fp32 and bf16: what a user of the
              default gets, per-call cost included
    peers     mha's default path against torch's SDPA and ONNX Runtime's CPU MultiHeadAttention
              (when onnxruntime is installed: the onnx extra), fp32 forward, T 1024 and 4096
    native    the native kernel (mha.kernels.native) against torch's SDPA: forward and forward +
              backward in fp32 and bf16, a decoding step, a sliding window, accuracy; GFLOP/s
              beside a same-run matmul and as a fraction of this CPU's limit for the dtype, GB/s
              as a fraction of the read rate (mha.tools.bench_native, mha.tools.bench_peaks)
    peaks     this CPU's limits at the thread count in use: fp32 FMA and bf16 dot-product peaks
              (the native build's chains), AMX (torch's bf16 matmul) where present, the read rate
              (mha.tools.bench_peaks)
    distributed  ring attention (zigzag, contiguous, striped) and Ulysses attention on W spawned ranks
              against one process running flash over the whole causal sequence: peak memory per
              rank, balance of the ranks' attention CPU time, scores per ring step, a check
              (mha.tools.bench_distributed)
    gpu       (a CUDA device) plain calls against torch's SDPA (time, bitwise), the terms torch's SDPA
              lacks against FlexAttention written by hand (forward, forward + backward), float16 and
              bfloat16 errors against float64 beside torch's own and math's (mha.tools.bench_gpu)
    flex      (CPU) mha's flex backend (FlexAttention compiled) beside the native kernel and
              FlexAttention by hand: a causal window with softcap, forward
    hf        transformers models, one forward with attn_implementation="mha" against "sdpa" and
              "eager": the all-MiniLM-L6-v2 checkpoint (batch 32) and a tiny GPT-OSS (sinks, sliding
              window); time interleaved here, peak memory each in a fresh process (python -m
              mha.tools.bench_hf); and a Llama built from its config generating 32 tokens after a
              prompt of each length, fp32 and bf16, mha against sdpa. Needs the hf extra.
"""

from __future__ import annotations

import csv
import functools
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from .. import numpy as mnp
from ..functional import scaled_dot_product_attention
from ..kernels import BACKENDS, Contract, flash_attention, tuning
from ..modules.cache import KVCache
from ..modules.general import GeneralAttention
from ..nn import MultiheadAttention
from ..positions import CAUSAL, Band
from . import (
    bench_distributed,
    bench_gpu,
    bench_hf,
    bench_memory,
    bench_native,
    bench_peaks,
    bench_quality,
    bench_variants,
    plot_variants,
)
from . import distributed_demo as demo
from .bench_memory import HEAD_DIM, HEADS

_CAUSAL = Contract(band=CAUSAL)


@dataclass
class Row:
    section: str
    point: str  # e.g. "B4 T512 E512"
    times_ms: dict[str, float]  # implementation -> best time
    ratios: dict[str, float] = field(default_factory=dict)  # "ours/torch-train" -> value
    extra: dict[str, float] = field(default_factory=dict)  # GFLOP/s, MiB, errors ...
    detail: dict = field(default_factory=dict)  # kept in results.json only (e.g. per-head errors)
    threads: int | None = None  # the torch thread count it ran at (mha bench stamps it)


def machine(*, matmul_n: int = 2048) -> dict:
    """Where the figures are taken: the CPU (model, the flags that matter, its kind), threads,
    versions, and this machine's matmul rates now (GFLOP/s of an n^3 product, fp32 and bf16)."""
    info = tuning.cpu()
    rates = {f"{name} matmul GFLOP/s": bench_native.matmul_gflops(dtype, matmul_n)
             for name, dtype in bench_native.DTYPES.items()}
    return {"cpu": info["model"], "cpu flags": info["flags"], "cpu kind": info["kind"],
            "threads": torch.get_num_threads(), "cores": os.cpu_count(), **rates,
            "torch": torch.__version__, "numpy": np.__version__, "python": platform.python_version()}


def describe(info: dict) -> str:
    """One line saying where a table's figures were taken (matmul rates and thread counts given as
    lists where the rows ran at several: one figure each, in order)."""
    def figures(value) -> str:
        return " / ".join(f"{x:.0f}" for x in value) if isinstance(value, list) else f"{value:.0f}"
    rates = ", ".join(f"{key.split()[0]} {figures(info[key])}" for key in info if key.endswith("matmul GFLOP/s"))
    counts = info["threads"] if isinstance(info["threads"], list) else [info["threads"]]
    threads = threads_label(counts[0]) if len(counts) == 1 else f"{' / '.join(map(str, counts))} threads"
    return (f"{info['cpu']} ({' '.join(info['cpu flags']) or 'no avx2/avx512/amx'}), {threads}, "
            f"matmul GFLOP/s {rates}, torch {info['torch']}")


def threads_label(n: int) -> str:
    return f"{n} thread{'s' if n != 1 else ''}"


def best_times(fns: dict[str, Callable[[], object]], repeat: int, *, calls: int = 1,
               before: Callable[[], object] | None = None) -> dict[str, float]:
    """Best time in ms per call of each function: one warm-up call each, then ``repeat`` rounds in
    turn, each timing ``calls`` calls and keeping their mean; ``before`` runs ahead of every call,
    untimed (to reset state, such as a cache's length)."""
    for fn in fns.values():
        if before is not None:
            before()
        fn()
    times = {name: float("inf") for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            total = 0.0
            for _ in range(calls):
                if before is not None:
                    before()
                start = time.perf_counter()
                fn()
                total += time.perf_counter() - start
            times[name] = min(times[name], total / calls * 1e3)
    return times


def paired_times(fns: dict[str, Callable[[], object]], pairs: int, *, calls: int = 1) -> dict[str, list[float]]:
    """Seconds a call of each of two functions in ``pairs`` pairs, one after the other, the order
    swapped every other pair (the first of a pair meets what the last of the pair before left);
    each sample the mean of ``calls`` calls in a row. Sample i of one and sample i of the other were
    taken side by side: their ratio is the pair's."""
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(pairs):
        for name in (names if i % 2 == 0 else names[::-1]):
            start = time.perf_counter()
            for _ in range(calls):
                fns[name]()
            times[name].append((time.perf_counter() - start) / calls)
    return times


def _pair(E: int, heads: int = HEADS):
    torch.manual_seed(0)
    theirs = torch.nn.MultiheadAttention(E, heads, batch_first=True)
    ours = MultiheadAttention(E, heads, batch_first=True).eval()
    ours.load_state_dict(theirs.state_dict())
    theirs_eval = torch.nn.MultiheadAttention(E, heads, batch_first=True).eval()
    theirs_eval.load_state_dict(theirs.state_dict())
    return ours, theirs.train(), theirs_eval  # torch in train mode with dropout 0: its faster path


def module_rows(points, repeat: int, causal: bool = False) -> Iterator[Row]:
    """Forward, no weights. Causal: ours takes is_causal=True; torch the causal attn_mask, as most
    code calls it, and also with the is_causal hint that lets its training path skip the masked half."""
    for B, T, E in points:
        ours, torch_train, torch_eval = _pair(E)
        x = torch.randn(B, T, E)
        mask = torch.nn.Transformer.generate_square_subsequent_mask(T) if causal else None
        fns = {"ours": lambda: ours(x, x, x, need_weights=False, is_causal=causal),
               "torch-train": lambda: torch_train(x, x, x, need_weights=False, attn_mask=mask),
               "torch-eval": lambda: torch_eval(x, x, x, need_weights=False, attn_mask=mask)}
        if causal:
            fns["torch-train+hint"] = lambda: torch_train(x, x, x, need_weights=False, attn_mask=mask, is_causal=True)
        with torch.no_grad():
            t = best_times(fns, repeat)
        yield Row("causal" if causal else "module", f"B{B} T{T} E{E}", t,
                  {f"ours/{name}": t["ours"] / t[name] for name in fns if name != "ours"})


# -- per-call overhead: tiny shapes, where Python work shows --------------------------------------

OVERHEAD_POINTS = [(1, 1, 256, 8), (1, 16, 256, 8), (4, 8, 128, 4)]  # (B, T, E, H)


def overhead_rows(repeat: int, *, points=OVERHEAD_POINTS, decode_lengths=(1024, 8192)) -> Iterator[Row]:
    """Eval forward (no_grad) of the drop-in against torch's eval path at tiny shapes, and one decode
    step of the general module with a preallocated KVCache against a bare torch step on its own
    preallocated buffers (see _decode_step_row). Times are per call, the best of
    ``repeat`` rounds of 200 calls each, the compared calls in turn."""
    with torch.no_grad():
        for B, T, E, H in points:
            ours, _, theirs = _pair(E, H)  # theirs: torch's eval path
            x = torch.randn(B, T, E)
            t = best_times({"ours": lambda: ours(x, x, x, need_weights=False),
                            "torch-eval": lambda: theirs(x, x, x, need_weights=False),
                            "ours weights": lambda: ours(x, x, x),
                            "torch-eval weights": lambda: theirs(x, x, x)}, repeat, calls=200)
            yield Row("overhead", f"drop-in B{B} T{T} E{E} H{H}", t,
                      {"ours/torch-eval": t["ours"] / t["torch-eval"],
                       "weights: ours/torch-eval": t["ours weights"] / t["torch-eval weights"]})
        for S in decode_lengths:
            yield _decode_step_row(S, repeat)
            yield _decode_step_row(S, repeat, slots=max(4 * S, 4096))  # preallocated for a long generation
        yield _cache_formats_row(max(decode_lengths), repeat)


def _decode_step_row(S: int, repeat: int, E: int = 512, slots: int | None = None) -> Row:
    """One decode step at S cached keys: the general module on a KVCache(max_length=slots, S + 1
    by default: users preallocate for the longest generation) against the same layers written out
    in torch, with its own buffers: write the new key and value into slot S, SDPA over the filled
    slots [:S + 1], out-projection."""
    torch.manual_seed(0)
    D = E // HEADS
    slots = slots or S + 1
    module = GeneralAttention(E, E, E, D, D, E, HEADS).eval()
    cache = KVCache(max_length=slots)
    prompt = torch.randn(1, S, E)
    module(prompt, prompt, prompt, is_causal=True, cache=cache)  # S keys cached
    keys, values = torch.zeros(1, HEADS, slots, D), torch.zeros(1, HEADS, slots, D)  # torch's own buffers
    keys[:, :, :S], values[:, :, :S] = cache.keys, cache.values
    x = torch.randn(1, 1, E)
    q_proj, k_proj, v_proj, out_proj = module.q_proj, module.k_proj, module.v_proj, module.out_proj

    def heads(t):
        return t.view(1, 1, HEADS, D).transpose(1, 2)  # (1, 1, E) -> (1, H, 1, D)

    def bare():
        keys[:, :, S:S + 1] = heads(k_proj(x))
        values[:, :, S:S + 1] = heads(v_proj(x))
        o = torch.nn.functional.scaled_dot_product_attention(heads(q_proj(x)), keys[:, :, :S + 1],
                                                             values[:, :, :S + 1])  # the filled slots
        return out_proj(o.transpose(1, 2).reshape(1, 1, E))  # (1, H, 1, D) -> (1, 1, E)

    t = best_times({"ours": lambda: module(x, x, x, is_causal=True, cache=cache), "torch step": bare},
                   repeat, calls=50, before=lambda: cache.crop(S))
    return Row("overhead", f"decode step S={S} of {slots} slots E{E} H{HEADS}", t,
               {"ours/torch step": t["ours"] / t["torch step"]})


def _cache_formats_row(S: int, repeat: int, E: int = 512) -> Row:
    """One decode step at S cached keys of the general module, whole (projections, the new token
    stored, attention), from a float32 cache (a float32 module), a bfloat16 and an 8-bit one (a
    bfloat16 module): what each format costs a user, its storing included (the 8-bit cache
    quantizes the new key and value each step). The targets: bf16 at most 0.55 of fp32, int8 at
    most 0.6 of bf16 (as the native rows' decode from caches, there for the kernel alone)."""
    torch.manual_seed(0)
    D = E // HEADS
    steps = {}
    for name, dtype, quantize in (("fp32", torch.float32, None), ("bf16", torch.bfloat16, None),
                                  ("int8", torch.bfloat16, "int8")):
        module = GeneralAttention(E, E, E, D, D, E, HEADS).eval().to(dtype)
        cache = KVCache(max_length=S + 1, quantize=quantize)
        prompt, x = torch.randn(1, S, E, dtype=dtype), torch.randn(1, 1, E, dtype=dtype)
        module(prompt, prompt, prompt, is_causal=True, cache=cache)  # S keys cached
        steps[name] = (functools.partial(module, x, x, x, is_causal=True, cache=cache), functools.partial(cache.crop, S))

    def crop_all():
        for _, crop in steps.values():
            crop()

    t = best_times({name: step for name, (step, _) in steps.items()}, repeat, calls=20, before=crop_all)
    return Row("overhead", f"decode step S={S} E{E} H{HEADS}, cache formats", t,
               {"bf16/fp32": t["bf16"] / t["fp32"], "int8/bf16": t["int8"] / t["bf16"]})


def matmul_gflops(n: int = 2048, repeat: int = 3) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    t = best_times({"mm": lambda: a @ b}, repeat)["mm"]
    return 2 * n ** 3 / (t * 1e-3) / 1e9


def backend_rows(lengths, repeat: int, math_limit: int = 2048) -> Iterator[Row]:
    peak = matmul_gflops()
    for T in lengths:
        q, k, v = (torch.randn(1, HEADS, T, HEAD_DIM) for _ in range(3))
        arrays = [t.numpy() for t in (q, k, v)]
        for causal in (False, True):
            contract = _CAUSAL if causal else None
            fns = {name: (lambda f=BACKENDS[name]: f(q, k, v, contract)) for name in ("sdpa", "flash")}
            if T <= math_limit:
                fns["math"] = lambda: BACKENDS["math"](q, k, v, contract)
            fns["numpy-blocked"] = lambda: mnp.blocked_attention(*arrays, None, causal)
            with torch.no_grad():
                t = best_times(fns, repeat)
            flops = 4 * HEADS * T * T * HEAD_DIM / (2 if causal else 1)
            gflops = {f"{name} GFLOP/s": flops / (ms * 1e-3) / 1e9 for name, ms in t.items()}
            ratios = {"flash speed/sdpa speed": t["sdpa"] / t["flash"],
                      "numpy time/sdpa time": t["numpy-blocked"] / t["sdpa"]}
            yield Row("backends", f"T{T}{' causal' if causal else ''}", t, ratios,
                      {**gflops, "matmul GFLOP/s": peak})


def training_rows(points, repeat: int) -> Iterator[Row]:
    for B, T, E in points:
        ours, theirs, _ = _pair(E)
        ours.train()
        x = torch.randn(B, T, E, requires_grad=True)

        def step(module):
            module(x, x, x, need_weights=False)[0].sum().backward()

        t = best_times({"ours": lambda: step(ours), "torch": lambda: step(theirs)}, repeat)
        yield Row("training", f"B{B} T{T} E{E}", t, {"ours/torch": t["ours"] / t["torch"]})


def decode_row(tokens: int, E: int = 512) -> Row:
    """Generate ``tokens`` tokens one at a time: with a KV cache vs recomputing full causal attention
    over the whole prefix at every step; and the cached per-token latency early vs late."""

    torch.manual_seed(0)
    module = GeneralAttention(E, E, E, E // HEADS, E // HEADS, E, HEADS).eval()
    x = torch.randn(1, tokens, E)
    cache, step_ms = KVCache(max_length=tokens), []
    with torch.no_grad():
        start = time.perf_counter()
        for t in range(tokens):
            step = time.perf_counter()
            module(x[:, t:t + 1], x[:, t:t + 1], x[:, t:t + 1], is_causal=True, cache=cache)
            step_ms.append((time.perf_counter() - step) * 1e3)
        cached = (time.perf_counter() - start) * 1e3
        start = time.perf_counter()
        for t in range(tokens):
            prefix = x[:, : t + 1]
            module(prefix, prefix, prefix, is_causal=True)[:, -1]
        recomputed = (time.perf_counter() - start) * 1e3
    eighth = max(1, tokens // 8)
    early, late = np.median(step_ms[:eighth]), np.median(step_ms[-eighth:])
    return Row("modern", f"decode {tokens} tokens, E{E} H{HEADS}", {"kv cache": cached, "recompute": recomputed},
               {"recompute/cache": recomputed / cached, "late/early token latency": late / early},
               {"early token ms": early, "late token ms": late})


def window_row(T: int, window: int, repeat: int) -> Row:
    """Causal sliding-window attention (flash, O(T*w)) vs dense causal attention (SDPA), B=1 H=8 D=64."""

    q, k, v = (torch.randn(1, HEADS, T, HEAD_DIM) for _ in range(3))
    band = Contract(band=Band(window, 0))
    with torch.no_grad():
        t = best_times({"dense causal (sdpa)": lambda: BACKENDS["sdpa"](q, k, v, _CAUSAL),
                        "window (flash)": lambda: flash_attention(q, k, v, band)}, repeat)
    return Row("modern", f"T{T} window {window}", t,
               {"dense causal/window": t["dense causal (sdpa)"] / t["window (flash)"]})


def variant_rows(lengths, repeat: int, names=None) -> Iterator[Row]:
    """Every efficient variant at each length, each in a fresh process (peak RSS is per process)."""
    for T in lengths:
        for name in names or bench_variants.VARIANTS:
            result = run_worker("mha.tools.bench_variants", name, T, repeat)
            if not result["finite"]:
                raise RuntimeError(f"{name} at T={T} returned non-finite values")
            yield Row("variants", f"T{T} {name}", {"time": result["ms"]},
                      extra={"peak RSS growth MiB": result["peak_mib"], "T": T})


def quality_rows(lengths, documents: int, repeat: int, names=None) -> Iterator[Row]:
    """Every efficient variant on all-MiniLM-L6-v2's real attention (mha.tools.bench_quality)."""
    model = bench_quality.checkpoint()
    for T in lengths:
        for q in bench_quality.measure(model, T, documents, names, repeat):
            errors = torch.tensor(q.head_errors)  # (layers, heads)
            yield Row("quality", f"T{T} {q.variant}", {"attention": q.attention_ms},
                      extra={"T": T, "head error median": errors.median().item(), "head error max": errors.max().item(),
                             "embedding cosine": q.cosine, "cosine min": q.cosine_min, "top-5 kept": q.neighbours_kept},
                      detail={"head errors": q.head_errors})


# -- workers in fresh processes (peak memory is per process) ------------------------------------

def run_worker(module: str, *args, env: dict[str, str] | None = None) -> dict:
    """Run ``python -m module *args`` in a fresh process (``env`` added to its environment);
    returns the JSON it prints."""
    done = subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, text=True,
                          env=None if env is None else {**os.environ, **env})
    if done.returncode != 0:
        raise RuntimeError(f"{module} {' '.join(map(str, args))} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout)


@functools.cache  # a baseline is measured once per length
def fresh_memory_case(name: str, T: int) -> tuple[float, float]:
    """(peak RSS growth MiB, seconds) of one memory case at length T, in a fresh process."""
    result = run_worker("mha.tools.bench_memory", name, T)
    return result["growth_mib"], result["seconds"]


def memory_rows(T: int, names=None) -> Iterator[Row]:
    """Peak RSS growth of each default path at T and T/2 (fresh processes), against its torch
    baseline at T, and the growth ratio from T/2 to T (about 2 when memory is O(T), 4 when O(T^2))."""
    cases = bench_memory.MEMORY_CASES
    for name in names or [n for n, (_, baseline) in cases.items() if baseline is not None]:
        growth, seconds = fresh_memory_case(name, T)
        half, _ = fresh_memory_case(name, T // 2)
        baseline, _ = fresh_memory_case(cases[name][1], T)
        yield Row("memory", f"T{T} {name}", {"call": seconds * 1e3},
                  {"growth / torch": growth / max(baseline, 1.0), "growth T / growth T/2": growth / max(half, 1.0)},
                  {"peak RSS growth MiB": growth, f"at T{T // 2} MiB": half, "torch MiB": baseline})


def hf_rows(name: str, T: int, repeat: int) -> Iterator[Row]:
    """One transformers model (mha.tools.bench_hf.MODELS) at length T under each implementation:
    best forward time (interleaved, the same inputs) and peak RSS growth (fresh processes)."""
    load, inputs_at, implementations = bench_hf.MODELS[name]
    models = {implementation: load(implementation) for implementation in implementations}
    inputs = inputs_at(models["mha"], T)
    times = best_times({i: functools.partial(bench_hf.forward, m, inputs) for i, m in models.items()}, repeat)
    growth = {i: run_worker("mha.tools.bench_hf", name, i, T, env=bench_hf.WORKER_ENV)["growth_mib"]
              for i in implementations}
    ratios = {}
    for other in implementations[1:]:
        ratios[f"mha/{other} time"] = times["mha"] / times[other]
        ratios[f"mha/{other} peak"] = growth["mha"] / max(growth[other], 1.0)
    batch = inputs["input_ids"].shape[0]
    yield Row("hf", f"{name} B{batch} T{T}", times, ratios, {f"{i} peak MiB": g for i, g in growth.items()})


GENERATE_MATMUL_GFLOPS = 5.0  # hf_generate_rows leaves out a dtype whose 512^3 matmul is slower than this here


def hf_generate_rows(prompts, dtypes, new_tokens: int, repeat: int) -> Iterator[Row]:
    """A Llama (mha.tools.bench_hf.llama) generating ``new_tokens`` greedily after one prompt of each
    length, under attn_implementation="mha" and "sdpa" (the same weights), timed in pairs, the order
    swapped every other pair, ``repeat`` pairs at least 5: each one's best time, mha/sdpa the median
    of the pairs' ratios (the target: never above 1; a ratio of two best times, each taken at another
    moment of a drifting machine, moved more), and how many new tokens agree before the first that
    differs ("tokens alike": bfloat16 greedy decoding can part where two logits lie within bfloat16's
    rounding of each other, as two bfloat16 attentions do: docs/benchmarks.md)."""
    for name in dtypes:
        dtype = getattr(torch, name)
        rate = bench_native.matmul_gflops(dtype, 512)
        if rate < GENERATE_MATMUL_GFLOPS:  # (bfloat16 on a CPU without bf16 instructions: minutes a prompt)
            yield Row("hf", f"llama generate {name}: not timed (torch's {name} matmul runs at {rate:.1f} GFLOP/s here)", {})
            continue
        models = {i: bench_hf.llama(i, dtype) for i in ("mha", "sdpa")}
        for T in prompts:
            prompt = torch.randint(0, 8000, (1, T), generator=torch.Generator().manual_seed(T))
            tokens = {i: bench_hf.generate(m, prompt, new_tokens) for i, m in models.items()}
            taken = paired_times({i: functools.partial(bench_hf.generate, m, prompt, new_tokens)
                                  for i, m in models.items()}, max(5, repeat))
            yield Row("hf", f"llama generate {name} prompt {T} + {new_tokens}",
                      {i: min(ts) * 1e3 for i, ts in taken.items()},
                      {"mha/sdpa time": statistics.median(a / b for a, b in zip(taken["mha"], taken["sdpa"]))},
                      {"tokens alike": float(_leading_alike(tokens["mha"][0, T:], tokens["sdpa"][0, T:])),
                       "new tokens": float(new_tokens)})


def _leading_alike(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many of two token sequences' first tokens agree, up to the first that differs."""
    differ = (a != b).nonzero()
    return int(differ[0]) if len(differ) else len(a)


def distributed_rows(T: int, nprocs: int) -> Iterator[Row]:
    """Ring (each balance) and Ulysses attention on ``nprocs`` spawned ranks against one process
    running flash over the whole causal sequence (mha.tools.bench_distributed)."""
    baseline = None
    for mode, balance, reports in bench_distributed.runs(T, nprocs):
        s = demo.summary(reports)
        if mode == "single":
            baseline = s["peak_growth_mib"]
            yield Row("distributed", f"T{T} one process, flash", {"attention (wall)": s["seconds"] * 1e3}, {},
                      {"peak growth MiB": baseline, "attention CPU s": reports[0]["cpu_seconds"]})
            continue
        yield Row("distributed", f"T{T} W{nprocs} {mode} {balance}", {"slowest rank (wall)": s["seconds"] * 1e3},
                  {"peak per rank / one process": s["peak_growth_mib"] / baseline,
                   "slowest / fastest rank CPU": s["cpu_balance"]},
                  {"peak per rank MiB": s["peak_growth_mib"], "scores slowest / fastest": s["score_balance"],
                   "check error": s["check_error"]}, detail={"ranks": reports})


# A read this much longer than its step: probably a disturbed round. A step reads its tiles as a few streams
# at once, and this memory reads a few streams up to ~1.5x as fast as the one-stream sum (float32 steps read
# 1.10-1.31x it, 8 streams 1.48x: docs/native.md "Streams", benchmarks/read_streams.py).
DISTURBED = 1.5


def _read_beside(step_ms: float, read_ms: float, nbytes: int, *, who: str = "") -> tuple[dict, dict]:
    """A decoding row's read figures, (extra, detail): ``who``'s fraction of the same bytes' read in the
    same rounds (``of read``), that read's GB/s, and the bytes against the last-level cache (below 1
    both come from it, in part); a note where the read took over DISTURBED times the step, which reads
    the same bytes and more, as a few streams at once (docs/native.md): probably a disturbed round (or,
    over a few KiB, torch's per-call cost), not a figure."""
    extra = {f"{who}of read": read_ms / step_ms, "read GB/s (same bytes, same rounds)": nbytes / read_ms / 1e6}
    cache = bench_native.last_level_cache_bytes()
    if cache:
        extra["bytes / last-level cache"] = nbytes / cache
    detail = {}
    if read_ms > DISTURBED * step_ms:
        detail["note"] = (f"its read took {read_ms / step_ms:.2f}x the step's time: probably a disturbed round (or, over "
                          "a few KiB, torch's per-call cost), not a figure; more --repeat")
    return extra, detail


def _cache_decode_rows(p: dict, where: str, memory: float) -> Iterator[Row]:
    """A decoding step (D128) from each cache format, read in place by the paged kernel
    (bench_native.cache_decode_point), a row each: its time
    beside the float32 and bfloat16 caches' (the targets: bf16 at most 0.55 of fp32, int8 at most 0.6
    of bf16), the bytes it reads per second and as a fraction of a read of the same bytes timed in the
    same rounds (_read_beside; ``memory read GB/s (sum)``: the peaks' 512 MiB sum, minutes apart), its error."""
    ms, held, reads = p["ms"], p["bytes"], p["reads"]
    for name in ms:
        read, note = _read_beside(ms[name], reads[name], held[name])
        yield Row("native", f"decode {where}, {name}", {"step": ms[name], "read": reads[name]},
                  {"/ fp32 cache": ms[name] / ms["float32 cache"], "/ bf16 cache": ms[name] / ms["bfloat16 cache"]},
                  {"GB/s": held[name] / ms[name] / 1e6, **read, "error": p["errors"][name],
                   "bytes / bf16's": held[name] / held["bfloat16 cache"], "memory read GB/s (sum)": memory}, detail=note)


def peak_rows() -> Iterator[Row]:
    """This CPU's limits at the thread count in use (mha.tools.bench_peaks), one row each (absent
    ones named), and which limit the native section judges each dtype's products against."""
    peaks = bench_peaks.current()
    threads = torch.get_num_threads()
    for name, value in peaks.items():
        if value is None:
            yield Row("peaks", f"{name}: not on this CPU / build", {}, detail={"limit": name})
        else:
            yield Row("peaks", name, {}, extra={"figure": value, "per thread": value / threads}, detail={"limit": name})
    for dtype in bench_native.DTYPES:
        limit = bench_peaks.limit_of(dtype, peaks)
        if limit:
            yield Row("peaks", f"{dtype} products judged against: {limit[0]}", {},
                      extra={"figure": limit[1], "per thread": limit[1] / threads})


def native_rows(grid: dict, repeat: int) -> Iterator[Row]:
    """The native kernel against torch's SDPA (mha.tools.bench_native): forward, forward +
    backward, decoding, a prompt over pages, a sliding window, accuracy; GFLOP/s beside a same-run square matmul of
    side grid["matmul"] (a CPU without bfloat16 instructions runs torch's bfloat16 matmul at well
    under 1 GFLOP/s: keep it small in quick grids)."""
    times = functools.partial(best_times, repeat=repeat)
    matmul = {name: bench_native.matmul_gflops(dtype, grid["matmul"]) for name, dtype in bench_native.DTYPES.items()}
    peaks = bench_peaks.current()
    memory = peaks["read GB/s"]

    def timed(point: str, ms: dict, work: float, dtype: str) -> Row:
        rates = {"native": work / ms["native"] / 1e6, "sdpa": work / ms["sdpa"] / 1e6}
        limit = bench_peaks.limit_of(dtype, peaks)
        of_limit = {f"{who} of limit": rate / limit[1] for who, rate in rates.items()} if limit else {}
        return Row("native", point, {"native": ms["native"], "sdpa": ms["sdpa"]}, {"native/sdpa": ms["native"] / ms["sdpa"]},
                   {"native GFLOP/s": rates["native"], "sdpa GFLOP/s": rates["sdpa"], **of_limit,
                    f"{dtype} matmul GFLOP/s (section's own)": matmul[dtype]}, {"limit": limit[0] if limit else None})

    for dtype in bench_native.DTYPES:
        for T in grid["forward"]:
            for causal in (False, True):
                p = bench_native.forward_point(dtype, T, causal, times)
                yield timed(f"forward {dtype} T{T}{' causal' if causal else ''}", p, p["flops"], dtype)
        p = bench_native.forward_point(dtype, grid["one_head"], True, times, heads=1)
        yield timed(f"forward {dtype} T{grid['one_head']} causal H1", p, p["flops"], dtype)
        p = bench_native.training_point(dtype, grid["training"], times)
        yield timed(f"forward+backward {dtype} T{grid['training']} causal", p, p["flops"], dtype)
        p = bench_native.decode_point(dtype, grid["decode"], times)
        read, note = _read_beside(p["native"], p["read"], p["bytes"], who="native ")
        yield Row("native", f"decode {dtype} L1 S{grid['decode']} Hq32/Hkv8 D128",
                  {"native": p["native"], "sdpa": p["sdpa"], "read": p["read"]}, {"native/sdpa": p["native"] / p["sdpa"]},
                  {"native GB/s (K, V read)": p["bytes"] / p["native"] / 1e6, "sdpa GB/s": p["bytes"] / p["sdpa"] / 1e6,
                   **read,
                   "memory read GB/s (sum)": memory}, detail=note)
    for S in grid["cache_decode"]:  # GQA 32 / 8, where 4 rows share each key widened; 8 / 8, one row a key
        for B, heads in ((1, (32, 8)), (8, (32, 8)), (1, (8, 8))):
            yield from _cache_decode_rows(bench_native.cache_decode_point(S, times, B=B, heads=heads),
                                          f"B{B} S{S} paged{'' if heads == (32, 8) else ' Hq8/Hkv8'}", memory)
    for dtype in bench_native.DTYPES:  # a prompt over pages (a prefill into a paged cache) beside the dense forward
        p = bench_native.paged_prompt_point(dtype, grid["paged_prompt"], times)
        yield Row("native", f"prompt {dtype} T{grid['paged_prompt']} causal Hq8/Hkv2 over pages of 16",
                  {"paged": p["paged"], "native": p["native"], "sdpa": p["sdpa"]},
                  {"paged/native": p["paged"] / p["native"], "paged/sdpa": p["paged"] / p["sdpa"]},
                  {"paged GFLOP/s": p["flops"] / p["paged"] / 1e6})
    calls = functools.partial(best_times, repeat=repeat, calls=10)  # short calls: several per timing
    for dtype in bench_native.DTYPES:  # where the dispatch starts to pick it (mha.kernels.dispatch.native_pays)
        for T in grid["short"]:
            p = bench_native.forward_point(dtype, T, False, calls)
            yield timed(f"short forward {dtype} T{T}", p, p["flops"], dtype)
    T, window = grid["window"]
    ms = bench_native.window_point(T, window, times)
    yield Row("native", f"window ({window}, 0) fp32 T{T}", ms,
              {"dense causal/window": ms["sdpa dense causal"] / ms["native window"]})
    for dtype in bench_native.DTYPES:
        errors = bench_native.accuracy_point(dtype, grid["accuracy"])
        yield Row("native", f"accuracy {dtype} T{grid['accuracy']} causal", {},
                  {"native/sdpa error": errors["native"] / errors["sdpa"]},
                  {"native error": errors["native"], "sdpa error": errors["sdpa"]})


def gpu_rows(grid: dict, repeat: int, device="cuda") -> Iterator[Row]:
    """The gpu section (mha.tools.bench_gpu) on ``device``: plain calls, the terms torch's SDPA lacks
    against FlexAttention by hand, half-precision errors. The device's name goes in each row."""
    name = torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else str(device)
    for T in grid["plain"]:
        for causal in (False, True):
            p = bench_gpu.plain_point(T, causal, repeat, device=device)
            yield Row("gpu", f"plain bf16 B4 H16 T{T} D128{' causal' if causal else ''} ({name})", p["times"],
                      {"mha/torch": p["times"]["mha"] / p["times"]["torch"]}, {"bitwise": p["bitwise"]})
    T = grid["terms"]
    backward = torch.device(device).type == "cuda"  # FlexAttention has no CPU backward
    for term in grid["term_sets"]:
        p = bench_gpu.terms_point(term, T, repeat, device=device, backward=backward)
        ratios = {f"{part} mha/flex": ms["mha"] / ms["flex"] for part in ("forward", "forward+backward")
                  if (ms := p.get(part))}
        yield Row("gpu", f"{term} bf16 B4 H16 T{T} D128 ({name}, mha ran {p['backend']})",
                  {f"{part} {who}": ms for part in ("forward", "forward+backward") for who, ms in p.get(part, {}).items()},
                  ratios, {"mha vs flex error": p["error"]})
    for dtype in (torch.float16, torch.bfloat16):
        for case, errors in bench_gpu.error_points(dtype, device=device).items():
            yardstick = errors.get("torch", errors["math"])
            yield Row("gpu", f"error {str(dtype)[6:]} {case} ({name})", {},
                      {f"mha/{'torch' if 'torch' in errors else 'math'} error": errors["mha"] / max(yardstick, 1e-30)},
                      {f"{who} error": e for who, e in errors.items()})


def flex_rows(lengths, repeat: int) -> Iterator[Row]:
    """The flex section: mha's flex backend on CPU beside the native kernel and FlexAttention by hand."""
    for dtype in (torch.float32, torch.bfloat16):
        for T in lengths:
            ms = bench_gpu.cpu_flex_point(T, dtype, repeat)
            ratios = {f"{who}/native": ms[who] / ms["native"] for who in ("mha flex", "flex by hand") if "native" in ms}
            yield Row("flex", f"causal window 256 + softcap {str(dtype)[6:]} B1 H8 T{T} D64 (no grad)", ms,
                      {**ratios, "mha flex/flex by hand": ms["mha flex"] / ms["flex by hand"]})


def plot_native(rows: list[Row], path: str) -> None:
    """The native kernel's time over torch's SDPA's at each point (below 1: faster), and its GFLOP/s
    beside torch's and the same-run matmul's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in rows if r.section == "native" and "native/sdpa" in r.ratios]
    fig, (ratio_ax, speed_ax) = plt.subplots(1, 2, figsize=(13, 5))
    names = [r.point for r in timed]
    ratio_ax.barh(names, [r.ratios["native/sdpa"] for r in timed], color="tab:green")
    ratio_ax.axvline(1.0, color="black", linewidth=1)
    ratio_ax.set(title="native time / torch SDPA time (same run)", xlabel="ratio (below 1: native faster)")
    ratio_ax.invert_yaxis()
    flops = [r for r in timed if "native GFLOP/s" in r.extra]
    y = range(len(flops))
    speed_ax.barh([i - 0.2 for i in y], [r.extra["native GFLOP/s"] for r in flops], height=0.4, label="native")
    speed_ax.barh([i + 0.2 for i in y], [r.extra["sdpa GFLOP/s"] for r in flops], height=0.4, label="torch SDPA")
    for i, r in enumerate(flops):
        matmul = next(v for k, v in r.extra.items() if "matmul GFLOP/s" in k)
        speed_ax.plot([matmul, matmul], [i - 0.45, i + 0.45], color="black", linewidth=2)
    speed_ax.set_yticks(list(y), [r.point for r in flops])
    speed_ax.invert_yaxis()
    speed_ax.set(title="GFLOP/s (black: a 2048^3 matmul of the dtype, same run)", xlabel="GFLOP/s")
    speed_ax.legend()
    for ax in (ratio_ax, speed_ax):
        ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- the attention contract: time against torch on the same calls ---------------------------------

def alternated_rounds(calls: int, repeat: int) -> int:
    """Single calls of each way auto_rows alternates, for a point whose loops take ``calls`` calls:
    one per loop call up to tuning.SHORT_CALL_SINGLES (the tuning's rule), at least 3, times
    ``repeat``. With 4 (the rule before), T = 128, where both sides run torch's kernel, read 0.89 to
    1.32 over three runs on 2 Zen 3 cores: the median of four single calls of 0.5 ms is this
    machine's jitter."""
    return max(3, min(tuning.SHORT_CALL_SINGLES, calls)) * repeat


def auto_rows(lengths, decode_keys, repeat: int, *, projection: bool = False, mask: bool = False) -> Iterator[Row]:
    """backend="auto" (mha.functional.scaled_dot_product_attention: checks, contract, dispatch,
    whichever kernel it picks) against torch's SDPA on the same call, B1 H8 D64, no_grad: prefill
    at every length (causal), fp32 and bf16, and decoding steps (L=1, 2 kv heads, GQA) over
    ``decode_keys`` keys. Timed two ways: back-to-back (short calls several per round, so per-call
    cost shows) and single calls alternated with other work (tuning.alternated_samples): their
    ratio the median of each round's auto/torch, the two calls a round takes one after the other
    (the ratio of the two medians, taken from calls up to a second apart, moved with this
    machine's drift: 1.08 where the rounds' median read 1.03-1.05, both sides torch's kernel).
    ``projection``: q, k and v as a model's projections give them, (B, T, H, D) seen as (B, H, T, D)
    (rows H * D apart), the prefill points only. ``mask``: the prefill points not causal, beside an
    attn_mask (L, S) of bool (a fifth of the keys hidden at random), the decoding points left out."""
    F = torch.nn.functional
    for name, dtype in bench_native.DTYPES.items():
        points = [(f"T{T}", (1, HEADS, T), (1, HEADS, T), not mask) for T in lengths]
        points += [(f"decode S{S}", (1, HEADS, 1), (1, 2, S), False) for S in ([] if projection or mask else decode_keys)]
        for point, (B, H, L), (_, Hkv, S), causal in points:
            hidden = torch.rand(L, S) > 0.2 if mask else None
            if projection:
                q = torch.randn(B, L, H, HEAD_DIM).to(dtype).transpose(1, 2)
                k, v = (torch.randn(B, S, Hkv, HEAD_DIM).to(dtype).transpose(1, 2) for _ in range(2))
            else:
                q = torch.randn(B, H, L, HEAD_DIM).to(dtype)
                k, v = (torch.randn(B, Hkv, S, HEAD_DIM).to(dtype) for _ in range(2))
            gqa = Hkv != H
            calls = max(1, min(200, 2 ** 22 // (L * S)))
            fns = {"auto": lambda: scaled_dot_product_attention(q, k, v, hidden, is_causal=causal, enable_gqa=gqa),
                   "torch": lambda: F.scaled_dot_product_attention(q, k, v, hidden, is_causal=causal, enable_gqa=gqa)}
            with torch.no_grad():
                t = best_times(fns, repeat, calls=calls)
                alone = tuning.alternated_samples(fns, alternated_rounds(calls, repeat))
            paired = statistics.median(a / b for a, b in zip(alone["auto"], alone["torch"]))
            how = ", a bool mask (L, S)" if mask else ", heads of a projection" if projection else ""
            yield Row("auto", f"{name} {point}{' causal' if causal else ''}{how}",
                      {**t, **{f"{way} alternated": statistics.median(seconds) * 1e3 for way, seconds in alone.items()}},
                      {"auto/torch": t["auto"] / t["torch"], "auto/torch alternated": paired})


def peer_rows(lengths, repeat: int) -> Iterator[Row]:
    """mha's default path against torch's SDPA and ONNX Runtime's CPU attention (the com.microsoft
    MultiHeadAttention contrib op, on its own (B, T, H*D) layout, as many threads as torch), fp32,
    B1 H8 D64, not causal, same inputs, interleaved; and the largest difference from torch's output.
    Needs onnxruntime and onnx (the onnx extra)."""
    import onnxruntime
    for T in lengths:
        session = _onnx_attention(T, HEADS, HEAD_DIM)
        x = {name: np.random.default_rng(T).standard_normal((1, T, HEADS * HEAD_DIM), dtype=np.float32)
             for name in "qkv"}
        q, k, v = (torch.from_numpy(x[name]).view(1, T, HEADS, HEAD_DIM).transpose(1, 2).contiguous()
                   for name in "qkv")  # (1, T, H*D) -> (1, H, T, D)
        with torch.no_grad():
            t = best_times({"mha": lambda: scaled_dot_product_attention(q, k, v),
                            "torch": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v),
                            "onnxruntime": lambda: session.run(None, x)}, repeat)
            reference = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
            ours = scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)  # (1, H, T, D) -> (1, T, H*D)
        theirs = torch.from_numpy(session.run(None, x)[0])
        yield Row("peers", f"fp32 T{T}", t,
                  {"mha/torch": t["mha"] / t["torch"], "onnxruntime/torch": t["onnxruntime"] / t["torch"],
                   "mha/onnxruntime": t["mha"] / t["onnxruntime"]},
                  {"mha error": (ours - reference).abs().max().item(),
                   "onnxruntime error": (theirs - reference).abs().max().item()},
                  {"onnxruntime": onnxruntime.__version__})


def _onnx_attention(T: int, heads: int, head_dim: int):
    """An ONNX Runtime session of one com.microsoft MultiHeadAttention: q, k, v (1, T, H*D) -> (1, T, H*D)."""
    import onnx
    import onnxruntime
    from onnx import TensorProto, helper
    width = heads * head_dim
    node = helper.make_node("MultiHeadAttention", ["q", "k", "v"], ["o"], domain="com.microsoft", num_heads=heads)
    graph = helper.make_graph([node], "attention",
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, T, width]) for n in "qkv"],
                              [helper.make_tensor_value_info("o", TensorProto.FLOAT, [1, T, width])])
    model = helper.make_model(graph, ir_version=10,  # what onnxruntime reads (onnx writes newer ones by default)
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    onnx.checker.check_model(model)
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    # its idle threads would otherwise spin after each run, taking the cores from the call timed next
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def contract_rows(T: int, repeat: int) -> Iterator[Row]:
    """mha.functional.scaled_dot_product_attention against torch's on the same call, B1 H8 D64,
    fp32, no_grad. Where torch has no fused form (bottom-right, padding beside causality, windows,
    ALiBi) torch is given the equivalent dense mask, as a torch user would have to."""
    ours = scaled_dot_product_attention

    F = torch.nn.functional
    q, k, v = bench_memory.attention_inputs(T)
    half = q[:, :, T // 2:]
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    padding = torch.ones(1, 1, 1, T, dtype=torch.bool)
    padding[..., -T // 16:] = False
    slopes = torch.ones(HEADS)
    cases = {
        "causal": (lambda: ours(q, k, v, is_causal=True), lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
        "causal bottom-right, L = T/2": (
            lambda: ours(half, k, v, is_causal=True, causal_alignment="bottom_right"),
            lambda: F.scaled_dot_product_attention(half, k, v, attn_mask=(j <= i[T // 2:]))),
        "causal + key padding": (
            lambda: ours(q, k, v, attn_mask=padding, is_causal=True),
            lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=padding & (j <= i))),
        "window (256, 0)": (
            lambda: ours(q, k, v, window=(256, 0)),
            lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=(j <= i) & (j >= i - 256))),
        "ALiBi causal": (
            lambda: ours(q, k, v, is_causal=True, alibi_slopes=slopes),
            lambda: F.scaled_dot_product_attention(
                q, k, v, attn_mask=(-slopes[:, None, None] * (j - i).abs()).masked_fill(j > i, float("-inf")))),
    }
    for name, (mine, theirs) in cases.items():
        with torch.no_grad():
            t = best_times({"ours": mine, "torch": theirs}, repeat)
        yield Row("contract", f"T{T} {name}", t, {"ours/torch": t["ours"] / t["torch"]})
    yield padded_decoder_row(8, 128, 256, repeat)


def padded_decoder_row(B: int, T: int, E: int, repeat: int) -> Row:
    """A padded causal batch through the drop-in (key_padding_mask + is_causal; torch: the causal
    attn_mask), eval, no weights: at short T the contract folds into one mask for torch's kernel."""
    ours, torch_train, torch_eval = _pair(E)
    x = torch.randn(B, T, E)
    padding = torch.zeros(B, T, dtype=torch.bool)
    padding[:, -T // 8:] = True
    causal = torch.nn.Transformer.generate_square_subsequent_mask(T) == float("-inf")  # bool, True = masked
    fns = {"ours": lambda: ours(x, x, x, key_padding_mask=padding, need_weights=False, is_causal=True)}
    for name, module in (("torch-train", torch_train), ("torch-eval", torch_eval)):
        fns[name] = lambda m=module: m(x, x, x, key_padding_mask=padding, need_weights=False, attn_mask=causal)
    with torch.no_grad():
        t = best_times(fns, repeat)
    return Row("contract", f"drop-in B{B} T{T} E{E} causal + key padding", t,
               {"ours/torch": t["ours"] / t["torch-train"], "ours/torch-eval": t["ours"] / t["torch-eval"]})


def plot_backends(rows: list[Row], path: str) -> None:
    """Time vs T per backend, log-log, causal and not side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, causal in zip(axes, (False, True)):
        mine = [r for r in rows if r.section == "backends" and r.point.endswith("causal") == causal]
        lengths = [int(r.point.split()[0][1:]) for r in mine]
        for name in dict.fromkeys(n for r in mine for n in r.times_ms):
            points = [(T, r.times_ms[name]) for T, r in zip(lengths, mine) if name in r.times_ms]
            ax.loglog(*zip(*points), marker="o", label=name)
        ax.set(title=f"attention core, B=1 H={HEADS} D={HEAD_DIM}{', causal' if causal else ''}",
               xlabel="sequence length T", ylabel="time (ms)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def scaling_rows(rows: list[Row]) -> Iterator[Row]:
    """How each timed point scales with the thread count, from rows run at several (mha bench
    --threads 2 16), for points measured at every count: a row per implementation (its time at each
    count, its speedup from the fewest threads) or per limit of the peaks section (its figure at each
    count, its speedup from the fewest), then a row per ratio of the point (native/sdpa, ...) with its
    value at each count."""
    counts = sorted({r.threads for r in rows if r.threads is not None})
    if len(counts) < 2:
        return
    by_point: dict[tuple[str, str], dict[int, Row]] = {}
    for r in rows:
        if r.threads is not None and (r.times_ms or ("limit" in r.detail and "figure" in r.extra)):  # or a peak
            by_point.setdefault((r.section, r.point), {})[r.threads] = r
    first = counts[0]
    measured = [(f"{section}: {point}", at) for (section, point), at in by_point.items() if set(at) == set(counts)]
    for point, at in measured:
        if not at[first].times_ms:  # a limit (the peaks section): its figure at each count, and how it grew
            yield Row("scaling", point, {}, {f"speedup {first} to {n}": at[n].extra["figure"] / at[first].extra["figure"]
                                             for n in counts[1:]},
                      {f"at {threads_label(n)}": at[n].extra["figure"] for n in counts})
        for name in at[first].times_ms:
            yield Row("scaling", f"{point} ({name})", {threads_label(n): at[n].times_ms[name] for n in counts},
                      {f"speedup {first} to {n}": at[first].times_ms[name] / at[n].times_ms[name] for n in counts[1:]})
    for point, at in measured:
        for name in at[first].ratios:
            if all(name in at[n].ratios for n in counts):
                yield Row("scaling", f"{point}: {name}", {}, {}, {f"at {threads_label(n)}": at[n].ratios[name] for n in counts})


def write(rows: list[Row], info: dict, directory: str) -> list[str]:
    """results.json, results.csv and backends.png into ``directory``; returns the paths. Rows run at
    several thread counts are all written; the plots draw those of the most threads."""
    os.makedirs(directory, exist_ok=True)
    paths = [os.path.join(directory, name) for name in ("results.json", "results.csv", "backends.png")]
    with open(paths[0], "w") as f:
        json.dump({"machine": info, "rows": [asdict(r) for r in rows]}, f, indent=1)
    with open(paths[1], "w", newline="") as f:
        table = csv.writer(f)  # quotes the points and measures that hold commas
        table.writerow(["section", "point", "measure", "value", "threads"])
        for r in rows:
            for kind, values in (("ms", r.times_ms), ("", r.ratios), ("", r.extra)):
                for name, value in values.items():
                    table.writerow([r.section, r.point, f"{name}{' ' + kind if kind else ''}", f"{value:.6g}",
                                    "" if r.threads is None else r.threads])
    most = max((r.threads for r in rows if r.threads is not None), default=None)
    rows = [r for r in rows if r.threads in (None, most)]
    if any(r.section == "backends" for r in rows):
        plot_backends(rows, paths[2])
    else:
        paths.pop()
    if any(r.section in ("variants", "quality") for r in rows):
        paths += plot_study(rows, directory)
    if any(r.section == "native" for r in rows):
        paths.append(os.path.join(directory, "native.png"))
        plot_native(rows, paths[-1])
    if any(r.section == "distributed" for r in rows):
        paths.append(os.path.join(directory, "distributed.png"))
        bench_distributed.plot_distributed(rows, paths[-1])
    return paths


def plot_study(rows: list[Row], directory: str) -> list[str]:
    """The efficient-attention study's figures; the trained task joins the Pareto plot when
    ``directory`` holds benchmarks/train_variants.py's training.json."""
    names = [r.point.split(" ", 1)[1] for r in rows if r.section in ("variants", "quality")]
    training, training_path = None, os.path.join(directory, "training.json")
    if os.path.exists(training_path):
        with open(training_path) as f:
            training = json.load(f)
    styles = plot_variants.study_styles(names)
    paths = [os.path.join(directory, "variants.png")]
    plot_variants.plot_variants(rows, paths[0], styles)
    if any(r.section == "quality" for r in rows):
        paths += [os.path.join(directory, "quality.png"), os.path.join(directory, "pareto.png")]
        plot_variants.plot_quality(rows, paths[1])
        plot_variants.plot_pareto(rows, paths[2], styles, training)
    return paths


def serving_rows(key_lengths, repeat: int, *, decode_rows: int = 60, chunk: int = 256, chunk_keys: int = 2048,
                 block_size: int = 16) -> Iterator[Row]:
    """The attention of one mixed serving step alone: ``decode_rows`` sequences decoding one token
    over S cached keys each, and one prefill chunk of ``chunk`` rows over ``chunk_keys`` keys;
    H 8 over Hkv 2, D 64, float32 and bfloat16. mha.kernels.paged_attention over a PagedKVCache's
    pages (auto: native in place when built) against the same attention on contiguous keys: one
    call of the dispatch per sequence, and one varlen call over them packed (without, then with,
    the gather that would pack them); and torch's SDPA over every key with one dense (new rows x
    all keys) mask, as transformers' continuous batching runs sdpa."""
    from ..kernels import attention, paged_attention, varlen_attention
    from ..modules.paged_cache import PagedKVCache

    H, Hkv, D = 8, 2, 64
    for S, dtype in itertools.product(key_lengths, (torch.float32, torch.bfloat16)):
        lengths_k = [S] * decode_rows + [chunk_keys]
        lengths_q = [1] * decode_rows + [chunk]
        cache = PagedKVCache(num_blocks=sum(-(-n // block_size) for n in lengths_k), block_size=block_size,
                             num_kv_heads=Hkv, head_dim=D, dtype=dtype)
        ids = [cache.add()[0] for _ in lengths_k]
        slots = cache.reserve(ids, lengths_k)
        g = torch.Generator().manual_seed(0)
        keys, values = (torch.randn(len(slots), Hkv, D, generator=g).to(dtype) for _ in range(2))
        cache.write(0, slots, keys, values)
        q = torch.randn(sum(lengths_q), H, D, generator=g).to(dtype)
        cu_q = torch.tensor([0, *itertools.accumulate(lengths_q)])
        cu_k = torch.tensor([0, *itertools.accumulate(lengths_k)])
        table, seen = cache.block_table(ids), cache.lengths(ids)
        mask = _serving_mask(lengths_q, lengths_k)  # (new rows, all keys) bool, True = attend
        dense = [x.transpose(0, 1)[None] for x in (q, keys, values)]  # (T, X, D) -> (1, X, T, D)

        def gathered():
            pages_k, pages_v = cache.pages(0)
            flat = table[table >= 0].long()
            return (pages_k[flat].transpose(1, 2).flatten(0, 1), pages_v[flat].transpose(1, 2).flatten(0, 1))

        alone = [(x[None] for x in (q[a:b].transpose(0, 1), keys[c:d].transpose(0, 1), values[c:d].transpose(0, 1)))
                 for a, b, c, d in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:])]  # (1, X, T, D) per sequence
        alone = [tuple(x) for x in alone]
        contracts = [Contract(band=CAUSAL, offset=S_b - L_b) for L_b, S_b in zip(lengths_q, lengths_k)]

        def per_sequence():
            for (qb, kb, vb), contract in zip(alone, contracts):
                attention(qb, kb, vb, contract)

        with torch.no_grad():
            t = best_times({
                "paged": lambda: paged_attention(q, *cache.pages(0), table, cu_q, seen),
                "contiguous, per sequence": per_sequence,
                "varlen contiguous": lambda: varlen_attention(q, keys, values, cu_q, cu_k, is_causal=True),
                "gather + varlen": lambda: varlen_attention(q, *_unpad(gathered(), lengths_k, block_size), cu_q, cu_k,
                                                            is_causal=True),
                "sdpa dense mask": lambda: F.scaled_dot_product_attention(*dense, attn_mask=mask, enable_gqa=True)},
                repeat)
        name = str(dtype).removeprefix("torch.")
        yield Row("serving", f"{decode_rows} decode rows over {S} keys + {chunk} rows over {chunk_keys}, {name}", t,
                  {"paged/contiguous": t["paged"] / t["contiguous, per sequence"],
                   "paged/varlen": t["paged"] / t["varlen contiguous"],
                   "paged/sdpa mask": t["paged"] / t["sdpa dense mask"]},
                  {"keys MiB": 2 * sum(lengths_k) * Hkv * D * keys.element_size() / 2 ** 20})


def _serving_mask(lengths_q, lengths_k) -> Tensor:
    """(sum L, sum S) bool: each sequence's new rows see its own keys, causal bottom-right."""
    mask = torch.zeros(sum(lengths_q), sum(lengths_k), dtype=torch.bool)
    r = c = 0
    for L, S in zip(lengths_q, lengths_k):
        mask[r:r + L, c:c + S] = Band(None, 0).visible(L, S, S - L)
        r, c = r + L, c + S
    return mask


def _unpad(pages: tuple[Tensor, Tensor], lengths_k, block_size: int) -> tuple[Tensor, Tensor]:
    """Gathered whole pages (n * P, Hkv, D) down to each sequence's keys, packed."""
    keep = torch.cat([torch.arange(-(-S // block_size) * block_size) < S for S in lengths_k])
    return pages[0][keep], pages[1][keep]


def serving_generate_rows(workloads, dtypes=("float32", "bfloat16")) -> Iterator[Row]:
    """Tokens/s and peak memory of transformers' generate_batch with mha, sdpa (and paged|eager
    where it fits: bench_serving.ways_of), and of one-at-a-time generate, on a small Llama
    (mha.tools.bench_serving), each way in a fresh process, one after another; each way once
    (minutes, not a best-of)."""
    from .bench_serving import ways_of

    for workload, name in itertools.product(workloads, dtypes):
        got = {way: run_worker("mha.tools.bench_serving", workload, name, way) for way in ways_of(workload, name)}
        rate = {way: result["tokens_per_s"] for way, result in got.items()}
        ratios = {f"mha/{way} tokens/s": rate["mha"] / r for way, r in rate.items() if way != "mha"}
        yield Row("serving", f"generate {workload} new, {name}", {}, ratios,
                  {**{f"{way} tok/s": r for way, r in rate.items()},
                   **{f"{way} peak MiB": result["peak_mib"] for way, result in got.items()}})
