"""The two computations every fuzz result is compared with, written from the formula with torch's
plain ops and nothing of mha's (so that a bug in mha's positions, masks or kernels is not in them):

    reference   float64, dense: the exact answer for the inputs as given (rounded to their dtype)
    torch_own   what torch computes in the inputs' dtype: its SDPA where the call is one torch
                expresses, else the same formula in the dtype with float32 scores and softmax (the
                way torch's fused CPU kernels work), as torch would run it op by op

and the tolerance rule: an error may be at most 2x torch's own error in the same dtype, plus a
floor of 2 eps(dtype) log2(2 + n) times the size of the result's sums of n terms (the sums in absolute values, and how far
the result moves when every score moves by one rounding of its own size: see _Sizes). Where
torch's error is zero by luck (one key, a saturated softmax cancelling exactly) or small by luck
(at large logits every correct kernel's error is its scores' rounding, and which keys it hits is
chance: correctly rounded scores were measured 3.5x torch's error on one case), a result within
a few roundings of the scores is still exact; a saturated softmax has no conditioning term, so a
kernel that recomputes its scores differently in the backward (P = e^(s - lse) with another s)
is still caught.

NaN: an input NaN (or a score made NaN or +inf by an infinity) reaches the rows that see it: a
query's row, a key's or a value's rows where that key is visible (a value only in its columns).
Rows that see it only behind a mask, the band or padding may or may not be NaN: torch's own kernels
differ there (its math path and its kernel with a mask add the mask, -inf + NaN = NaN; its causal
kernel skips the hidden tiles) and so do tiled kernels. ``certain`` and ``possible`` say which.

Shapes: q (..., H, L, D), k (..., Hk, S, D), v (..., Hv, S, Dv), flattened here to (N, H, L|S, X).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

FLOOR = 2.0  # times eps(dtype), the size of what was summed and log2(2 + its length)


@dataclass
class Spec:
    """Everything that shapes the scores, as plain tensors and numbers (no mha type)."""
    enable_gqa: bool = False
    scale: float | None = None
    band: tuple[int | None, int | None] | None = None  # visible distances key - query: (-left, right)
    q_pos: Tensor | None = None  # (L,) or (N, L): the queries' positions
    k_pos: Tensor | None = None  # (S,) or (N, S)
    key_valid: Tensor | None = None  # (N, S) bool
    mask: Tensor | None = None  # bool (True = attend) or float, broadcasting to (..., L, S)
    slopes: Tensor | None = None  # (H,)
    softcap: float | None = None
    sinks: Tensor | None = None  # (H,)


@dataclass
class Outcome:
    out: Tensor
    grads: dict[str, Tensor] = field(default_factory=dict)  # dq, dk, dv, d_alibi, d_sinks
    bounds: dict[str, tuple[float, float]] = field(default_factory=dict)  # (size, flush) per quantity: _Sizes
    certain: Tensor | None = None  # bool like out: NaN for sure (see the module docstring)
    possible: Tensor | None = None  # bool like out: NaN allowed
    backends: tuple[str, ...] | None = None  # torch's own: the backends that run it so (None: a way for every one)


def as_4d(q: Tensor, k: Tensor, v: Tensor, enable_gqa: bool) -> tuple[Tensor, Tensor, Tensor, tuple[int, ...]]:
    """q, k, v broadcast to one (N, H, T, X) each (k and v repeated to H heads under enable_gqa), and
    the output's leading dims. Differentiable: gradients sum back to the inputs' shapes."""
    rank = max(x.dim() for x in (q, k, v))
    q, k, v = (x.reshape((1,) * (rank - x.dim()) + tuple(x.shape)) for x in (q, k, v))  # (..., T, X) -> (1.., T, X)
    if enable_gqa and rank >= 3:
        H = q.shape[-3]
        k, v = (x.repeat_interleave(H // x.shape[-3], dim=-3) if x.shape[-3] else x for x in (k, v))
    lead = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])  # (torch's takes 40 us a call)
    N, heads = math.prod(lead[:-1]), (lead[-1] if lead else 1)
    flat = [x.expand(*lead, *x.shape[-2:]).reshape(N, heads, *x.shape[-2:]) for x in (q, k, v)]  # -> (N, H, T, X)
    return (*flat, lead)


def output_shape(q: Tensor, k: Tensor, v: Tensor, enable_gqa: bool) -> tuple[int, ...]:
    """The output's shape (*lead, L, Dv) of inputs of these shapes (the broadcast rule of as_4d)."""
    rank = max(x.dim() for x in (q, k, v))
    shapes = [(1,) * (rank - x.dim()) + tuple(x.shape[:-2]) for x in (q, k, v)]
    if enable_gqa and rank >= 3:
        shapes = [shape[:-1] + (q.shape[-3],) for shape in shapes]
    return (*np.broadcast_shapes(*shapes), q.shape[-2], v.shape[-1])


def _scores_and_visible(q4: Tensor, k4: Tensor, t: Spec, lead, work: torch.dtype, scale_first: bool = False):
    """The shaped scores (N, H, L, S) in ``work`` before hidden keys are filled, and visible (bool).
    ``scale_first``: q scaled before its product with k (torch's math path's order), else after."""
    N, H, L, D = q4.shape
    S = k4.shape[-2]
    scale = t.scale if t.scale is not None else (1.0 / math.sqrt(D) if D else 1.0)
    if scale_first:
        s = (q4.to(work) * scale) @ k4.to(work).transpose(-1, -2)
    else:
        s = (q4.to(work) @ k4.to(work).transpose(-1, -2)) * scale
    if t.softcap is not None:
        s = t.softcap * torch.tanh(s / t.softcap)
    q_pos = t.q_pos if t.q_pos is not None else torch.arange(L)
    k_pos = t.k_pos if t.k_pos is not None else torch.arange(S)
    rel = (k_pos[..., None, :] - q_pos[..., :, None]).to(torch.float64)  # (L, S) or (N, L, S)
    rel = rel if rel.dim() == 2 else rel[:, None]  # (N, L, S) -> (N, 1, L, S)
    if t.slopes is not None:
        s = s - t.slopes.to(work)[:, None, None] * rel.abs().to(work)
    visible = torch.ones(s.shape, dtype=torch.bool)
    if t.band is not None:
        left, right = t.band
        if left is not None:
            visible = visible & (rel >= -left)
        if right is not None:
            visible = visible & (rel <= right)
    if t.key_valid is not None:
        visible = visible & t.key_valid[:, None, None, :]
    if t.mask is not None:
        mask = t.mask.expand(*lead, L, S).reshape(N, H, L, S)  # (..., L, S) -> (N, H, L, S)
        if mask.dtype == torch.bool:
            visible = visible & mask
        else:
            s = s + mask.to(work)
    return s, visible


def _softmax(s: Tensor, visible: Tensor, sinks: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """(P (N, H, L, S), the sinks' weights (N, H, L, 1) or None): softmax over the visible keys and a
    sink per head; zeros for a row that sees none (and has no sink)."""
    s = s.masked_fill(~visible, -math.inf)  # filled: a NaN behind the mask stays out
    if sinks is not None:
        column = sinks.to(s.dtype)[:, None, None].expand(*s.shape[:-1], 1)  # (H,) -> (N, H, L, 1)
        p = torch.softmax(torch.cat([s, column], dim=-1), dim=-1)
        return p[..., :-1], p[..., -1:]
    empty = (s == -math.inf).all(dim=-1, keepdim=True)
    return torch.softmax(s.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0), None


def dense(q: Tensor, k: Tensor, v: Tensor, t: Spec, *, work: torch.dtype) -> tuple[Tensor, Tensor, tuple]:
    """(out (..., L, Dv) in v's dtype, P (N, H, L, S) in ``work``, the output's leading dims): scores
    (q scaled first, as torch's math path) and softmax in ``work``, P rounded to v's dtype for its
    product with v (as torch's kernels do)."""
    q4, k4, v4, lead = as_4d(q, k, v, t.enable_gqa)
    s, visible = _scores_and_visible(q4, k4, t, lead, work, scale_first=True)
    p, _ = _softmax(s, visible, t.sinks)
    out = p.to(v4.dtype) @ v4  # (N, H, L, S) @ (N, H, S, Dv)
    return out.reshape(*lead, *out.shape[-2:]), p, lead


def reference(q: Tensor, k: Tensor, v: Tensor, t: Spec, cotangent: Tensor | None) -> Outcome:
    """float64 of the inputs as given: output, gradients (with cotangent), sizes and NaN zones."""
    leaves = {name: x.detach().to(torch.float64).requires_grad_(cotangent is not None)
              for name, x in (("dq", q), ("dk", k), ("dv", v))}
    for name, x in (("d_alibi", t.slopes), ("d_sinks", t.sinks)):
        if x is not None:
            leaves[name] = x.detach().to(torch.float64).requires_grad_(cotangent is not None)
    wide = Spec(**{**t.__dict__, "slopes": leaves.get("d_alibi"), "sinks": leaves.get("d_sinks"),
                    "mask": None if t.mask is None else (t.mask if t.mask.dtype == torch.bool else t.mask.double())})
    q4, k4, v4, lead = as_4d(leaves["dq"], leaves["dk"], leaves["dv"], t.enable_gqa)
    s, visible = _scores_and_visible(q4, k4, wide, lead, torch.float64)
    p, p_sink = _softmax(s, visible, wide.sinks)
    v_nan = v4.isnan()
    out4 = p @ v4.masked_fill(v_nan, 0.0)
    certain, possible = _nan_zones(s, visible, p, v_nan)
    out4 = out4.masked_fill(certain, math.nan)
    out = out4.reshape(*lead, *out4.shape[-2:])
    result = Outcome(out=out.detach(), certain=certain.reshape(out.shape), possible=possible.reshape(out.shape))
    sizes = _Sizes(q4, k4, v4, out4, p, p_sink, s, wide, leaves)
    result.bounds["out"] = sizes.output()
    if cotangent is None or not out.requires_grad:
        return result
    g4 = cotangent.to(torch.float64).expand(out.shape).reshape(out4.shape)  # (..., L, Dv) -> (N, H, L, Dv)
    result.bounds.update(sizes.gradients(g4))
    grads = torch.autograd.grad(out4, list(leaves.values()), g4, allow_unused=True)
    result.grads = {name: torch.zeros_like(leaf) if g is None else g for (name, leaf), g in zip(leaves.items(), grads)}
    return result


def _nan_zones(s: Tensor, visible: Tensor, p: Tensor, v_nan: Tensor) -> tuple[Tensor, Tensor]:
    """(certain, possible) NaN of the output (N, H, L, Dv): see the module docstring."""
    bad = s.isnan() | (s == math.inf)  # (N, H, L, S)
    row_certain = (bad & visible).any(-1, keepdim=True)
    row_possible = bad.any(-1, keepdim=True)
    sees = visible & ~(s == -math.inf)  # the keys a row sees
    if p.shape[-1]:
        sees = sees & ~p.isnan()
    v_certain = (sees.to(torch.float64) @ v_nan.to(torch.float64)) > 0  # (N, H, L, Dv)
    v_possible = v_nan.any(-2, keepdim=True).expand_as(v_certain)
    return row_certain | v_certain, row_possible | v_possible | row_certain | v_certain


class _Sizes:
    """The size of what each result sums, as (size, flush) floats. size: ``plain`` (the sums in
    absolute values: P |V| for the output, P^T |dO| for dV, |scale| A |K| for dQ with A = P (|dO|
    |V|^T + |dO| |O|), ...) plus ``conditioning``: how far the result moves when every score moves by
    one rounding of its own size (s_abs = |scale| |q| |k| + |s|), to first order and with the
    softmax's cancellations (a saturated softmax does not move: its one weight is 1 whatever its
    score). flush: the plain sums with every weight 1, for the weights a kernel flushes below
    tiny/eps of a row's largest. Summed back over broadcast dims and shared heads as the gradients
    are (autograd of the expansion)."""

    def __init__(self, q4, k4, v4, out4, p, p_sink, s, t: Spec, leaves):
        finite = (lambda x: torch.nan_to_num(x.detach(), nan=0.0, posinf=0.0, neginf=0.0))  # noqa: E731
        self.q, self.k, self.v, self.out, self.p = (finite(x) for x in (q4, k4, v4, out4, p))
        self.p_sink = None if p_sink is None else finite(p_sink)
        self.expanded, self.t, self.leaves = {"dq": q4, "dk": k4, "dv": v4}, t, leaves
        D = q4.shape[-1]
        self.scale = abs(t.scale if t.scale is not None else (1.0 / math.sqrt(D) if D else 1.0))
        self.s_abs = self.scale * (self.q.abs() @ self.k.abs().transpose(-1, -2)) + finite(s).abs()  # (N, H, L, S)
        ps = self.p * self.s_abs
        self.r = (self.s_abs + ps.sum(-1, keepdim=True) - 2 * ps).clamp_min(0)  # a weight's relative move, in roundings

    def output(self) -> tuple[float, float]:
        plain, flush = self.p @ self.v.abs(), self.v.abs().sum(-2)
        if self.p.numel() == 0 or self.v.shape[-1] == 0:
            return _max(plain), _max(flush)
        N, H, L, Dv = self.out.shape  # sum_j p_ij s_abs_ij |v_j - out_i|: the move of out_i
        S = self.v.shape[-2]
        spread = torch.cdist(self.out.reshape(N * H, L, Dv), self.v.reshape(N * H, S, Dv), p=math.inf).view(self.p.shape)
        return _max(plain) + _max((self.p * self.s_abs * spread).sum(-1)), _max(flush)

    def gradients(self, g: Tensor) -> dict[str, tuple[float, float]]:
        p, r = self.p, self.r
        dp = g @ self.v.transpose(-1, -2)  # (N, H, L, S)
        delta = (g * self.out).sum(-1, keepdim=True)  # (N, H, L, 1)
        moved = p * r * (dp - delta).abs()
        cond_a = moved + p * moved.sum(-1, keepdim=True)  # the move of dS = P (dP - delta)
        plain, flush = self._plain(p, g), self._plain(torch.ones_like(p), g)
        conditioning = {**self._products(cond_a, (p * r).transpose(-1, -2) @ g.abs()),
                        "d_alibi": (cond_a * self._distances()).sum((0, 2, 3))}
        if self.p_sink is not None:  # p_sink moves by sum_j P_j s_abs_j roundings, delta by its terms'
            moved_sink = (plain["delta"] * (p * self.s_abs).sum(-1, keepdim=True)
                          + (p * r * (dp - delta).abs()).sum(-1, keepdim=True))  # (N, H, L, 1)
            conditioning["d_sinks"] = (self.p_sink * moved_sink).sum((0, 2, 3))
        sizes = {}
        for name in ("dq", "dk", "dv", "d_alibi", "d_sinks"):
            if name == "d_alibi" and self.t.slopes is None or name == "d_sinks" and self.p_sink is None:
                continue
            size, cond, flushed = (self._summed(name, x[name]) for x in (plain, conditioning, flush))
            sizes[name] = (size + cond, flushed)
        return sizes

    def _plain(self, p: Tensor, g: Tensor) -> dict[str, Tensor]:
        """The gradients' sums in absolute values for weights p (N, H, L, S), before summing back."""
        delta_abs = (g.abs() * (p @ self.v.abs())).sum(-1, keepdim=True)  # rowsum(|dO| |O|) at most: (N, H, L, 1)
        a = p * (g.abs() @ self.v.abs().transpose(-1, -2) + delta_abs)
        sinks = torch.ones_like(delta_abs) if p is not self.p else self.p_sink
        return {**self._products(a, p.transpose(-1, -2) @ g.abs()), "delta": delta_abs,
                "d_alibi": (a * self._distances()).sum((0, 2, 3)),
                "d_sinks": None if sinks is None else (sinks * delta_abs).sum((0, 2, 3))}

    def _products(self, a: Tensor, dv: Tensor) -> dict[str, Tensor]:
        return {"dq": self.scale * a @ self.k.abs(), "dk": self.scale * a.transpose(-1, -2) @ self.q.abs(), "dv": dv}

    def _summed(self, name: str, x: Tensor) -> float:
        if name in self.expanded:  # summed back to the input's shape
            x = torch.autograd.grad(self.expanded[name], self.leaves[name], x, retain_graph=True)[0]
        return _max(x)

    def _distances(self) -> Tensor:
        L, S = self.p.shape[-2:]
        q_pos = self.t.q_pos if self.t.q_pos is not None else torch.arange(L)
        k_pos = self.t.k_pos if self.t.k_pos is not None else torch.arange(S)
        rel = (k_pos[..., None, :] - q_pos[..., :, None]).abs().to(torch.float64)
        return rel if rel.dim() == 2 else rel[:, None]  # (N, L, S) -> (N, 1, L, S)


def _max(x: Tensor) -> float:
    finite = x[x.isfinite()]
    return float(finite.abs().max()) if finite.numel() else 0.0


def torch_own(q: Tensor, k: Tensor, v: Tensor, t: Spec, cotangent: Tensor | None, *, expressible: bool,
              is_causal: bool) -> list[Outcome]:
    """torch's computations in the inputs' dtype, each a way torch computes this call (the error
    allowed is 2x the largest of theirs):

        the formula      float32 scores and softmax (float64 for float64), P rounded to the dtype for
                         its product with v, op by op: every call
        as given         F.scaled_dot_product_attention on the inputs as they are (torch picks its
                         kernel by their dims and layout): a call torch expresses (``expressible``:
                         no window, ALiBi, softcap, sinks, bottom-right alignment or positions) and
                         answers (its causal kernel gives NaN at scale <= 0; no rows keep the
                         query's batch dims)
        fused            torch's fused kernel on (N, H, L, D) contiguous copies, the band, padding and
                         masks folded into one mask: every call without ALiBi, softcap or sinks; under
                         enable_gqa also with the heads shared (torch's GQA path: measured, its dV at
                         large logits differs from the one with repeated heads at short S)
    """
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    outcomes = [_torch_run(q, k, v, t, cotangent, lambda qq, kk, vv, tt: dense(qq, kk, vv, tt, work=work)[0])]
    if expressible and not (is_causal and t.mask is not None):
        def as_given(qq, kk, vv, tt):
            return F.scaled_dot_product_attention(qq, kk, vv, attn_mask=tt.mask, is_causal=is_causal, scale=tt.scale,
                                                  enable_gqa=tt.enable_gqa)
        outcomes.append(_torch_run(q, k, v, t, cotangent, as_given))
    if t.slopes is None and t.softcap is None and t.sinks is None:
        outcomes.append(_torch_run(q, k, v, t, cotangent, _fused))
        if t.enable_gqa:  # torch told to share the heads (its kernel differs from repeated heads at short S)
            outcomes.append(_torch_run(q, k, v, t, cotangent, lambda *args: _fused(*args, shared=True)))
    return [o for o in outcomes if o is not None]


def _fused(q: Tensor, k: Tensor, v: Tensor, t: Spec, *, shared: bool = False) -> Tensor:
    """torch's fused kernel on contiguous (N, H, L, D) copies, every hidden key in one mask; with
    ``shared``, k and v keep their shared heads (one count for both) and torch is told enable_gqa."""
    q4, k4, v4, lead = as_4d(q, k, v, t.enable_gqa)
    step = 1
    if shared and q.dim() >= 3 and k.dim() >= 3 and v.dim() >= 3 and k.shape[-3] and v.shape[-3]:
        step = q4.shape[1] // math.lcm(k.shape[-3], v.shape[-3])  # query heads per shared head
    empty = q4.new_zeros(q4.shape[:-1] + (0,))
    visible = _scores_and_visible(empty, k4[..., :0], Spec(**{**t.__dict__, "mask": None, "scale": 1.0}), lead,
                                  q4.dtype)[1] if q4.numel() or k4.numel() else None
    mask = visible
    if t.mask is not None:
        user = t.mask.expand(*lead, *q4.shape[-2:-1], k4.shape[-2]).reshape(*q4.shape[:-1], k4.shape[-2])  # -> (N, H, L, S)
        mask = user & visible if user.dtype == torch.bool else user.masked_fill(~visible, -math.inf)
    k4, v4 = k4[:, ::step], v4[:, ::step]  # (N, H, S, X) -> (N, H / step, S, X): the heads each group shares
    out = F.scaled_dot_product_attention(q4.contiguous(), k4.contiguous(), v4.contiguous(), attn_mask=mask, scale=t.scale,
                                         enable_gqa=step > 1)
    return out.reshape(*lead, *out.shape[-2:])


def _torch_run(q, k, v, t: Spec, cotangent, compute) -> Outcome | None:
    """compute(q, k, v, terms) on fresh leaves in the inputs' dtype, with gradients; None when torch
    refuses or fails the call (an exception, the wrong shape, NaN from finite inputs)."""
    leaves = {name: x.detach().clone().requires_grad_(cotangent is not None) for name, x in (("dq", q), ("dk", k), ("dv", v))}
    for name, x in (("d_alibi", t.slopes), ("d_sinks", t.sinks)):
        if x is not None:
            leaves[name] = x.detach().clone().requires_grad_(cotangent is not None)
    own = Spec(**{**t.__dict__, "slopes": leaves.get("d_alibi"), "sinks": leaves.get("d_sinks")})
    try:
        out = compute(leaves["dq"], leaves["dk"], leaves["dv"], own)
    except Exception:  # noqa: BLE001  (torch refuses some calls it could express: a 1-D mask, IndexError)
        return None
    if out.shape != output_shape(q, k, v, t.enable_gqa):
        return None
    if out.isnan().any() and not any(x.isnan().any() or x.isinf().any() for x in (q, k, v)):
        return None  # a failure of torch's (its causal kernel at scale <= 0), not an error to allow
    result = Outcome(out=out.detach())
    if cotangent is not None and out.requires_grad:
        grads = torch.autograd.grad(out, list(leaves.values()), cotangent.to(out.dtype).expand(out.shape),
                                    allow_unused=True)
        result.grads = {name: torch.zeros_like(leaf) if g is None else g for (name, leaf), g in zip(leaves.items(), grads)}
    return result


def error(x: Tensor, ref: Tensor) -> float:
    """The largest |x - ref| where both are finite (0 where there is nothing to compare)."""
    if x.shape != ref.shape:
        return math.inf
    both = x.isfinite() & ref.isfinite()
    if not both.any():
        return 0.0
    return float((x.to(torch.float64)[both] - ref.to(torch.float64)[both]).abs().max())


def tolerance(torch_error: float, bound: tuple[float, float], dtype: torch.dtype, terms: int) -> float:
    """2x torch's own error plus the rounding floor (see the module docstring) for sums of ``terms``,
    and twice the flush term: tiny / eps of the dtype computed in (float32 for the half types) times
    the sums with every weight 1 (weights below that fraction of a row's largest are flushed by
    design: mha.kernels.flash, exp's slow path and denormals)."""
    size, flush = bound
    wide = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32)
    return 2.0 * torch_error + FLOOR * torch.finfo(dtype).eps * size * math.log2(2 + terms) + 2 * wide.tiny / wide.eps * flush
