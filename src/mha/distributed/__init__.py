"""Attention across processes, on torch.distributed (gloo on CPU, NCCL on CUDA).

    SequenceLayout     which positions of the sequence each rank holds (zigzag, contiguous, striped)
    ring_attention     exact attention from sequence shards: K/V blocks travel a ring
    ulysses_attention  exact attention from sequence shards: all-to-all to head shards and back
    parallelize        an mha module run sequence-parallel (ring, Ulysses) or head-parallel

Every rank calls these with its own shards; the default group is torch.distributed's (set up by
torchrun, or by mha.tools.launch.spawn on one machine). Without torch.distributed they run
as one process holding the whole sequence. docs/distributed.md says how they work and which to use.
"""

from .layout import SequenceLayout
from .parallel import parallelize
from .ring import ring_attention
from .ulysses import ulysses_attention

__all__ = ["SequenceLayout", "parallelize", "ring_attention", "ulysses_attention"]
