"""Attention across processes, on torch.distributed (gloo on CPU, NCCL on CUDA).

    SequenceLayout     which positions of the sequence each rank holds (zigzag, contiguous, striped)
    ring_attention     exact attention from sequence shards: K/V blocks travel a ring
    ulysses_attention  exact attention from sequence shards: all-to-all to head shards and back
    parallelize        an mha module run sequence-parallel (ring, Ulysses) or head-parallel
"""

from .layout import SequenceLayout
from .ring import ring_attention

__all__ = ["SequenceLayout", "ring_attention"]
