"""The flex backend: torch's FlexAttention (torch.nn.attention.flex_attention), compiled by Inductor
into one fused kernel for CUDA (and for CPU, forward only), with the whole contract as its two
functions and a block mask:

    mask_mod (which keys a query sees)     the band (causality, windows; either alignment, any offset),
                                           per-sequence positions (a KV cache; packed sequences: varlen as a
                                           document mask), key padding, the caller's bool mask and mask_mod
    block mask                             the mask_mod at FlexAttention's block granularity, built once per
                                           (shapes, terms) and cached (BlockMasks, below): blocks no query
                                           sees are skipped
    score_mod (how the scores are shaped)  the caller's score_mod, softcap, ALiBi, the caller's additive mask
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

TAKES = frozenset({"band", "positions", "key_valid", "mask", "alibi_slopes", "scale", "softcap", "sinks",
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
        t is not None and t.requires_grad for t in (q, k, v, contract.alibi_slopes, contract.sinks))


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
    L, S, Dv = q.shape[-2], k.shape[-2], v.shape[-1]
    if 0 in (math.prod(lead), L, S, Dv):  # nothing to compute, or rows that see nothing: zeros
        out = attached_zeros((*lead, L, Dv), q, k, v)
        return out, torch.full((*lead, L), float("-inf"), device=q.device) if with_lse else None
    q4, k4, v4 = _as_4d(q, lead), _as_4d(k, kv_lead), _as_4d(v, kv_lead)  # (B, H, L, D), (B, Hkv, S, D|Dv)
    functions = _Functions(contract, lead, L, S, q.device, q.dtype)
    need_lse = with_lse or contract.sinks is not None
    result = _call(q4, k4, v4, functions, scale=contract.scale_for(q.shape[-1]), need_lse=need_lse)
    out, lse = result if need_lse else (result, None)
    if contract.sinks is not None:
        out, lse = _with_sinks(out, lse, contract.sinks)
    out = out.view(*lead, L, Dv)
    return out, (lse.view(*lead, L) if with_lse else None)


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
        hidden = self.mask_mod if self.hides and self.decoding else None
        if not any(x is not None for x in (user, cap, slopes, additive, hidden)):
            return None

        def score_mod(score, b, h, q_idx, kv_idx):
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
    reused while the same call repeats (a training step, a prefill of the same length). A term's
    tensor is known by its identity and version (an in-place change builds anew), a function by its
    code and what it closes over; an entry holds them, so no id is reused while it lives.
    Inside torch.compile nothing is cached: the block mask is built in the graph."""

    def __init__(self, size: int = 16):
        self.size = size
        self.entries: OrderedDict = OrderedDict()
        self.built = 0  # how many were built (the tests count them)

    def get(self, functions: _Functions, L: int, S: int):
        B, H = functions.mask_batch, functions.mask_heads
        if torch.compiler.is_compiling():
            return _flex.create_block_mask(functions.mask_mod, B, H, L, S, device=functions.device)
        key, held = _key((functions.device, B, H, L, S), functions.contract)
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
            return entry[0]
        build = _flex.create_block_mask if B * H * L * S <= _EAGER_BUILD or _EAGER[-1] else _compiled_block_mask()
        block_mask = build(functions.mask_mod, B, H, L, S, device=functions.device)
        self.built += 1
        self.entries[key] = (block_mask, held)
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)
        return block_mask

    def clear(self) -> None:
        self.entries.clear()


BLOCK_MASKS = BlockMasks()


def _key(shapes: tuple, contract: Contract) -> tuple[tuple, list]:
    """(a hashable key of the contract's hiding terms, the objects the key names by identity)."""
    held: list = []
    parts = [shapes, contract.band, contract.offset if contract.positions is None else None]
    for value in (contract.positions, contract.key_valid, contract.mask, contract.mask_mod):
        parts.append(_value_key(value, held))
    return tuple(parts), held


def _value_key(value, held: list):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Tensor):
        held.append(value)
        return ("tensor", id(value), value._version, tuple(value.shape), value.dtype, value.device)
    if isinstance(value, tuple):
        return tuple(_value_key(x, held) for x in value)
    code = getattr(value, "__code__", None)
    if code is not None:  # a function: its code and what it closes over
        cells = tuple(_value_key(_cell(c), held) for c in value.__closure__ or ())
        held.append(value)
        return ("function", code, cells)
    held.append(value)
    return ("object", id(value))


def _cell(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None
