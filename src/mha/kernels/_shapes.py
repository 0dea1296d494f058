"""The leading dims of a kernel's inputs: how q, k and v broadcast, and gradients back to them.

q (..., H, L, D), k (..., Hkv, S, D), v (..., Hkv, S, Dv); the batch dims broadcast together, and k
and v may have fewer heads than q (GQA: Hkv divides H).
"""

from __future__ import annotations

import math

from torch import Tensor


def leads(q: Tensor, k: Tensor, v: Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The common leading dims of the queries' side and of the keys' and values': (..., H) for
    both, or (..., H) and (..., Hkv) when k and v have fewer heads (GQA: Hkv divides H)."""
    if (q.dim() >= 3 and k.dim() >= 3 and v.dim() >= 3 and k.shape[-3] == v.shape[-3] != q.shape[-3]
            and q.shape[-3] % k.shape[-3] == 0):
        batch = broadcast(q.shape[:-3], k.shape[:-3], v.shape[:-3])
        return (*batch, q.shape[-3]), (*batch, k.shape[-3])
    lead = broadcast(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    return lead, lead


def broadcast(*shapes) -> tuple[int, ...]:
    """The shape that ``shapes`` broadcast to, torch's and NumPy's rule (dims aligned from the right, a
    dim of 1 taking the other's size), read in Python: torch.broadcast_shapes takes 40 us a call (its
    reference implementation's symbolic checks; its first call imports sympy, 0.3 s and ~40 MiB), more
    than a short call's attention. RuntimeError where they do not broadcast, as torch's."""
    first = shapes[0] if shapes else ()
    if all(s == first for s in shapes[1:]):
        return tuple(first)
    out = [1] * max(len(s) for s in shapes)
    for shape in shapes:
        for i, size in enumerate(shape, len(out) - len(shape)):
            if size != 1:
                if out[i] != 1 and out[i] != size:
                    raise RuntimeError(f"shapes {', '.join(str(tuple(s)) for s in shapes)} do not broadcast: "
                                       f"{out[i]} against {size} at dim {i - len(out)}")
                out[i] = size
    return tuple(out)


def unit_last_stride(*tensors: Tensor) -> bool:
    """Whether every tensor's last dim has stride 1, as torch's fused CPU kernel wants (is_contiguous()
    would not do: it ignores the stride of a dim of size 1)."""
    return all(t.stride(-1) == 1 for t in tensors)


def unflat(grad: Tensor, like: Tensor, lead: tuple[int, ...]) -> Tensor:
    """(B*H, T, D) -> the input's shape, summed over the dims the input was broadcast along."""
    grad = grad.view(*lead, *grad.shape[-2:]).to(like.dtype)  # (B*H, T, D) -> (..., T, D)
    return grad.sum_to_size(like.shape) if grad.shape != like.shape else grad


def matched_kv_heads(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """k and v with one head count. torch's enable_gqa lets k and v share heads separately (k's Hk
    and v's Hv each divide the query's H); the kernels take one count: the least common multiple,
    each repeated to it (query head h still reads key head h // (H / Hk) and value head h // (H / Hv)).
    Anything else is returned as it is (for the broadcast rule to judge)."""
    if k.dim() < 3 or v.dim() < 3 or k.shape[-3] == v.shape[-3] or q.dim() < 3:
        return k, v
    H, Hk, Hv = q.shape[-3], k.shape[-3], v.shape[-3]
    if 0 in (Hk, Hv) or H % Hk or H % Hv:
        return k, v
    heads = math.lcm(Hk, Hv)  # (..., Hk|Hv, S, D) -> (..., lcm, S, D)
    return k.repeat_interleave(heads // Hk, dim=-3), v.repeat_interleave(heads // Hv, dim=-3)


def attached_zeros(shape: tuple[int, ...], *inputs: Tensor) -> Tensor:
    """Zeros of ``shape`` in the inputs' dtype and device, in their autograd graph (their gradients
    are zeros): the result of attention with no rows to compute or no key to see."""
    out = inputs[0].new_zeros(shape)
    for x in inputs:
        if x.requires_grad:
            out = out + x.narrow(-1, 0, 0).sum()  # an empty sum: exactly 0, never NaN, and a gradient path
    return out
