"""Exact attention backends sharing one signature, and the choice between them.

    backend(q, k, v, contract=None, *, dropout_p=0.0)
    q (..., L, D), k (..., S, D), v (..., S, Dv); contract: mha.kernels.Contract (the band,
    positions, masks, ALiBi, scale, softcap and sinks: everything that shapes the scores)

`math` returns (output, weights); the others return the output. `native` is the project's own
compiled CPU kernel (csrc/native.cpp, built on first use: every term of the contract, forward and
backward, fp32 accumulation, decoding); `flash` is the same algorithm in readable torch ops (the
reference); `sdpa` is torch's fused kernel, for the contracts it can express.

Every call in mha goes through the dispatch (mha.kernels.dispatch), the one place a backend is
chosen, with its reason logged ("mha.dispatch"): :func:`attention` (any contract),
:func:`attention_with_lse` (with each row's log-sum-exp: the parts of ring attention, the
efficient variants' exact parts), :func:`varlen_attention` (a packed batch of sequences of
different lengths, one call), :func:`paged_attention` (many sequences' new rows over KV-cache
pages, one call). :func:`choose_backend` / :func:`choose_lse_backend` say which and why.
"""

from .contract import Contract
from .dispatch import BACKENDS, attention, attention_with_lse, choose_backend, choose_lse_backend
from .flash import flash_attention, flash_attention_with_lse
from .math import math_attention, safe_softmax
from .merge import merge_attention
from .native import native_attention, native_attention_with_lse, native_available
from .paged import paged_attention
from .sdpa import sdpa_attention
from .varlen import varlen_attention

__all__ = ["BACKENDS", "Contract", "attention", "attention_with_lse", "choose_backend", "choose_lse_backend",
           "flash_attention", "flash_attention_with_lse", "math_attention", "merge_attention", "native_attention",
           "native_attention_with_lse", "native_available", "paged_attention", "safe_softmax", "sdpa_attention",
           "varlen_attention"]
