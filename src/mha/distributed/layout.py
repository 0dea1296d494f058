"""Which positions of a sequence each rank holds: SequenceLayout.

A sequence of ``length`` tokens is padded to a length the layout divides and cut into runs of
slots ("pieces"); rank r holds its pieces side by side, ``local_length`` slots in all:

    contiguous   rank r holds one run, chunk r of W:            ranks  0 0 1 1 2 2 3 3
    zigzag       2W chunks; rank r holds chunks r and 2W-1-r:   ranks  0 1 2 3 3 2 1 0
    striped      rank r holds positions r, r + W, r + 2W, ...:  ranks  0 1 2 3 0 1 2 3

Under causal attention the later positions see more keys. Contiguous gives the last rank W times
the first one's work; zigzag pairs an early chunk with a late one, so every rank (and every step
of the ring, mha.distributed.ring) does the same work; striped balances the same way with one
position per run. Padding slots sit at the end of a piece (positions >= length); the attention
functions never attend them and give them zero output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _checks
from . import comm

__all__ = ["BALANCES", "Piece", "SequenceLayout"]

BALANCES = ("zigzag", "contiguous", "striped")


@dataclass(frozen=True)
class Piece:
    """A run of a rank's slots: local slots [local, local + size) hold the positions
    start, start + stride, ...; the first ``valid`` of them are tokens, the rest padding."""
    local: int
    start: int
    size: int
    valid: int
    stride: int = 1

    @property
    def rows(self) -> slice:
        """The local slots that hold tokens."""
        return slice(self.local, self.local + self.valid)

    def within(self, slots: range) -> Piece | None:
        """The piece's tokens that sit in local ``slots`` (a run of them), or None if there are none."""
        first, last = max(self.local, slots.start), min(self.local + self.valid, slots.stop)
        if last <= first:
            return None
        count = last - first
        return Piece(first, self.start + self.stride * (first - self.local), count, count, self.stride)

    def positions(self, device=None) -> Tensor:
        """(valid,) int64: the positions of the tokens."""
        return torch.arange(self.start, self.start + self.stride * self.valid, self.stride, device=device)


class SequenceLayout:
    """Which positions of a ``length``-token sequence each rank of ``group`` holds.

    Args:
        length: the sequence's true length (the tokens; padding is added as the layout needs).
        group: a torch.distributed process group; None: the default group (or, when
            torch.distributed is not initialised, one process holding everything).
        balance: "zigzag" (default), "contiguous" or "striped" (see the module docstring).
        world_size, rank: a layout of that many ranks seen from ``rank``, described without a
            group (to plan, or to shard data ahead of time); its unshard needs the group.

    ``shard(x, dim)`` gives this rank's part of a whole tensor, ``unshard(x, dim)`` the whole
    tensor back, on every rank, in order and at its true length.
    """

    def __init__(self, length: int, group=None, balance: str = "zigzag", *, world_size: int | None = None,
                 rank: int = 0) -> None:
        self.length = _checks.positive_int("length", length)
        _checks.one_of("balance", balance, BALANCES)
        self.group, self.balance = group, balance
        if world_size is None:
            self.world_size, self.rank = comm.world(group)
        else:  # described, not joined: for planning and for sharding data without the group
            if group is not None:
                raise ValueError("pass group or world_size, not both (world_size describes a layout without a group)")
            self.world_size = _checks.positive_int("world_size", world_size)
            self.rank = _checks.integer("rank", rank)
            if not 0 <= self.rank < self.world_size:
                raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")
        self._joined = world_size is None
        chunks = 2 * self.world_size if balance == "zigzag" else self.world_size
        self.padded_length = -(-self.length // chunks) * chunks  # the next multiple of the chunk count
        self.local_length = self.padded_length // self.world_size
        self._pieces = tuple(self._cut(r) for r in range(self.world_size))

    def __repr__(self) -> str:
        return (f"SequenceLayout(length={self.length}, balance={self.balance!r}, world_size={self.world_size}, "
                f"rank={self.rank}, local_length={self.local_length})")

    def pieces(self, rank: int | None = None) -> tuple[Piece, ...]:
        """The runs of slots ``rank`` (default: this one) holds, in local order."""
        return self._pieces[self.rank if rank is None else rank]

    def positions(self, rank: int | None = None, device=None) -> Tensor:
        """(local_length,) int64: the position of every slot of ``rank``; padding slots hold
        positions >= length (a RoPE may rotate them: they are never attended)."""
        return torch.cat([torch.arange(p.start, p.start + p.stride * p.size, p.stride, device=device)
                          for p in self.pieces(rank)])

    def slots(self, device=None) -> Tensor:
        """(length,) int64: where each position sits when the ranks' shards are laid side by side
        (rank r's slot i at r * local_length + i), in the order of positions."""
        where = torch.empty(self.length, dtype=torch.long, device=device)
        for rank in range(self.world_size):
            for p in self.pieces(rank):
                first = rank * self.local_length + p.local
                where[p.start: p.start + p.stride * p.valid: p.stride] = torch.arange(first, first + p.valid, device=device)
        return where

    def shard(self, x: Tensor, dim: int = -2) -> Tensor:
        """This rank's part of ``x``, whose ``dim`` has the whole sequence: ``local_length`` slots
        along ``dim``, zeros in the padding slots. Differentiable."""
        dim = self._dim("x", x, dim, self.length, "the whole sequence (length)")
        parts = []
        for p in self.pieces():
            if p.stride == 1:
                part = x.narrow(dim, min(p.start, self.length), p.valid)
            else:
                part = x.index_select(dim, p.positions(x.device))
            parts.append(_pad(part, dim, p.size - p.valid))
        return torch.cat(parts, dim) if len(parts) > 1 else parts[0]

    def unshard(self, x: Tensor, dim: int = -2) -> Tensor:
        """The whole tensor from every rank's part ``x`` (``local_length`` slots along ``dim``), in
        the order of positions and at the true length, on every rank (an all-gather; not
        differentiable: it is for results and checks)."""
        dim = self._dim("x", x, dim, self.local_length, "this rank's slots (local_length)")
        if not self._joined and self.world_size > 1:
            raise ValueError("unshard gathers from every rank: it needs a layout of the group, not one given world_size")
        gathered = comm.all_gather(x.detach(), self.group)
        whole = torch.cat(gathered, dim)  # (..., W * local_length, ...): the ranks' slots side by side
        return whole.index_select(dim, self.slots(x.device))

    def _dim(self, name: str, x: Tensor, dim: int, size: int, meaning: str) -> int:
        _checks.tensor(name, x)
        if not -x.dim() <= dim < x.dim():
            raise ValueError(f"dim must be in [{-x.dim()}, {x.dim()}) for {name} of shape {tuple(x.shape)}, got {dim}")
        dim %= x.dim()
        if x.shape[dim] != size:
            raise ValueError(f"{name} must have {size} = {meaning} entries along dim {dim}, got shape {tuple(x.shape)}")
        return dim

    def _cut(self, rank: int) -> tuple[Piece, ...]:
        W, n = self.world_size, self.local_length
        if self.balance == "striped":
            return (Piece(0, rank, n, _tokens(self.length, rank, n, W), stride=W),)
        if self.balance == "contiguous":
            return (self._chunk(0, rank, n),)
        half = n // 2  # zigzag: chunk r, then chunk 2W-1-r
        return self._chunk(0, rank, half), self._chunk(half, 2 * W - 1 - rank, half)

    def _chunk(self, local: int, index: int, size: int) -> Piece:
        start = index * size
        return Piece(local, start, size, max(0, min(size, self.length - start)))


def _tokens(length: int, first: int, slots: int, stride: int) -> int:
    """How many of the positions first, first + stride, ... (``slots`` of them) are below length."""
    return max(0, min(slots, -(-(length - first) // stride)))


def _pad(x: Tensor, dim: int, count: int) -> Tensor:
    """``count`` zero slots appended along ``dim``."""
    if count == 0:
        return x
    widths = [0, 0] * (x.dim() - 1 - dim) + [0, count]  # F.pad lists the last dim first
    return F.pad(x, widths)
