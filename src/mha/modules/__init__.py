"""The modules' layer: what every attention module is built from, and the general module itself.

    pipeline      the one forward of every module: project -> split heads -> attend -> merge
                  heads -> out-project (the drop-in, the general module, parallelize and the
                  transformers integration all run it), and the attend functions it calls
    projections   the drop-in's input projections (torch's packed or separate weights)
    general       GeneralAttention: every width free (seed 002), GQA, RoPE, ALiBi, windows,
                  softcap, sinks, an efficient variant, a KV cache
    cache         KVCache: past keys and values for decoding, sequences of different lengths
    paged_cache   PagedKVCache: many sequences' keys and values in fixed-size pages (serving)
    rope          RotaryEmbedding and apply_rope (rotate-half and interleaved conventions)

Below this layer: mha.kernels (the contract, the backends and the one dispatch), mha.positions
and mha.masks. Above it: mha.nn (torch's drop-ins), mha.functional, mha.distributed.parallelize.
"""

from .cache import KVCache
from .general import GeneralAttention
from .paged_cache import PagedKVCache
from .rope import RotaryEmbedding, apply_rope

__all__ = ["GeneralAttention", "KVCache", "PagedKVCache", "RotaryEmbedding", "apply_rope"]
