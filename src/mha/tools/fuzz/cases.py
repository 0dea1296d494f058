"""A fuzz case: every choice that makes one attention call, drawn from a seed, and the inputs it makes.

Five kinds of call:

    sdpa       mha.functional.scaled_dot_product_attention on every backend: batch dims that
               broadcast, GQA (k and v with their own head counts), causality in both alignments,
               windows, ALiBi, softcap, sinks, bool and float masks of every broadcast shape,
               scale (zero and negative too), strided layouts, NaN and infinities
    positions  mha.kernels.attention with per-sequence positions and key padding: a KV cache after
               left-padded prompts, on every backend
    varlen     mha.kernels.varlen_attention: packed sequences of different lengths (empty ones too)
    paged      mha.kernels.paged_attention: sequences' new rows (decoding rows, chunks, whole prompts)
               over their keys in a pool of pages (shuffled, partly filled, spare ones), inference only
    bad        a bad argument: every backend must refuse it with the same exception type

Sizes come from SIZES, the edges of the kernels' tiles and of the bf16 pairs among them; a case
is a frozen dataclass, printable as the JSON that replays it (``python -m mha.tools.fuzz --replay``).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
from dataclasses import dataclass

import torch
from torch import Tensor

LENGTHS = (0, 1, 2, 3, 5, 7, 8, 15, 16, 17, 31, 33, 63, 64, 65, 127, 129, 255, 256, 257)
HEAD_DIMS = (0, 1, 2, 3, 7, 8, 16, 31, 32, 33, 64, 65, 128)
DTYPES = ("float32", "float32", "bfloat16", "float16", "float64")
LAYOUTS = ("contiguous", "transposed", "mT", "sliced", "strided", "expanded")
MASK_SHAPES = ("LS", "1LS", "S", "H1S", "BHLS", "B1LS", "B11S")
SOFTCAPS = (1.0, 5.0, 30.0, 1e4, 1e6)
SCALES = (None, None, None, 0.0, -0.5, 1.0, 2.5e-2, 1e3)
MAGNITUDES = (1.0, 1.0, 1.0, 1e-3, 30.0, 100.0)
POISONS = ("q:nan", "k:nan", "v:nan", "q:inf", "k:inf", "q:-inf", "k:-inf")
BAD = ("scale:nan", "scale:inf", "scale:str", "is_causal:str", "is_causal:int", "enable_gqa:str", "window:short",
       "window:negative", "window:float", "softcap:zero", "softcap:negative", "softcap:nan", "softcap:inf",
       "alibi:shape", "alibi:int", "sinks:shape", "mask:shape", "mask:int", "dtype:int", "dtype:mixed",
       "head_dim", "key_length", "heads:indivisible", "heads:zero_kv", "dropout:negative", "dropout:big",
       "dropout:str", "alignment", "rank:1", "not_a_tensor")
PAGE_SIZES = (1, 2, 3, 16, 64, 256)
CACHE_LENGTHS = (1, 1, 2, 3, 15, 16, 17, 63, 64, 65, 129, 200, 257, 300)
CHUNKS = (2, 15, 16, 17, 63, 64, 65, 129)
POOL_LAYOUTS = ("contiguous", "transposed", "mT", "sliced", "strided")  # written in place: no expanded pool
PAGED_POISONS = ("k:nan", "k:nan", "q:nan", "v:nan", "k:inf", "q:-inf", "pool:nan")
WORK = 4_000_000  # batch x heads x L x S x (D + Dv) at most: a case stays a few milliseconds


@dataclass(frozen=True)
class Case:
    """One call. Leading dims are q's (..., H) and k's and v's (..., Hk) and (..., Hv): their batch
    dims broadcast together; with enable_gqa, Hk and Hv each divide H."""
    kind: str = "sdpa"
    seed: int = 0
    dtype: str = "float32"
    q_lead: tuple[int, ...] = (1, 2)
    k_lead: tuple[int, ...] = (1, 2)
    v_lead: tuple[int, ...] = (1, 2)
    enable_gqa: bool = False
    L: int = 8
    S: int = 8
    D: int = 8
    Dv: int = 8
    layouts: tuple[str, str, str] = ("contiguous", "contiguous", "contiguous")
    is_causal: bool = False
    alignment: str | None = None
    window: tuple[int, int] | None = None
    alibi: bool = False
    softcap: float | None = None
    sinks: bool = False
    mask: str | None = None
    mask_shape: str = "LS"
    scale: float | None = None
    magnitude: float = 1.0
    poison: str | None = None
    lengths: tuple[int, ...] = ()  # positions: the sequences' key lengths; varlen, paged: their query lengths
    k_lengths: tuple[int, ...] = ()  # varlen, paged: the sequences' key lengths
    block_size: int = 0  # paged: key slots per page of the pool
    bad: str | None = None
    grad: bool = True
    threads: int = 1  # torch's threads for the call (the kernels split work differently with more)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Case:
        fields = json.loads(text)
        tuples = {f.name for f in dataclasses.fields(cls) if "tuple" in str(f.type)}
        return cls(**{name: tuple(value) if name in tuples and value is not None else value
                      for name, value in fields.items()})

    def replace(self, **changes) -> Case:
        return dataclasses.replace(self, **changes)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def heads(self) -> int:
        return self.q_lead[-1] if self.q_lead else 1

    def size(self) -> int:
        """How big the case is (the driver keeps the smallest repro of each finding)."""
        terms = sum(bool(x) for x in (self.is_causal, self.window, self.alibi, self.softcap, self.sinks, self.mask,
                                      self.poison, self.scale is not None, self.enable_gqa))
        shapes = math.prod(self.q_lead) * (self.L + 1) * (self.S + 1) * (self.D + self.Dv + 1)
        layouts = sum(layout != "contiguous" for layout in self.layouts)
        sequences = 100 * (len(self.lengths) + len(self.k_lengths)) + sum(self.lengths) + sum(self.k_lengths)
        return shapes + 1000 * terms + 1000 * layouts + sequences + self.block_size


# -- drawing cases ---------------------------------------------------------------------------------


def draw(rng: random.Random) -> Case:
    """A random case: mostly sdpa, then positions, varlen, paged and bad arguments."""
    kind = rng.choices(("sdpa", "positions", "varlen", "paged", "bad"), weights=(62, 11, 10, 10, 7))[0]
    case = {"sdpa": _draw_sdpa, "positions": _draw_positions, "varlen": _draw_varlen, "paged": _draw_paged,
            "bad": _draw_bad}[kind](rng)
    return case.replace(seed=rng.randrange(2 ** 31), threads=rng.choice((1, 2)))


def _length(rng: random.Random) -> int:
    return rng.choice(LENGTHS) if rng.random() < 0.7 else rng.randrange(1, 300)


def _draw_heads(rng: random.Random) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], bool]:
    """(q_lead, k_lead, v_lead, enable_gqa): 0 to 3 leading dims, batch dims that broadcast, GQA."""
    rank = rng.choices((0, 1, 2, 3), weights=(5, 10, 75, 10))[0]
    q_lead = tuple(rng.choice((0, 1, 1, 2, 3, 4)) if i < rank - 1 else rng.choice((0, 1, 1, 2, 3, 4, 6, 8))
                   for i in range(rank))
    k_lead, v_lead = list(q_lead), list(q_lead)
    for i in range(rank - 1):  # a batch dim of 1 on one side broadcasts
        if q_lead[i] > 1 and rng.random() < 0.15:
            k_lead[i] = v_lead[i] = 1
        elif rng.random() < 0.1:
            q_lead = (*q_lead[:i], 1, *q_lead[i + 1:])
    gqa = rank >= 1 and q_lead[-1] > 1 and rng.random() < 0.35
    if gqa:
        divisors = [d for d in range(1, q_lead[-1] + 1) if q_lead[-1] % d == 0]
        k_lead[-1] = rng.choice(divisors)
        v_lead[-1] = k_lead[-1] if rng.random() < 0.7 else rng.choice(divisors)
    return q_lead, tuple(k_lead), tuple(v_lead), gqa


def _draw_sdpa(rng: random.Random) -> Case:
    q_lead, k_lead, v_lead, gqa = _draw_heads(rng)
    L, S = _length(rng), _length(rng)
    D = rng.choice(HEAD_DIMS)
    Dv = D if rng.random() < 0.7 else rng.choice(HEAD_DIMS)
    dtype = rng.choice(DTYPES)
    has_heads = len(q_lead) >= 1
    case = Case(
        dtype=dtype, q_lead=q_lead, k_lead=k_lead, v_lead=v_lead, enable_gqa=gqa, L=L, S=S, D=D, Dv=Dv,
        layouts=tuple(rng.choice(LAYOUTS) if rng.random() < 0.4 else "contiguous" for _ in range(3)),
        is_causal=rng.random() < 0.4,
        alignment=rng.choice((None, None, "top_left", "bottom_right")),
        window=(rng.choice((-1, 0, 1, 3, 16, 64)), rng.choice((-1, 0, 2, 16))) if rng.random() < 0.2 else None,
        alibi=has_heads and rng.random() < 0.15,
        softcap=rng.choice(SOFTCAPS) if rng.random() < 0.15 else None,
        sinks=has_heads and rng.random() < 0.15,
        mask=rng.choice(("bool", "float")) if rng.random() < 0.3 else None,
        mask_shape=rng.choice(MASK_SHAPES),
        scale=rng.choice(SCALES),
        magnitude=rng.choice(MAGNITUDES),
        poison=rng.choice(POISONS) if rng.random() < 0.1 else None,
        grad=rng.random() < 0.6 and dtype != "float16",
    )
    return _within_budget(case)


def _draw_positions(rng: random.Random) -> Case:
    B, Hkv = rng.choice((1, 2, 3)), rng.choice((1, 2))
    H = Hkv * rng.choice((1, 2, 4))
    S = rng.choice((1, 5, 16, 17, 33, 64, 65, 129, 257))
    L = min(S, rng.choice((1, 2, 5, 16, 17, 33)))
    case = Case(
        kind="positions", dtype=rng.choice(DTYPES), q_lead=(B, H), k_lead=(B, Hkv), v_lead=(B, Hkv), enable_gqa=True,
        L=L, S=S, D=rng.choice((1, 3, 8, 16, 64)), Dv=rng.choice((1, 3, 8, 16, 64)),
        is_causal=rng.random() < 0.7,
        window=(rng.choice((-1, 2, 8, 32)), rng.choice((-1, 0, 3))) if rng.random() < 0.25 else None,
        alibi=rng.random() < 0.2, softcap=rng.choice(SOFTCAPS) if rng.random() < 0.15 else None,
        sinks=rng.random() < 0.15, scale=rng.choice(SCALES), magnitude=rng.choice(MAGNITUDES),
        lengths=tuple(rng.randint(0, S) for _ in range(B)), grad=rng.random() < 0.5)
    return case.replace(Dv=case.D) if rng.random() < 0.6 else case


def _draw_varlen(rng: random.Random) -> Case:
    count = rng.choice((1, 2, 3, 5))
    k_lengths = tuple(rng.choice((0, 1, 2, 11, 16, 17, 48, 63, 64, 65, 66, 129)) for _ in range(count))
    lengths = tuple(k if rng.random() < 0.7 else rng.randint(0, k) for k in k_lengths)
    Hkv = rng.choice((1, 2, 4))
    H = Hkv * rng.choice((1, 2))
    D = rng.choice((1, 3, 8, 32, 64))
    return Case(kind="varlen", dtype=rng.choice(("float32", "bfloat16", "bfloat16", "float16", "float64")),
                q_lead=(H,), k_lead=(Hkv,), v_lead=(Hkv,), D=D, Dv=D if rng.random() < 0.7 else rng.choice((1, 8, 64)),
                is_causal=rng.random() < 0.6,
                window=(rng.choice((-1, 4, 16)), rng.choice((-1, 0, 4))) if rng.random() < 0.2 else None,
                alibi=rng.random() < 0.15, softcap=rng.choice(SOFTCAPS) if rng.random() < 0.1 else None,
                sinks=rng.random() < 0.15, scale=rng.choice(SCALES), magnitude=rng.choice(MAGNITUDES),
                lengths=lengths, k_lengths=k_lengths, grad=rng.random() < 0.4)


def _draw_paged(rng: random.Random) -> Case:
    """1 to 5 sequences, each L_b >= 1 new rows over S_b >= L_b keys in pages of block_size slots;
    causal (bottom-right) mostly, GQA, every term, the pool in a layout of its own; no gradients."""
    k_lengths = tuple(rng.choice(CACHE_LENGTHS) if rng.random() < 0.8 else rng.randint(1, 300)
                      for _ in range(rng.randint(1, 5)))
    Hkv = rng.choice((1, 2, 4))
    D = rng.choice((0, 1, 3, 8, 16, 31, 64, 65, 128))
    pool = tuple(rng.choice(POOL_LAYOUTS) if rng.random() < 0.3 else "contiguous" for _ in range(2))
    case = Case(kind="paged", dtype=rng.choice(DTYPES), q_lead=(Hkv * rng.choice((1, 2, 4)),), k_lead=(Hkv,),
                v_lead=(Hkv,), D=D, Dv=D if rng.random() < 0.7 else rng.choice((0, 1, 7, 8, 64)),
                layouts=("contiguous", *pool), is_causal=rng.random() < 0.8,
                window=(rng.choice((-1, 0, 1, 2, 5, 16, 100)), rng.choice((-1, 0, 3))) if rng.random() < 0.25 else None,
                alibi=rng.random() < 0.15, softcap=rng.choice(SOFTCAPS) if rng.random() < 0.15 else None,
                sinks=rng.random() < 0.15, scale=rng.choice(SCALES), magnitude=rng.choice(MAGNITUDES),
                poison=rng.choice(PAGED_POISONS) if rng.random() < 0.1 else None,
                lengths=tuple(_new_rows(rng, S) for S in k_lengths), k_lengths=k_lengths,
                block_size=rng.choice(PAGE_SIZES), grad=False)
    return _paged_within_budget(case)


def _new_rows(rng: random.Random, S: int) -> int:
    """A sequence's new query rows over its S keys: a decoding row, the whole prompt, a chunk."""
    how = rng.choices(("decode", "prefill", "edge", "any"), weights=(35, 30, 20, 15))[0]
    return {"decode": 1, "prefill": S, "edge": min(S, rng.choice(CHUNKS)), "any": rng.randint(1, S)}[how]


def _paged_within_budget(case: Case) -> Case:
    """The costliest sequence's query rows halved (its keys once it has one row) until the work is within WORK."""
    lengths, k_lengths = list(case.lengths), list(case.k_lengths)
    per_pair = case.heads * (case.D + case.Dv + 2)
    while per_pair * sum(L * S for L, S in zip(lengths, k_lengths)) > WORK:
        b = max(range(len(lengths)), key=lambda i: lengths[i] * k_lengths[i])
        if lengths[b] > 1:
            lengths[b] //= 2
        else:
            k_lengths[b] = max(1, k_lengths[b] // 2)
    return case.replace(lengths=tuple(lengths), k_lengths=tuple(k_lengths))


def _draw_bad(rng: random.Random) -> Case:
    return Case(kind="bad", bad=rng.choice(BAD), dtype=rng.choice(("float32", "bfloat16")), L=rng.choice((1, 4, 17)),
                S=rng.choice((1, 4, 17)), q_lead=(2, 4), k_lead=(2, 4), v_lead=(2, 4), grad=False)


def _within_budget(case: Case) -> Case:
    """Lengths shrunk until the case's work is within WORK."""
    while math.prod(case.q_lead) * case.L * case.S * (case.D + case.Dv + 2) > WORK:
        case = case.replace(L=max(1, case.L // 2), S=max(1, case.S // 2))
    return case


# -- the inputs of a case ---------------------------------------------------------------------------


def generator(case: Case, salt: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed((case.seed * 7919 + salt) % 2 ** 63)


def tensor(shape: tuple[int, ...], layout: str, dtype: torch.dtype, g: torch.Generator, magnitude: float = 1.0) -> Tensor:
    """Random normal values of ``shape`` (..., T, X), in memory laid out as ``layout`` says:
    transposed (dims -3 and -2 swapped in memory, as heads split from a (B, T, H, X) projection),
    mT (the last two swapped), sliced (a stride-2 last dim), strided (rows of a wider buffer, a
    storage offset), expanded (the first dim broadcast from 1: stride 0)."""
    def values(*dims):
        return (torch.randn(dims, generator=g, dtype=torch.float64) * magnitude).to(dtype)

    if layout == "transposed" and len(shape) >= 3:
        return values(*shape[:-3], shape[-2], shape[-3], shape[-1]).transpose(-3, -2)
    if layout == "mT" and len(shape) >= 2:
        return values(*shape[:-2], shape[-1], shape[-2]).mT
    if layout == "sliced":
        return values(*shape[:-1], 2 * shape[-1])[..., ::2]
    if layout == "strided" and len(shape) >= 2:
        return values(*shape[:-2], shape[-2] + 3, shape[-1] + 5)[..., 2:2 + shape[-2], 1:1 + shape[-1]]
    if layout == "expanded" and len(shape) >= 3 and shape[0] > 1:
        return values(1, *shape[1:]).expand(shape)
    return values(*shape)


def qkv(case: Case) -> tuple[Tensor, Tensor, Tensor]:
    """q (*q_lead, L, D), k (*k_lead, S, D), v (*v_lead, S, Dv), each in its layout, poisoned as the case says."""
    g, dtype = generator(case), case.torch_dtype
    shapes = ((*case.q_lead, case.L, case.D), (*case.k_lead, case.S, case.D), (*case.v_lead, case.S, case.Dv))
    magnitudes = (case.magnitude, case.magnitude, 1.0)
    q, k, v = (tensor(shape, layout, dtype, g, m) for shape, layout, m in zip(shapes, case.layouts, magnitudes))
    return poisoned(case, q, k, v, g)


def poisoned(case: Case, q: Tensor, k: Tensor, v: Tensor, g: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v with the case's poison (``which:value``, as "k:nan") at one random element of one of
    them (a copy of it); the others as they are. A poison of none of them (paged's pool:nan) changes nothing."""
    which, _, kind = (case.poison or "").partition(":")
    target = {"q": q, "k": k, "v": v}.get(which)
    if target is None or not target.numel():
        return q, k, v
    target = target.clone()  # an expanded tensor cannot take one element (the clone keeps other layouts)
    index = int(torch.randint(target.numel(), (), generator=g))
    target[tuple(_unravel(index, target.shape))] = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}[kind]
    return tuple(target if name == which else x for name, x in (("q", q), ("k", k), ("v", v)))


def packed(case: Case, g: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """varlen, paged: the sequences one after another, q (Tq, H, D), k (Tk, Hkv, D), v (Tk, Hkv, Dv)."""
    dtype, H, Hkv = case.torch_dtype, case.q_lead[-1], case.k_lead[-1]
    q = tensor((sum(case.lengths), H, case.D), "contiguous", dtype, g, case.magnitude)
    k = tensor((sum(case.k_lengths), Hkv, case.D), "contiguous", dtype, g, case.magnitude)
    v = tensor((sum(case.k_lengths), Hkv, case.Dv), "contiguous", dtype, g)
    return q, k, v


def pages(case: Case, k: Tensor, v: Tensor, g: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """paged: (k_pages (N, Hkv, P, D), v_pages (N, Hkv, P, Dv), block_table (B, M) int32) holding the
    packed k (Tk, Hkv, D) and v (Tk, Hkv, Dv): sequence b's key j in page table[b, j // P], slot
    j % P. The pages come in shuffled order with up to 3 spare ones, the table has up to 2 unused
    columns, its unused entries are -1, and the pool is laid out as case.layouts[1:] say. Slots that
    hold no key keep random values, or NaN with the poison pool:nan (a kernel must never read them)."""
    P = case.block_size
    used = [-(-S // P) for S in case.k_lengths]  # pages per sequence
    N = sum(used) + int(torch.randint(0, 4, (), generator=g))
    order = torch.randperm(N, generator=g).to(torch.int32)
    table = torch.full((len(used), max(used) + int(torch.randint(0, 3, (), generator=g))), -1, dtype=torch.int32)
    for b, (first, n) in enumerate(zip(itertools.accumulate(used, initial=0), used)):
        table[b, :n] = order[first:first + n]
    keys = torch.cat([torch.arange(S) for S in case.k_lengths])  # (Tk,): each key's index in its sequence
    owner = torch.repeat_interleave(torch.arange(len(used)), torch.tensor(case.k_lengths))  # (Tk,)
    page, slot = table[owner, keys // P].long(), keys % P
    pools = []
    for x, layout, magnitude in ((k, case.layouts[1], case.magnitude), (v, case.layouts[2], 1.0)):
        pool = tensor((N, x.shape[1], P, x.shape[2]), layout, x.dtype, g, magnitude)
        if case.poison == "pool:nan":
            pool.fill_(math.nan)
        pool[page, :, slot] = x  # pool[page[t], :, slot[t]] = x[t]: (Tk, Hkv, X) into (N, Hkv, P, X)
        pools.append(pool)
    return pools[0], pools[1], table


def _unravel(index: int, shape: tuple[int, ...]) -> list[int]:
    """The multi-index of flat ``index`` in ``shape`` (row-major)."""
    out = []
    for size in reversed(shape):
        index, rest = divmod(index, size)
        out.append(rest)
    return out[::-1]


def per_head(case: Case, salt: int) -> Tensor:
    """ALiBi slopes (positive, ALiBi's range) or sink logits, (H,) in the case's dtype."""
    g = generator(case, salt)
    if salt == 1:  # slopes
        return (torch.rand(case.heads, generator=g, dtype=torch.float64) * 0.5 + 1e-3).to(case.torch_dtype)
    return (torch.randn(case.heads, generator=g, dtype=torch.float64) * 2).to(case.torch_dtype)


def attn_mask(case: Case) -> Tensor | None:
    """The caller's mask (bool True = attend, or float, -inf here and there), of the case's broadcast shape."""
    if case.mask is None:
        return None
    lead = case.q_lead
    B = lead[0] if len(lead) >= 2 else 1
    H = lead[-1] if lead else 1
    shape = {"LS": (case.L, case.S), "1LS": (1, case.L, case.S), "S": (case.S,), "H1S": (H, 1, case.S),
             "BHLS": (*lead, case.L, case.S), "B1LS": (B, *([1] * (len(lead) - 1)), case.L, case.S),
             "B11S": (B, *([1] * (len(lead) - 1)), 1, case.S)}[case.mask_shape]
    if len(shape) > len(lead) + 2:
        shape = shape[len(shape) - len(lead) - 2:]
    g = generator(case, 3)
    if case.mask == "bool":
        return torch.rand(shape, generator=g) < 0.8
    values = torch.randn(shape, generator=g, dtype=torch.float64)
    values = values.masked_fill(torch.rand(shape, generator=g) < 0.15, -math.inf)
    return values.to(case.torch_dtype)


def sequence_positions(case: Case) -> tuple[Tensor, Tensor, Tensor]:
    """positions: (query (B, L), key (B, S) positions, key_valid (B, S)) of a cache holding sequence b's
    ``lengths[b]`` keys at its end (left padding before them, at negative positions), the L queries
    being its last L positions."""
    S, L = case.S, case.L
    k_pos = torch.stack([torch.arange(S) - (S - n) for n in case.lengths])  # (B, S)
    return k_pos[:, S - L:], k_pos, k_pos >= 0


def band_of(case: Case) -> tuple[int | None, int | None] | None:
    """(left, right) visible distances key - query (None: unbounded), or None when every key is visible."""
    if case.window is None:
        return (None, 0) if case.is_causal else None
    left, right = (None if w == -1 else w for w in case.window)
    right = 0 if case.is_causal else right
    return None if left is None and right is None else (left, right)


def offset_of(case: Case, L: int, S: int) -> int:
    """Where query 0 sits: 0 top-left, S - L bottom-right (the default with ALiBi, or a window that
    bounds what is_causal alone does not)."""
    windowed = case.window is not None and band_of(case) != band_of(dataclasses.replace(case, window=None))
    alignment = case.alignment or ("bottom_right" if windowed or case.alibi else "top_left")
    return 0 if alignment == "top_left" else S - L
