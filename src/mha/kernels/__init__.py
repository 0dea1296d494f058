"""Exact attention backends sharing one signature, and the choice between them.

    backend(q, k, v, mask=None, is_causal=False, scale=None, dropout_p=0.0)
    q (B, H, L, D), k (B, H, S, D), v (B, H, S, Dv), mask additive (see mha.masks)

`math` returns (output, weights); the others return output only. `flash` is the project's own
blocked kernel (O(T) memory, log-sum-exp, no dropout); `sdpa` is torch's fused kernel.
"""

from __future__ import annotations

import logging

from .flash import flash_attention, flash_attention_with_lse
from .math import fully_masked_rows, math_attention, safe_softmax
from .merge import merge_attention
from .sdpa import sdpa_attention

__all__ = ["BACKENDS", "choose_backend", "flash_attention", "flash_attention_with_lse",
           "fully_masked_rows", "math_attention", "merge_attention", "safe_softmax", "sdpa_attention"]

BACKENDS = {"math": math_attention, "sdpa": sdpa_attention, "flash": flash_attention}

log = logging.getLogger("mha.dispatch")


def choose_backend(requested: str = "auto", *, need_weights: bool = False, dropout_p: float = 0.0,
                   mask_requires_grad: bool = False) -> tuple[str, str]:
    """The backend that will run, and why. Raises ValueError for an unknown or unfit request.

    auto: weights requested -> math (the only backend that returns them); otherwise sdpa, torch's
    fused kernel: the fastest exact kernel on this project's CPUs (flash, ours, runs at 0.85-1.0x
    its speed at T=4096 and slower at short T: see benchmarks/README.md) and as frugal with memory.
    """
    names = ("auto", *BACKENDS)
    if requested not in names:
        raise ValueError(f"backend must be one of {names}, got {requested!r}")
    if need_weights:
        if requested not in ("auto", "math"):
            raise ValueError(
                f"backend={requested!r} does not return attention weights; "
                "use backend='math' or need_weights=False"
            )
        choice = ("math", "attention weights requested: only the math backend returns them")
    elif requested == "auto":
        choice = ("sdpa", "no weights requested: torch's fused kernel")
    else:
        choice = (requested, "requested explicitly")
    if choice[0] == "flash" and dropout_p > 0.0:
        raise ValueError("backend='flash' has no dropout; use 'sdpa' or 'math' when dropout_p > 0")
    if choice[0] == "flash" and mask_requires_grad:
        raise ValueError("backend='flash' does not differentiate through attn_mask; use 'sdpa' or 'math'")
    log.debug("backend %s: %s", *choice)
    return choice
