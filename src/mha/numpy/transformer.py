"""A transformer encoder block in NumPy (seed 004), equal to torch.nn.TransformerEncoderLayer.

    post-norm:  Z = LayerNorm(X + MHA(X));      Y = LayerNorm(Z + W2 act(W1 Z))
    pre-norm:   Z = X + MHA(LayerNorm(X));      Y = Z + W2 act(W1 LayerNorm(Z))

``params`` holds the layer's state_dict as arrays (self_attn.*, linear1.*, linear2.*, norm1.*,
norm2.*). Dropout is not modelled (the oracle is the eval-mode computation).
"""

from __future__ import annotations

import math

import numpy as np

from .attention import _linear, multi_head_attention

__all__ = ["layer_norm", "relu", "gelu", "transformer_encoder_layer"]


def layer_norm(x: np.ndarray, weight=None, bias=None, eps: float = 1e-5) -> np.ndarray:
    """(x - mean) / sqrt(var + eps) over the last axis, then * weight + bias."""
    y = (x - x.mean(axis=-1, keepdims=True)) / np.sqrt(x.var(axis=-1, keepdims=True) + eps)
    if weight is not None:
        y = y * weight
    return y if bias is None else y + bias


def relu(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0)


_erf = np.vectorize(math.erf, otypes=[float])


def gelu(x: np.ndarray) -> np.ndarray:
    """x * Phi(x), the exact GELU (torch's default)."""
    return (0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))).astype(x.dtype)


_ACTIVATIONS = {"relu": relu, "gelu": gelu}


def transformer_encoder_layer(src, params, num_heads, *, src_mask=None, src_key_padding_mask=None,
                              is_causal=False, norm_first=False, activation="relu",
                              layer_norm_eps=1e-5, batch_first=False):
    """torch.nn.TransformerEncoderLayer's forward (eval) in NumPy.

    src (S, B, E), or (B, S, E) with batch_first, or unbatched (S, E); masks as
    torch.nn.MultiheadAttention (bool True = masked out). ``activation``: "relu", "gelu" or a
    NumPy function.
    """
    if isinstance(activation, str) and activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be 'relu', 'gelu' or a function, got {activation!r}")
    act = _ACTIVATIONS[activation] if isinstance(activation, str) else activation
    attention = {k[len("self_attn."):]: v for k, v in params.items() if k.startswith("self_attn.")}

    def norm(x, name):
        return layer_norm(x, params.get(f"{name}.weight"), params.get(f"{name}.bias"), layer_norm_eps)

    def self_attention(x):
        out, _ = multi_head_attention(x, x, x, attention, num_heads, attn_mask=src_mask,
                                      key_padding_mask=src_key_padding_mask, is_causal=is_causal,
                                      need_weights=False, batch_first=batch_first)
        return out

    def feed_forward(x):
        hidden = act(_linear(x, params["linear1.weight"], params.get("linear1.bias")))
        return _linear(hidden, params["linear2.weight"], params.get("linear2.bias"))

    x = src  # every step but attention acts on the last axis: the layout does not matter to them
    if norm_first:
        x = x + self_attention(norm(x, "norm1"))
        return x + feed_forward(norm(x, "norm2"))
    x = norm(x + self_attention(x), "norm1")
    return norm(x + feed_forward(x), "norm2")
