"""The collectives mha.distributed uses, on torch.distributed (gloo on CPU, NCCL on CUDA).

    world(group)                     (world size, this rank): (1, 0) without torch.distributed
    Ring(group).pass_on(tensors)     send to the next rank, receive the previous rank's, in the
                                     background (point-to-point: isend / irecv in one batch)
    all_gather(x, group)             every rank's x
    all_to_all(x, scatter, gather)   x cut along ``scatter``, piece i to rank i, the received
                                     pieces joined along ``gather``; differentiable
    copy_to_group(x) / reduce_from_group(x)
                                     Megatron's pair for a split layer: identity forward with a
                                     gradient summed over the group / a sum over the group with
                                     the gradient passed through
    sum_gradients_over(module, group)
                                     each parameter's gradient summed over the group as it is
                                     computed (the ranks saw parts of one sequence)

Nothing here assumes a device: buffers are made like the tensors they receive.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["Ring", "all_gather", "all_to_all", "copy_to_group", "global_rank", "initialized", "reduce_from_group",
           "sum_gradients_over", "world"]


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def world(group=None) -> tuple[int, int]:
    """(world size, this rank) of ``group``; one process when torch.distributed is not initialised."""
    if initialized():
        return dist.get_world_size(group), dist.get_rank(group)
    if group is not None:
        raise ValueError("group was given but torch.distributed is not initialised "
                         "(call torch.distributed.init_process_group first)")
    return 1, 0


def global_rank(group, rank: int) -> int:
    """The default group's number of ``group``'s rank ``rank`` (what point-to-point ops take)."""
    return rank if group is None else dist.get_global_rank(group, rank)


class Ring:
    """Point-to-point passing around the ranks of ``group``: rank r sends to r + 1 and receives
    from r - 1 (mod W)."""

    def __init__(self, group=None) -> None:
        self.group = group
        self.size, rank = world(group)
        self.next = global_rank(group, (rank + 1) % self.size)
        self.previous = global_rank(group, (rank - 1) % self.size)

    def pass_on(self, tensors: tuple[Tensor, ...], *, tag: int = 0) -> _InFlight:
        """Start sending ``tensors`` to the next rank and receiving the previous rank's (the same
        shapes and dtypes) into new buffers; ``.wait()`` returns the received ones. The sent
        tensors must stay unchanged until then. Exchanges in flight at the same time need tags
        ``tag``, ``tag + 1``, ... apart (one per tensor)."""
        sent = tuple(t.contiguous() for t in tensors)
        received = tuple(torch.empty_like(t) for t in sent)
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag + i) for i, t in enumerate(sent)]
        ops += [dist.P2POp(dist.irecv, r, self.previous, self.group, tag + i) for i, r in enumerate(received)]
        return _InFlight(dist.batch_isend_irecv(ops), sent, received)


class _InFlight:
    def __init__(self, works, sent: tuple[Tensor, ...], received: tuple[Tensor, ...]) -> None:
        self.works, self.sent, self.received = works, sent, received  # the sent buffers live until wait()

    def wait(self) -> tuple[Tensor, ...]:
        for work in self.works:
            work.wait()
        self.sent = ()
        return self.received


def all_gather(x: Tensor, group=None) -> list[Tensor]:
    """Every rank's ``x`` (all the same shape), in rank order."""
    size, _ = world(group)
    if size == 1:
        return [x]
    x = x.contiguous()
    gathered = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(gathered, x, group=group)
    return gathered


def all_to_all(x: Tensor, scatter_dim: int, gather_dim: int, group=None) -> Tensor:
    """``x`` cut into W equal pieces along ``scatter_dim``, piece i sent to rank i; the pieces
    received (one from each rank, in rank order) joined along ``gather_dim``. The backward is
    the opposite exchange."""
    if world(group)[0] == 1:
        return x
    return _AllToAll.apply(x, scatter_dim, gather_dim, group)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _exchange(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _exchange(grad, gather_dim, scatter_dim, ctx.group), None, None, None


def _exchange(x: Tensor, scatter_dim: int, gather_dim: int, group) -> Tensor:
    size, _ = world(group)
    scatter_dim, gather_dim = scatter_dim % x.dim(), gather_dim % x.dim()
    if x.shape[scatter_dim] % size:
        raise ValueError(f"all_to_all: dim {scatter_dim} of shape {tuple(x.shape)} is not divisible by {size} ranks")
    pieces = x.unflatten(scatter_dim, (size, -1)).movedim(scatter_dim, 0).contiguous()  # (W, ..., n / W, ...)
    received = torch.empty_like(pieces)
    dist.all_to_all_single(received, pieces, group=group)  # received[i]: rank i's piece for this rank
    received = received.movedim(0, gather_dim)  # (..., W, m, ...): the senders before the gathered dim
    return received.flatten(gather_dim, gather_dim + 1)  # (..., W * m, ...)


def copy_to_group(x: Tensor, group=None) -> Tensor:
    """Identity; the gradient is summed over the group (every rank used x for a part of the result)."""
    return _CopyToGroup.apply(x, group) if world(group)[0] > 1 else x


def reduce_from_group(x: Tensor, group=None) -> Tensor:
    """The sum of every rank's x; the gradient passes through (every rank holds the whole result)."""
    return _ReduceFromGroup.apply(x, group) if world(group)[0] > 1 else x


def _all_reduce(x: Tensor, group) -> Tensor:
    x = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(x, group=group)
    return x


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def sum_gradients_over(module: nn.Module, group=None) -> list:
    """Hooks that sum each parameter's gradient over ``group`` as it is computed (before it is
    accumulated into .grad); returns their handles (``handle.remove()`` undoes one)."""
    if world(group)[0] == 1:
        return []
    return [p.register_hook(lambda grad: _all_reduce(grad, group)) for p in module.parameters() if p.requires_grad]
