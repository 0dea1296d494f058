"""``mha bench --sections gpu`` (a CUDA device) and ``--sections flex`` (FlexAttention on CPU beside
the native kernel): mha against torch's own kernels, in one run, interleaved.

    plain     B4 H16 D128 bf16, causal and not: mha's default call against torch's SDPA, the time
              ratio and whether the result is torch's bitwise
    terms     the terms torch's SDPA has no form for, B4 H16 T D128 bf16 (a sliding window, softcap,
              ALiBi, sinks, packed documents, a window with softcap and sinks): mha's default call
              (which runs them on FlexAttention) against FlexAttention written by hand with the same
              functions (compiled, its block mask built once), forward and forward + backward
    errors    float16 and bfloat16 errors against float64 (B2 H8 over 2 kv heads, L96 S160 D64, the
              calls that were wrong on CUDA): mha's beside torch's own for the same call where torch
              has one, and beside mha's math backend in that dtype
    flex      (CPU) mha's flex backend, the native kernel and hand-written FlexAttention, forward

Times are the best of ``repeat`` rounds of ``calls`` calls each, the compared functions in turn,
the device synchronised around each round (CUDA); errors are max |got - want| / max |want|.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ..functional import scaled_dot_product_attention as sdpa
from ..kernels import Contract, choose_backend
from ..kernels.varlen import varlen_attention
from ..positions import Band

__all__ = ["TERMS", "cpu_flex_point", "error_points", "plain_point", "terms_point", "times"]

HEADS, HEAD_DIM = 16, 128
TERMS = ("window", "softcap", "alibi", "sinks", "documents", "window+softcap+sinks")


def times(fns: dict[str, Callable[[], object]], repeat: int, *, calls: int = 10, device="cuda") -> dict[str, float]:
    """Best ms per call of each function: a warm-up call each (compiles), then ``repeat`` rounds in
    turn of ``calls`` calls, the device synchronised around each."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    for fn in fns.values():
        fn()
    sync()
    best = {name: float("inf") for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            sync()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            sync()
            best[name] = min(best[name], (time.perf_counter() - start) / calls * 1e3)
    return best


def _qkv(B, H, L, S, D, dtype, device, *, kv_heads=None, grad=False, seed=0) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = ((B, H, L, D), (B, kv_heads or H, S, D), (B, kv_heads or H, S, D))
    return tuple(torch.randn(s, generator=g).to(device=device, dtype=dtype).requires_grad_(grad) for s in shapes)


# -- plain calls ---------------------------------------------------------------------------------------

def plain_point(T: int, causal: bool, repeat: int, device="cuda", dtype=torch.bfloat16, B=4) -> dict:
    """{"times": {"mha": ms, "torch": ms}, "bitwise": 1.0 or 0.0} of one plain call."""
    q, k, v = _qkv(B, HEADS, T, T, HEAD_DIM, dtype, device)
    with torch.no_grad():
        ms = times({"mha": lambda: sdpa(q, k, v, is_causal=causal),
                    "torch": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)}, repeat, device=device)
        same = torch.equal(sdpa(q, k, v, is_causal=causal), F.scaled_dot_product_attention(q, k, v, is_causal=causal))
    return {"times": ms, "bitwise": float(same)}


# -- the terms torch's SDPA lacks: mha against FlexAttention written by hand ---------------------------

def _hand_flex(name: str, T: int, device, slopes: Tensor, sinks: Tensor, document: Tensor, window: int):
    """FlexAttention with the term's functions written by hand: (call(q, k, v) -> out, the block mask
    built once). q, k, v (B, H, T, D); documents: (1, H, T, D) packed."""
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

    compiled = torch.compile(flex_attention, dynamic=False if torch.device(device).type == "cpu" else None)  # as mha's

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def windowed(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= window)

    def same_document(b, h, q_idx, kv_idx):
        return (document[q_idx] == document[kv_idx]) & (q_idx >= kv_idx)

    def softcap(score, b, h, q_idx, kv_idx):
        return 30.0 * torch.tanh(score / 30.0)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    mask = {"window": windowed, "softcap": causal, "alibi": causal, "sinks": causal, "documents": same_document,
            "window+softcap": windowed, "window+softcap+sinks": windowed}[name]
    score = {"softcap": softcap, "alibi": alibi, "window+softcap": softcap, "window+softcap+sinks": softcap}.get(name)
    block_mask = create_block_mask(mask, None, None, T, T, device=device)
    with_sinks = "sinks" in name

    def call(q, k, v):
        if not with_sinks:
            return compiled(q, k, v, score_mod=score, block_mask=block_mask)
        out, aux = compiled(q, k, v, score_mod=score, block_mask=block_mask, return_aux=AuxRequest(lse=True))
        kept = torch.sigmoid(aux.lse - sinks[:, None])  # the sink's share of each row, its value zero
        return (out.float() * kept[..., None]).to(out.dtype)
    return call


def _mha_call(name: str, T: int, slopes: Tensor, sinks: Tensor, cu: Tensor, window: int) -> Callable:
    """mha's default call with the term: what a user writes."""
    if name == "documents":
        def packed(q, k, v):  # (1, H, T, D) -> (T, H, D), back after
            rows = [x[0].transpose(0, 1) for x in (q, k, v)]
            return varlen_attention(*rows, cu, cu, is_causal=True).transpose(0, 1)[None]
        return packed
    options = {"window": {"window": (window, 0)}, "softcap": {"softcap": 30.0}, "alibi": {"alibi_slopes": slopes},
               "sinks": {"sinks": sinks},
               "window+softcap+sinks": {"window": (window, 0), "softcap": 30.0, "sinks": sinks}}[name]
    return lambda q, k, v: sdpa(q, k, v, is_causal=True, **options)


def _compiled_throughout():
    """dynamo's recompile limit raised for the bench: mha's flex and the hand-written one share
    FlexAttention's code object, whose 8 compiled entries (a dtype, a grad mode, a set of terms each)
    would otherwise run out and leave the later points timing torch's unfused fallback."""
    config = torch._dynamo.config
    return config.patch(recompile_limit=256) if hasattr(config, "recompile_limit") else config.patch(cache_size_limit=256)


def terms_point(name: str, T: int, repeat: int, **options) -> dict:
    """{"forward": {"mha": ms, "flex": ms}, "forward+backward": {...}, "backend": what auto ran, "error":
    max |mha - hand| / max |hand|}: one term set against FlexAttention by hand (_terms_point's options)."""
    with _compiled_throughout():
        return _terms_point(name, T, repeat, **options)


def _terms_point(name: str, T: int, repeat: int, *, device="cuda", dtype=torch.bfloat16, B=4, backward=True,
                 window=512) -> dict:
    """terms_point's work (documents: B = 1 of B * T tokens in 8 documents)."""
    slopes = torch.exp2(-8.0 * torch.arange(1, HEADS + 1) / HEADS).to(device)
    sinks = torch.linspace(-1.0, 1.0, HEADS).to(device)
    if name == "documents":
        B, T = 1, B * T
    lengths = torch.full((8,), T // 8)
    lengths[-1] += T - int(lengths.sum())
    cu = F.pad(lengths.cumsum(0), (1, 0))
    document = torch.repeat_interleave(torch.arange(8), lengths).to(device)
    mha_call = _mha_call(name, T, slopes, sinks, cu, window)
    hand_call = _hand_flex(name, T, device, slopes, sinks, document, window)
    q, k, v = _qkv(B, HEADS, T, T, HEAD_DIM, dtype, device, grad=backward)
    result = {"backend": _backend_of(name, q, k, v, slopes, sinks, window)}
    with torch.no_grad():
        result["forward"] = times({"mha": lambda: mha_call(q, k, v), "flex": lambda: hand_call(q, k, v)}, repeat,
                                  device=device)
        want = hand_call(q, k, v).float()
        result["error"] = float((mha_call(q, k, v).float() - want).abs().max() / want.abs().max())
    if backward:
        grad = torch.randn_like(q[..., :v.shape[-1]])
        result["forward+backward"] = times(
            {"mha": lambda: torch.autograd.grad(mha_call(q, k, v), (q, k, v), grad),
             "flex": lambda: torch.autograd.grad(hand_call(q, k, v), (q, k, v), grad)}, repeat, calls=5, device=device)
    return result


def _backend_of(name, q, k, v, slopes, sinks, window) -> str:
    """The backend mha's auto runs the term set on (documents: the packed call's)."""
    if name == "documents":
        from ..positions import packed
        n = q.shape[-2]
        q_pos, k_pos, band = packed(torch.tensor([n]), torch.tensor([n]), Band(None, 0))
        contract = Contract(band=band, positions=(q_pos[None].to(q.device), k_pos[None].to(q.device)))
    else:
        terms = {"window": dict(band=Band(window, 0)), "softcap": dict(band=Band(None, 0), softcap=30.0),
                 "alibi": dict(band=Band(None, 0), alibi_slopes=slopes), "sinks": dict(band=Band(None, 0), sinks=sinks),
                 "window+softcap+sinks": dict(band=Band(window, 0), softcap=30.0, sinks=sinks)}[name]
        contract = Contract(**terms)
    return choose_backend("auto", q, k, v, contract)[0]


# -- half-precision errors against float64 --------------------------------------------------------------

def error_points(dtype: torch.dtype, device="cuda") -> dict[str, dict[str, float]]:
    """{case: {"mha": error, "torch": error (where torch has the call), "math": error}}: the calls
    issue 42 found wrong on CUDA, B2 H8 over 2 kv heads, L96 S160 D64, against float64 (mha's math on
    the CPU)."""
    B, H, Hkv, L, S, D = 2, 8, 2, 96, 160, 64
    q, k, v = _qkv(B, H, L, S, D, torch.float64, "cpu", kv_heads=Hkv, seed=1)
    mask = torch.zeros(L, S, dtype=torch.float64)
    mask[:, ::3] = -1e4  # a float additive mask: every third key pushed away
    hidden = torch.ones(B, 1, L, S, dtype=torch.bool)
    hidden[0, 0, 5] = False  # one row that sees nothing
    slopes = torch.exp2(-8.0 * torch.arange(1, H + 1, dtype=torch.float64) / H)
    cases = {"float mask": dict(attn_mask=mask), "bool mask, a row sees nothing": dict(attn_mask=hidden),
             "window (32, 0) bottom-right": dict(window=(32, 0)),
             "window (32, 0) top-left": dict(window=(32, 0), causal_alignment="top_left"),
             "alibi": dict(alibi_slopes=slopes), "softcap": dict(softcap=20.0, is_causal=True),
             "sinks": dict(sinks=torch.linspace(-1.0, 1.0, H, dtype=torch.float64), is_causal=True)}
    results = {}
    for name, options in cases.items():
        want = sdpa(q, k, v, enable_gqa=True, backend="math", **options)
        low = [x.to(device=device, dtype=dtype) for x in (q, k, v)]
        moved = {key: _moved(x, key, device, dtype) for key, x in options.items()}
        row = {"mha": _error(sdpa(*low, enable_gqa=True, **moved), want),
               "math": _error(sdpa(*low, enable_gqa=True, backend="math", **moved), want)}
        if "attn_mask" in options:  # torch has the call itself
            row["torch"] = _error(F.scaled_dot_product_attention(*low, attn_mask=moved["attn_mask"], enable_gqa=True), want)
        results[name] = row
    return results


def _moved(x, key: str, device, dtype):
    """An option on the device: a bool mask as it is, slopes and sinks in float32, a float mask in the
    query's dtype (as torch's own call needs it there)."""
    if not isinstance(x, Tensor):
        return x
    if x.dtype == torch.bool:
        return x.to(device)
    return x.to(device=device, dtype=torch.float32 if key in ("alibi_slopes", "sinks") else dtype)


def _error(got: Tensor, want: Tensor) -> float:
    got = got.detach().to(device="cpu", dtype=torch.float64)
    return float((got - want).abs().max() / want.abs().max())


# -- CPU: flex beside native ------------------------------------------------------------------------------

def cpu_flex_point(T: int, dtype: torch.dtype, repeat: int, window: int = 256) -> dict[str, float]:
    """ms of a causal window with softcap, B1 H8 D64, no grad: mha's flex backend (compiled), the
    native kernel (when built), FlexAttention by hand, torch's SDPA over the dense causal call."""
    from ..kernels import native
    q, k, v = _qkv(1, 8, T, T, 64, dtype, "cpu")
    hand = _hand_flex("window+softcap", T, "cpu", torch.ones(8), torch.zeros(8), torch.zeros(T, dtype=torch.long), window)
    fns = {"mha flex": lambda: sdpa(q, k, v, is_causal=True, window=(window, 0), softcap=30.0, backend="flex"),
           "flex by hand": lambda: hand(q, k, v),
           "torch causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)}
    if native.native_available():
        fns["native"] = lambda: sdpa(q, k, v, is_causal=True, window=(window, 0), softcap=30.0, backend="native")
    with torch.no_grad():
        return times(fns, repeat, calls=3, device="cpu")
