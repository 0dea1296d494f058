"""mha: multi-head attention from the formula to the kernel, proven equal to PyTorch.

    mha.numpy               the float64 NumPy oracle, readable beside the paper
    mha.functional          scaled_dot_product_attention, multi_head_attention_forward (torch's signatures)
    mha.nn                  torch's drop-ins: MultiheadAttention, TransformerEncoderLayer, TransformerDecoderLayer
    mha.GeneralAttention    the general module: widths cq, ck, cv, dk, dv, do and h heads (seed 002),
                            GQA (num_kv_heads), RoPE, ALiBi, sliding windows, softcap, sinks, a KV cache
                            (formerly mha.MultiHeadAttention, one letter from torch's drop-in
                            mha.nn.MultiheadAttention: the old name is a deprecated alias for one release)
    mha.KVCache, mha.RotaryEmbedding  (mha.rope.apply_rope: the rotation as a function)
    mha.layouts             weights between layouts (torch, general, per-head, Annotated, labml, BERT,
                            GPT-2, Llama)
    mha.efficient           approximate attention variants, one signature
    mha.kernels             the attention contract, exact backends and the dispatch between them
    mha.positions           the one position rule: distances, bands (causal, windows), alignment, ALiBi
    mha.masks               the one place the caller's masks are validated and canonicalised
    mha.capture_attention   record every attention module's weights during a forward
    mha.view, mha.explorer  the attention explorer: one self-contained HTML page of a forward's maps,
                            a row's breakdown term by term, averages, a diff of two runs
    mha.distributed         attention across processes on torch.distributed: SequenceLayout,
                            ring_attention, ulysses_attention, parallelize (sequence or heads)
    mha.integrations        other libraries, imported only on request: transformers (register():
                            attn_implementation="mha"; the hf extra)

Shape legend (the same letters everywhere): B batch, H query heads, Hkv key/value heads, L query
length, S key length, T a length where L = S, E embedding width, D per-head width of queries and
keys, Dv per-head width of values. The general module's constructor keeps seed 002's names
(cq, ck, cv the input widths, dk = D, dv = Dv, do the output width, h = H).

The tools the ``mha`` command runs (verify, bench, explain, plot, convert) live in mha.tools;
``mha distributed`` runs mha.tools.distributed_demo.
"""

from . import distributed, efficient, explorer, functional, kernels, layouts, masks, nn, numpy, positions, rope
from ._cache import KVCache
from ._capture import capture_attention
from ._general import GeneralAttention
from .explorer import view
from .rope import RotaryEmbedding

__version__ = "0.1.0"

__all__ = ["GeneralAttention", "KVCache", "RotaryEmbedding", "capture_attention", "distributed", "efficient", "explorer",
           "functional", "kernels", "layouts", "masks", "nn", "numpy", "positions", "rope", "view", "__version__"]


def __getattr__(name: str):
    """The deprecated names: mha.MultiHeadAttention is mha.GeneralAttention."""
    if name == "MultiHeadAttention":
        import warnings

        warnings.warn("mha.MultiHeadAttention is renamed mha.GeneralAttention (the same class); the old name "
                      "goes in the next release", DeprecationWarning, stacklevel=2)
        return GeneralAttention
    raise AttributeError(f"module 'mha' has no attribute {name!r}")
