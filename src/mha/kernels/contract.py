"""The attention contract: the one value every backend receives besides q, k and v.

It says which keys each query sees and how its scores are shaped before the softmax:

    s = (q . k) * scale * logit_scale_h          scale: 1 / sqrt(D) unless given; logit_scale: (H,) per-head
                                                 multipliers (an inverse temperature), optional
    s = score_mod(s, b, h, q_idx, kv_idx)        the caller's function, FlexAttention's signature, optional
    s = softcap * tanh(s / softcap)              logit soft-capping (Gemma 2), optional
    s = s - slope_h * |rel|                      ALiBi, optional (rel: mha.positions.relative)
    s = s + mask     /  s = -inf where not mask  the caller's mask: additive float, or bool True = attend
    s = -inf where the band, padding or the caller's mask_mod hides the key
    p = softmax over the keys and, per head, one sink logit that joins every row's softmax and
        is then dropped (GPT-OSS's attention sinks), optional

Positions follow mha.positions: query i sits at i + offset and key j at j, unless ``positions``
gives them per sequence (a KV cache holding sequences of different lengths). A backend either
honours the whole contract at O(L + S) memory or says it cannot (mha.kernels.choose_backend routes
around it); the math backend honours everything by building the L x S scores, as it must to
return the weights. Each backend declares the terms it takes (its TAKES, names of these fields); the
dispatch refuses a contract with a term a backend does not declare (Contract.terms), so that a new
field is refused everywhere until a backend says it takes it. The score shaping is written here
once and used by every backend: the math backend applies it to the whole (L, S) range, the flash
backend tile by tile (the native kernel mirrors it in C++: csrc/native.cpp's Terms).

Shapes: B batch, H heads, L query length, S key length.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from .. import _checks, masks, positions
from ..positions import CAUSAL, Band
from . import mods

__all__ = ["LEARNED", "NONE", "TERMS", "TOP_LEFT_CAUSAL", "Contract", "contract_of", "from_keywords", "mask_tile", "resolve",
           "undeclared"]

_NEG_INF = float("-inf")


@dataclass(frozen=True, eq=False)
class Contract:
    """Which keys each query sees and how its scores are shaped (see the module docstring).

    band:          mha.positions.Band of visible distances (causal, sliding window) or None
    offset:        the alignment of the default positions (query i at i + offset, key j at j)
    positions:     (query (B|1, L), key (B|1, S)) int64 positions per sequence, or None
    key_valid:     (B|1, S) bool, False where a key is padding, or None
    mask:          the caller's mask, bool (True = attend) or additive float, broadcastable to
                   (B, H, L, S), or None
    alibi_slopes:  (H,) ALiBi slopes, or None
    scale:         the factor of q . k; None means 1 / sqrt(D)
    logit_scale:   (H,) each head's factor of its scaled scores (an inverse temperature), or None
    softcap:       logit soft-capping c > 0, or None
    sinks:         (H,) per-head sink logits, or None
    score_mod:     score_mod(score, b, h, q_idx, kv_idx) -> score (mha.kernels.mods), or None
    mask_mod:      mask_mod(b, h, q_idx, kv_idx) -> bool, True = attend (mha.kernels.mods), or None
    The (H,) tensors are checked against the query's heads when a kernel runs (check_heads).
    """
    band: Band | None = None
    offset: int = 0
    positions: tuple[Tensor, Tensor] | None = None
    key_valid: Tensor | None = None
    mask: Tensor | None = None
    alibi_slopes: Tensor | None = None
    scale: float | None = None
    logit_scale: Tensor | None = None
    softcap: float | None = None
    sinks: Tensor | None = None
    score_mod: Callable | None = None
    mask_mod: Callable | None = None

    def __repr__(self) -> str:
        shown = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or (f.name == "offset" and value == 0):
                continue
            if isinstance(value, Tensor):
                value = f"<{tuple(value.shape)} {value.dtype}>"
            elif isinstance(value, tuple):
                value = "(" + ", ".join(f"<{tuple(t.shape)}>" for t in value) + ")"
            elif callable(value):
                value = getattr(value, "__name__", type(value).__name__)
            shown.append(f"{f.name}={value}")
        return f"Contract({', '.join(shown)})"

    def __post_init__(self):
        _checks.optional_finite_real("scale", self.scale)  # NaN or inf would make every score NaN
        mods.check("score_mod", self.score_mod)
        mods.check("mask_mod", self.mask_mod)
        # the names of the terms it sets: every field that is not None (the offset is the band's and
        # ALiBi's alignment, not a term of its own); a backend takes it only if it declares each (its TAKES)
        object.__setattr__(self, "terms", frozenset(
            f.name for f in fields(self) if f.name != "offset" and getattr(self, f.name) is not None))

    def replace(self, **changes) -> Contract:
        """This contract with ``changes``: the shared NONE or TOP_LEFT_CAUSAL where it comes to one of
        them (contract_of), so that a module's terms plus a plain call's band keep the fast path."""
        if type(self) is not Contract:
            return dataclasses.replace(self, **changes)
        if self is NONE:  # a module of no own terms (most): only the changes (on every call's path)
            return contract_of(**changes)
        return contract_of(**{**{name: getattr(self, name) for name in _FIELDS}, **changes})

    def scale_for(self, head_dim: int) -> float:
        """The scale, 1 / sqrt(D) by default; with D = 0 every score is an empty sum, 0, whatever
        multiplies it: 1 then (torch's 1 / sqrt(0) = inf would make them NaN; its kernels give the
        uniform weights of scores 0)."""
        if self.scale is not None:
            return self.scale
        return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0

    def query_scale(self, head_dim: int, dtype: torch.dtype) -> float | Tensor:
        """What multiplies q so that q . k is the scaled score: the scale (scale_for), or with a
        logit_scale each head's scale * logit_scale_h as (H, 1, 1) in ``dtype`` (over (..., H, L, D))."""
        scale = self.scale_for(head_dim)
        if self.logit_scale is None:
            return scale
        return (self.logit_scale.to(dtype) * scale)[:, None, None]  # (H,) -> (H, 1, 1)

    def fold_logit_scale(self, q: Tensor, heads_dim: int = -3) -> tuple[Tensor, Contract]:
        """(q with each head's rows times its logit_scale, the contract without it): the same scores,
        (q t_h) . k * scale, for a kernel that has no such term (sdpa, native, paged); differentiable
        through q and logit_scale (autograd's multiply). q (..., H, L, D), or its heads at another
        ``heads_dim`` (paged rows (Tq, H, D): -2), in its dtype, rounded once."""
        if self.logit_scale is None:
            return q, self
        factor = self.logit_scale.to(masks.additive_dtype(q.dtype))  # (H,)
        factor = factor.view(-1, *[1] * (-heads_dim - 1))  # (H,) -> (H, 1, ..., 1) over the dims after the heads
        return (q * factor).to(q.dtype), self.replace(logit_scale=None)

    @property
    def learned(self) -> tuple[Tensor | None, ...]:
        """The terms that may be learned (each gets a gradient), in LEARNED's order, each or None."""
        return tuple(getattr(self, name) for name in LEARNED)

    @property
    def needs_positions(self) -> bool:
        """Whether the scores depend on where queries and keys sit (band or ALiBi)."""
        return self.band is not None or self.alibi_slopes is not None

    # -- the score shaping, for any range of query rows and key columns ------------------------

    def cap(self, s: Tensor, *, inplace: bool) -> tuple[Tensor, Tensor | None]:
        """(softcap * tanh(s / softcap), tanh(s / softcap)), or (s, None) without softcap. In place,
        ``s`` is left holding the tanh (the backward's d/ds is 1 - tanh^2)."""
        c = self.softcap
        if c is None:
            return s, None
        tanh = s.div_(c).tanh_() if inplace else torch.tanh(s / c)
        return tanh * c, tanh

    def distances(self, rows: range, cols: range, device) -> Tensor:
        """rel = key position - query position: (r, c), or (B|1, 1, r, c) with per-sequence positions."""
        if self.positions is None:
            return positions.relative(*positions.aligned(rows, cols, self.offset, device))
        q_pos, k_pos = self.positions
        rel = positions.relative(q_pos[:, rows.start:rows.stop], k_pos[:, cols.start:cols.stop])  # (B, r, c)
        return rel[:, None]  # (B, r, c) -> (B, 1, r, c): the same for every head

    def position_terms(self, rel: Tensor, dtype) -> tuple[Tensor | None, Tensor | None]:
        """(ALiBi bias (..., H, r, c) or None, band-hidden bool (..., r, c) or None) of the distances."""
        bias = None
        if self.alibi_slopes is not None:
            slopes = self.alibi_slopes.to(dtype)
            bias = positions.alibi_bias(slopes, rel if rel.dim() == 2 else rel[:, 0])  # (..., H, r, c)
        hidden = None if self.band is None else ~self.band.allowed(rel)
        return bias, hidden

    def hidden(self, rows: range, cols: range, band_hidden: Tensor | None = None) -> list[Tensor]:
        """The bool masks (True = hidden) of a tile that broadcast to its (B, H, r, c) scores: the
        band's (given, or None where it hides nothing), the key padding's and a bool mask's."""
        masks_ = [] if band_hidden is None else [band_hidden]
        if self.key_valid is not None:
            masks_.append(~self.key_valid[:, None, None, cols.start:cols.stop])  # (B, S) -> (B, 1, 1, c)
        if self.mask is not None and self.mask.dtype == torch.bool:
            masks_.append(~mask_tile(self.mask, rows, cols))  # True = attend -> True = hidden
        return masks_

    def modified(self, s: Tensor, rows: range, cols: range) -> Tensor:
        """The caller's score_mod applied to the scaled scores s (..., H, r, c) (a new tensor), or s."""
        return s if self.score_mod is None else mods.modified(self.score_mod, s, rows, cols)

    def shape_scores(self, s: Tensor, rows: range, cols: range, *, inplace: bool,
              bias: Tensor | None = None, hidden: list[Tensor] | None = None) -> Tensor:
        """s (B, H, r, c), the capped scores of query ``rows`` and key ``cols``, plus the ALiBi
        ``bias`` and a float mask, and -inf where ``hidden`` (see :meth:`hidden`). Without ``hidden``
        both are computed here (from the whole contract)."""
        if hidden is None:
            band_hidden = None
            if self.needs_positions:
                bias, band_hidden = self.position_terms(self.distances(rows, cols, s.device), s.dtype)
            hidden = self.hidden(rows, cols, band_hidden)
        if self.mask_mod is not None:
            hidden = [*hidden, ~mods.allowed(self.mask_mod, tuple(s.shape[:-2]), rows, cols, s.device)]
        if bias is not None:
            s = s.add_(bias) if inplace else s + bias
        if self.mask is not None and self.mask.dtype != torch.bool:
            mask = masks.to_dtype(mask_tile(self.mask, rows, cols), s.dtype)
            s = s.add_(mask) if inplace else s + mask
        for h in hidden:  # filled, not added: a NaN score (a NaN key) behind the mask stays out
            s = s.masked_fill_(h, _NEG_INF) if inplace else s.masked_fill(h, _NEG_INF)
        return s

    def key_range(self, rows: range, S: int) -> tuple[int, int]:
        """[lo, hi): the keys some query of ``rows`` may see (with per-sequence positions: all)."""
        if self.band is None or self.positions is not None:
            return 0, S
        return self.band.key_range(rows.start + self.offset, rows.stop - 1 + self.offset, S)

    def band_covers(self, rows: range, cols: range) -> bool:
        """Whether the band hides nothing in the tile (default positions only)."""
        if self.band is None:
            return True
        if self.positions is not None:
            return False
        return self.band.covers(rows.start + self.offset, rows.stop - 1 + self.offset, cols.start, cols.stop)


_FIELDS = tuple(f.name for f in fields(Contract))
TERMS = frozenset(_FIELDS) - {"offset"}  # every term a backend may declare
LEARNED = ("alibi_slopes", "sinks", "logit_scale")  # the per-head tensors that get gradients (Contract.learned)
NONE = Contract()
TOP_LEFT_CAUSAL = Contract(band=CAUSAL)  # torch's is_causal: what its kernel takes as it is


def contract_of(*, band: Band | None = None, offset: int = 0, positions: tuple[Tensor, Tensor] | None = None,
                key_valid: Tensor | None = None, mask: Tensor | None = None, alibi_slopes: Tensor | None = None,
                scale: float | None = None, softcap: float | None = None, sinks: Tensor | None = None,
                score_mod: Callable | None = None, mask_mod: Callable | None = None,
                logit_scale: Tensor | None = None) -> Contract:
    """A Contract of these terms; the shared NONE when every term but the offset (which only places
    a band or ALiBi) is None, the shared TOP_LEFT_CAUSAL for causality alone: the common calls build
    no value, and the dispatch knows them by identity."""
    if (positions is None and key_valid is None and mask is None and alibi_slopes is None and scale is None
            and logit_scale is None and softcap is None and sinks is None and score_mod is None and mask_mod is None):
        if band is None:
            return NONE
        if band is CAUSAL and offset == 0:
            return TOP_LEFT_CAUSAL
    return Contract(band=band, offset=offset, positions=positions, key_valid=key_valid, mask=mask,
                    alibi_slopes=alibi_slopes, scale=scale, logit_scale=logit_scale, softcap=softcap, sinks=sinks,
                    score_mod=score_mod, mask_mod=mask_mod)


_PER_HEAD = "(num_heads,): one value per query head (dim {dim} of {query})"


def from_keywords(like: Tensor, heads: int, *, is_causal: bool = False, window: tuple[int, int] | None = None,
                  band: Band | None = None, alibi_slopes: Tensor | None = None, scale: float | None = None,
                  softcap: float | None = None, sinks: Tensor | None = None, logit_scale: Tensor | None = None,
                  head_dim: str = "-3", query: str = "query", names: dict | None = None, **terms) -> Contract:
    """The Contract of the keywords every entry point takes (is_causal, window, alibi_slopes, scale,
    logit_scale, softcap, sinks), each checked here, the one place they are turned into terms; ``band`` instead of
    is_causal and window where the caller has one (a packing's, a mask's); ``terms`` are the rest as
    they are (offset, positions, key_valid, mask, score_mod, mask_mod). like: the query (its device);
    heads: its head count, at dim ``head_dim`` of the tensor called ``query``. names: another name
    for a keyword in the messages (transformers' "scaling", "s_aux")."""
    named = {"scale": "scale", "softcap": "softcap", "sinks": "sinks", **(names or {})}
    meaning = _PER_HEAD.format(dim=head_dim, query=query)
    return contract_of(band=band if band is not None else positions.band(is_causal, window),
                       alibi_slopes=_checks.per_head("alibi_slopes", alibi_slopes, heads, like, meaning),
                       scale=_checks.optional_finite_real(named["scale"], scale),
                       logit_scale=_checks.per_head("logit_scale", logit_scale, heads, like, meaning),
                       softcap=_checks.optional_positive_real(named["softcap"], softcap),
                       sinks=_checks.per_head(named["sinks"], sinks, heads, like, meaning), **terms)


def check_heads(contract: Contract, q: Tensor) -> None:
    """The contract's per-head tensors (alibi_slopes, sinks, logit_scale) hold one value per query head
    (dim -3 of q, where q has one): a ValueError naming the one that does not, never a kernel reading
    past its end or a broadcast failing deep in torch."""
    if q.dim() < 3:
        return
    for name in LEARNED:
        x = getattr(contract, name)
        if x is not None:
            _checks.shape(name, x, (q.shape[-3],), _PER_HEAD.format(dim="-3", query="query"))


def undeclared(takes: frozenset[str], contract: Contract, who: str = "it") -> str | None:
    """Why a backend refuses the contract for its terms alone: the terms it does not declare (its
    TAKES), named ("WHO does not take softcap, sinks"); or None."""
    extra = contract.terms - takes
    return f"{who} does not take {', '.join(sorted(extra))}" if extra else None


def resolve(contract: Contract | None) -> Contract:
    """A kernel's ``contract`` argument: None means the empty contract (no mask, no band)."""
    if contract is None:
        return NONE
    if not isinstance(contract, Contract):
        raise TypeError(f"contract must be an mha.kernels.Contract or None, got {type(contract).__name__}")
    return contract


def mask_tile(mask: Tensor, rows: range, cols: range) -> Tensor:
    """The mask's part for ``rows`` x ``cols`` (dims of size 1 broadcast)."""
    r = slice(None) if mask.shape[-2] == 1 else slice(rows.start, rows.stop)
    c = slice(None) if mask.shape[-1] == 1 else slice(cols.start, cols.stop)
    return mask[..., r, c]


