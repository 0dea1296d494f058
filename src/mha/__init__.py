"""mha: multi-head attention from the formula to the kernel, proven equal to PyTorch.

    mha.numpy               the float64 NumPy oracle, readable beside the paper
    mha.functional          scaled_dot_product_attention, multi_head_attention_forward (torch's signatures)
    mha.nn                  torch's drop-ins: MultiheadAttention, TransformerEncoderLayer, TransformerDecoderLayer
    mha.GeneralAttention    the general module: widths cq, ck, cv, dk, dv, do and h heads, each its own,
                            GQA (num_kv_heads), RoPE, ALiBi, sliding windows, softcap, sinks, a KV cache
                            (formerly mha.MultiHeadAttention, one letter from torch's drop-in
                            mha.nn.MultiheadAttention: the old name is a deprecated alias for one release)
    mha.KVCache             the contiguous KV cache (decoding; sequences of different lengths)
    mha.PagedKVCache        many sequences' keys and values in fixed-size pages (serving; shared prefixes)
    mha.RotaryEmbedding     RoPE (mha.modules.rope.apply_rope: the rotation as a function)
    mha.modules             the modules' layer: the one pipeline (project -> split heads -> attend ->
                            merge -> out-project), projections, the general module, the cache, RoPE
    mha.layouts             weights between layouts (torch, general, per-head, Annotated, labml, BERT,
                            GPT-2, Llama)
    mha.efficient           approximate attention variants, one signature
    mha.kernels             the attention contract, exact backends and the dispatch between them
    mha.positions           the one position rule: distances, bands (causal, windows), alignment, ALiBi
    mha.masks               the one place the caller's masks are validated and canonicalised
    mha.capture_attention   record the per-head weights of every attention call during a forward (the
                            dispatch's observers, like mha.explorer.record)
    mha.view, mha.explorer  the attention explorer: one self-contained HTML page of a forward's maps,
                            a row's breakdown term by term, averages, a diff of two runs
    mha.distributed         attention across processes on torch.distributed: SequenceLayout,
                            ring_attention, ulysses_attention, parallelize (sequence or heads)
    mha.integrations        other libraries, imported only on request: transformers (register():
                            attn_implementation="mha"; the hf extra)

Shape legend (the same letters everywhere): B batch, H query heads, Hkv key/value heads, L query
length, S key length, T a length where L = S, E embedding width, D per-head width of queries and
keys, Dv per-head width of values. The general module's constructor keeps the names of the
write-up it rebuilds (cq, ck, cv the input widths, dk = D, dv = Dv, do the output width, h = H).

The tools the ``mha`` command runs (verify, bench, explain, plot, convert) live in mha.tools;
``mha distributed`` runs mha.tools.distributed_demo.
"""

from . import distributed, efficient, explorer, functional, kernels, layouts, masks, modules, nn, numpy, positions
from ._version import __version__
from .explorer import capture_attention, view
from .modules import GeneralAttention, KVCache, PagedKVCache, RotaryEmbedding

__all__ = ["GeneralAttention", "KVCache", "PagedKVCache", "RotaryEmbedding", "capture_attention", "distributed",
           "efficient", "explorer", "functional", "kernels", "layouts", "masks", "modules", "nn", "numpy", "positions",
           "view", "__version__"]


_RENAMED = {  # deprecated name: (what it is now, its new name); each goes in the next release
    "MultiHeadAttention": (lambda: GeneralAttention, "mha.GeneralAttention (the same class)"),
    "rope": (lambda: modules.rope, "mha.modules.rope (the same module)"),
}


def __getattr__(name: str):
    """The deprecated names: mha.MultiHeadAttention is mha.GeneralAttention, mha.rope is mha.modules.rope."""
    if name in _RENAMED:
        import warnings

        now, new_name = _RENAMED[name]
        warnings.warn(f"mha.{name} is renamed {new_name}; the old name goes in the next release",
                      DeprecationWarning, stacklevel=2)
        return now()
    raise AttributeError(f"module 'mha' has no attribute {name!r}")
