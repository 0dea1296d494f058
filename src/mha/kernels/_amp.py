"""torch.autocast for kernels that call torch's ops below its autocast layer."""

from __future__ import annotations

import torch
from torch import Tensor


def autocast_inputs(*tensors: Tensor) -> tuple[Tensor, ...]:
    """The floating tensors in the autocast dtype when autocast is on for their device (as torch's
    SDPA casts its inputs), else unchanged."""
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in tensors)
