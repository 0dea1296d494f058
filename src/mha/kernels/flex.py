"""The flex backend: torch's FlexAttention (torch.nn.attention.flex_attention), compiled by Inductor
into one fused kernel for CUDA (and for CPU, forward only), with the whole contract as its two
functions and a block mask:

    mask_mod (which keys a query sees)     the band (causality, windows; either alignment, any offset),
                                           per-sequence positions (a KV cache; packed sequences: varlen as a
                                           document mask), key padding, the caller's bool mask and mask_mod
    block mask                             the mask_mod at FlexAttention's block granularity, built once per
                                           (shapes, terms) and cached (BlockMasks, below): blocks no query
                                           sees are skipped
    score_mod (how the scores are shaped)  logit_scale, the caller's score_mod, softcap, ALiBi, the caller's
                                           additive mask
    sinks                                  from the returned log-sum-exp: out * sigmoid(lse - sink_h), exact
                                           and differentiable (the sink joins the softmax with a zero value)
    GQA, Dv != D, scale                    FlexAttention's own (enable_gqa, scale)

A call of few query rows (a decoding step: L <= DECODE_ROWS) takes the mask terms in its score_mod
instead (-inf where hidden) and no block mask: a decoding loop, whose key count and offset change at
every step, builds nothing per step; the offsets are device tensors, so the compiled kernel is reused.

What it refuses, by name: dropout; float64 (FlexAttention compiles float32, float16 and bfloat16;
flex.eager() takes float64);
head dims below 16 on CUDA (its Triton kernel's minimum); on CPU, gradients and the log-sum-exp
(sinks), which torch's compiled CPU kernel lacks (torch 2.13); torch.func transforms and forward-mode
AD; a mask that needs its gradient. :func:`eager` runs torch's uncompiled FlexAttention instead (its
reference implementation, which materialises the scores: for checking score and mask functions, and
for the tests, on any device).

Shapes: q (..., H, L, D), k (..., Hkv, S, D), v (..., Hkv, S, Dv); the leading dims before the heads
are FlexAttention's batch (flattened), Hkv divides H.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import shutil
import types
from collections import OrderedDict
from collections.abc import Callable

import torch
from torch import Tensor

from . import mods
from ._context import autograd_function_refusal
from ._shapes import attached_zeros, leads, matched_kv_heads
from .contract import Contract, resolve, undeclared

__all__ = ["DECODE_ROWS", "TAKES", "BlockMasks", "available", "eager", "flex_attention", "flex_attention_with_lse",
           "unsupported"]

TAKES = frozenset({"band", "positions", "key_valid", "mask", "alibi_slopes", "scale", "logit_scale", "softcap", "sinks",
                   "score_mod", "mask_mod"})
DECODE_ROWS = 128  # up to this many query rows (FlexAttention's decoding kernel's): mask terms in score_mod
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_EAGER_BUILD = 1 << 24  # mask elements (B * H * L * S) up to which a block mask is built eagerly, else compiled

try:
    from torch.nn.attention import flex_attention as _flex
except ImportError:  # a torch without FlexAttention
    _flex = None


def available() -> bool:
    """Whether this torch has FlexAttention."""
    return _flex is not None


# -- eager: torch's uncompiled FlexAttention ---------------------------------------------------------

_EAGER = [False]


@contextlib.contextmanager
def eager():
    """Within it, the flex backend runs torch's uncompiled FlexAttention (its reference, which
    materialises the (B, H, L, S) scores) instead of the compiled kernel: to check score and mask
    functions, and the tests on CPU, where it gives the log-sum-exp the compiled CPU kernel lacks."""
    _EAGER.append(True)
    try:
        yield
    finally:
        _EAGER.pop()


def _compiled_or_eager(device: torch.device) -> Callable:
    if _EAGER[-1] or torch.compiler.is_compiling():  # inside a compiled graph FlexAttention is compiled with it
        return _flex.flex_attention
    return _compiled_flex(device.type)


@functools.cache
def _compiled_flex(device_type: str) -> Callable:
    """torch.compile(flex_attention): with dynamic shapes on CUDA (a decoding loop's growing key count
    compiles once more, then never), static on CPU (torch 2.13's CPU code for dynamic shapes fails to
    compile for some masks, measured: a document mask after a recompile; a new shape compiles anew)."""
    return torch.compile(_flex.flex_attention, dynamic=False if device_type == "cpu" else None)


@functools.cache
def _compiled_block_mask() -> Callable:
    return torch.compile(_flex.create_block_mask)


@functools.cache
def _cpu_compiler() -> bool:
    """Whether Inductor finds a C++ compiler for CPU kernels."""
    return any(shutil.which(c) for c in (os.environ.get("CXX", ""), "c++", "g++", "clang++") if c)


# -- what it takes -------------------------------------------------------------------------------------

def unsupported(q: Tensor, k: Tensor, v: Tensor, contract: Contract, dropout_p: float = 0.0, *,
                need_lse: bool = False) -> str | None:
    """Why the flex backend cannot run this call, or None. (The terms it takes: TAKES.)"""
    if reason := undeclared(TAKES, contract):
        return reason
    if _flex is None:
        return f"this torch ({torch.__version__}) has no torch.nn.attention.flex_attention"
    if dropout_p > 0.0:
        return "FlexAttention has no dropout"
    if not (q.dtype == k.dtype == v.dtype and (q.dtype in _DTYPES or _EAGER[-1] and q.dtype == torch.float64)):
        return f"FlexAttention compiles float32, float16 and bfloat16 (got {q.dtype}, {k.dtype}, {v.dtype})"
    if not (q.device == k.device == v.device) or q.device.type not in ("cuda", "cpu"):
        return f"it runs on CUDA or CPU tensors, all on one device (got {q.device}, {k.device}, {v.device})"
    if reason := autograd_function_refusal(q, k, v, contract.mask):
        return reason
    D, Dv = q.shape[-1], v.shape[-1]
    if D == 0:
        return "a head dim of 0"
    if q.is_cuda and not _EAGER[-1] and min(D, Dv) < 16:
        return f"FlexAttention's CUDA kernel needs head dims of at least 16 (got D={D}, Dv={Dv})"
    if reason := _batch_refusal(q, k, v, contract):
        return reason
    if q.is_cpu and not _EAGER[-1]:
        if not torch.compiler.is_compiling() and not _cpu_compiler():  # (compiling: the outer graph's own)
            return "no C++ compiler for torch's compiled CPU kernel (flex.eager() runs without one)"
        if need_lse or contract.sinks is not None:
            return "torch's compiled FlexAttention returns no log-sum-exp on CPU (sinks and the lse path need it)"
    if _needs_grad(q, k, v, contract) and (refusal := _torch_refusal(q, k, v)):
        return f"torch refuses: {refusal}"
    return None


def _batch_refusal(q: Tensor, k: Tensor, v: Tensor, contract: Contract) -> str | None:
    try:
        lead, _ = leads(q, k, v)
    except RuntimeError:
        return "q, k and v whose batch dims do not broadcast"
    if len(lead) > 2 and (contract.positions is not None or contract.key_valid is not None):
        return "positions or padding with more than one batch dim"
    return None


def _needs_grad(q, k, v, contract: Contract) -> bool:
    return torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, *contract.learned))


def _torch_refusal(q: Tensor, k: Tensor, v: Tensor) -> str | None:
    """torch's own check of the device for a call that needs gradients (torch 2.13 refuses CPU and
    MPS: no backward there), or None. Asked, so that a torch that adds a backward is taken."""
    check = getattr(_flex, "_validate_device", None)
    if check is None:
        return None
    try:
        check(q, k, v)
    except (NotImplementedError, ValueError) as error:
        return str(error).split(". ")[0]
    return None


# -- the call ------------------------------------------------------------------------------------------

def flex_attention(q: Tensor, k: Tensor, v: Tensor, contract: Contract | None = None, *,
                   dropout_p: float = 0.0) -> Tensor:
    """The backend entry point: output (..., L, Dv)."""
    return _checked_run(q, k, v, resolve(contract), dropout_p, with_lse=False)[0]


def flex_attention_with_lse(q: Tensor, k: Tensor, v: Tensor, contract: Contract | None = None) -> tuple[Tensor, Tensor]:
    """(output (..., L, Dv), log-sum-exp (..., L) in float32, sinks included; -inf for a row that sees
    nothing and has no sink). Differentiable through both (CUDA)."""
    return _checked_run(q, k, v, resolve(contract), 0.0, with_lse=True)


def _checked_run(q, k, v, contract: Contract, dropout_p: float, *, with_lse: bool):
    k, v = matched_kv_heads(q, k, v)
    mods.check_devices(q.device, score_mod=contract.score_mod, mask_mod=contract.mask_mod)
    if reason := unsupported(q, k, v, contract, dropout_p, need_lse=with_lse):
        raise ValueError(f"the flex backend cannot run this call: {reason}")
    return _run(q, k, v, contract, with_lse=with_lse)


def _run(q: Tensor, k: Tensor, v: Tensor, contract: Contract, *, with_lse: bool) -> tuple[Tensor, Tensor | None]:
    lead, kv_lead = leads(q, k, v)
    L, Dv = q.shape[-2], v.shape[-1]
    if q.shape[-2] <= DECODE_ROWS:
        k, v, contract = _visible_keys(k, v, contract, L)
    S = k.shape[-2]
    if 0 in (math.prod(lead), L, S):  # nothing to compute, or rows that see no key: zeros (and the sinks' lse)
        out = attached_zeros((*lead, L, Dv), q, k, v)
        return out, (_empty_lse(lead, L, contract.sinks, q) if with_lse else None)
    if Dv == 0:  # one zero column to compute with (the log-sum-exp is still the keys'), dropped after
        out, lse = _run(q, k, v.new_zeros(*v.shape[:-1], 1), contract, with_lse=with_lse)
        return out[..., :0], lse
    q4, k4, v4 = _as_4d(q, lead), _as_4d(k, kv_lead), _as_4d(v, kv_lead)  # (B, H, L, D), (B, Hkv, S, D|Dv)
    functions = _Functions(contract, lead, L, S, q.device, q.dtype)
    need_lse = with_lse or contract.sinks is not None
    result = _call(q4, k4, v4, functions, scale=contract.scale_for(q.shape[-1]), need_lse=need_lse)
    out, lse = result if need_lse else (result, None)
    if contract.sinks is not None:
        out, lse = _with_sinks(out, lse, contract.sinks)
    out = out.view(*lead, L, Dv)
    return out, (lse.view(*lead, L) if with_lse else None)


def _visible_keys(k: Tensor, v: Tensor, contract: Contract, L: int) -> tuple[Tensor, Tensor, Contract]:
    """A call of few rows (a decoding step) over the keys its band lets them see, [lo, hi) of S
    (Contract.key_range): a window over a long cache reads only the window. Default positions and
    none of the caller's functions (they index the keys as given) only; the offset, padding and mask
    follow the keys."""
    S = k.shape[-2]
    if contract.band is None or contract.positions is not None or contract.score_mod is not None \
            or contract.mask_mod is not None:
        return k, v, contract
    lo, hi = contract.key_range(range(L), S)
    if (lo, hi) == (0, S):
        return k, v, contract
    keys = slice(lo, hi)
    mask = contract.mask
    if mask is not None and mask.shape[-1] > 1:
        mask = mask[..., keys]
    key_valid = None if contract.key_valid is None else contract.key_valid[:, keys]
    moved = contract.replace(offset=contract.offset - lo, mask=mask, key_valid=key_valid)
    return k[..., keys, :], v[..., keys, :], moved


def _empty_lse(lead: tuple[int, ...], L: int, sinks: Tensor | None, q: Tensor) -> Tensor:
    """The log-sum-exp of rows that see no key: -inf, or the sink's logit (the sink is all they see);
    float32 (float64 for float64 queries), as FlexAttention's."""
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if sinks is None:
        return torch.full((*lead, L), float("-inf"), dtype=dtype, device=q.device)
    return sinks.to(dtype)[:, None].expand(*lead, L).clone()  # (H,) -> (..., H, L)


def _call(q4, k4, v4, functions: _Functions, *, scale: float, need_lse: bool):
    """FlexAttention itself: (out (B, H, L, Dv), and lse (B, H, L) when asked)."""
    options = {"score_mod": functions.score_mod, "block_mask": functions.block_mask, "scale": scale,
               "enable_gqa": k4.shape[1] != q4.shape[1]}
    if not need_lse:
        return _compiled_or_eager(q4.device)(q4, k4, v4, **options)
    if hasattr(_flex, "AuxRequest"):
        out, aux = _compiled_or_eager(q4.device)(q4, k4, v4, return_aux=_flex.AuxRequest(lse=True), **options)
        return out, aux.lse
    return _compiled_or_eager(q4.device)(q4, k4, v4, return_lse=True, **options)  # torch before AuxRequest


def _with_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """The sinks (H,) joined to every row's softmax: the keys' weights shrink by e^lse / (e^lse +
    e^sink) = sigmoid(lse - sink), the sink's value is zero; lse (B, H, L) becomes logaddexp(lse, sink)."""
    sink = sinks.to(lse.dtype)[:, None]  # (H,) -> (H, 1)
    kept = torch.sigmoid(lse - sink)  # (B, H, L): 0 for a row that saw nothing (lse = -inf)
    out = (out.to(kept.dtype) * kept[..., None]).to(out.dtype)
    return out, torch.logaddexp(lse, sink.expand_as(lse))


def _as_4d(x: Tensor, lead: tuple[int, ...]) -> Tensor:
    """(..., H, T, X) -> (B, H, T, X): the leading dims before the heads broadcast and flattened."""
    if x.dim() == 4 and tuple(x.shape[:2]) == lead:
        return x
    x = x.expand(*lead, *x.shape[-2:])
    heads = lead[-1] if lead else 1
    return x.reshape(math.prod(lead[:-1]), heads, *x.shape[-2:])  # (..., H, T, X) -> (B, H, T, X)


# -- the contract as FlexAttention's functions ---------------------------------------------------------

def _reader(t: Tensor) -> Callable:
    """Read a (B|1, H|1, L|1, S|1) tensor at (b, h, q_idx, kv_idx), its dims of size 1 at 0."""
    used = tuple(i for i in range(4) if t.shape[i] > 1)
    flat = t.reshape([t.shape[i] for i in used])  # the dims of size 1 dropped: a view

    def read(b, h, q_idx, kv_idx):
        index = (b, h, q_idx, kv_idx)
        return flat[tuple(index[i] for i in used)]
    return read


def _as_4d_mask(mask: Tensor, lead: tuple[int, ...], B: int) -> Tensor:
    """The caller's mask (..., H|1, L|1, S|1), broadcastable to (*lead, L, S), as (B|1, H|1, L|1, S|1)."""
    mask = mask.reshape((1,) * max(0, max(len(lead), 1) + 2 - mask.dim()) + tuple(mask.shape))
    batch = mask.shape[:-3]
    if all(n == 1 for n in batch):
        return mask.reshape(1, *mask.shape[-3:])
    return mask.expand(*lead[:-1], *mask.shape[-3:]).reshape(B, *mask.shape[-3:])  # (..., H|1, L|1, S|1) -> (B, ...)


class _Functions:
    """The contract as FlexAttention's score_mod and block mask (whose mask_mod holds the hiding
    terms), or, for a call of few rows, one score_mod with the hiding terms as -inf."""

    def __init__(self, contract: Contract, lead: tuple[int, ...], L: int, S: int, device, dtype=torch.float32):
        """lead: the call's leading dims (..., H), flattened to FlexAttention's (B, H)."""
        B, H = math.prod(lead[:-1]), (lead[-1] if lead else 1)
        self.contract, self.device = contract, device
        self.score_dtype = torch.float64 if dtype == torch.float64 else torch.float32  # the scores' in the kernel
        self.hides: list[Callable] = []  # predicates: True = the query sees the key
        self.mask_batch = self.mask_heads = 1  # the block mask's batch and heads: 1 where nothing depends on them
        self.rel = _relative(contract, device)
        if contract.band is not None:
            self.hides.append(_within(contract.band, self.rel))
            if contract.positions is not None:
                self.mask_batch = max(p.shape[0] for p in contract.positions)
        if contract.key_valid is not None:
            valid = contract.key_valid  # (B|1, S)
            self.mask_batch = max(self.mask_batch, valid.shape[0])
            self.hides.append(_reader(valid[:, None, None, :]))  # (B|1, S) -> (B|1, 1, 1, S)
        mask = None if contract.mask is None else _as_4d_mask(contract.mask, lead, B)
        if mask is not None and mask.dtype == torch.bool:
            self.mask_batch, self.mask_heads = max(self.mask_batch, mask.shape[0]), max(self.mask_heads, mask.shape[1])
            self.hides.append(_reader(mask))
        if contract.mask_mod is not None:
            if _reads_batch_or_head(contract.mask_mod):
                self.mask_batch, self.mask_heads = B, H
            self.hides.append(contract.mask_mod)
        self.mask_mod = _all_of(tuple(self.hides)) if self.hides else None
        self.additive = None if mask is None or mask.dtype == torch.bool else _reader(mask)
        self.decoding = L <= DECODE_ROWS
        self.block_mask = BLOCK_MASKS.get(self, L, S) if self.hides and not self.decoding else None
        self.score_mod = self._score_mod()

    def _score_mod(self) -> Callable | None:
        c = self.contract
        user, additive, rel = c.score_mod, self.additive, self.rel
        cap = None if c.softcap is None else _scalar(c.softcap, self.score_dtype, self.device)
        slopes = c.alibi_slopes  # as given: a converted copy made inside torch.compile is no input of the kernel
        heads = c.logit_scale  # (likewise)
        hidden = self.mask_mod if self.hides and self.decoding else None
        if not any(x is not None for x in (heads, user, cap, slopes, additive, hidden)):
            return None

        def score_mod(score, b, h, q_idx, kv_idx):
            if heads is not None:
                score = score * heads[h].to(score.dtype)
            if user is not None:
                score = user(score, b, h, q_idx, kv_idx)
            if cap is not None:
                score = cap * torch.tanh(score / cap)
            if slopes is not None:
                score = score - slopes[h].to(score.dtype) * rel(b, q_idx, kv_idx).abs()
            if additive is not None:
                score = score + additive(b, h, q_idx, kv_idx)
            if hidden is not None:
                score = torch.where(hidden(b, h, q_idx, kv_idx), score, -float("inf"))
            return score
        return score_mod


def _scalar(value, dtype: torch.dtype, device):
    """A number a score or mask function closes over: a 0-d device tensor, so that the compiled kernel
    takes any value (a Python number is compiled in); inside torch.compile the number itself (a tensor
    made in the graph is no input of FlexAttention's: torch 2.13's CPU lowering finds no kernel then)."""
    return value if torch.compiler.is_compiling() else torch.full((), value, dtype=dtype, device=device)


def _all_of(hides: tuple[Callable, ...]) -> Callable:
    """One mask_mod of every hiding term: True where the query sees the key."""
    def mask_mod(b, h, q_idx, kv_idx):
        seen = hides[0](b, h, q_idx, kv_idx)
        for hide in hides[1:]:
            seen = seen & hide(b, h, q_idx, kv_idx)
        return seen
    return mask_mod


def _relative(contract: Contract, device) -> Callable | None:
    """rel(b, q_idx, kv_idx) = key position - query position (mha.positions' rule), or None when no
    term reads positions. The offset: _scalar's."""
    if not contract.needs_positions:
        return None
    if contract.positions is None:
        offset = _scalar(contract.offset, torch.int64, device)
        return lambda b, q_idx, kv_idx: kv_idx - (q_idx + offset)
    q_pos, k_pos = contract.positions  # (B|1, L), (B|1, S)
    q_one, k_one = q_pos.shape[0] == 1, k_pos.shape[0] == 1
    return lambda b, q_idx, kv_idx: k_pos[0 if k_one else b, kv_idx] - q_pos[0 if q_one else b, q_idx]


def _within(band, rel: Callable) -> Callable:
    """The band as a predicate: -left <= rel <= right (Band.allowed), None sides unbounded."""
    left, right = band.left, band.right

    def within(b, h, q_idx, kv_idx):
        r = rel(b, q_idx, kv_idx)
        if left is None and right is None:
            return r == r
        if left is None:
            return r <= right
        if right is None:
            return r >= -left
        return (r >= -left) & (r <= right)
    return within


def _reads_batch_or_head(mask_mod: Callable) -> bool:
    """Whether the caller's mask_mod uses its b or h argument: called once with index tensors that
    record their use. One that does gets a block mask per batch and head; one that does not, one
    shared block mask (a document mask, a window), as FlexAttention's users build with B = H = None."""
    if torch.compiler.is_compiling():  # (no class made while tracing: the block mask is built in the graph either way)
        return True
    used = []

    class Recording(Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            used.append(func)
            raise _Used

    zero = torch.zeros((), dtype=torch.int32)
    try:
        mask_mod(zero.as_subclass(Recording), zero.as_subclass(Recording), zero.clone(), zero.clone())
    except _Used:
        return True
    except Exception:  # anything else it did with them: assume it reads them (the safe side)
        return True
    return bool(used)


class _Used(Exception):
    pass


# -- block masks, built once per (shapes, terms) --------------------------------------------------------

class BlockMasks:
    """A small cache of FlexAttention BlockMasks: one is built once per (device, shapes, terms) and
    reused while the same call repeats (a training step, a prefill of the same length).

    The key holds what decides which blocks are seen: the band and offset, and the tensors of the
    positions, the key padding and a bool mask by identity and version (an in-place change builds
    anew); the caller's mask_mod by its code, its defaults, what it closes over and the globals it
    names, the same way. What cannot be known so (a list, a dict or an object a function reads, an
    inference-mode tensor, which has no version) is not cached: its block mask is built per call.
    An entry holds the objects its key names by identity, so no id is reused while it lives. Inside
    torch.compile nothing is cached: the block mask is built in the graph."""

    def __init__(self, size: int = 16):
        self.size = size
        self.entries: OrderedDict = OrderedDict()
        self.built = 0  # how many were built (the tests count them)

    def get(self, functions: _Functions, L: int, S: int):
        B, H = functions.mask_batch, functions.mask_heads
        if torch.compiler.is_compiling():
            return _flex.create_block_mask(functions.mask_mod, B, H, L, S, device=functions.device)
        key, held = _key((functions.device, B, H, L, S), functions.contract)
        entry = None if key is None else self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
            return entry[0]
        build = _flex.create_block_mask if B * H * L * S <= _EAGER_BUILD or _EAGER[-1] else _compiled_block_mask()
        block_mask = build(functions.mask_mod, B, H, L, S, device=functions.device)
        self.built += 1
        if key is not None:
            self.entries[key] = (block_mask, held)
            while len(self.entries) > self.size:
                self.entries.popitem(last=False)
        return block_mask

    def clear(self) -> None:
        self.entries.clear()


BLOCK_MASKS = BlockMasks()


class _Uncacheable(Exception):
    """A value whose changes a key cannot see."""


def _key(shapes: tuple, contract: Contract) -> tuple[tuple | None, list]:
    """(a hashable key of the contract's hiding terms, or None when one cannot be made; the objects
    the key names by identity)."""
    held: list = []
    bool_mask = contract.mask if contract.mask is not None and contract.mask.dtype == torch.bool else None
    parts = [shapes, contract.band, contract.offset if contract.positions is None else None]
    try:
        for value in (contract.positions, contract.key_valid, bool_mask, contract.mask_mod):
            parts.append(_value_key(value, held, depth=0))
    except _Uncacheable:
        return None, held
    return tuple(parts), held


_PLAIN = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)


def _value_key(value, held: list, *, depth: int):
    """A hashable stand-in for ``value`` that changes when it does (_Uncacheable where none can)."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, Tensor):
        if value.is_inference():  # no version counter: an in-place change would go unseen
            raise _Uncacheable
        held.append(value)
        return ("tensor", id(value), value._version, tuple(value.shape), value.dtype, value.device)
    if isinstance(value, (tuple, frozenset)):
        return (type(value).__name__, *(_value_key(x, held, depth=depth) for x in value))
    code = getattr(value, "__code__", None)
    if code is not None and depth < 4:  # a function: its code, defaults, cells, globals and bound object
        held.append(value)
        scope = getattr(value, "__globals__", {})
        names = {name: scope[name] for name in code.co_names if name in scope}
        parts = (getattr(value, "__defaults__", None), getattr(value, "__kwdefaults__", None),
                 tuple(_cell(c) for c in getattr(value, "__closure__", None) or ()),
                 tuple(sorted(names.items(), key=lambda item: item[0])), getattr(value, "__self__", None))
        return ("function", code, *(_value_key(_freeze(part), held, depth=depth + 1) for part in parts))
    if isinstance(value, (type, types.BuiltinFunctionType, types.ModuleType)):  # a class, torch.where, torch itself
        return ("named", getattr(value, "__module__", None), getattr(value, "__qualname__", None),
                getattr(value, "__name__", None))
    raise _Uncacheable  # a list, a dict, an object: its contents may change under the same id


def _freeze(part):
    """dicts of keyword defaults and of globals as tuples of their items (keyed like any tuple)."""
    if isinstance(part, dict):
        return tuple(sorted(part.items(), key=lambda item: item[0]))
    return part


def _cell(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None
