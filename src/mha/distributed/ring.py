"""Ring attention: each rank keeps its queries; the key/value blocks travel around the ranks.

    step 0: rank r attends its queries to its own K/V block, while sending that block to r + 1
    step t: ... to the block of rank r - t, received during step t - 1, while passing it on
    after W steps every query has seen every key; the parts merge by log-sum-exp (in float32,
    or float64 for float64 inputs; a row that sees nothing stays zero)

Each step is a set of blocks, one per pair of (query piece, key piece) of the two ranks (a piece:
a run of consecutive positions, mha.distributed.layout). A pair's positions are an offset, the
one position rule of mha.positions: query i of a piece starting at position a and key j of a
piece starting at b are at distance j - (i + (a - b)), so causality, windows and ALiBi hold across
the ring as in one process, and a pair the band hides entirely is never computed. With zigzag,
every rank's causal work is the same at every step, so no rank waits for another:

    W = 2, chunks 0..3 (rank 0 holds 0 and 3, rank 1 holds 1 and 2); scores a rank computes, in
    diagonals (a causal chunk x chunk block, d) and full blocks (f = 2 d):

                   step 0 (own keys)                  step 1 (the other rank's keys)
    rank 0         0x0 d, 3x0 f, 3x3 d    = 4 d       3x1 f, 3x2 f   = 4 d
    rank 1         1x1 d, 2x1 f, 2x2 d    = 4 d       2x0 f, 1x0 f   = 4 d

The backward passes each block's dK/dV accumulator (float32) around the ring behind its K/V:
rank r adds its queries' contributions to the block it holds and sends the sum on; after W steps
each accumulator is back with its owner. Each block's contribution uses the whole softmax's
log-sum-exp (mha.kernels.dispatch.backward_with_lse), so the gradients are exact. GQA: only the key/value heads
travel. Sinks join every row once, after the merge.

Memory per rank: its q, k, v and output (1/W of the sequence each), the block it computes on and
half of the next one (K/V travel in two units, halves of the slots, each let go once computed on
and sent), and one block's partial output (query pieces are cut at the halves too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from .. import masks, positions
from ..kernels import dispatch
from ..kernels.contract import Contract, contract_of
from ..kernels.merge import add_sinks, merge_into, sink_gradient
from . import comm
from .inputs import check
from .layout import Piece, SequenceLayout

__all__ = ["ring_attention"]

_ACCUMULATORS = 4  # the tags of dK/dV in flight, apart from K/V's (0 to 3: two units of two tensors)


def ring_attention(q: Tensor, k: Tensor, v: Tensor, layout: SequenceLayout, *, is_causal: bool = False,
                   scale: float | None = None, enable_gqa: bool = False, window: tuple[int, int] | None = None,
                   alibi_slopes: Tensor | None = None, softcap: float | None = None,
                   sinks: Tensor | None = None) -> Tensor:
    """Exact attention over the whole sequence, from this rank's shards (see the module docstring).

    q (B, H, T, D), k (B, Hkv, T, D), v (B, Hkv, T, Dv): this rank's slots of the sequence
    (T = layout.local_length, as layout.shard gives them) -> output (B, H, T, Dv), zeros in the
    padding slots. Every rank of layout.group calls it with its own shards.

    The options are mha.functional.scaled_dot_product_attention's, at the sequence's positions:
    is_causal, scale, enable_gqa (k, v with Hkv heads dividing H), window (flash-attn's (left,
    right), -1 unbounded), alibi_slopes (H,), softcap, sinks (H,). Differentiable in q, k, v,
    alibi_slopes and sinks; the gradients of alibi_slopes and sinks are this rank's share (sum them
    over the group, as for any parameter the ranks share).
    """
    terms = check(q, k, v, layout, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, window=window,
                  alibi_slopes=alibi_slopes, softcap=softcap, sinks=sinks)
    if dispatch.OBSERVERS:
        raise ValueError("ring attention cannot be recorded (mha.capture_attention, mha.explorer.record): each block it "
                         "computes is a part of a row's softmax, no call sees a whole row; record the model on one "
                         "process, or use ulysses_attention, whose calls see whole sequences")
    return _Ring.apply(q, k, v, terms.alibi_slopes, terms.sinks, layout, terms)


@dataclass(frozen=True)
class Block:
    """One pair of a step: query slots ``rows`` against key slots ``cols`` of the keys held."""
    rows: slice
    cols: slice
    contract: Contract


def blocks(layout: SequenceLayout, query_rank: int, key_rank: int, terms: Contract, device=None,
           key_slots: range | None = None) -> list[Block]:
    """The pairs of pieces rank ``query_rank`` computes against ``key_rank``'s keys (those in
    ``key_slots``, a run of its slots, by default all; ``cols`` count from its start), skipping
    the pairs the band hides entirely. Query pieces are cut at the units too, so that no block's
    partial output is larger than half of this rank's."""
    key_slots = key_slots or range(layout.local_length)
    query_pieces = [qp.within(rows) for rows in units(layout.local_length) for qp in layout.pieces(query_rank)]
    found = []
    for qp in filter(None, query_pieces):
        for kp in layout.pieces(key_rank):
            kp = kp.within(key_slots)
            if kp is not None:
                contract = _pair_contract(qp, kp, terms, device)
                if contract is not None:
                    cols = slice(kp.local - key_slots.start, kp.local - key_slots.start + kp.valid)
                    found.append(Block(qp.rows, cols, contract))
    return found


def _pair_contract(qp: Piece, kp: Piece, terms: Contract, device) -> Contract | None:
    """The contract of query piece ``qp`` against key piece ``kp``, or None when nothing is visible."""
    shaping = dict(alibi_slopes=terms.alibi_slopes, scale=terms.scale, softcap=terms.softcap)
    band, offset = terms.band, positions.offset_between(qp.start, kp.start)  # query i at a + i, key j at b + j
    if qp.stride != 1:  # striped: query i at a + W i, key j at b + W j
        if terms.alibi_slopes is not None:  # |rel| = |W (j - i) + b - a|: the positions one by one
            q_pos, k_pos = qp.positions(device)[None], kp.positions(device)[None]  # (1, L), (1, S)
            return contract_of(band=band, positions=(q_pos, k_pos), **shaping)
        band, offset = (None if band is None else band.strided(qp.stride, kp.start - qp.start)), 0
    contract = contract_of(band=positions.needed(band, qp.valid, kp.valid, offset), offset=offset, **shaping)
    lo, hi = contract.key_range(positions.whole(qp.valid), kp.valid)
    return contract if hi > lo else None


def visible_pairs(layout: SequenceLayout, query_rank: int, key_rank: int, terms: Contract) -> int:
    """How many (query, key) scores rank ``query_rank`` computes against ``key_rank``'s keys: the
    work of one step of the ring (a fully visible pair counts L * S, a causal diagonal about half)."""
    total = 0
    for b in blocks(layout, query_rank, key_rank, terms):
        L, S, contract = b.rows.stop - b.rows.start, b.cols.stop - b.cols.start, b.contract
        band = contract.band
        if band is None:
            total += L * S
            continue
        if contract.positions is None:
            q_pos, k_pos = positions.aligned(range(L), range(S), contract.offset)  # (L,), (S,)
        else:
            q_pos, k_pos = contract.positions[0][0], contract.positions[1][0]  # (1, L), (1, S) -> (L,), (S,)
        first, stop = band.interval(q_pos, k_pos)  # (L,) each
        total += int((stop - first).sum())
    return total


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, alibi_slopes, sinks, layout: SequenceLayout, terms: Contract):
        # alibi_slopes and sinks (also in terms) are arguments so that autograd tracks them
        compute = masks.additive_dtype(q.dtype)  # float32 for half precision
        B, H, T, _ = q.shape
        out = torch.zeros(B, H, T, v.shape[-1], dtype=compute, device=q.device)
        lse = torch.full((B, H, T), float("-inf"), dtype=compute, device=q.device)
        qc = q.to(compute)
        for unit in _around(layout, (k, v)):
            _attend_unit(qc, unit, out, lse, layout, terms)
            del unit  # let the unit go before the next one arrives
        if sinks is not None:
            add_sinks(out, lse, sinks)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.layout, ctx.terms = layout, terms
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        layout, terms = ctx.layout, ctx.terms
        compute = lse.dtype
        qc, oc, doc = q.to(compute), out.to(compute), grad_out.to(compute)
        dq = torch.zeros_like(qc)
        d_slopes = None if terms.alibi_slopes is None else torch.zeros_like(terms.alibi_slopes, dtype=compute)
        ring = comm.Ring(layout.group)
        travelling = {}  # unit index -> the dK/dV accumulator of that unit of the block held, on its way around
        for unit in _around(layout, (k, v)):
            tag = _ACCUMULATORS + 2 * unit.index  # apart from K/V's tags, and per unit
            incoming = ring.pass_on(travelling[unit.index], tag=tag) if unit.step > 0 else None
            dk, dv = _differentiate_unit(qc, oc, doc, lse, unit, dq, d_slopes, layout, terms)
            if incoming is not None:
                acc_k, acc_v = incoming.wait()
                dk, dv = dk.add_(acc_k), dv.add_(acc_v)
            travelling[unit.index] = (dk, dv)
            del unit
        if layout.world_size > 1:  # the last holder sends each accumulator home
            for index, acc in travelling.items():
                travelling[index] = ring.pass_on(acc, tag=_ACCUMULATORS + 2 * index).wait()
        dk, dv = (torch.cat([travelling[index][i] for index in sorted(travelling)], dim=2) for i in (0, 1))
        d_sinks = None
        if sinks is not None:
            d_sinks = sink_gradient(sinks, lse, (doc * oc).sum(-1))  # delta = rowsum(dO * O): (B, H, T)
        d_slopes = None if d_slopes is None else d_slopes.to(terms.alibi_slopes.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), d_slopes, d_sinks, None, None


def _attend_unit(qc: Tensor, unit: Unit, out: Tensor, lse: Tensor, layout: SequenceLayout, terms: Contract) -> None:
    """Merge the attention of the queries ``qc`` over one unit of keys into ``out`` and ``lse``."""
    ku, vu = (x.to(qc.dtype) for x in unit.tensors)
    for b in blocks(layout, layout.rank, unit.owner, terms, qc.device, unit.slots):
        part_out, part_lse = dispatch.attention_with_lse(qc[:, :, b.rows], ku[:, :, b.cols], vu[:, :, b.cols], b.contract)
        merge_into(out[:, :, b.rows], lse[:, :, b.rows], part_out, part_lse)
        del part_out, part_lse  # before the next part is made


def _differentiate_unit(qc, oc, doc, lse, unit: Unit, dq: Tensor, d_slopes: Tensor | None,
                        layout: SequenceLayout, terms: Contract) -> tuple[Tensor, Tensor]:
    """This rank's queries' contributions to one unit's dK, dV (returned) and to dq and d_slopes
    (added in place), from the whole softmax's output ``oc`` and ``lse``."""
    ku, vu = (x.to(qc.dtype) for x in unit.tensors)
    dk, dv = torch.zeros_like(ku), torch.zeros_like(vu)
    for b in blocks(layout, layout.rank, unit.owner, terms, qc.device, unit.slots):
        rows, cols = b.rows, b.cols
        grads = dispatch.backward_with_lse(qc[:, :, rows], ku[:, :, cols], vu[:, :, cols], b.contract,
                                 oc[:, :, rows], lse[:, :, rows], doc[:, :, rows])
        dq[:, :, rows] += grads[0]
        dk[:, :, cols] += grads[1]
        dv[:, :, cols] += grads[2]
        if grads[3] is not None:
            d_slopes += grads[3]
    return dk, dv


class Unit(NamedTuple):
    """A run of slots of the block held at a step of the ring, with its K/V tensors."""
    step: int
    owner: int  # the rank whose block it is
    index: int
    slots: range
    tensors: tuple[Tensor, ...]


def units(local_length: int) -> list[range]:
    """The runs of slots K/V travel in: two halves (one when there is a single slot)."""
    half = (local_length + 1) // 2
    return [range(0, half), range(half, local_length)] if local_length > 1 else [range(local_length)]


def _around(layout: SequenceLayout, block: tuple[Tensor, ...]):
    """Every unit of every step of the ring, starting with this rank's own block. A unit of the
    next block is received while the same unit of this one is computed on (and sent on); once
    done, it is let go, so a rank holds its own block, the one it computes on and one unit more."""
    ring = comm.Ring(layout.group)
    parts = units(layout.local_length)
    held = [tuple(t[:, :, slots] for t in block) for slots in parts]  # step 0: views of this rank's own
    owner = layout.rank
    for step in range(layout.world_size):
        arrived = []
        for i, slots in enumerate(parts):
            flight = ring.pass_on(held[i], tag=2 * i) if step < layout.world_size - 1 else None
            yield Unit(step, owner, i, slots, held[i])
            held[i] = None  # computed on and (after the wait below) sent: let go
            if flight is not None:
                arrived.append(flight.wait())
        held, owner = arrived, (owner - 1) % layout.world_size
