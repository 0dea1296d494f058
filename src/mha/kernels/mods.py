"""The caller's score and mask functions, in FlexAttention's signatures (torch.nn.attention.flex_attention):

    score_mod(score, b, h, q_idx, kv_idx) -> score    a term of one score (a bias, a cap, a table read)
    mask_mod(b, h, q_idx, kv_idx) -> bool             whether query q_idx sees key kv_idx (True = attend)

Each is written for one score: its arguments are 0-d tensors (the score in float32, or float64 for
float64 inputs; the indices int32). This module checks them and evaluates them over a block of
scores with torch.vmap, one dim at a time, as FlexAttention's own reference does: the math backend's
way (the flex backend hands them to FlexAttention, which compiles them into its kernel). Where they
sit in the contract (mha.kernels.Contract): score_mod first, on the scaled score q . k * scale (what
FlexAttention's score_mod sees); softcap, ALiBi and an additive mask after it; mask_mod hides keys
beside the band, the padding and a bool mask.

The indices, in mha's layouts (q (..., H, L, D)):

    b       the batch: the leading dims before the heads, flattened (0 for 3-D input)
    h       the query head (under GQA the query's, not the key's)
    q_idx   the query row, kv_idx the key column, of the call (varlen: rows of the packed batch,
            so a vector of document ids indexes them as it is)
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["allowed", "check", "check_device", "check_devices", "modified"]

_SIGNATURES = {"score_mod": "score_mod(score, b, h, q_idx, kv_idx) -> score",
               "mask_mod": "mask_mod(b, h, q_idx, kv_idx) -> bool"}


def check(name: str, fn) -> Callable | None:
    """``fn`` if it is a function of FlexAttention's signature for ``name`` ("score_mod" or
    "mask_mod"), or None; a TypeError naming it otherwise."""
    if fn is None:
        return None
    wanted = 5 if name == "score_mod" else 4
    if not callable(fn):
        raise TypeError(f"{name} must be a function {_SIGNATURES[name]} (FlexAttention's signature), "
                        f"got {type(fn).__name__}")
    if _positional_count(fn) not in (wanted, None):
        raise TypeError(f"{name} must take {wanted} arguments, {_SIGNATURES[name]} (FlexAttention's "
                        f"signature), got a function of {_positional_count(fn)}")
    return fn


def check_device(name: str, fn: Callable | None, device) -> None:
    """A ValueError naming ``name`` when ``fn`` closes over a tensor on another device than the
    query's (it would fail deep in torch, or in a compiled kernel). Eager only: reading the cells
    while torch.compile traces would break the graph."""
    if torch.compiler.is_compiling():
        return
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, Tensor) and value.device != torch.device(device):
            raise ValueError(f"{name} closes over a tensor on {value.device} but query is on {device}; "
                             "move the tensors it reads to the query's device")


def check_devices(device, **functions: Callable | None) -> None:
    """check_device for each function by its name (score_mod=..., mask_mod=...)."""
    for name, fn in functions.items():
        check_device(name, fn, device)


def _positional_count(fn) -> int | None:
    """How many positional arguments ``fn`` takes without a default, or None when that cannot be read
    (a builtin, a callable object, *args). Read off its code, not inspect.signature (which
    torch.compile cannot trace)."""
    code = getattr(fn, "__code__", None)
    if code is None or code.co_flags & inspect.CO_VARARGS:
        return None
    bound = 1 if getattr(fn, "__func__", None) is not None else 0  # a bound method: self is given
    return code.co_argcount - len(getattr(fn, "__defaults__", None) or ()) - bound


def _indices(lead: tuple[int, ...], rows, cols, device) -> tuple[Tensor, ...]:
    """b (B,), h (H,), q_idx (r,), kv_idx (c,) as int32, for scores (*lead, r, c)."""
    B = 1
    for n in lead[:-1]:
        B *= n
    H = lead[-1] if lead else 1
    return tuple(torch.arange(a, b, dtype=torch.int32, device=device)
                 for a, b in ((0, B), (0, H), (rows.start, rows.stop), (cols.start, cols.stop)))


def _over_grid(fn: Callable, *, with_score: bool) -> Callable:
    """fn, written for one (b, h, q_idx, kv_idx), over (B,), (H,), (r,), (c,) index vectors (and a
    (B, H, r, c) score): four vmaps, the innermost over kv_idx."""
    for position in (3, 2, 1, 0):  # kv_idx, q_idx, h, b: the outermost vmap maps b
        dims = [None] * 4
        dims[position] = 0
        fn = torch.vmap(fn, in_dims=((0,) if with_score else ()) + tuple(dims))
    return fn


def modified(score_mod: Callable, s: Tensor, rows, cols) -> Tensor:
    """score_mod over scores s (*lead, r, c) of query ``rows`` and key ``cols`` (ranges or slices): a
    new tensor."""
    lead = tuple(s.shape[:-2])
    if s.numel() == 0:
        return s
    check_device("score_mod", score_mod, s.device)
    b, h, q, kv = _indices(lead, rows, cols, s.device)
    grid = s.reshape(len(b), len(h), len(q), len(kv))  # (*lead, r, c) -> (B, H, r, c)
    out = _over_grid(score_mod, with_score=True)(grid, b, h, q, kv)
    return out.to(s.dtype).reshape(s.shape)


def allowed(mask_mod: Callable, lead: tuple[int, ...], rows, cols, device) -> Tensor:
    """mask_mod over (*lead, r, c): bool, True where the query sees the key."""
    check_device("mask_mod", mask_mod, device)
    b, h, q, kv = _indices(lead, rows, cols, device)
    if 0 in (len(b), len(h), len(q), len(kv)):
        return torch.ones(*lead, len(q), len(kv), dtype=torch.bool, device=device)
    out = _over_grid(mask_mod, with_score=False)(b, h, q, kv)
    if out.dtype != torch.bool:
        raise TypeError(f"mask_mod must return a bool tensor (True = attend), got {out.dtype}")
    return out.reshape(*lead, len(q), len(kv))
