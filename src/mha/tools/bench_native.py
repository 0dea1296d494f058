"""``mha bench --sections native``: the native kernel against torch's SDPA, in one run.

Every point times the native kernel and torch's fused kernel on the same inputs, interleaved
(mha.tools.bench.best_times), B=1 H=8 D=64 unless said; GFLOP/s (4 B H L S D, halved when causal;
3.5x that for forward + backward) sit beside a same-run 2048^3 matmul of the same dtype. Points:

    forward        fp32 and bf16, T = 1024 and 4096, causal and not
    one head       the causal forward of H = 1, T = 4096: one sequence's blocks, costing 1 to T / 64
                   blocks' keys, spread over the threads (the work's split, not the products)
    short          forward at T = 16 .. 512: where the native kernel's per-call cost stops showing
    training       forward + backward, T = 2048, causal, fp32 and bf16
    decode         one query, S = 16384 cached keys, 32 query heads on 8 kv heads, D = 128; the
                   K/V bytes read per second beside a same-run sum over 256 MiB (memory speed)
    window         a sliding window of 256 keys at T = 16384 against dense causal SDPA
    accuracy       error against float64 of both, fp32 and bf16 (T = 1024, causal)
"""

from __future__ import annotations

import functools
import glob
import re
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..kernels import Contract, native
from ..positions import CAUSAL, Band

HEADS, HEAD_DIM = 8, 64
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def matmul_gflops(dtype: torch.dtype, n: int = 2048, repeat: int = 3) -> float:
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ b
    best = min(_seconds(lambda: a @ b) for _ in range(repeat))
    return 2 * n ** 3 / best / 1e9


def read_gbytes_per_second(mib: int = 256, repeat: int = 4) -> float:
    """This machine's memory read speed now: read_call over a ``mib`` MiB tensor, best of ``repeat``."""
    x = torch.ones(mib * 2 ** 17, dtype=torch.int64)  # mib MiB
    read = read_call(x)
    best = min(_seconds(read) for _ in range(repeat))
    return x.numel() * 8 / best / 1e9


def read_call(*tensors: torch.Tensor) -> Callable[[], object]:
    """A read of the bytes the tensors hold: torch's sum over each as 64-bit integers, whatever its
    dtype (the bytes before its first and past its last whole word left out): torch's fastest read of them (from the
    third-level cache a float32 or bfloat16 sum took 1.2-1.5x an int64 one over the same bytes, from
    memory the same; 8-bit integers sum at under 1 GB/s). Timed among a decoding step's rounds, it is
    the read rate beside the step: this machine's read rate drifts 10-20 % within minutes."""
    def as_words(t: torch.Tensor) -> torch.Tensor:
        if not t.is_contiguous():  # a sum of a strided view reads its copy, or lines it skips
            raise ValueError(f"read_call reads contiguous tensors, got one of shape {tuple(t.shape)} "
                             f"and strides {t.stride()}: pass the tensor it is a view of")
        flat = t.reshape(-1).view(torch.uint8)
        flat = flat[(-flat.data_ptr()) % 8:]  # a view that starts between words: from its first whole one
        return flat[: flat.numel() // 8 * 8].view(torch.int64)
    words = [as_words(t) for t in tensors]
    return lambda: [t.sum() for t in words]


@functools.cache
def last_level_cache_bytes(root: str = "/sys/devices/system/cpu/cpu0/cache") -> int | None:
    """The size of this CPU's largest cache as Linux reports it (the highest level among ``root``'s
    index*/level and index*/size, such as "32768K" or "1M"); None where it does not say."""
    found = {}
    for index in glob.glob(f"{root}/index*"):
        try:
            with open(f"{index}/level") as level, open(f"{index}/size") as size:
                match = re.fullmatch(r"(\d+)([KMG]?)", size.read().strip())
                if match and int(match[1]) > 0:
                    found[int(level.read())] = int(match[1]) * {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}[match[2]]
        except (OSError, ValueError):
            continue
    return found[max(found)] if found else None


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _inputs(dtype, L, S=None, heads=HEADS, kv_heads=None, head_dim=HEAD_DIM, grad=False):
    g = torch.Generator().manual_seed(0)
    shapes = ((1, heads, L, head_dim), (1, kv_heads or heads, S or L, head_dim), (1, kv_heads or heads, S or L, head_dim))
    return tuple(torch.randn(s, generator=g).to(dtype).requires_grad_(grad) for s in shapes)


def forward_point(dtype: str, T: int, causal: bool, times, *, heads: int = HEADS) -> dict:
    """{"native": ms, "sdpa": ms, "flops": ...} of one no-grad forward at length T."""
    q, k, v = _inputs(DTYPES[dtype], T, heads=heads)
    contract = Contract(band=CAUSAL) if causal else Contract()
    with torch.no_grad():
        ms = times({"native": lambda: native.native_attention(q, k, v, contract),
                    "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)})
    return {**ms, "flops": 4 * heads * T * T * HEAD_DIM / (2 if causal else 1)}


def training_point(dtype: str, T: int, times) -> dict:
    """Forward + backward, causal: the backward costs about 2.5 forwards (3.5x the flops in all)."""
    q, k, v = _inputs(DTYPES[dtype], T, grad=True)
    grad = torch.randn_like(q)
    ms = times({"native": lambda: native.native_attention(q, k, v, Contract(band=CAUSAL)).backward(grad),
                "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)})
    return {**ms, "flops": 3.5 * 4 * HEADS * T * T * HEAD_DIM / 2}


def decode_point(dtype: str, S: int, times) -> dict:
    """One new query over S cached keys, GQA 32 / 8 heads, D = 128; the K/V bytes read per call."""
    q, k, v = _inputs(DTYPES[dtype], 1, S, heads=32, kv_heads=8, head_dim=128)
    with torch.no_grad():
        ms = times({"native": lambda: native.native_attention(q, k, v),
                    "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                    "read": read_call(k, v)})  # the same bytes, in the same rounds
    return {**ms, "bytes": 2 * k.numel() * k.element_size()}


def cache_decode_point(S: int, times, *, B: int = 1, heads: tuple[int, int] = (32, 8)) -> dict:
    """One new query per sequence over S cached keys (B sequences, ``heads`` query / key-value heads:
    GQA 32 / 8, or 8 / 8 where each key is read for one query row; D = 128), the
    keys and values held as float32, bfloat16 or int8 (as mha's caches keep them, mha.kernels.storage:
    a float32 scale per (token, head) after each row), each read in place by the native paged kernel
    (one page per sequence) under float32 queries, the int8 cache again under bfloat16 queries (a
    bfloat16 model's: the bfloat16 cache's queries, which 8-bit keys score on 16-bit integers where the
    build has AVX512-VNNI), and the int8 rows with their scales apart (contiguous k_scales, v_scales:
    the layout the caches kept before mha.kernels.storage): times, the bytes each cache holds, and
    each output's largest error against float64 attention over the unquantized keys; and a read of
    each cache's bytes in the same rounds ("reads": read_call's time per cache)."""
    from ..kernels import paged_attention, storage

    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, heads[0], 128, generator=g)  # (B sequences x 1 row, H, D)
    k, v = (torch.randn(B, heads[1], S, 128, generator=g) for _ in range(2))  # (B pages, Hkv, P = S, D)
    table, cu, lengths = torch.arange(B)[:, None], torch.arange(B + 1), torch.full((B,), S)
    k8, v8 = storage.store(k, True), storage.store(v, True)  # (B, Hkv, S, 128 + 4) int8
    (k_rows, k_scales), (v_rows, v_scales) = ((rows.contiguous(), scales.contiguous())
                                              for rows, scales in (storage.split(k8), storage.split(v8)))
    kb, vb, qb = k.bfloat16(), v.bfloat16(), q.bfloat16()
    calls = {"float32 cache": lambda: paged_attention(q, k, v, table, cu, lengths, is_causal=False),
             "bfloat16 cache": lambda: paged_attention(qb, kb, vb, table, cu, lengths, is_causal=False),
             "int8 cache": lambda: paged_attention(q, k8, v8, table, cu, lengths, is_causal=False),
             "int8 cache, bfloat16 queries": lambda: paged_attention(qb, k8, v8, table, cu, lengths, is_causal=False),
             "int8, scales apart": lambda: paged_attention(q, k_rows, v_rows, table, cu, lengths, is_causal=False,
                                                           k_scales=k_scales, v_scales=v_scales)}
    reads = {"float32 cache": read_call(k, v), "bfloat16 cache": read_call(kb, vb), "int8 cache": read_call(k8, v8),
             "int8, scales apart": read_call(k_rows, v_rows, k_scales, v_scales)}
    with torch.no_grad():
        both = times({**calls, **{f"read {name}": read for name, read in reads.items()}})
        ms, read_ms = {name: both[name] for name in calls}, {name: both[f"read {name}"] for name in reads}
        read_ms["int8 cache, bfloat16 queries"] = read_ms["int8 cache"]  # the same bytes: read once a round
        exact = paged_attention(q.double(), k.double(), v.double(), table, cu, lengths, is_causal=False, backend="math")
        errors = {name: float((call().double() - exact).abs().max()) for name, call in calls.items()}
    held = {"float32 cache": 2 * k.numel() * 4, "bfloat16 cache": 2 * k.numel() * 2, "int8 cache": 2 * k8.numel(),
            "int8 cache, bfloat16 queries": 2 * k8.numel(), "int8, scales apart": 2 * k8.numel()}
    return {"ms": ms, "reads": read_ms, "errors": errors, "bytes": held}


def paged_prompt_point(dtype: str, T: int, times, *, kv_heads: int = 2, page: int = 16) -> dict:
    """A causal prompt of T rows over its own T keys held in pages of ``page`` keys (a prefill into a
    PagedKVCache, a chunk of continuous batching), GQA HEADS / kv_heads: mha.kernels.paged_attention
    against the dense native forward and torch's SDPA on the same keys contiguous."""
    from ..kernels import paged_attention

    q, k, v = _inputs(DTYPES[dtype], T, kv_heads=kv_heads)
    rows = q[0].transpose(0, 1).contiguous()  # (1, H, T, D) -> (T, H, D)
    pages = [x[0].transpose(0, 1).reshape(T // page, page, kv_heads, HEAD_DIM).transpose(1, 2).contiguous()
             for x in (k, v)]  # (1, Hkv, T, D) -> (T / page, Hkv, page, D)
    table, cu, lengths = torch.arange(T // page)[None], torch.tensor([0, T]), torch.tensor([T])
    with torch.no_grad():
        ms = times({"paged": lambda: paged_attention(rows, *pages, table, cu, lengths),
                    "native": lambda: native.native_attention(q, k, v, Contract(band=CAUSAL)),
                    "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)})
    return {**ms, "flops": 4 * HEADS * T * T * HEAD_DIM / 2}


def window_point(T: int, window: int, times) -> dict:
    """A causal sliding window (flash-attn's (window, 0)) on native against dense causal SDPA, fp32."""
    q, k, v = _inputs(torch.float32, T)
    with torch.no_grad():
        return times({"native window": lambda: native.native_attention(q, k, v, Contract(band=Band(window, 0))),
                      "sdpa dense causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)})


def error_pairs(amplitude: float, calls: int, *, terms: bool = False, seed: int = 0) -> list[tuple[float, float]]:
    """Per random float32 call (B1 H3 L = S = 24, D 32, Dv 64; q and k times ``amplitude``, so its
    scores reach about 4 * amplitude^2 typically), (native's largest error against float64, the
    reference's): torch's SDPA, or with ``terms`` (ALiBi, a window (17, 5) and sinks, which torch's
    kernel lacks) mha's math backend in float32."""
    from ..functional import scaled_dot_product_attention as attend

    g = torch.Generator().manual_seed(seed)
    pairs = []
    for _ in range(calls):
        q, k = (torch.randn(1, 3, 24, 32, generator=g, dtype=torch.float64) * amplitude for _ in range(2))
        v = torch.randn(1, 3, 24, 64, generator=g, dtype=torch.float64)
        options = {}
        if terms:
            options = {"alibi_slopes": torch.rand(3, generator=g, dtype=torch.float64), "window": (17, 5),
                       "sinks": torch.randn(3, generator=g, dtype=torch.float64) * amplitude}
        exact = attend(q, k, v, backend="math", **options)
        low = {name: x.float() if isinstance(x, torch.Tensor) else x for name, x in options.items()}
        with torch.no_grad():
            ours = attend(q.float(), k.float(), v.float(), backend="native", **low).double()
            theirs = (attend(q.float(), k.float(), v.float(), backend="math", **low) if terms
                      else F.scaled_dot_product_attention(q.float(), k.float(), v.float())).double()
        pairs.append((float((ours - exact).abs().max()), float((theirs - exact).abs().max())))
    return pairs


def accuracy_point(dtype: str, T: int) -> dict:
    """Largest |output - float64 output| of native and of torch's SDPA in ``dtype``, causal."""
    q, k, v = _inputs(torch.float64, T)
    exact = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    low = [x.to(DTYPES[dtype]) for x in (q, k, v)]
    with torch.no_grad():
        ours = native.native_attention(*low, Contract(band=CAUSAL)).double()
        theirs = F.scaled_dot_product_attention(*low, is_causal=True).double()
    return {"native": float((ours - exact).abs().max()), "sdpa": float((theirs - exact).abs().max())}
