"""mha.nn.MultiheadAttention: a drop-in for torch.nn.MultiheadAttention.

Same constructor, forward, defaults, state_dict keys and shapes, initialisation and return
values; the computation is mha.functional.multi_head_attention_forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.init import constant_, xavier_normal_, xavier_uniform_
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from .. import _checks, masks
from ..functional import projected_attention
from ..modules.pipeline import check_inputs, nested_forward, own_tensors
from ..modules.projections import ProjectionWeights

__all__ = ["MultiheadAttention"]


class MultiheadAttention(nn.Module):
    """Multi-head attention with torch.nn.MultiheadAttention's interface (seq-first by default).

    Parameters as torch: ``in_proj_weight`` (3E, E) when kdim == vdim == embed_dim, else
    ``q_proj_weight`` (E, E), ``k_proj_weight`` (E, kdim), ``v_proj_weight`` (E, vdim);
    ``in_proj_bias`` (3E,), ``bias_k``/``bias_v`` (1, 1, E), ``out_proj`` (Linear E -> E).
    Masks: bool True = masked OUT, float masks are added.

    Differences from torch (deliberate): ``is_causal=True`` always applies the causal mask, with
    or without ``attn_mask`` (combined when both are given), in train and eval; a query row whose
    keys are all masked gives zeros and finite gradients; ``need_weights=False`` computes no
    weights; the eval path is the same computation as the train path (no slower fast path).
    """

    __constants__ = ["batch_first"]

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False,
                 add_zero_attn=False, kdim=None, vdim=None, batch_first=False, device=None,
                 dtype=None) -> None:
        embed_dim = _checks.integer("embed_dim", embed_dim)
        num_heads = _checks.integer("num_heads", num_heads)
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(f"embed_dim and num_heads must be greater than 0, got "
                             f"embed_dim={embed_dim} and num_heads={num_heads} instead")
        factory = {"device": device, "dtype": dtype}
        super().__init__()
        self.embed_dim = embed_dim
        self.kdim = _checks.positive_int("kdim", kdim) if kdim is not None else embed_dim
        self.vdim = _checks.positive_int("vdim", vdim) if vdim is not None else embed_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.dropout = _checks.probability("dropout", dropout)
        self.batch_first = batch_first
        self.head_dim = _checks.divisible(embed_dim, num_heads)

        if self._qkv_same_embed_dim:
            self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim, **factory))
            for name in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
                self.register_parameter(name, None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty(embed_dim, embed_dim, **factory))
            self.k_proj_weight = nn.Parameter(torch.empty(embed_dim, self.kdim, **factory))
            self.v_proj_weight = nn.Parameter(torch.empty(embed_dim, self.vdim, **factory))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = NonDynamicallyQuantizableLinear(embed_dim, embed_dim, bias=bias, **factory)
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty(1, 1, embed_dim, **factory))
            self.bias_v = nn.Parameter(torch.empty(1, 1, embed_dim, **factory))
        else:
            self.bias_k = self.bias_v = None
        self.add_zero_attn = add_zero_attn
        self.backend = "auto"  # mha only: "auto", "math", "sdpa", "flash" or "native" (see mha.kernels)
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        """torch's order and distributions: xavier_uniform_ on the (packed) projection weights,
        zero biases, xavier_normal_ on bias_k then bias_v (out_proj.weight keeps Linear's init)."""
        if self._qkv_same_embed_dim:
            xavier_uniform_(self.in_proj_weight)
        else:
            for w in (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight):
                xavier_uniform_(w)
        if self.in_proj_bias is not None:
            constant_(self.in_proj_bias, 0.0)
            constant_(self.out_proj.bias, 0.0)
        if self.bias_k is not None:
            xavier_normal_(self.bias_k)
            xavier_normal_(self.bias_v)

    def __setstate__(self, state):
        state.setdefault("_qkv_same_embed_dim", True)  # modules pickled by old torch versions
        super().__setstate__(state)

    def merge_masks(self, attn_mask: Tensor | None, key_padding_mask: Tensor | None,
                    query: Tensor) -> tuple[Tensor | None, int | None]:
        """torch's helper for its Transformer layers' fused path: (mask, mask_type).

        mask_type 1: key_padding_mask (B, S) alone; 2: attn_mask (L, S) or (B*H, L, S), with the
        key padding added, as one additive (B, H, L, S) mask. query is (B, L, E).
        """
        if attn_mask is None:
            return key_padding_mask, (None if key_padding_mask is None else 1)
        B, L, _ = query.shape
        mask, key_valid = masks.from_multihead(attn_mask, key_padding_mask, batch=B, num_heads=self.num_heads,
                                          L=L, S=L, batched=True, like=query)
        merged = masks.combined_additive(mask, key_valid, masks.additive_dtype(query.dtype))
        return merged.expand(B, self.num_heads, L, L), 2

    def forward(self, query: Tensor, key: Tensor, value: Tensor,
                key_padding_mask: Tensor | None = None, need_weights: bool = True,
                attn_mask: Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[Tensor, Tensor | None]:
        """query (L, B, E) / (B, L, E) with batch_first / (L, E) unbatched; key, value (S, ...).

        Returns (output shaped like query, weights or None): weights are (B, L, S) averaged over
        heads, or (B, H, L, S) with average_attn_weights=False ((L, S) / (H, L, S) unbatched),
        taken after dropout as in torch.
        """
        if _checks.nested(query) or _checks.nested(key) or _checks.nested(value):
            return self._nested(query, key, value, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                                need_weights=need_weights, average_attn_weights=average_attn_weights,
                                is_causal=is_causal)
        batched = check_inputs(query, key, value, query_width=("embed_dim", self.embed_dim),
                               key_width=("kdim", self.kdim), value_width=("vdim", self.vdim),
                               batch_first=self.batch_first)
        weight, out_bias = own_tensors(self._modules["out_proj"], "weight", "bias")
        in_proj_weight, q_w, k_w, v_w, bias, bias_k, bias_v = own_tensors(
            self, "in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias", "bias_k", "bias_v")
        if query.dtype != weight.dtype or query.device != weight.device:
            _checks.same_dtype_device("query", query, **{"the module's weight": weight})
        if bias is not None and bias.dtype != query.dtype:
            bias = bias.to(query.dtype)  # as torch: a bias of another dtype is added in the query's
        proj = ProjectionWeights(in_proj_weight, q_w, k_w, v_w, bias)  # shaped by the constructor: no per-call checks
        out, weights = projected_attention(
            query, key, value, proj, self.num_heads, bias_k=bias_k, bias_v=bias_v,
            add_zero_attn=self.add_zero_attn, dropout_p=self.dropout if self.training else 0.0,
            out_proj_weight=weight, out_proj_bias=out_bias, key_padding_mask=key_padding_mask,
            need_weights=need_weights, attn_mask=attn_mask,
            average_attn_weights=average_attn_weights, is_causal=is_causal,
            batched=batched, batch_first=self.batch_first, backend=getattr(self, "backend", "auto"))
        return out, weights

    def _nested(self, query, key, value, *, key_padding_mask, attn_mask, need_weights, average_attn_weights,
                is_causal) -> tuple[Tensor, Tensor | None]:
        """Nested (ragged) query (B, j, E), key and value (B, j', kdim|vdim), batch_first: packed, one
        varlen call (mha.modules.pipeline.nested_forward); the output is nested like the query."""
        for name, x in (("query", query), ("key", key), ("value", value)):
            if not x.is_nested or x.dim() != 3:
                raise ValueError(f"{name} must be a nested (B, length, features) tensor like the others, got "
                                 f"{'a nested' if x.is_nested else 'a dense'} {x.dim()}-D tensor")
        if not self.batch_first:
            raise ValueError("nested inputs are (B, length, features): construct the module with batch_first=True")
        if key_padding_mask is not None or attn_mask is not None:
            raise ValueError("with nested inputs each sequence's length is its padding: key_padding_mask and attn_mask "
                             "are not taken (is_causal is, bottom-right within each sequence)")
        if self.bias_k is not None or self.add_zero_attn or (self.training and self.dropout > 0):
            raise ValueError("nested inputs run as packed varlen attention: no add_bias_kv, add_zero_attn or dropout "
                             "(call eval() for dropout)")
        weight, out_bias = own_tensors(self._modules["out_proj"], "weight", "bias")
        in_proj_weight, q_w, k_w, v_w, bias = own_tensors(
            self, "in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias")
        proj = ProjectionWeights(in_proj_weight, q_w, k_w, v_w, bias)
        return nested_forward(
            query, key, value, project=lambda q, k, v: proj.heads(q, k, v, self.num_heads, False),
            out_proj=lambda x: F.linear(x, weight, out_bias), is_causal=is_causal,
            need_weights=need_weights, average_attn_weights=average_attn_weights,
            backend=getattr(self, "backend", "auto"))
