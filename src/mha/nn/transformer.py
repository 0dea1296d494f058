"""Transformer encoder and decoder layers built on mha.nn.MultiheadAttention.

Drop-ins for torch.nn.TransformerEncoderLayer / TransformerDecoderLayer: the same constructor
arguments, attributes, submodule names (so the same state_dict keys), initialisation order and
forward arguments. The attention is ours; ``is_causal`` / ``tgt_is_causal`` / ``memory_is_causal``
apply the causal mask instead of being hints. They are not subclasses of torch's layers, so
torch.nn.TransformerEncoder never routes them through its nested-tensor fast path.

    post-norm (norm_first=False):  x = norm1(x + SA(x));        x = norm2(x + FF(x))
    pre-norm  (norm_first=True):   x = x + SA(norm1(x));        x = x + FF(norm2(x))
    FF(x) = linear2(dropout(activation(linear1(x))))
"""

from __future__ import annotations

import numbers
from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor, nn

from .. import _checks
from .multihead_attention import MultiheadAttention

__all__ = ["TransformerEncoderLayer", "TransformerDecoderLayer"]

_ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu}


def _activation(activation: str | Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    if isinstance(activation, str):
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be 'relu', 'gelu' or a callable, got {activation!r}")
        return _ACTIVATIONS[activation]
    if not callable(activation):
        raise TypeError(f"activation must be 'relu', 'gelu' or a callable, got {type(activation).__name__}")
    return activation


def _relu_or_gelu(activation) -> int:
    if activation is F.relu or isinstance(activation, nn.ReLU):
        return 1
    if activation is F.gelu or isinstance(activation, nn.GELU):
        return 2
    return 0


class _FeedForwardLayer(nn.Module):
    """What both layers share: argument checks, the feed-forward block and the residual wiring."""

    __constants__ = ["norm_first"]

    @staticmethod
    def _check(d_model, nhead, dim_feedforward, dropout, layer_norm_eps):
        for name, value in (("d_model", d_model), ("nhead", nhead), ("dim_feedforward", dim_feedforward)):
            _checks.positive_int(name, value)
        _checks.probability("dropout", dropout)
        if isinstance(layer_norm_eps, bool) or not isinstance(layer_norm_eps, numbers.Real) or layer_norm_eps < 0:
            raise ValueError(f"layer_norm_eps must be a non-negative float, got {layer_norm_eps!r}")

    def _init_rest(self, sublayers, *, d_model, dim_feedforward, dropout, activation, layer_norm_eps, norm_first,
                   bias, factory):
        """Everything after the attention modules, in torch's order (so seeded weights match):
        linear1, dropout, linear2, norm_first, norm1..n, dropout1..n, activation."""
        self.linear1 = nn.Linear(d_model, dim_feedforward, bias=bias, **factory)
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(dim_feedforward, d_model, bias=bias, **factory)
        self.norm_first = norm_first
        for i in range(1, sublayers + 1):
            setattr(self, f"norm{i}", nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory))
        for i in range(1, sublayers + 1):
            setattr(self, f"dropout{i}", nn.Dropout(dropout))
        self.activation = _activation(activation)

    def _feed_forward(self, x: Tensor) -> Tensor:
        return self.linear2(self.dropout(self.activation(self.linear1(x))))

    def _residual(self, x: Tensor, norm: nn.LayerNorm, block: Callable[[Tensor], Tensor]) -> Tensor:
        """One sub-layer: pre-norm x + block(norm(x)), or post-norm norm(x + block(x))."""
        if self.norm_first:
            return x + block(norm(x))
        return norm(x + block(x))


class TransformerEncoderLayer(_FeedForwardLayer):
    """Self-attention then feed-forward; arguments as torch.nn.TransformerEncoderLayer."""

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int = 2048, dropout: float = 0.1,
                 activation: str | Callable[[Tensor], Tensor] = F.relu, layer_norm_eps: float = 1e-5,
                 batch_first: bool = False, norm_first: bool = False, bias: bool = True,
                 device=None, dtype=None) -> None:
        super().__init__()
        self._check(d_model, nhead, dim_feedforward, dropout, layer_norm_eps)
        factory = {"device": device, "dtype": dtype}
        self.self_attn = MultiheadAttention(d_model, nhead, dropout=dropout, bias=bias,
                                            batch_first=batch_first, **factory)
        self._init_rest(2, d_model=d_model, dim_feedforward=dim_feedforward, dropout=dropout, activation=activation,
                        layer_norm_eps=layer_norm_eps, norm_first=norm_first, bias=bias, factory=factory)
        self.activation_relu_or_gelu = _relu_or_gelu(self.activation)  # as torch's layer records it

    def forward(self, src: Tensor, src_mask: Tensor | None = None,
                src_key_padding_mask: Tensor | None = None, is_causal: bool = False) -> Tensor:
        """src (S, B, E), (B, S, E) with batch_first, or (S, E); masks as torch's layer."""
        def self_attention(x):
            out = self.self_attn(x, x, x, attn_mask=src_mask, key_padding_mask=src_key_padding_mask,
                                 need_weights=False, is_causal=is_causal)[0]
            return self.dropout1(out)

        x = self._residual(src, self.norm1, self_attention)
        return self._residual(x, self.norm2, lambda x: self.dropout2(self._feed_forward(x)))


class TransformerDecoderLayer(_FeedForwardLayer):
    """Self-attention, cross-attention on ``memory``, feed-forward; as torch.nn.TransformerDecoderLayer."""

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int = 2048, dropout: float = 0.1,
                 activation: str | Callable[[Tensor], Tensor] = F.relu, layer_norm_eps: float = 1e-5,
                 batch_first: bool = False, norm_first: bool = False, bias: bool = True,
                 device=None, dtype=None) -> None:
        super().__init__()
        self._check(d_model, nhead, dim_feedforward, dropout, layer_norm_eps)
        factory = {"device": device, "dtype": dtype}
        self.self_attn = MultiheadAttention(d_model, nhead, dropout=dropout, batch_first=batch_first,
                                            bias=bias, **factory)
        self.multihead_attn = MultiheadAttention(d_model, nhead, dropout=dropout,
                                                 batch_first=batch_first, bias=bias, **factory)
        self._init_rest(3, d_model=d_model, dim_feedforward=dim_feedforward, dropout=dropout, activation=activation,
                        layer_norm_eps=layer_norm_eps, norm_first=norm_first, bias=bias, factory=factory)

    def forward(self, tgt: Tensor, memory: Tensor, tgt_mask: Tensor | None = None,
                memory_mask: Tensor | None = None, tgt_key_padding_mask: Tensor | None = None,
                memory_key_padding_mask: Tensor | None = None, tgt_is_causal: bool = False,
                memory_is_causal: bool = False) -> Tensor:
        """tgt (T, B, E) and memory (S, B, E) (batch-first or unbatched likewise); masks as torch's layer."""
        def self_attention(x):
            out = self.self_attn(x, x, x, attn_mask=tgt_mask, key_padding_mask=tgt_key_padding_mask,
                                 need_weights=False, is_causal=tgt_is_causal)[0]
            return self.dropout1(out)

        def cross_attention(x):
            out = self.multihead_attn(x, memory, memory, attn_mask=memory_mask,
                                      key_padding_mask=memory_key_padding_mask, need_weights=False,
                                      is_causal=memory_is_causal)[0]
            return self.dropout2(out)

        x = self._residual(tgt, self.norm1, self_attention)
        x = self._residual(x, self.norm2, cross_attention)
        return self._residual(x, self.norm3, lambda x: self.dropout3(self._feed_forward(x)))
