"""parallelize(module, mode): an mha attention module run across the ranks of a group.

    "ring", "ulysses"  sequence-parallel: every rank holds the whole module and its part of the
                       sequence (the inputs are shards, as SequenceLayout.shard gives them); the
                       attention runs as ring_attention or ulysses_attention, RoPE at the
                       sequence's positions. The parameters' gradients are summed over the group
                       as they are computed, so each rank holds the single-process gradient.
    "heads"            head-parallel (Megatron): every rank holds the whole sequence and 1/W of
                       the heads: the q/k/v projections' rows of its heads (column-parallel), the
                       output projection's columns of its heads (row-parallel: the partial outputs
                       are summed over the group, then the bias is added). The input's gradient is
                       summed over the group; each rank's parameters are its slices of the
                       single-process module's, with their gradients.

The module is changed in place (its class becomes a subclass that runs the parallel forward, as
torch's fully_shard does) and returned. Sequence-parallel modules take ``layout=`` (a
SequenceLayout) in forward; without it the sequence is W times the local length, unpadded.
Masks, KV caches, attention weights and dropout are not taken in parallel (a clear error says so);
causality, windows, ALiBi, softcap, sinks, logit_scale, RoPE and GQA are.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import _checks
from ..functional import projected_attention
from ..kernels.contract import contract_of
from ..modules.general import GeneralAttention
from ..modules.pipeline import check_inputs, own_tensors, pipeline
from ..modules.projections import ProjectionWeights
from ..nn import MultiheadAttention
from . import comm
from .layout import BALANCES, SequenceLayout
from .ring import ring_attention
from .ulysses import ulysses_attention

__all__ = ["MODES", "parallelize"]

MODES = ("ring", "ulysses", "heads")
_SEQUENCE_ATTENTION = {"ring": ring_attention, "ulysses": ulysses_attention}


def parallelize(module: nn.Module, mode: str = "ring", group=None, *, balance: str = "zigzag") -> nn.Module:
    """``module`` (an mha.GeneralAttention or mha.nn.MultiheadAttention) made to run across the
    ranks of ``group`` (default: the default group) in ``mode`` (see the module docstring); in
    place, returned. ``balance``: the sequence layout when forward gets no ``layout``."""
    if not isinstance(module, (GeneralAttention, MultiheadAttention)):
        raise TypeError("parallelize takes an mha.GeneralAttention or mha.nn.MultiheadAttention, "
                        f"got {type(module).__name__}")
    _checks.one_of("mode", mode, MODES)
    _checks.one_of("balance", balance, BALANCES)
    if isinstance(module, _Parallel):
        raise ValueError(f"the module is already parallelized ({module.parallel_mode!r})")
    if isinstance(module, GeneralAttention) and module.attention is not None:
        raise ValueError("an efficient attention variant is not parallelized: use attention='exact'")
    size, rank = comm.world(group)
    if mode == "heads":
        _split_heads(module, size, rank, group)
        mixin = _HeadParallelDropIn if isinstance(module, MultiheadAttention) else _HeadParallel
    else:
        comm.sum_gradients_over(module, group)
        mixin = _SequenceParallelDropIn if isinstance(module, MultiheadAttention) else _SequenceParallel
    module.__class__ = _subclass(mixin, type(module))
    module.parallel_mode, module.parallel_group, module.parallel_balance = mode, group, balance
    return module


class _Parallel:
    """What every parallelized module's class derives from (besides its own)."""
    parallel_mode: str

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, parallel={self.parallel_mode!r}"

    def _layout(self, layout: SequenceLayout | None, local_length: int) -> SequenceLayout:
        if layout is None:
            size, _ = comm.world(self.parallel_group)
            return SequenceLayout(size * local_length, self.parallel_group, self.parallel_balance)
        if not isinstance(layout, SequenceLayout):
            raise TypeError(f"layout must be an mha.distributed.SequenceLayout or None, got {type(layout).__name__}")
        return layout


@functools.cache
def _subclass(mixin: type, cls: type) -> type:
    return type(f"{mixin.__name__.lstrip('_')}{cls.__name__}", (mixin, cls), {})


def _refuse(mode: str, **given) -> None:
    """A ValueError naming the first option given that parallel attention does not take."""
    for name, value in given.items():
        if value is not None and value is not False:
            raise ValueError(f"a module parallelized with mode={mode!r} does not take {name}; "
                             "causality, windows, ALiBi, softcap, sinks, logit_scale, RoPE and GQA are supported")


# -- sequence-parallel ----------------------------------------------------------------------------


class _SequenceParallel(_Parallel):
    """mha.GeneralAttention on sequence shards (B, T, c) -> (B, T, do)."""

    def forward(self, query: Tensor, key: Tensor, value: Tensor, *, key_padding_mask=None, attn_mask=None,
                is_causal: bool = False, cache=None, backend: str = "auto", layout: SequenceLayout | None = None):
        _refuse(self.parallel_mode, key_padding_mask=key_padding_mask, attn_mask=attn_mask, cache=cache,
                add_bias_kv=self.bias_k is not None, add_zero_attn=self.add_zero_attn,
                **{"dropout in training": self.training and self.dropout > 0,
                   "a backend other than 'auto'": backend != "auto"})
        batched = check_inputs(query, key, value, query_width=("cq", self.cq), key_width=("ck", self.ck),
                               value_width=("cv", self.cv), batch_first=True)
        layout = self._layout(layout, query.shape[1 if batched else 0])

        alibi_slopes, sinks, logit_scale = own_tensors(self, "alibi_slopes", "sinks", "logit_scale")

        def project(x_q, x_k, x_v):
            q, k, v = self._project(x_q, x_k, x_v)  # (B, h, T, dk), (B, Hkv, T, dk), (B, Hkv, T, dv)
            if self.rope is not None:  # at the sequence's positions, not the shard's
                where = layout.positions(device=q.device)  # (T,)
                q, k = self.rope(q, where), self.rope(k, where)
            q, _ = contract_of(logit_scale=logit_scale).fold_logit_scale(q)  # each head's factor, into its queries
            return q, k, v

        attention = functools.partial(
            _SEQUENCE_ATTENTION[self.parallel_mode], layout=layout, is_causal=is_causal, window=self.window,
            alibi_slopes=alibi_slopes, softcap=self.softcap, sinks=sinks, enable_gqa=self.num_kv_heads != self.h)
        out, _ = pipeline(query, key, value, batched=batched, batch_first=True, project=project,
                          attend=lambda q, k, v: (attention(q, k, v), None), out_proj=self.out_proj)
        return out


class _SequenceParallelDropIn(_Parallel):
    """mha.nn.MultiheadAttention on sequence shards, in its own layout (seq-first unless batch_first)."""

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask=None, need_weights: bool = True,
                attn_mask=None, average_attn_weights: bool = True, is_causal: bool = False, *,
                layout: SequenceLayout | None = None):
        _refuse_weights(self.parallel_mode, need_weights)
        _refuse(self.parallel_mode, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                add_bias_kv=self.bias_k is not None, add_zero_attn=self.add_zero_attn,
                **{"dropout in training": self.training and self.dropout > 0})
        batched = check_inputs(query, key, value, query_width=("embed_dim", self.embed_dim),
                               key_width=("kdim", self.kdim), value_width=("vdim", self.vdim),
                               batch_first=self.batch_first)
        layout = self._layout(layout, query.shape[1 if batched and self.batch_first else 0])
        is_self_attention = query is key and key is value
        projections = _projections(self)
        attention = functools.partial(_SEQUENCE_ATTENTION[self.parallel_mode], layout=layout, is_causal=is_causal)
        weight, bias = own_tensors(self.out_proj, "weight", "bias")
        out, _ = pipeline(query, key, value, batched=batched, batch_first=self.batch_first,
                          project=lambda x_q, x_k, x_v: projections.heads(x_q, x_k, x_v, self.num_heads, is_self_attention),
                          attend=lambda q, k, v: (attention(q, k, v), None),  # (B, H, T, D)
                          out_proj=functools.partial(F.linear, weight=weight, bias=bias))
        return out, None


def _refuse_weights(mode: str, need_weights: bool) -> None:
    if need_weights:
        raise ValueError(f"a MultiheadAttention parallelized with mode={mode!r} returns no attention weights: "
                         "call it with need_weights=False")


def _projections(module: MultiheadAttention) -> ProjectionWeights:
    packed, q_w, k_w, v_w, bias = own_tensors(module, "in_proj_weight", "q_proj_weight", "k_proj_weight",
                                              "v_proj_weight", "in_proj_bias")
    return ProjectionWeights(packed, q_w, k_w, v_w, bias)


# -- head-parallel ----------------------------------------------------------------------------------


class _SplitLinear(nn.Module):
    """A rank's part of a Linear's weight (and a bias), and the group it was split over."""

    def __init__(self, weight: Tensor, bias: Tensor | None, group) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = None if bias is None else nn.Parameter(bias)
        self.group = group


class ColumnParallelLinear(_SplitLinear):
    """This rank's rows of a Linear (its output features); the input's gradient is summed over the group."""

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(comm.copy_to_group(x, self.group), self.weight, self.bias)


class RowParallelLinear(_SplitLinear):
    """This rank's columns of a Linear (its input features): the partial outputs are summed over the
    group, then the (whole) bias is added."""

    def forward(self, x: Tensor) -> Tensor:
        out = comm.reduce_from_group(F.linear(x, self.weight), self.group)
        return out if self.bias is None else out + self.bias


class _HeadParallel(_Parallel):
    """mha.GeneralAttention with this rank's heads: its own forward, on split projections."""

    def forward_with_weights(self, *args, **kwargs):
        raise ValueError("a module parallelized with mode='heads' returns no attention weights (each rank "
                         "holds some of the heads): call forward")


class _HeadParallelDropIn(_Parallel):
    """mha.nn.MultiheadAttention with this rank's heads."""

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask=None, need_weights: bool = True,
                attn_mask=None, average_attn_weights: bool = True, is_causal: bool = False):
        _refuse_weights(self.parallel_mode, need_weights)
        batched = check_inputs(query, key, value, query_width=("embed_dim", self.embed_dim),
                               key_width=("kdim", self.kdim), value_width=("vdim", self.vdim),
                               batch_first=self.batch_first)
        same = query is key and key is value
        query, key, value = (comm.copy_to_group(x, self.parallel_group) for x in (query, key, value))
        if same:
            key = value = query  # one packed projection, as before the split
        weight, bias = own_tensors(self.out_proj, "weight", "bias")
        bias_k, bias_v = own_tensors(self, "bias_k", "bias_v")
        out, _ = projected_attention(
            query, key, value, _projections(self), self.num_heads, bias_k=bias_k, bias_v=bias_v,
            add_zero_attn=self.add_zero_attn, dropout_p=self.dropout if self.training else 0.0,
            out_proj_weight=weight, out_proj_bias=None, key_padding_mask=key_padding_mask, need_weights=False,
            attn_mask=self._my_heads(attn_mask, batched), average_attn_weights=True, is_causal=is_causal,
            batched=batched, batch_first=self.batch_first, backend=getattr(self, "backend", "auto"))
        out = comm.reduce_from_group(out, self.parallel_group)
        return (out if bias is None else out + bias), None

    def _my_heads(self, attn_mask: Tensor | None, batched: bool) -> Tensor | None:
        """A per-head attn_mask (B*H, L, S) (unbatched (H, L, S)) cut to this rank's heads."""
        if attn_mask is None or attn_mask.dim() != 3:
            return attn_mask
        size, rank = comm.world(self.parallel_group)
        H = self.num_heads * size
        per_head = attn_mask.unflatten(0, (-1, H)) if batched else attn_mask[None]  # (B*H, L, S) -> (B, H, L, S)
        mine = per_head[:, rank * self.num_heads:(rank + 1) * self.num_heads]
        return mine.flatten(0, 1) if batched else mine[0]  # (B, H / W, L, S) -> (B*H / W, L, S)


def _split_heads(module: nn.Module, size: int, rank: int, group) -> None:
    """Keep this rank's heads of every per-head parameter and buffer (in place)."""
    H = module.h if isinstance(module, GeneralAttention) else module.num_heads
    Hkv = module.num_kv_heads if isinstance(module, GeneralAttention) else H
    if H % size or Hkv % size:
        raise ValueError(f"mode='heads' splits the heads among the ranks: {H} query heads and {Hkv} key/value "
                         f"heads must both divide among {size} ranks")
    heads, kv_heads = _share(H, size, rank), _share(Hkv, size, rank)
    with torch.no_grad():
        if isinstance(module, GeneralAttention):
            _split_general(module, heads, kv_heads, group)
        else:
            _split_drop_in(module, heads)


def _share(count: int, size: int, rank: int) -> slice:
    """Rank ``rank``'s part of ``count`` heads split evenly among ``size`` ranks."""
    return slice(rank * count // size, (rank + 1) * count // size)


def _features(heads: slice, width: int) -> slice:
    """The features of ``heads`` in a (heads * width) dimension."""
    return slice(heads.start * width, heads.stop * width)


def _part(x: Tensor | None, dim: int, features: slice) -> Tensor | None:
    return None if x is None else x.narrow(dim, features.start, features.stop - features.start).clone()


def _split_general(module: GeneralAttention, heads: slice, kv_heads: slice, group) -> None:
    qk, kv, vv = _features(heads, module.dk), _features(kv_heads, module.dk), _features(kv_heads, module.dv)
    for name, rows in (("q_proj", qk), ("k_proj", kv), ("v_proj", vv)):
        linear = getattr(module, name)
        setattr(module, name, ColumnParallelLinear(_part(linear.weight, 0, rows), _part(linear.bias, 0, rows), group))
    out = module.out_proj
    module.out_proj = RowParallelLinear(_part(out.weight, 1, _features(heads, module.dv)),
                                        None if out.bias is None else out.bias.detach().clone(), group)
    if module.bias_k is not None:
        module.bias_k = nn.Parameter(_part(module.bias_k, 2, kv))
        module.bias_v = nn.Parameter(_part(module.bias_v, 2, vv))
    for name in ("sinks", "logit_scale"):  # learned per head: each rank keeps its heads'
        if getattr(module, name) is not None:
            setattr(module, name, nn.Parameter(_part(getattr(module, name), 0, heads)))
    if module.alibi_slopes is not None:
        module.alibi_slopes = _part(module.alibi_slopes, 0, heads)
    module.h, module.num_kv_heads = heads.stop - heads.start, kv_heads.stop - kv_heads.start


def _split_drop_in(module: MultiheadAttention, heads: slice) -> None:
    features = _features(heads, module.head_dim)
    E = module.embed_dim
    thirds = [slice(i * E + features.start, i * E + features.stop) for i in range(3)]  # q, k, v rows
    if module.in_proj_weight is not None:
        module.in_proj_weight = nn.Parameter(torch.cat([module.in_proj_weight[rows] for rows in thirds]))
    else:
        for name in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
            setattr(module, name, nn.Parameter(_part(getattr(module, name), 0, features)))
    if module.in_proj_bias is not None:
        module.in_proj_bias = nn.Parameter(torch.cat([module.in_proj_bias[rows] for rows in thirds]))
    module.out_proj.weight = nn.Parameter(_part(module.out_proj.weight, 1, features))
    if module.bias_k is not None:
        module.bias_k = nn.Parameter(_part(module.bias_k, 2, features))
        module.bias_v = nn.Parameter(_part(module.bias_v, 2, features))
    module.num_heads = heads.stop - heads.start
