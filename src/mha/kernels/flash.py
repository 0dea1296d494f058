"""The flash backend: exact attention in tiles, never holding an L x S matrix.

For each block of queries, the keys are visited in tiles and merged into a running softmax
(the log-sum-exp merge of mha.kernels.merge in place); the result comes with its log-sum-exp, so
flash results over separate key sets merge exactly with merge_attention. Every term of the
contract (mha.kernels.Contract) is applied tile by tile: tiles the band hides are never computed
(a sliding window w costs O(L * w)), masks are sliced, ALiBi and padding come from positions.
Attention sinks start each row's running softmax (a key with logit sink_h and a zero value).
The backward pass recomputes each tile's probabilities from each row's saved max m and sum l (not
the log-sum-exp, whose rounding, |m| eps, would reach every weight at large logits):

    P = exp(S - m) / l,  dV = P^T dO,  dP = dO V^T,  dS = P * (dP - rowsum(dO * O)),
    dQ = dS K * scale,  dK = dS^T Q * scale,  d slope_h = -sum dS |rel|,  d sink_h = -sum P_sink rowsum(dO * O)

(with softcap, dS is multiplied by 1 - tanh^2; with dropout, P is replaced by P * Z in dV and
dP by dP * Z, Z the tile's keep mask / (1 - p), redrawn from the same seed; with a per-head
logit_scale t, scale * t_h takes scale's place and d t_h = scale * sum(Q * dS K) over the head's rows).

Memory: O((L + S) * D) plus a few (B*H, block_q, block_k) tiles. Shapes: q (..., L, D),
k (..., S, D), v (..., S, Dv), the leading dims broadcast together (the last one is the heads:
ALiBi slopes and sinks are (H,)), except that k and v may have Hkv heads dividing q's H (GQA).
float16/bfloat16 inputs are computed in float32; under torch.autocast the inputs are cast to the
autocast dtype first, as torch's SDPA does.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from .. import masks
from ._context import autocast_enabled, autocast_inputs, autograd_function_refusal
from ._shapes import leads, matched_kv_heads, unflat
from .contract import Contract, resolve, undeclared
from .merge import sink_gradient

__all__ = ["BLOCK_K", "BLOCK_Q", "TAKES", "WINDOW_BLOCKS", "flash_attention", "flash_attention_backward",
           "flash_attention_with_lse", "unsupported"]

# every term but the caller's functions (math and flex take them), named: a new field is refused until declared here
TAKES = frozenset({"band", "positions", "key_valid", "mask", "alibi_slopes", "scale", "logit_scale", "softcap", "sinks"})
BLOCK_Q = 256
BLOCK_K = 256
WINDOW_BLOCKS = (64, 128)  # a sliding window: smaller blocks waste less work on its edges
_NEG_INF = float("-inf")


def flash_attention(q: Tensor, k: Tensor, v: Tensor, contract: Contract | None = None, *,
                    dropout_p: float = 0.0) -> Tensor:
    """The backend entry point: output (..., L, Dv)."""
    return flash_attention_with_lse(q, k, v, contract, dropout_p=dropout_p)[0]


def flash_attention_with_lse(q: Tensor, k: Tensor, v: Tensor, contract: Contract | None = None, *,
                             dropout_p: float = 0.0, block_q: int | None = None,
                             block_k: int | None = None) -> tuple[Tensor, Tensor]:
    """(output (..., L, Dv), log-sum-exp (..., L) in float32 or wider: log of the softmax's
    denominator, sinks included; -inf for a row that sees no key and has no sink)."""
    contract = resolve(contract)
    k, v = matched_kv_heads(q, k, v)
    reason = unsupported(q, k, v, contract)
    if reason:
        raise ValueError(f"the flash backend cannot run this call: {reason}")
    options = (contract, float(dropout_p), *_block_sizes(contract, block_q, block_k))
    arguments = (*contract.learned, options)  # (alibi_slopes, sinks, logit_scale): each gets its gradient
    if autocast_enabled(q.device.type):
        with torch.autocast(q.device.type, enabled=False):  # the tiles mix dtypes on purpose
            return _Flash.apply(*autocast_inputs(q, k, v), *arguments)
    return _Flash.apply(q, k, v, *arguments)


def flash_attention_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, grad_out: Tensor,
                             contract: Contract | None = None) -> tuple[Tensor | None, ...]:
    """(dq, dk, dv, d alibi_slopes, d sinks, d logit_scale (each or None)) of attention over these keys, given
    the output ``out`` (..., L, Dv) and log-sum-exp ``lse`` (..., L) of the whole softmax, which may
    span more keys than k and v hold (sequence-parallel attention's other blocks): P = e^(S - lse)
    is then this block's share of the true probabilities, and the gradients are this block's exact
    contributions, which add up over the blocks. No dropout. Gradients come in the inputs' dtypes."""
    contract = resolve(contract)
    block_q, block_k = _block_sizes(contract, None, None)
    tiles = _Tiles(q, k, v, contract, 0.0)
    return tuple(_backward(tiles, (q, k, v), out, grad_out, block_q, block_k, shift=lse))


def _block_sizes(contract: Contract, block_q: int | None, block_k: int | None) -> tuple[int, int]:
    windowed = contract.band is not None and contract.band.left is not None
    default_q, default_k = WINDOW_BLOCKS if windowed else (BLOCK_Q, BLOCK_K)
    return block_q or default_q, block_k or default_k


def unsupported(q: Tensor, k: Tensor, v: Tensor, contract: Contract, dropout_p: float = 0.0) -> str | None:
    """Why flash cannot run this call, or None. (It honours every term of the contract but the
    caller's functions, TAKES.)"""
    return undeclared(TAKES, contract) or autograd_function_refusal(q, k, v, contract.mask)


class _Flash(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, alibi_slopes, sinks, logit_scale, options):
        contract, dropout_p, block_q, block_k = options
        tiles = _Tiles(q, k, v, contract, dropout_p)
        out, lse, row_max, row_sum = _forward(tiles, block_q, block_k)
        ctx.save_for_backward(q, k, v, out, row_max, row_sum)
        ctx.options = options
        ctx.seed = tiles.seed
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        if torch.is_grad_enabled():
            raise RuntimeError("the flash backend has no double backward (create_graph=True); "
                               "use backend='math' for higher derivatives")
        q, k, v, out, row_max, row_sum = ctx.saved_tensors
        contract, dropout_p, block_q, block_k = ctx.options
        tiles = _Tiles(q, k, v, contract, dropout_p, seed=ctx.seed)
        return (*_backward(tiles, (q, k, v), out, grad_out, block_q, block_k, shift=row_max, norm=row_sum), None)


def _flat(x: Tensor, dtype, lead: tuple[int, ...]) -> Tensor:
    x = x.to(dtype).expand(*lead, *x.shape[-2:])  # batch dims broadcast to the common ones
    return x.reshape(math.prod(lead), x.shape[-2], x.shape[-1])  # (..., T, D) -> (B*H, T, D)


def _per_row(x: Tensor, lead: tuple[int, ...], dtype) -> Tensor:
    """A per-head (H,) tensor as (B*H, 1, 1), for the flattened rows."""
    return x.to(dtype).expand(lead).reshape(math.prod(lead), 1, 1)  # (H,) -> (..., H) -> (B*H, 1, 1)


class _Tile(NamedTuple):
    s: Tensor  # (BH, r, c) scores, -inf where hidden
    hidden: Tensor  # (BH, r, c) bool, True where the score is -inf: a hidden key, or a visible one scored -inf
    capped: Tensor | None  # tanh(raw / softcap), for the backward
    distance: Tensor | None  # |rel|, for the ALiBi slopes' gradient


class _Tiles:
    """The inputs flattened to (B*H, L, D) and (B*Hkv, S, D|Dv) in the compute dtype, and the
    scores of any tile of (query rows, key cols) under the contract, computed on demand (nothing
    L x S ever exists).

    GQA (Hkv < H, G = H / Hkv query heads per key/value head): a block of query rows is taken as
    (B*Hkv, G*r, D), the G heads that share a key/value head side by side, so that one matmul per
    key/value head serves them all and K, V are never repeated; the scores (B*Hkv, G*r, c) are
    then the same memory as (B*H, r, c), where the contract shapes them.
    """

    def __init__(self, q, k, v, contract: Contract, dropout_p: float, seed: int | None = None):
        self.lead, self.kv_lead = leads(q, k, v)  # (..., H), (..., Hkv)
        self.groups = 1 if self.kv_lead == self.lead else self.lead[-1] // self.kv_lead[-1]
        self.BH, self.BHkv = math.prod(self.lead), math.prod(self.kv_lead)
        self.L, self.S = q.shape[-2], k.shape[-2]
        self.dtype = masks.additive_dtype(q.dtype)  # float32 for float16/bfloat16
        self.out_dtype = v.dtype
        self.contract, self.dropout_p = contract, dropout_p
        self.scale = contract.scale_for(q.shape[-1])
        # what multiplies q: the scale, and each head's logit_scale (BH, 1, 1)
        self.factor = self.scale if contract.logit_scale is None else \
            _per_row(contract.logit_scale, self.lead, self.dtype) * self.scale
        self.q = _flat(q, self.dtype, self.lead) * self.factor  # (BH, L, D), pre-scaled
        self.k, self.v = _flat(k, self.dtype, self.kv_lead), _flat(v, self.dtype, self.kv_lead)  # (BHkv, S, D|Dv)
        self.kT = self.k.transpose(1, 2)  # (BHkv, D, S)
        self._block: tuple[range, Tensor] | None = None  # the query rows of the block being visited
        self.seed = seed if seed is not None or dropout_p == 0.0 else int(torch.randint(2 ** 62, ()).item())
        self._hidden: dict[tuple, Tensor] = {}  # band patterns of edge tiles by shape and shift
        info = torch.finfo(self.dtype)
        self.floor = math.log(info.tiny / info.eps)  # e^floor times any value above eps is a normal float

    def blocks(self, block_q: int):
        for i0 in range(0, self.L, block_q):
            yield range(i0, min(i0 + block_q, self.L))

    def key_tiles(self, rows: range, block_k: int):
        """The key ranges of tiles with a visible key. A band bounded on the left (a sliding
        window) whose keys for this block fit in 4 tiles is taken as one tile."""
        lo, hi = self.contract.key_range(rows, self.S)
        band = self.contract.band
        if band is not None and band.left is not None and hi - lo <= 4 * block_k:
            if hi > lo:
                yield range(lo, hi)
            return
        for j0 in range(lo - lo % block_k, hi, block_k):  # tiles start on multiples of block_k
            yield range(max(j0, lo), min(j0 + block_k, hi))

    def query_rows(self, x: Tensor, rows: range) -> Tensor:
        """Rows of a query-side (BH, L, X) tensor as (BHkv, G*r, X): a view without GQA, else a copy."""
        if self.groups == 1:
            return x[:, rows.start:rows.stop]
        grouped = x.view(self.BHkv, self.groups, self.L, x.shape[-1])  # (BH, L, X) -> (BHkv, G, L, X)
        return grouped[:, :, rows.start:rows.stop].reshape(self.BHkv, self.groups * len(rows), x.shape[-1])

    def put_query_rows(self, x: Tensor, rows: range, block: Tensor) -> None:
        """Write a (BHkv, G*r, X) block back into rows of x (BH, L, X): a no-op where query_rows gave a
        view (no GQA, or one row per head, as the last block of L = 257 has): the block is x's memory."""
        if self.groups == 1:
            return
        target = x.view(self.BHkv, self.groups, self.L, x.shape[-1])[:, :, rows.start:rows.stop]  # (BH, L, X) -> (BHkv, G, r, X)
        if block.data_ptr() != target.data_ptr():
            target.copy_(block.view(target.shape))  # (BHkv, G*r, X) -> (BHkv, G, r, X)

    def by_kv_head(self, t: Tensor) -> Tensor:
        """A tile (BH, r, c) as (BHkv, G*r, c), the same memory."""
        return t.view(self.BHkv, self.groups * t.shape[1], t.shape[2])

    def add_weighted_values(self, acc: Tensor, p: Tensor, v_tile: Tensor) -> None:
        """acc (BH, r, Dv) += p (BH, r, c) @ v_tile (BHkv, c, Dv)."""
        if self.groups == 1:
            acc.baddbmm_(p, v_tile)
        else:
            acc.add_(torch.bmm(self.by_kv_head(p), v_tile).view(acc.shape))  # (BHkv, G*r, Dv) -> (BH, r, Dv)

    def scores(self, rows: range, cols: range) -> _Tile:
        """The tile's scores (BH, r, c), ready for the softmax, and what its backward needs."""
        if self._block is None or self._block[0] != rows:
            self._block = (rows, self.query_rows(self.q, rows))
        s = torch.bmm(self._block[1], self.kT[:, :, cols.start:cols.stop])  # (BHkv, G*r, c)
        s = s.view(self.BH, len(rows), len(cols))  # (BHkv, G*r, c) -> (BH, r, c)
        s, capped = self.contract.cap(s, inplace=True)  # capped: tanh(s / c), or None
        rel, bias, band_hidden = self._position_terms(rows, cols)
        hidden = self.contract.hidden(rows, cols, band_hidden)
        self.contract.shape_scores(s.view(*self.lead, len(rows), len(cols)), rows, cols, inplace=True, bias=bias,
                            hidden=hidden)
        distance = None if rel is None or bias is None else rel.abs()
        return _Tile(s, s == _NEG_INF, capped, distance)  # the band, padding, masks and -inf scores alike

    def _position_terms(self, rows: range, cols: range):
        """(rel or None, ALiBi bias or None, band-hidden or None) of the tile; band edges cached."""
        contract = self.contract
        covered = contract.band_covers(rows, cols)
        if not contract.needs_positions or (covered and contract.alibi_slopes is None):
            return None, None, None
        if contract.alibi_slopes is None and contract.positions is None:  # a band edge: the pattern repeats
            key = (len(rows), len(cols), cols.start - rows.start)
            if key not in self._hidden:
                self._hidden[key] = contract.position_terms(contract.distances(rows, cols, self.q.device),
                                                            self.dtype)[1]
            return None, None, self._hidden[key]
        rel = contract.distances(rows, cols, self.q.device)
        bias, hidden = contract.position_terms(rel, self.dtype)
        return rel, bias, None if covered else hidden

    def probabilities(self, tile: _Tile, shift: Tensor) -> Tensor:
        """e^(scores - shift), in place, with exact zeros where the tile hides a key.

        The exponent is floored at log(tiny / eps) (-71 in float32): exp takes a slow path for
        arguments below about -87 (80x slower on this project's CPUs), and denormal weights, or
        their products with the values, slow the following matmul by 100x or more. A key that far
        below the row's maximum weighs less than the float's resolution of the sum either way.
        Keys scored -inf (hidden, or scored so) are zeroed after the exp: they weigh exactly nothing,
        and a row with nothing else gets nothing (not e^floor, normalised to 1).
        """
        return tile.s.sub_(shift).clamp_(min=self.floor).exp_().masked_fill_(tile.hidden, 0.0)

    def keep(self, rows: range, cols: range, shape) -> Tensor | None:
        """Dropout's scaled keep mask Z of a tile (the same draw in forward and backward), or None."""
        if self.dropout_p == 0.0:
            return None
        generator = torch.Generator(self.q.device).manual_seed(
            (self.seed + rows.start * (self.S + 1) + cols.start) % 2 ** 63)
        kept = torch.rand(shape, generator=generator, device=self.q.device, dtype=self.dtype) >= self.dropout_p
        return kept.to(self.dtype).mul_(0.0 if self.dropout_p == 1.0 else 1.0 / (1.0 - self.dropout_p))


def _forward(tiles: _Tiles, block_q: int, block_k: int):
    """Online softmax: per query block, a running max m, sum l and unnormalised output acc.

    Each key tile is merged in place: with m' = max(m, tile max), acc <- acc e^(m - m') + P V and
    l <- l e^(m - m') + rowsum(P), P = e^(S - m'); at the end out = acc / l, lse = m' + log l. This
    is merge_attention's formula in running, unnormalised form; buffers are reused tile to tile
    (a fresh tile buffer per step costs about a fifth of the time on CPU). A sink starts a row
    at m = sink, l = 1.
    """
    lead, L, dtype, v3 = tiles.lead, tiles.L, tiles.dtype, tiles.v
    BH, Dv = tiles.q.shape[0], v3.shape[-1]
    out = torch.zeros(BH, L, Dv, dtype=dtype, device=v3.device)
    row_max = torch.full((BH, L), _NEG_INF, dtype=dtype, device=v3.device)
    row_sum = torch.zeros(BH, L, dtype=dtype, device=v3.device)
    sinks = tiles.contract.sinks
    running = _Running(BH, min(block_q, L), Dv, dtype, v3.device,
                       None if sinks is None else _per_row(sinks, lead, dtype))
    for rows in tiles.blocks(block_q):
        state = running.start(len(rows))
        for cols in tiles.key_tiles(rows, block_k):
            tile = tiles.scores(rows, cols)
            running.add(state, tiles, tile, tiles.v[:, cols.start:cols.stop], tiles.keep(rows, cols, tile.s.shape))
        block = slice(rows.start, rows.stop)
        running.finish(state, out[:, block], row_max[:, block], row_sum[:, block])
    lse = (row_max + row_sum.log()).view(*lead, L)  # float32 (or float64); -inf where l = 0
    return out.view(*lead, L, Dv).to(tiles.out_dtype), lse, row_max, row_sum


class _Running:
    """Buffers of the running softmax of one query block (B*H, rows, ...), reused block to block."""

    def __init__(self, BH, rows, Dv, dtype, device, sinks):
        self.shape, self.dtype, self.device = (BH, rows, Dv), dtype, device
        self.buffers = self._make(rows)
        self.sinks = sinks  # (BH, 1, 1) or None

    def _make(self, rows):
        """(m, m_new, alpha, l (BH, rows, 1), acc (BH, rows, Dv)): contiguous, as ops with out= want them."""
        BH, _, Dv = self.shape
        make = lambda *shape: torch.empty(BH, *shape, dtype=self.dtype, device=self.device)  # noqa: E731
        return (*(make(rows, 1) for _ in range(4)), make(rows, Dv))

    def start(self, rows):
        # a block of fewer rows (the last) gets buffers of its own: a slice of the others would not be contiguous
        state = self.buffers if rows == self.shape[1] else self._make(rows)
        if self.sinks is None:
            state[0].fill_(_NEG_INF)
            state[3].zero_()
        else:  # the sink, seen first: a logit with weight e^(sink - m) = 1 and a zero value
            state[0].copy_(self.sinks.expand_as(state[0]))
            state[3].fill_(1.0)
        state[4].zero_()
        return state

    @staticmethod
    def add(state, tiles, tile, v_tile, keep):
        """Merge one tile of scores (BH, r, c) with its values (BHkv, c, Dv) into the state."""
        m, m_new, alpha, l, acc = state
        torch.maximum(m, tile.s.amax(dim=-1, keepdim=True), out=m_new)
        nothing_yet = m_new == _NEG_INF  # rows with no visible key so far: shift by 0 (e^(-inf - 0) = 0)
        m_new.masked_fill_(nothing_yet, 0.0)
        torch.sub(m, m_new, out=alpha).clamp_(min=tiles.floor).exp_()  # e^(m - m') rescales the past (floored)
        p = tiles.probabilities(tile, m_new)  # in place: P = e^(S - m')
        l.mul_(alpha).add_(p.sum(dim=-1, keepdim=True))
        tiles.add_weighted_values(acc.mul_(alpha), p if keep is None else p.mul_(keep), v_tile)
        m.copy_(m_new.masked_fill_(nothing_yet, _NEG_INF))  # they keep m = -inf: their first visible max shifts them

    @staticmethod
    def finish(state, out, row_max, row_sum):
        m, _, _, l, acc = state
        out.copy_(acc.div_(l.clamp_min(torch.finfo(l.dtype).tiny)))  # rows that saw nothing: 0 (out: a view)
        row_max.copy_(m.squeeze(-1))
        row_sum.copy_(l.squeeze(-1))


def _backward(tiles: _Tiles, inputs, out, grad_out, block_q, block_k, *, shift: Tensor, norm: Tensor | None = None):
    """(dq, dk, dv, d alibi_slopes, d sinks, d logit_scale (each or None)), each shaped like its input. The
    probabilities are P = e^(S - shift) / norm: the rows' max and sum from this forward (exact at
    large logits), or the log-sum-exp and no norm (another forward's: sequence parallelism)."""
    lead, L, dtype, contract = tiles.lead, tiles.L, tiles.dtype, tiles.contract
    do3, o3 = _flat(grad_out, dtype, lead), _flat(out, dtype, lead)
    shift3 = shift.reshape(tiles.BH, L, 1).to(dtype)  # (..., L) -> (BH, L, 1)
    empty = shift3 == _NEG_INF if norm is None else norm.reshape(tiles.BH, L, 1) == 0
    shift3 = torch.where(empty, torch.full_like(shift3, float("inf")), shift3)  # rows that saw nothing: P = 0
    inv_norm = None if norm is None else torch.where(empty, 1.0, norm.reshape(tiles.BH, L, 1).to(dtype)).reciprocal()
    delta = (do3 * o3).sum(dim=-1, keepdim=True)  # (BH, L, 1) = rowsum(dO * O)
    dq, dk, dv = torch.zeros_like(tiles.q), torch.zeros_like(tiles.k), torch.zeros_like(tiles.v)
    d_slopes = None if contract.alibi_slopes is None else torch.zeros(dq.shape[0], dtype=dtype, device=dq.device)
    alpha = tiles.scale if contract.logit_scale is None else 1.0  # per head: dq's factor applied at the end
    for rows in tiles.blocks(block_q):
        i0, i1 = rows.start, rows.stop
        do_rows, q_rows = tiles.query_rows(do3, rows), tiles.query_rows(tiles.q, rows)  # (BHkv, G*r, Dv|D)
        dq_rows = tiles.query_rows(dq, rows)
        for cols in tiles.key_tiles(rows, block_k):
            j0, j1 = cols.start, cols.stop
            tile = tiles.scores(rows, cols)
            p = tiles.probabilities(tile, shift3[:, i0:i1])  # (BH, r, c)
            if inv_norm is not None:
                p.mul_(inv_norm[:, i0:i1])
            keep = tiles.keep(rows, cols, p.shape)
            dp = torch.bmm(do_rows, tiles.v[:, j0:j1].transpose(1, 2)).view(p.shape)  # dO V^T: (BH, r, c)
            if keep is not None:
                dp.mul_(keep)
            kept = tiles.by_kv_head(p if keep is None else p * keep)  # (BHkv, G*r, c)
            dv[:, j0:j1].baddbmm_(kept.transpose(1, 2), do_rows)  # (P Z)^T dO
            ds = p.mul_(dp.sub_(delta[:, i0:i1]))  # P * (dP - delta), reusing p's storage
            if tile.distance is not None:  # d/d slope of -slope |rel|
                d_slopes -= (ds.view(*lead, len(rows), len(cols)) * tile.distance).sum((-2, -1)).reshape(-1)
            if tile.capped is not None:  # d/ds of c tanh(s / c)
                ds.mul_(tile.capped.mul_(tile.capped).neg_().add_(1.0))
            ds = tiles.by_kv_head(ds)  # (BHkv, G*r, c)
            dq_rows.baddbmm_(ds, tiles.k[:, j0:j1], alpha=alpha)  # dS K * scale
            dk[:, j0:j1].baddbmm_(ds.transpose(1, 2), q_rows)  # dS^T (Q * scale)
        tiles.put_query_rows(dq, rows, dq_rows)
    d_logit_scale = None
    if contract.logit_scale is not None:  # s = q k * scale * t_h: d t_h = scale * sum q (dS K), dq = (dS K) * scale * t_h
        d_logit_scale = _per_head((dq * _flat(inputs[0], dtype, lead)).sum((-2, -1)) * tiles.scale,
                                  contract.logit_scale, lead)
        dq.mul_(tiles.factor)
    kinds = (lead, tiles.kv_lead, tiles.kv_lead)
    grads = [unflat(grad, x, shape) for grad, x, shape in zip((dq, dk, dv), inputs, kinds)]
    grads.append(None if d_slopes is None else _per_head(d_slopes, contract.alibi_slopes, lead))
    if contract.sinks is None:
        grads.append(None)
    else:
        per_row = [None if x is None else x.reshape(*lead, L).to(dtype) for x in (shift, delta, norm)]  # -> (..., H, L)
        grads.append(sink_gradient(contract.sinks, *per_row))
    grads.append(d_logit_scale)
    return grads


def _per_head(grad: Tensor, like: Tensor, lead: tuple[int, ...]) -> Tensor:
    """(B*H,) -> (H,) summed over the batch, in like's dtype."""
    return grad.view(math.prod(lead[:-1]), lead[-1]).sum(0).to(like.dtype)  # (B*H,) -> (B, H) -> (H,)
