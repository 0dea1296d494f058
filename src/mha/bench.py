"""Benchmarks: mha against torch, measured as ratios in one run on the same inputs.

Every timing is the best of ``repeat`` rounds in which the compared functions run in turn (so
drift in the machine's speed hits them alike). Sections:

    module    forward, need_weights=False, batch_first self-attention, fp32, no_grad:
              mha.nn.MultiheadAttention vs torch's training path and its default eval path
    causal    the same with a causal mask (ours: is_causal=True; torch: the causal attn_mask)
    backends  the attention core (B=1, H=8, D=64): sdpa, flash, math, numpy blocked, in GFLOP/s
              (4*B*H*L*S*D / time, halved when causal) beside a matmul's GFLOP/s
    training  forward + backward of the module vs torch's
    memory    peak RSS growth of every default path (causal, bottom-right, padding, windows, ALiBi,
              softcap, sinks; the general module with RoPE / ALiBi / window / padding; the drop-in)
              at T and T/2, each in a fresh process, against torch's causal SDPA on the same shape
    contract  time of mha's SDPA against torch's on the same call (torch given a dense mask where
              it has no fused form)
    modern    KV-cache decoding vs recomputation, per-token latency; sliding window vs dense causal
    variants  the efficient variants against exact attention: time, peak memory, error
"""

from __future__ import annotations

import functools
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from . import numpy as mnp
from .kernels import BACKENDS, Contract
from .nn import MultiheadAttention
from .positions import Band

HEADS, HEAD_DIM = 8, 64
_CAUSAL = Contract(band=Band(None, 0))


@dataclass
class Row:
    section: str
    point: str  # e.g. "B4 T512 E512"
    times_ms: dict[str, float]  # implementation -> best time
    ratios: dict[str, float] = field(default_factory=dict)  # "ours/torch-train" -> value
    extra: dict[str, float] = field(default_factory=dict)  # GFLOP/s, MiB, errors ...


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "threads": torch.get_num_threads(), "cores": os.cpu_count(),
            "torch": torch.__version__, "numpy": np.__version__, "python": platform.python_version()}


def best_times(fns: dict[str, Callable[[], object]], repeat: int) -> dict[str, float]:
    """Best wall time in ms of each function; one warm-up call each, then rounds in turn."""
    for fn in fns.values():
        fn()
    times = {name: float("inf") for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name] = min(times[name], (time.perf_counter() - start) * 1e3)
    return times


def _pair(E: int):
    torch.manual_seed(0)
    theirs = torch.nn.MultiheadAttention(E, HEADS, batch_first=True)
    ours = MultiheadAttention(E, HEADS, batch_first=True).eval()
    ours.load_state_dict(theirs.state_dict())
    theirs_eval = torch.nn.MultiheadAttention(E, HEADS, batch_first=True).eval()
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
    from .cache import KVCache
    from .nn import MultiHeadAttention

    torch.manual_seed(0)
    module = MultiHeadAttention(E, E, E, E // HEADS, E // HEADS, E, HEADS).eval()
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
    from .kernels import flash_attention

    q, k, v = (torch.randn(1, HEADS, T, HEAD_DIM) for _ in range(3))
    band = Contract(band=Band(window, 0))
    with torch.no_grad():
        t = best_times({"dense causal (sdpa)": lambda: BACKENDS["sdpa"](q, k, v, _CAUSAL),
                        "window (flash)": lambda: flash_attention(q, k, v, band)}, repeat)
    return Row("modern", f"T{T} window {window}", t,
               {"dense causal/window": t["dense causal (sdpa)"] / t["window (flash)"]})


# name: (variant factory source, causal); budgets follow each method's paper-style defaults
VARIANT_SETUPS = {
    "exact (sdpa)": ("efficient.Exact()", False),
    "exact causal (sdpa)": ("efficient.Exact()", True),
    "exact causal (flash)": ("FlashCausal()", True),
    "local w=256": ("efficient.Local(256)", True),
    "strided c=sqrt(T)": ("efficient.Strided(max(1, int(T ** 0.5)))", True),
    "fixed c=sqrt(T)": ("efficient.Fixed(max(1, int(T ** 0.5)), max(1, int(T ** 0.5) // 8))", True),
    "linformer k=256": ("efficient.Linformer(T, 256)", False),
    "nystrom m=64": ("efficient.Nystrom(64)", False),
    "linear": ("efficient.LinearAttention()", False),
    "linear causal": ("efficient.LinearAttention()", True),
    "performer m=256": ("efficient.Performer(64, 256, generator_seed=0)", False),
    "performer m=256 causal": ("efficient.Performer(64, 256, generator_seed=0)", True),
}

_VARIANT_SCRIPT = """
import sys, time, torch
from mha import efficient
from mha.kernels import Contract, flash_attention
from mha.positions import Band

class FlashCausal(torch.nn.Module):
    def forward(self, q, k, v, is_causal):
        return flash_attention(q, k, v, Contract(band=Band(None, 0) if is_causal else None))

T, repeat, causal, source = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
torch.manual_seed(0)
q, k, v = (torch.randn(1, 8, T, 64) for _ in range(3))
variant = eval(source)
def hwm():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmHWM")) / 1024
before = hwm()
best = float("inf")
with torch.no_grad():
    for _ in range(repeat):
        start = time.perf_counter()
        out = variant(q, k, v, is_causal=causal)
        best = min(best, time.perf_counter() - start)
    peak = hwm() - before
    rows = min(256, T)
    mask = torch.ones(rows, T, dtype=torch.bool).tril(T - rows) if causal else None
    ref = torch.nn.functional.scaled_dot_product_attention(q[:, :, -rows:], k, v, attn_mask=mask)
    error = ((out[:, :, -rows:] - ref).norm() / ref.norm()).item()
print(best * 1e3, peak, error)
"""


def variant_rows(lengths, repeat: int, names=None) -> Iterator[Row]:
    """Every efficient variant at each length, each in a fresh process (peak RSS is per process)."""
    for T in lengths:
        for name, (source, causal) in VARIANT_SETUPS.items():
            if names is not None and name not in names:
                continue
            done = subprocess.run([sys.executable, "-c", _VARIANT_SCRIPT, str(T), str(repeat), str(int(causal)), source],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{name} at T={T} failed:\n{done.stderr[-2000:]}")
            ms, peak, error = (float(x) for x in done.stdout.split())
            yield Row("variants", f"T{T} {name}", {"time": ms},
                      extra={"peak RSS growth MiB": peak, "relative error (last 256 rows)": error, "T": T})


def plot_variants(rows: list[Row], path: str) -> None:
    """Time and error against T per variant (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mine = [r for r in rows if r.section == "variants"]
    names = list(dict.fromkeys(r.point.split(" ", 1)[1] for r in mine))
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    for name in names:
        points = [(r.extra["T"], r.times_ms["time"], r.extra["relative error (last 256 rows)"])
                  for r in mine if r.point.split(" ", 1)[1] == name]
        Ts, times, errors = zip(*points)
        style = "-" if name.startswith("exact") else "--"
        left.loglog(Ts, times, style, marker="o", label=name)
        if not name.startswith("exact"):
            right.semilogx(Ts, errors, style, marker="o", label=name)
    left.set(title="time per forward (B=1, H=8, D=64)", xlabel="sequence length T", ylabel="ms")
    right.set(title="relative error vs exact attention", xlabel="sequence length T", ylabel="|out - exact| / |exact|")
    for ax in (left, right):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- memory of the default paths, each in a fresh process -------------------------------------------

def _attention_inputs(T: int, L: int | None = None):
    torch.manual_seed(0)
    return (torch.randn(1, HEADS, L or T, HEAD_DIM), torch.randn(1, HEADS, T, HEAD_DIM),
            torch.randn(1, HEADS, T, HEAD_DIM))


def _functional_case(T: int, L: int | None = None, **options):
    from .functional import scaled_dot_product_attention

    q, k, v = _attention_inputs(T, L)
    return lambda: scaled_dot_product_attention(q, k, v, **options)


def _module_case(T: int, padded: bool = False, dv: int = HEAD_DIM, **options):
    from .nn import MultiHeadAttention

    torch.manual_seed(0)
    E = HEADS * HEAD_DIM
    module = MultiHeadAttention(E, E, E, HEAD_DIM, dv, E, HEADS, **options).eval()
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
    from .nn import MultiheadAttention

    torch.manual_seed(0)
    module = MultiheadAttention(HEADS * HEAD_DIM, HEADS, batch_first=True).eval()
    x = torch.randn(1, T, HEADS * HEAD_DIM)
    padding = torch.zeros(1, T, dtype=torch.bool)
    padding[:, -T // 16:] = True
    return lambda: module(x, x, x, key_padding_mask=padding, need_weights=False, is_causal=True)[0]


def _torch_causal_case(T: int):
    q, k, v = _attention_inputs(T)
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
    from .rope import RotaryEmbedding

    return RotaryEmbedding(HEAD_DIM)


def _peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def memory_case(name: str, T: int) -> tuple[float, float]:
    """(peak RSS growth in MiB, seconds) of one no_grad call, after a warm-up at a small length
    (so that one-time allocations of the kernels do not count). Run it in a fresh process."""
    build = MEMORY_CASES[name][0]
    with torch.no_grad():
        build(256)()
        call = build(T)
        before = _peak_rss_mib()
        start = time.perf_counter()
        out = call()
        seconds = time.perf_counter() - start
    if not torch.isfinite(out).all():
        raise RuntimeError(f"memory case {name!r} gave non-finite values")
    return _peak_rss_mib() - before, seconds


def _memory_case_main() -> None:
    """Entry point of the fresh process: python -c '...' NAME T prints 'MiB seconds'."""
    name, T = sys.argv[1], int(sys.argv[2])
    print(*memory_case(name, T))


@functools.lru_cache(maxsize=None)  # a baseline is measured once per length
def _fresh_memory_case(name: str, T: int) -> tuple[float, float]:
    done = subprocess.run([sys.executable, "-c", "from mha.bench import _memory_case_main; _memory_case_main()",
                           name, str(T)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"memory case {name!r} at T={T} failed:\n{done.stderr[-2000:]}")
    growth, seconds = (float(x) for x in done.stdout.split())
    return growth, seconds


def memory_rows(T: int, names=None) -> Iterator[Row]:
    """Peak RSS growth of each default path at T and T/2 (fresh processes), against its torch
    baseline at T, and the growth ratio from T/2 to T (about 2 when memory is O(T), 4 when O(T^2))."""
    for name in names or [n for n, (_, baseline) in MEMORY_CASES.items() if baseline is not None]:
        growth, seconds = _fresh_memory_case(name, T)
        half, _ = _fresh_memory_case(name, T // 2)
        baseline_name = MEMORY_CASES[name][1]
        baseline, _ = _fresh_memory_case(baseline_name, T)
        yield Row("memory", f"T{T} {name}", {"call": seconds * 1e3},
                  {"growth / torch": growth / max(baseline, 1.0), "growth T / growth T/2": growth / max(half, 1.0)},
                  {"peak RSS growth MiB": growth, f"at T{T // 2} MiB": half, "torch MiB": baseline})


# -- the attention contract: time against torch on the same calls ---------------------------------

def contract_rows(T: int, repeat: int) -> Iterator[Row]:
    """mha.functional.scaled_dot_product_attention against torch's on the same call, B1 H8 D64,
    fp32, no_grad. Where torch has no fused form (bottom-right, padding beside causality, windows,
    ALiBi) torch is given the equivalent dense mask, as a torch user would have to."""
    from .functional import scaled_dot_product_attention as ours

    F = torch.nn.functional
    q, k, v = _attention_inputs(T)
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


def write(rows: list[Row], info: dict, directory: str) -> list[str]:
    """results.json, results.csv and backends.png into ``directory``; returns the paths."""
    os.makedirs(directory, exist_ok=True)
    paths = [os.path.join(directory, name) for name in ("results.json", "results.csv", "backends.png")]
    with open(paths[0], "w") as f:
        json.dump({"machine": info, "rows": [asdict(r) for r in rows]}, f, indent=1)
    with open(paths[1], "w") as f:
        f.write("section,point,measure,value\n")
        for r in rows:
            for kind, values in (("ms", r.times_ms), ("", r.ratios), ("", r.extra)):
                for name, value in values.items():
                    f.write(f"{r.section},{r.point},{name}{' ' + kind if kind else ''},{value:.6g}\n")
    if any(r.section == "backends" for r in rows):
        plot_backends(rows, paths[2])
    else:
        paths.pop()
    if any(r.section == "variants" for r in rows):
        paths.append(os.path.join(directory, "variants.png"))
        plot_variants(rows, paths[-1])
    return paths
