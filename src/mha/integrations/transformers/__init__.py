"""attn_implementation="mha": mha's exact attention inside HuggingFace transformers models.

    import mha.integrations.transformers
    mha.integrations.transformers.register()          # once per process
    model = AutoModel.from_pretrained(path, attn_implementation="mha")
    model.set_attn_implementation("mha")              # or switch a loaded model

transformers (5.x) asks two functions of an attention implementation, both registered here:

* a mask function, called once per forward (per mask type), that says which keys each query may
  see. Ours describes the common patterns without building them: a :class:`KeyMask` holds the
  band (causal, a sliding window, or none), where queries sit against keys (the cache's offset) and
  which keys are padding, O(B * S) memory. A pattern other than transformers' plain causal or
  bidirectional one is checked pair by pair first (in blocks of rows: the work of building the
  mask, not its memory). Any other pattern (packed sequences, chunked attention, a model's own mask
  functions), and any model that wants its mask materialised, gets transformers' dense
  (B, 1, L, S) bool mask, so that nothing is ever computed under a mask other than the model's.
* an attention function, called by every attention layer with q (B, H, L, D), k and v
  (B, Hkv, S, D|Dv): it runs mha's dispatch (mha.kernels.attention) under one attention contract
  built from the mask and the layer's arguments, and returns (B, L, H, Dv) as transformers expects.

Honoured: the mask (ours, a dense 4-D bool or float mask, or none with ``is_causal``), scaling,
dropout (in training mode only, as eager attention), GQA (num_key_value_groups), sliding windows
and chunk-free causal or bidirectional patterns, logit soft-capping (``softcap``, Gemma 2),
attention sinks (``s_aux``, GPT-OSS), a position bias (``position_bias``, added to the scores) and
``output_attentions`` (the weights, from the math backend). Continuous batching (generate_batch)
runs under its own name, "mha_flash": :func:`enable_continuous_batching` (below). A model that
reads or extends its mask itself (rare: a KeyMask then says so) runs with
``register(name, compact_masks=False)``: transformers' eager masks, mha's attention.

8-bit keys and values in ``generate``: pass ``past_key_values=Int8Cache()`` to a model loaded with
``attn_implementation="mha"`` (int8_cache). Float keys and values without a copy of the cache every
step: ``past_key_values=BufferedCache()`` (buffered_cache, any attention implementation).

The rooms: masks (the mask function, KeyMask), attention (the attention function), buffered_cache
(BufferedCache: layers in buffers with room), int8_cache (Int8Cache), continuous_batching
(generate_batch), compat (every use of transformers' private state, gated by version: a renamed one
is a RuntimeError naming it).
"""

from __future__ import annotations

try:
    import transformers  # noqa: F401
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError("mha.integrations.transformers needs transformers: "
                      "python -m pip install -c constraints.txt -e '.[hf]'") from error

from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from ... import _checks
from . import compat
from .attention import attention_forward
from .buffered_cache import BufferedCache, BufferedLayer
from .continuous_batching import (
    CONTINUOUS_BATCHING_NAME,
    ContinuousBatching,
    continuous_batching_forward,
    enable_continuous_batching,
)
from .int8_cache import Int8Cache, Int8Layer
from .masks import KeyMask, eager_mask_forward, mask_forward

__all__ = ["CONTINUOUS_BATCHING_NAME", "BufferedCache", "BufferedLayer", "ContinuousBatching", "Int8Cache", "Int8Layer",
           "KeyMask", "attention_forward",
           "continuous_batching_forward", "eager_mask_forward", "enable_continuous_batching", "mask_forward", "register"]


def register(name: str = "mha", *, compact_masks: bool = True) -> None:
    """Register mha's attention and mask functions with transformers under ``name``; afterwards
    ``from_pretrained(..., attn_implementation=name)`` and ``model.set_attn_implementation(name)``
    use them. Registering again under the same name replaces the choice of masks.

    compact_masks: True, masks as :class:`KeyMask` (O(B * S)) wherever the model lets them be
    skipped; False, always transformers' eager mask (dense (B, 1, L, S) float), for a model that
    reads or extends its mask itself.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    _checks.flag("compact_masks", compact_masks)
    registered = compat.registered(name)
    if registered is not None and registered is not attention_forward:
        raise ValueError(f"name {name!r} is already an attn_implementation of transformers "
                         f"({getattr(registered, '__name__', registered)}); choose another name")
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, mask_forward if compact_masks else eager_mask_forward)
