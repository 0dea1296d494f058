"""What the calling context asks of a kernel: torch.autocast, torch.func transforms, forward-mode AD.

The kernels call torch's ops below the layers that handle these (an autograd.Function, torch's
private CPU flash op), so they look at the context themselves.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch._C._functorch import TransformType, get_interpreter_stack
from torch.autograd import forward_ad


def autocast_inputs(*tensors: Tensor) -> tuple[Tensor, ...]:
    """The floating tensors in the autocast dtype when autocast is on for their device (as torch's
    SDPA casts its inputs), else unchanged."""
    device = tensors[0].device.type
    if not autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in tensors)


def autocast_enabled(device_type: str) -> bool:
    """Whether torch.autocast is on for the device type; False for one autocast does not know (the
    meta device, where shapes are inferred: torch raises when asked about it)."""
    return device_type != "meta" and torch.is_autocast_enabled(device_type)


def transforms_active() -> bool:
    """Whether a torch.func transform (vmap, grad, jvp, jacrev, ...) is running."""
    return torch._C._are_functorch_transforms_active()


def autograd_function_refusal(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> str | None:
    """Why a kernel written as a torch.autograd.Function (flash, native) cannot run a call, or None:
    torch.func transforms, forward-mode AD, and a mask that needs its gradient are beyond it."""
    if transforms_active():
        return "it does not run under torch.func transforms (vmap, grad, jvp, jacrev); use backend='math'"
    if forward_mode(q, k, v):
        return "it has no forward-mode AD (jvp); use backend='math'"
    if mask is not None and mask.requires_grad and torch.is_grad_enabled():
        return "it does not differentiate through attn_mask; use backend='math'"
    return None


def may_branch_on_values() -> bool:
    """Whether Python may branch on a tensor's values (``bool(t.any())``): not while torch.func
    transforms run (vmap cannot) nor while torch.compile traces (it would break the graph)."""
    return not transforms_active() and not torch.compiler.is_compiling()


def forward_mode(*tensors: Tensor | None) -> bool:
    """Whether forward-mode derivatives are asked for: a dual tensor, or torch.func.jvp running."""
    if forward_ad._current_level < 0 and not transforms_active():  # no dual level open: no dual tensor
        return False
    if any(t is not None and forward_ad.unpack_dual(t).tangent is not None for t in tensors):
        return True
    return transforms_active() and any(i.key() == TransformType.Jvp for i in get_interpreter_stack() or ())


def differentiates(*tensors: Tensor | None) -> bool:
    """Whether anything differentiates through these tensors: an autograd graph (grad mode on and one
    of them requires grad), a forward-mode tangent, or a torch.func transform running. Where nothing
    does, a kernel may work in place and return results no autograd graph records."""
    if transforms_active():
        return True
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return True
    return forward_mode(*tensors)
