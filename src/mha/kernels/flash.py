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
_NEG_INF = float("-inf")


def flash_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
                    is_causal: bool = False, scale: float | None = None,
                    dropout_p: float = 0.0) -> Tensor:
    """The backend entry point (the shared signature); dropout is not supported here."""
    if dropout_p > 0.0:
        raise ValueError("the flash backend has no dropout; use backend='sdpa' or 'math' for dropout_p > 0")
    out, _ = flash_attention_with_lse(q, k, v, mask, is_causal, scale)
    return out


def flash_attention_with_lse(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
                             is_causal: bool = False, scale: float | None = None,
                             block_q: int = BLOCK_Q, block_k: int = BLOCK_K) -> tuple[Tensor, Tensor]:
    """(output (B, H, L, Dv), log-sum-exp (B, H, L) in float32; -inf for rows with no visible key)."""
    if mask is not None and mask.requires_grad and torch.is_grad_enabled():
        raise ValueError("the flash backend does not differentiate through attn_mask; use backend='math'")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _Flash.apply(q, k, v, mask, is_causal, scale, block_q, block_k)


class _Flash(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, is_causal, scale, block_q, block_k):
        out, lse = _forward(q, k, v, mask, is_causal, scale, block_q, block_k)
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.options = (is_causal, scale, block_q, block_k)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out, lse, mask = ctx.saved_tensors
        dq, dk, dv = _backward(q, k, v, out, lse, mask, grad_out, *ctx.options)
        return dq, dk, dv, None, None, None, None, None


def _compute_dtype(x: Tensor) -> torch.dtype:
    return masks.additive_dtype(x.dtype)  # float32 for float16/bfloat16


def _flat(x: Tensor, dtype, lead: tuple[int, ...]) -> Tensor:
    x = x.to(dtype).expand(*lead, *x.shape[-2:])  # key/value batch dims broadcast to the query's
    return x.reshape(-1, x.shape[-2], x.shape[-1])  # (B, H, T, D) -> (B*H, T, D)


def _tiles(L: int, S: int, block_q: int, block_k: int, is_causal: bool):
    """(i0, i1, j0, j1) of every tile that has a visible key (top-left causal: j <= i)."""
    for i0 in range(0, L, block_q):
        yield from _tiles_of_block(i0, min(i0 + block_q, L), S, block_k, is_causal)


def _tiles_of_block(i0: int, i1: int, S: int, block_k: int, is_causal: bool):
    last = min(S, i1) if is_causal else S  # causal: keys after the block's last query are skipped
    for j0 in range(0, last, block_k):
        yield i0, i1, j0, min(j0 + block_k, last)


def _scores(q3, kT3, mask, is_causal, i0, i1, j0, j1, lead):
    """The tile's scores (B*H, rows, cols), masked; ``q3`` is pre-scaled."""
    s = torch.bmm(q3[:, i0:i1], kT3[:, :, j0:j1])  # (BH, r, D) @ (BH, D, c) -> (BH, r, c)
    if mask is not None:
        rows = slice(None) if mask.shape[-2] == 1 else slice(i0, i1)
        cols = slice(None) if mask.shape[-1] == 1 else slice(j0, j1)
        s.view(*lead, i1 - i0, j1 - j0).add_(mask[..., rows, cols])  # broadcasts over B, H
    if is_causal and j1 - 1 > i0:  # some key in the tile lies after some query
        future = torch.arange(j0, j1, device=s.device) > torch.arange(i0, i1, device=s.device)[:, None]
        s.masked_fill_(future, _NEG_INF)
    return s


def _mask_for(mask: Tensor | None, dtype, lead: tuple[int, ...]) -> Tensor | None:
    """The mask with as many dims as (*lead, L, S), for slicing tile by tile."""
    if mask is None:
        return None
    mask = masks.to_dtype(mask, dtype)
    return mask.reshape((1,) * (len(lead) + 2 - mask.dim()) + tuple(mask.shape))  # (L, S) -> (1, 1, L, S)


def _forward(q, k, v, mask, is_causal, scale, block_q, block_k):
    """Online softmax: per query block, a running max m, sum l and unnormalised output acc.

    Each key tile is merged in place: with m' = max(m, tile max), acc <- acc e^(m - m') + P V and
    l <- l e^(m - m') + rowsum(P), P = e^(S - m'); at the end out = acc / l, lse = m' + log l. This
    is merge_attention's formula in running, unnormalised form; buffers are reused tile to tile
    (a fresh tile buffer per step costs about a fifth of the time on CPU).
    """
    lead, L = tuple(q.shape[:-2]), q.shape[-2]
    S, Dv = k.shape[-2], v.shape[-1]
    dtype = _compute_dtype(q)
    q3 = _flat(q, dtype, lead) * scale
    kT3, v3 = _flat(k, dtype, lead).transpose(1, 2), _flat(v, dtype, lead)
    mask = _mask_for(mask, dtype, lead)
    BH = q3.shape[0]
    out = torch.zeros(BH, L, Dv, dtype=dtype, device=q.device)
    lse = torch.full((BH, L), _NEG_INF, dtype=dtype, device=q.device)
    running = _Running(BH, min(block_q, L), Dv, dtype, q.device)
    for i0 in range(0, L, block_q):
        i1 = min(i0 + block_q, L)
        state = running.start(i1 - i0)
        for _, _, j0, j1 in _tiles_of_block(i0, i1, S, block_k, is_causal):
            running.add(state, _scores(q3, kT3, mask, is_causal, i0, i1, j0, j1, lead), v3[:, j0:j1])
        running.finish(state, out[:, i0:i1], lse[:, i0:i1])
    return out.view(*lead, L, Dv).to(q.dtype), lse.view(*lead, L)  # lse stays float32 (or float64)


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


def _backward(q, k, v, out, lse, mask, grad_out, is_causal, scale, block_q, block_k):
    lead, L = tuple(q.shape[:-2]), q.shape[-2]
    S = k.shape[-2]
    dtype = _compute_dtype(q)
    q3, k3, v3 = _flat(q, dtype, lead), _flat(k, dtype, lead), _flat(v, dtype, lead)
    do3, o3 = _flat(grad_out, dtype, lead), _flat(out, dtype, lead)
    mask = _mask_for(mask, dtype, lead)
    lse3 = lse.reshape(-1, L, 1).to(dtype)
    lse3 = torch.where(lse3 == _NEG_INF, torch.full_like(lse3, float("inf")), lse3)  # empty rows: P = 0
    delta = (do3 * o3).sum(dim=-1, keepdim=True)  # (BH, L, 1) = rowsum(dO * O)
    qs3, kT3 = q3 * scale, k3.transpose(1, 2)
    dq, dk, dv = torch.zeros_like(q3), torch.zeros_like(k3), torch.zeros_like(v3)
    for i0, i1, j0, j1 in _tiles(L, S, block_q, block_k, is_causal):
        p = _scores(qs3, kT3, mask, is_causal, i0, i1, j0, j1, lead).sub_(lse3[:, i0:i1]).exp_()  # (BH, r, c)
        dv[:, j0:j1].baddbmm_(p.transpose(1, 2), do3[:, i0:i1])  # P^T dO
        dp = torch.bmm(do3[:, i0:i1], v3[:, j0:j1].transpose(1, 2))  # dO V^T: (BH, r, c)
        ds = p.mul_(dp.sub_(delta[:, i0:i1]))  # P * (dP - delta), reusing p's storage
        dq[:, i0:i1].baddbmm_(ds, k3[:, j0:j1], alpha=scale)
        dk[:, j0:j1].baddbmm_(ds.transpose(1, 2), q3[:, i0:i1], alpha=scale)
    return _unflat(dq, q, lead), _unflat(dk, k, lead), _unflat(dv, v, lead)


def _unflat(grad: Tensor, like: Tensor, lead: tuple[int, ...]) -> Tensor:
    """(B*H, T, D) -> the input's shape, summed over the dims the input was broadcast along."""
    grad = grad.view(*lead, *grad.shape[-2:]).to(like.dtype)  # (B*H, T, D) -> (B, H, T, D)
    return grad.sum_to_size(like.shape) if grad.shape != like.shape else grad
