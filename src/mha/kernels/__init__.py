"""Exact attention backends sharing one signature, and the choice between them.

    backend(q, k, v, mask=None, is_causal=False, scale=None, dropout_p=0.0)
    q (B, H, L, D), k (B, H, S, D), v (B, H, S, Dv), mask additive (see mha.masks)

`math` returns (output, weights); the others return output only.
"""

from __future__ import annotations

import logging

from .math import fully_masked_rows, math_attention, safe_softmax
from .sdpa import sdpa_attention

__all__ = ["BACKENDS", "choose_backend", "fully_masked_rows", "math_attention", "safe_softmax",
           "sdpa_attention"]

BACKENDS = {"math": math_attention, "sdpa": sdpa_attention}

log = logging.getLogger("mha.dispatch")


def choose_backend(requested: str = "auto", *, need_weights: bool = False) -> tuple[str, str]:
    """The backend that will run, and why. Raises ValueError for an unknown or unfit request."""
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
    log.debug("backend %s: %s", *choice)
    return choice
