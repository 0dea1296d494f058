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
every rank's causal work is the same at every step (two pairs' worth), so no rank waits:

    zigzag, W = 2 (chunks 0..3; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2)
                 keys: 0  1  2  3
        queries 0        \\
                1     #  \\
                2     #  #  \\
                3     #  #  #  \\       rank 0's rows (chunks 0, 3): \\ + # # # \\ = 2 + 2 + ... per step
                                       step 0 (own keys 0, 3): chunk 0 x 0 diagonal, chunk 3 x 0 full, chunk 3 x 3 diagonal
                                       step 1 (keys 1, 2):     chunk 3 x 1 full, chunk 3 x 2 full

The backward passes each block's dK/dV accumulator (float32) around the ring behind its K/V:
rank r adds its queries' contributions to the block it holds and sends the sum on; after W steps
each accumulator is back with its owner. Each block's contribution uses the whole softmax's
log-sum-exp (mha.kernels.partial), so the gradients are exact. GQA: only the key/value heads
travel. Sinks join every row once, after the merge.

Memory per rank: its q, k, v and output (1/W of the sequence each), the block being computed and
the one arriving, and one block's partial output; never the whole sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .. import masks, positions
from ..kernels import partial
from ..kernels.contract import Contract, contract_of
from ..kernels.merge import add_sinks, merge_into, sink_gradient
from . import comm
from .inputs import Terms, check
from .layout import Piece, SequenceLayout

__all__ = ["ring_attention"]

_ACCUMULATORS = 2  # the tags of dK/dV in flight, apart from K/V's (0 and 1)


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
    return _Ring.apply(q, k, v, terms.alibi_slopes, terms.sinks, layout, terms)


@dataclass(frozen=True)
class Block:
    """One pair of a step: query slots ``rows`` against the held block's key slots ``cols``."""
    rows: slice
    cols: slice
    contract: Contract


def blocks(layout: SequenceLayout, query_rank: int, key_rank: int, terms: Terms, device=None) -> list[Block]:
    """The pairs of pieces rank ``query_rank`` computes against ``key_rank``'s keys, skipping the
    pairs the band hides entirely."""
    found = []
    for qp in layout.pieces(query_rank):
        for kp in layout.pieces(key_rank):
            if qp.valid and kp.valid:
                contract = _pair_contract(qp, kp, terms, device)
                if contract is not None:
                    found.append(Block(qp.rows, kp.rows, contract))
    return found


def _pair_contract(qp: Piece, kp: Piece, terms: Terms, device) -> Contract | None:
    """The contract of query piece ``qp`` against key piece ``kp``, or None when nothing is visible."""
    shaping = dict(alibi_slopes=terms.alibi_slopes, scale=terms.scale, softcap=terms.softcap)
    if qp.stride != 1:  # striped: positions given one by one
        q_pos, k_pos = qp.positions(device)[None], kp.positions(device)[None]  # (1, L), (1, S)
        return contract_of(band=terms.band, positions=(q_pos, k_pos), **shaping)
    offset = qp.start - kp.start  # query i at a + i, key j at b + j: rel = j - (i + a - b)
    band = positions.needed(terms.band, qp.valid, kp.valid, offset)
    if band is not None:
        lo, hi = band.key_range(offset, offset + qp.valid - 1, kp.valid)
        if hi <= lo:
            return None
    return contract_of(band=band, offset=offset, **shaping)


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, alibi_slopes, sinks, layout: SequenceLayout, terms: Terms):
        compute = masks.additive_dtype(q.dtype)  # float32 for half precision
        B, H, T, _ = q.shape
        out = torch.zeros(B, H, T, v.shape[-1], dtype=compute, device=q.device)
        lse = torch.full((B, H, T), float("-inf"), dtype=compute, device=q.device)
        qc = q.to(compute)
        for owner, (kc, vc) in _around(layout, (k, v)):
            kc, vc = kc.to(compute), vc.to(compute)
            for b in blocks(layout, layout.rank, owner, terms, q.device):
                part_out, part_lse = partial.forward(qc[:, :, b.rows], kc[:, :, b.cols], vc[:, :, b.cols], b.contract)
                merge_into(out[:, :, b.rows], lse[:, :, b.rows], part_out, part_lse)
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
        travelling = None  # the held block's dK/dV accumulator, on its way around the ring
        for step, (owner, (kc, vc)) in enumerate(_around(layout, (k, v))):
            kc, vc = kc.to(compute), vc.to(compute)
            incoming = ring.pass_on(travelling, tag=_ACCUMULATORS) if step > 0 else None  # the accumulator of the block now held
            dk, dv = torch.zeros_like(kc), torch.zeros_like(vc)
            for b in blocks(layout, layout.rank, owner, terms, q.device):
                rows, cols = b.rows, b.cols
                grads = partial.backward(qc[:, :, rows], kc[:, :, cols], vc[:, :, cols], b.contract,
                                         oc[:, :, rows], lse[:, :, rows], doc[:, :, rows])
                dq[:, :, rows] += grads[0]
                dk[:, :, cols] += grads[1]
                dv[:, :, cols] += grads[2]
                if grads[3] is not None:
                    d_slopes += grads[3]
            if incoming is not None:
                acc_k, acc_v = incoming.wait()
                dk, dv = dk.add_(acc_k), dv.add_(acc_v)
            travelling = (dk, dv)
        if layout.world_size > 1:  # the last holder sends each accumulator home
            travelling = ring.pass_on(travelling, tag=_ACCUMULATORS).wait()
        dk, dv = travelling
        d_sinks = None
        if sinks is not None:
            d_sinks = sink_gradient(sinks, lse, (doc * oc).sum(-1))  # delta = rowsum(dO * O): (B, H, T)
        d_slopes = None if d_slopes is None else d_slopes.to(terms.alibi_slopes.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), d_slopes, d_sinks, None, None


def _around(layout: SequenceLayout, block: tuple[Tensor, ...]):
    """(owner rank, block) for every step of the ring, starting with this rank's own block; the
    next block is received while the current one is computed on."""
    ring = comm.Ring(layout.group)
    owner = layout.rank
    for step in range(layout.world_size):
        arriving = ring.pass_on(block) if step < layout.world_size - 1 else None
        yield owner, block
        if arriving is not None:
            block = arriving.wait()
            owner = (owner - 1) % layout.world_size
