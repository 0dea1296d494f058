"""Exact attention backends sharing one signature, and the choice between them.

    backend(q, k, v, contract=None, *, dropout_p=0.0)
    q (..., L, D), k (..., S, D), v (..., S, Dv); contract: mha.kernels.Contract (the band,
    positions, masks, ALiBi, scale, softcap and sinks: everything that shapes the scores)

`math` returns (output, weights); the others return the output. `flash` is the project's own
blocked kernel (O(L + S) memory, log-sum-exp, every term of the contract); `sdpa` is torch's
fused kernel, for the contracts it can express. :func:`choose_backend` picks one and says why.
"""

from __future__ import annotations

from .contract import Contract
from .dispatch import BACKENDS, attention, choose_backend
from .flash import flash_attention, flash_attention_with_lse
from .math import math_attention, safe_softmax
from .merge import merge_attention
from .sdpa import sdpa_attention

__all__ = ["BACKENDS", "Contract", "attention", "choose_backend", "flash_attention", "flash_attention_with_lse",
           "math_attention", "merge_attention", "safe_softmax", "sdpa_attention"]
