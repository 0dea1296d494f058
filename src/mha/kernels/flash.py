"""The flash backend: exact attention in tiles, never holding an L x S matrix.

For each block of queries, the keys are visited in tiles and merged into a running softmax
(the log-sum-exp merge of mha.kernels.merge in place); the result comes with its log-sum-exp, so
flash results over separate key sets merge exactly with merge_attention. Causal tiles wholly
above the diagonal are skipped; masks are added tile by tile. The backward
pass recomputes each tile's probabilities from the saved log-sum-exp:

    P = exp(S - lse),  dV = P^T dO,  dP = dO V^T,  dS = P * (dP - rowsum(dO * O)),
    dQ = dS K * scale,  dK = dS^T Q * scale

Memory: O((L + S) * D) plus one (B*H, block_q, block_k) tile. Shapes: q (B, H, L, D),
k (B, H, S, D), v (B, H, S, Dv) (any number of leading dims; key/value's broadcast to query's),
mask additive and broadcastable to (B, H, L, S).
float16/bfloat16 inputs are computed in float32.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import masks

BLOCK_Q = 256
BLOCK_K = 256
WINDOW_BLOCKS = (64, 128)  # a sliding window: smaller blocks waste less work on its edges
_NEG_INF = float("-inf")


def flash_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
                    is_causal: bool | masks.Band = False, scale: float | None = None,
                    dropout_p: float = 0.0, *, alibi_slopes: Tensor | None = None) -> Tensor:
    """The backend entry point (the shared signature); dropout is not supported here."""
    if dropout_p > 0.0:
        raise ValueError("the flash backend has no dropout; use backend='sdpa' or 'math' for dropout_p > 0")
    out, _ = flash_attention_with_lse(q, k, v, mask, is_causal, scale, alibi_slopes=alibi_slopes)
    return out


def flash_attention_with_lse(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
                             is_causal: bool | masks.Band = False, scale: float | None = None,
                             block_q: int | None = None, block_k: int | None = None, *,
                             alibi_slopes: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(output (B, H, L, Dv), log-sum-exp (B, H, L) in float32; -inf for rows with no visible key).

    is_causal: True (top-left) or a mha.masks.Band (causal alignment, sliding window): tiles with
    no visible key are never computed, so a window w costs O(L * w). alibi_slopes (H,): the ALiBi
    bias -slope_h * |j - (i + S - L)|, computed tile by tile.
    """
    if mask is not None and mask.requires_grad and torch.is_grad_enabled():
        raise ValueError("the flash backend does not differentiate through attn_mask; use backend='math'")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    band = masks.as_band(is_causal, q.shape[-2], k.shape[-2])
    windowed = band is not None and band.left is not None
    default_q, default_k = WINDOW_BLOCKS if windowed else (BLOCK_Q, BLOCK_K)
    return _Flash.apply(q, k, v, mask, band, alibi_slopes, scale, block_q or default_q, block_k or default_k)


class _Flash(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, band, alibi_slopes, scale, block_q, block_k):
        tiles = _TileScores(q, k, mask, band, alibi_slopes, scale)
        out, lse = _forward(tiles, v, block_q, block_k)
        ctx.save_for_backward(q, k, v, out, lse, mask, alibi_slopes)
        ctx.options = (band, scale, block_q, block_k)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out, lse, mask, alibi_slopes = ctx.saved_tensors
        band, scale, block_q, block_k = ctx.options
        tiles = _TileScores(q, k, mask, band, alibi_slopes, scale)
        dq, dk, dv = _backward(tiles, q, k, v, out, lse, grad_out, block_q, block_k)
        return dq, dk, dv, None, None, None, None, None, None


def _flat(x: Tensor, dtype, lead: tuple[int, ...]) -> Tensor:
    x = x.to(dtype).expand(*lead, *x.shape[-2:])  # key/value batch dims broadcast to the query's
    return x.reshape(-1, x.shape[-2], x.shape[-1])  # (B, H, T, D) -> (B*H, T, D)


def _tiles_of_block(i0: int, i1: int, S: int, block_k: int, band: masks.Band | None):
    """(i0, i1, j0, j1) of the key tiles of query block [i0, i1) that hold a visible key.

    A band bounded on the left (a sliding window) whose keys for this block fit in 4 tiles is
    taken as one tile: fewer, larger steps, each with the same mask pattern.
    """
    lo, hi = (0, S) if band is None else band.key_range(i0, i1, S)
    if band is not None and band.left is not None and hi - lo <= 4 * block_k:
        if hi > lo:
            yield i0, i1, lo, hi
        return
    for j0 in range(lo - lo % block_k, hi, block_k):  # tiles start on multiples of block_k
        yield i0, i1, max(j0, lo), min(j0 + block_k, hi)


class _TileScores:
    """The scaled, masked scores of any (query block, key tile), computed on demand.

    Holds the inputs flattened to (B*H, T, D) in the compute dtype; the mask, band and ALiBi bias
    are applied per tile, so nothing of size L x S ever exists.
    """

    def __init__(self, q, k, mask, band, alibi_slopes, scale):
        self.lead, self.L, self.S = tuple(q.shape[:-2]), q.shape[-2], k.shape[-2]
        self.dtype = masks.additive_dtype(q.dtype)  # float32 for float16/bfloat16
        self.scale = scale
        self.q = _flat(q, self.dtype, self.lead) * scale  # (BH, L, D), pre-scaled
        self.kT = _flat(k, self.dtype, self.lead).transpose(1, 2)  # (BH, D, S)
        self.mask = _mask_for(mask, self.dtype, self.lead)
        self.band = band
        self.slopes = None if alibi_slopes is None else alibi_slopes.to(self.dtype).view(-1, 1, 1)  # (H, 1, 1)
        self._cache: dict[tuple, Tensor] = {}  # tile patterns by shape and j0 - i0 (a window repeats them)

    def tiles(self, block_q: int, block_k: int):
        for i0 in range(0, self.L, block_q):
            yield from _tiles_of_block(i0, min(i0 + block_q, self.L), self.S, block_k, self.band)

    def __call__(self, i0, i1, j0, j1) -> Tensor:
        s = torch.bmm(self.q[:, i0:i1], self.kT[:, :, j0:j1])  # (BH, r, D) @ (BH, D, c) -> (BH, r, c)
        tile = s.view(*self.lead, i1 - i0, j1 - j0)  # (B, H, r, c): masks broadcast over B, H
        if self.mask is not None:
            rows = slice(None) if self.mask.shape[-2] == 1 else slice(i0, i1)
            cols = slice(None) if self.mask.shape[-1] == 1 else slice(j0, j1)
            tile.add_(self.mask[..., rows, cols])
        if self.slopes is not None:
            tile.sub_(self.slopes * self._distance(i1 - i0, j1 - j0, j0 - i0))  # -slope_h |j - (i + S - L)|
        if self.band is not None and not self._inside_band(i0, i1, j0, j1):
            s.masked_fill_(self._hidden(i1 - i0, j1 - j0, j0 - i0), _NEG_INF)
        return s

    def _hidden(self, r: int, c: int, shift: int) -> Tensor:
        """(r, c) True where the band hides key j0 + b from query i0 + a; depends on j0 - i0 only."""
        key = ("hidden", r, c, shift)
        if key not in self._cache:
            rows, cols = torch.arange(r, device=self.q.device), torch.arange(c, device=self.q.device) + shift
            self._cache[key] = ~self.band.allowed(rows, cols)
        return self._cache[key]

    def _distance(self, r: int, c: int, shift: int) -> Tensor:
        """(r, c) |j - (i + S - L)| for the tile at key shift j0 - i0."""
        key = ("distance", r, c, shift)
        if key not in self._cache:
            rows, cols = torch.arange(r, device=self.q.device), torch.arange(c, device=self.q.device) + shift
            self._cache[key] = (cols[None, :] - rows[:, None] - (self.S - self.L)).abs().to(self.dtype)
        return self._cache[key]

    def _inside_band(self, i0, i1, j0, j1) -> bool:
        """Whether every (query, key) of the tile is visible (then no masking is needed)."""
        lo_first, hi_first = self.band.key_range(i0, i0 + 1, self.S)
        lo_last, hi_last = self.band.key_range(i1 - 1, i1, self.S)
        return lo_last <= j0 and j1 <= hi_first and lo_first <= j0 and j1 <= hi_last


def _mask_for(mask: Tensor | None, dtype, lead: tuple[int, ...]) -> Tensor | None:
    """The mask with as many dims as (*lead, L, S), for slicing tile by tile."""
    if mask is None:
        return None
    mask = masks.to_dtype(mask, dtype)
    return mask.reshape((1,) * (len(lead) + 2 - mask.dim()) + tuple(mask.shape))  # (L, S) -> (1, 1, L, S)


def _forward(tiles: _TileScores, v, block_q, block_k):
    """Online softmax: per query block, a running max m, sum l and unnormalised output acc.

    Each key tile is merged in place: with m' = max(m, tile max), acc <- acc e^(m - m') + P V and
    l <- l e^(m - m') + rowsum(P), P = e^(S - m'); at the end out = acc / l, lse = m' + log l. This
    is merge_attention's formula in running, unnormalised form; buffers are reused tile to tile
    (a fresh tile buffer per step costs about a fifth of the time on CPU).
    """
    lead, L, dtype = tiles.lead, tiles.L, tiles.dtype
    v3 = _flat(v, dtype, lead)
    BH, Dv = v3.shape[0], v3.shape[-1]
    out = torch.zeros(BH, L, Dv, dtype=dtype, device=v.device)
    lse = torch.full((BH, L), _NEG_INF, dtype=dtype, device=v.device)
    running = _Running(BH, min(block_q, L), Dv, dtype, v.device)
    for i0 in range(0, L, block_q):
        i1 = min(i0 + block_q, L)
        state = running.start(i1 - i0)
        for _, _, j0, j1 in _tiles_of_block(i0, i1, tiles.S, block_k, tiles.band):
            running.add(state, tiles(i0, i1, j0, j1), v3[:, j0:j1])
        running.finish(state, out[:, i0:i1], lse[:, i0:i1])
    return out.view(*lead, L, Dv).to(v.dtype), lse.view(*lead, L)  # lse stays float32 (or float64)


class _Running:
    """Buffers of the running softmax of one query block (B*H, rows, ...), reused block to block."""

    def __init__(self, BH, rows, Dv, dtype, device):
        make = lambda *shape: torch.empty(BH, *shape, dtype=dtype, device=device)  # noqa: E731
        self.m, self.m_new, self.alpha, self.l = (make(rows, 1) for _ in range(4))
        self.acc = make(rows, Dv)

    def start(self, rows):
        state = tuple(x[:, :rows] for x in (self.m, self.m_new, self.alpha, self.l, self.acc))
        state[0].fill_(_NEG_INF)
        state[3].zero_()
        state[4].zero_()
        return state

    @staticmethod
    def add(state, s, v_tile):
        """Merge one tile of scores s (BH, r, c) with its values (BH, c, Dv) into the state."""
        m, m_new, alpha, l, acc = state
        torch.maximum(m, s.amax(dim=-1, keepdim=True), out=m_new)
        m_new.masked_fill_(m_new == _NEG_INF, 0.0)  # rows with nothing visible yet: shift by 0
        torch.sub(m, m_new, out=alpha).exp_()  # e^(m - m'): rescales what came before
        p = s.sub_(m_new).exp_()  # in place: P = e^(S - m')
        l.mul_(alpha).add_(p.sum(dim=-1, keepdim=True))
        acc.mul_(alpha).baddbmm_(p, v_tile)
        m.copy_(m_new)

    @staticmethod
    def finish(state, out, lse):
        m, _, _, l, acc = state
        torch.div(acc, l.clamp_min(torch.finfo(l.dtype).tiny), out=out)  # rows that saw nothing: 0
        torch.add(m, l.log(), out=lse.unsqueeze(-1))  # -inf where l = 0


def _backward(tiles: _TileScores, q, k, v, out, lse, grad_out, block_q, block_k):
    lead, L, dtype = tiles.lead, tiles.L, tiles.dtype
    k3, v3 = _flat(k, dtype, lead), _flat(v, dtype, lead)
    do3, o3 = _flat(grad_out, dtype, lead), _flat(out, dtype, lead)
    lse3 = lse.reshape(-1, L, 1).to(dtype)
    lse3 = torch.where(lse3 == _NEG_INF, torch.full_like(lse3, float("inf")), lse3)  # empty rows: P = 0
    delta = (do3 * o3).sum(dim=-1, keepdim=True)  # (BH, L, 1) = rowsum(dO * O)
    dq, dk, dv = torch.zeros_like(tiles.q), torch.zeros_like(k3), torch.zeros_like(v3)
    for i0, i1, j0, j1 in tiles.tiles(block_q, block_k):
        p = tiles(i0, i1, j0, j1).sub_(lse3[:, i0:i1]).exp_()  # (BH, r, c)
        dv[:, j0:j1].baddbmm_(p.transpose(1, 2), do3[:, i0:i1])  # P^T dO
        dp = torch.bmm(do3[:, i0:i1], v3[:, j0:j1].transpose(1, 2))  # dO V^T: (BH, r, c)
        ds = p.mul_(dp.sub_(delta[:, i0:i1]))  # P * (dP - delta), reusing p's storage
        dq[:, i0:i1].baddbmm_(ds, k3[:, j0:j1], alpha=tiles.scale)  # dS K * scale
        dk[:, j0:j1].baddbmm_(ds.transpose(1, 2), tiles.q[:, i0:i1])  # dS^T (Q * scale)
    return _unflat(dq, q, lead), _unflat(dk, k, lead), _unflat(dv, v, lead)


def _unflat(grad: Tensor, like: Tensor, lead: tuple[int, ...]) -> Tensor:
    """(B*H, T, D) -> the input's shape, summed over the dims the input was broadcast along."""
    grad = grad.view(*lead, *grad.shape[-2:]).to(like.dtype)  # (B*H, T, D) -> (B, H, T, D)
    return grad.sum_to_size(like.shape) if grad.shape != like.shape else grad
