"""mha.GeneralAttention: multi-head attention with every width free (seed 002).

    head_i = softmax(Q W_i^Q (K W_i^K)^T / sqrt(dk)) V W_i^V,   MHA = concat(head_1..head_h) W^O

    query (B, L, cq) -> Q W^Q: (B, L, h*dk)       key (B, S, ck) -> K W^K: (B, S, h*dk)
    value (B, S, cv) -> V W^V: (B, S, h*dv)       concat (B, L, h*dv) -> output (B, L, do)

torch.nn.MultiheadAttention is the special case cq = do = h*dk = h*dv (with kdim = ck, vdim = cv).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn
from torch.nn.init import constant_, xavier_normal_, xavier_uniform_

from .. import _checks, efficient, positions
from ..kernels.contract import Contract, contract_of
from ..kernels.dispatch import share_kv_heads
from .cache import KVCache
from .paged_cache import PagedStep
from .pipeline import attend, attend_positional, check_inputs, own_tensors, pipeline, split_heads
from .rope import RotaryEmbedding

__all__ = ["GeneralAttention"]


class GeneralAttention(nn.Module):
    """General multi-head attention, batch-first.

    Args:
        cq, ck, cv: widths of the query, key and value inputs.
        dk: per-head width of queries and keys; dv: per-head width of values (dk != dv allowed).
        do: output width.  h: number of heads.
        bias: biases on the four projections.  add_bias_kv: learned extra key/value (bias_k,
        bias_v) appended to the keys.  add_zero_attn: a zero key/value appended.
        dropout: on the attention weights, in training.
        num_kv_heads: key/value heads (GQA; 1: MQA), a divisor of h.
        rope: an mha.RotaryEmbedding applied to queries and keys at their positions.
        alibi: ALiBi's per-head linear bias -slope_h * |distance|.
        window: a sliding window (left, right), flash-attn's window_size (-1 = unbounded).
        softcap: scores become softcap * tanh(scores / softcap) (Gemma 2).
        sinks: learned per-head sink logits ``sinks`` (h,), zeros at the start, that join every
            row's softmax and are then dropped (GPT-OSS).
        logit_scale: a learned per-head factor of the scaled scores ``logit_scale`` (h,), ones at
            the start (an inverse temperature per head).
        attention: "exact" or an mha.efficient variant (a name or a module); attention_options
            are its constructor's arguments.

    Positions (mha.positions): without a cache, query i sits at position i and key j at j; with an
    mha.KVCache the new tokens continue each sequence. RoPE, causality, the window and ALiBi all
    read these positions, and none of them builds an L x S tensor (the dispatch, mha.kernels, runs
    them on a backend that applies them tile by tile: native or flash, or torch's kernel with one
    mask no larger than q, k and v).

    Parameters: ``bias_k`` (1, 1, h*dk), ``bias_v`` (1, 1, h*dv) with add_bias_kv, then the
    nn.Linear submodules ``q_proj`` (h*dk, cq), ``k_proj`` (h*dk, ck), ``v_proj`` (h*dv, cv),
    ``out_proj`` (do, h*dv). Initialised as torch.nn.MultiheadAttention initialises its own.

    Masks follow torch.nn.MultiheadAttention: bool True = masked OUT, float masks are added;
    attn_mask (L, S) or (B*h, L, S), key_padding_mask (B, S); is_causal applies the top-left
    causal mask (with attn_mask or without it). A query row whose keys are all masked gives zeros.
    """

    def __init__(self, cq: int, ck: int, cv: int, dk: int, dv: int, do: int, h: int, *,
                 bias: bool = True, add_bias_kv: bool = False, add_zero_attn: bool = False,
                 dropout: float = 0.0, num_kv_heads: int | None = None, rope: RotaryEmbedding | None = None,
                 alibi: bool = False, window: tuple[int, int] | None = None, softcap: float | None = None,
                 sinks: bool = False, logit_scale: bool = False, attention: str | nn.Module = "exact",
                 attention_options: dict | None = None, device=None, dtype=None) -> None:
        super().__init__()
        names = ("cq", "ck", "cv", "dk", "dv", "do", "h")
        cq, ck, cv, dk, dv, do, h = (_checks.positive_int(n, v) for n, v in zip(names, (cq, ck, cv, dk, dv, do, h)))
        hkv = h if num_kv_heads is None else _checks.positive_int("num_kv_heads", num_kv_heads)
        if h % hkv:
            raise ValueError(f"num_kv_heads must divide h: got h={h}, num_kv_heads={hkv}")
        factory = {"device": device, "dtype": dtype}
        self.cq, self.ck, self.cv, self.dk, self.dv, self.do, self.h = cq, ck, cv, dk, dv, do, h
        self.num_kv_heads = hkv
        self.dropout = _checks.probability("dropout", dropout)
        self.add_zero_attn = add_zero_attn
        self._set_positional(rope, alibi, window, add_bias_kv)
        self.softcap = _checks.optional_positive_real("softcap", softcap)
        _checks.flag("sinks", sinks)  # learned per-head sink logits or none
        _checks.flag("logit_scale", logit_scale)  # learned per-head factors of the scores or none
        if add_bias_kv:  # registered first: the parameter order seed 002 prints
            self.bias_k = nn.Parameter(torch.empty(1, 1, hkv * dk, **factory))
            self.bias_v = nn.Parameter(torch.empty(1, 1, hkv * dv, **factory))
        else:
            self.register_parameter("bias_k", None)
            self.register_parameter("bias_v", None)
        self.attention = self._variant(attention, attention_options)
        if self.attention is not None and (self.positional or add_bias_kv or add_zero_attn or sinks or softcap
                                           or logit_scale):
            raise ValueError("an efficient attention variant does not combine with rope, alibi, window, "
                             "softcap, sinks, logit_scale, add_bias_kv or add_zero_attn")
        self.q_proj = nn.Linear(cq, h * dk, bias=bias, **factory)
        self.k_proj = nn.Linear(ck, hkv * dk, bias=bias, **factory)
        self.v_proj = nn.Linear(cv, hkv * dv, bias=bias, **factory)
        self.out_proj = nn.Linear(h * dv, do, bias=bias, **factory)
        # sink logits, one per head: they join every row's softmax (GPT-OSS); zero at the start
        self.sinks = nn.Parameter(torch.zeros(h, **factory)) if sinks else None
        # each head's factor of its scaled scores (an inverse temperature); one at the start
        self.logit_scale = nn.Parameter(torch.ones(h, **factory)) if logit_scale else None
        self._reset_parameters()

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        if "logit_scale" not in self.__dict__ and "logit_scale" not in self._parameters:
            self.logit_scale = None  # a module pickled before logit_scale existed

    def _set_positional(self, rope, alibi, window, add_bias_kv) -> None:
        """RoPE, ALiBi and the sliding window: settings, no parameters (ALiBi's slopes a buffer)."""
        if rope is not None and not isinstance(rope, RotaryEmbedding):
            raise TypeError(f"rope must be an mha.RotaryEmbedding, got {type(rope).__name__}")
        if rope is not None and rope.rotary_dim > self.dk:
            raise ValueError(f"rope.rotary_dim={rope.rotary_dim} exceeds the head width dk={self.dk}")
        if window is not None:
            positions.check_window(window)  # (left, right), -1 = unbounded
            window = tuple(window)
        if (rope is not None or alibi or window is not None) and (add_bias_kv or self.add_zero_attn):
            raise ValueError("add_bias_kv / add_zero_attn have no position: they do not combine with rope, "
                             "alibi or window")
        self.rope, self.window = rope, window
        _checks.flag("alibi", alibi)
        self.register_buffer("alibi_slopes", positions.alibi_slopes(self.h) if alibi else None, persistent=False)

    def _variant(self, attention, options):
        """None for exact attention (the full machinery), else an mha.efficient variant module."""
        if isinstance(attention, nn.Module):
            return attention
        if attention == "exact" and not options:
            return None
        options = dict(options or {})
        if attention == "performer":
            options.setdefault("head_dim", self.dk)
        return efficient.make(attention, **options)

    @property
    def positional(self) -> bool:
        """Whether masks come from positions (RoPE, ALiBi or a window)."""
        return self.rope is not None or self.window is not None or own_tensors(self, "alibi_slopes")[0] is not None

    def _reset_parameters(self) -> None:
        """torch.nn.MultiheadAttention's scheme: xavier_uniform_ on the input projections (on the
        packed (3E, E) matrix when all widths are E, as torch does), zero biases, xavier_normal_
        on bias_k and bias_v; out_proj keeps nn.Linear's init with a zero bias."""
        projections = (self.q_proj, self.k_proj, self.v_proj)
        if len({self.cq, self.ck, self.cv, self.h * self.dk, self.h * self.dv}) == 1 and self.num_kv_heads == self.h:
            with torch.no_grad():
                packed = xavier_uniform_(torch.empty(3 * self.cq, self.cq, dtype=self.q_proj.weight.dtype,
                                                     device=self.q_proj.weight.device))
                for proj, part in zip(projections, packed.chunk(3)):
                    proj.weight.copy_(part)
        else:
            for proj in projections:
                xavier_uniform_(proj.weight)
        for proj in projections:
            if proj.bias is not None:
                constant_(proj.bias, 0.0)
        if self.out_proj.bias is not None:
            constant_(self.out_proj.bias, 0.0)
        if self.bias_k is not None:
            xavier_normal_(self.bias_k)
            xavier_normal_(self.bias_v)

    def extra_repr(self) -> str:
        extras = [f"num_kv_heads={self.num_kv_heads}"] if self.num_kv_heads != self.h else []
        extras += ["alibi=True"] if self.alibi_slopes is not None else []
        extras += [f"window={self.window}"] if self.window is not None else []
        extras += [f"softcap={self.softcap}"] if self.softcap is not None else []
        extras += ["sinks=True"] if self.sinks is not None else []
        extras += ["logit_scale=True"] if self.logit_scale is not None else []
        return (f"cq={self.cq}, ck={self.ck}, cv={self.cv}, dk={self.dk}, dv={self.dv}, "
                f"do={self.do}, h={self.h}, add_zero_attn={self.add_zero_attn}, dropout={self.dropout}"
                + "".join(", " + e for e in extras))

    def forward(self, query: Tensor, key: Tensor, value: Tensor, *, key_padding_mask: Tensor | None = None,
                attn_mask: Tensor | None = None, is_causal: bool = False, cache: KVCache | None = None,
                backend: str = "auto") -> Tensor:
        """query (B, L, cq), key (B, S, ck), value (B, S, cv), or unbatched (L, cq), (S, ck), (S, cv).

        Returns the output (B, L, do) (unbatched: (L, do)), always a tensor; the weights come from
        :meth:`forward_with_weights` (or mha.capture_attention).
        cache: an mha.KVCache, or a step of an mha.PagedKVCache (``paged.step(seq_ids, counts)``: a
        batch of sequences of different lengths, sequence b's counts[b] new tokens right-padded in
        the (B, L, .) input; inference); query/key/value are then the new tokens, appended to it
        (with RoPE, windows, ALiBi or a cache, masks come from positions: attn_mask is not taken).
        backend: "auto" or a backend of mha.kernels ("math", "sdpa", "flash", "native").
        """
        out, _ = self._attend(query, key, value, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                              is_causal=is_causal, cache=cache, backend=backend, need_weights=False)
        return out

    def forward_with_weights(self, query: Tensor, key: Tensor, value: Tensor, *,
                             key_padding_mask: Tensor | None = None, attn_mask: Tensor | None = None,
                             is_causal: bool = False, average_attn_weights: bool = True,
                             cache: KVCache | None = None) -> tuple[Tensor, Tensor]:
        """:meth:`forward` returning (output, weights) (native computes them where nothing is to
        differentiate, else the math backend): weights (B, L, S)
        averaged over heads, or (B, h, L, S) with average_attn_weights=False (unbatched: no B),
        taken after dropout as torch.nn.MultiheadAttention takes them."""
        return self._attend(query, key, value, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                            is_causal=is_causal, cache=cache, backend="auto", need_weights=True,
                            average_attn_weights=average_attn_weights)

    def _attend(self, query, key, value, *, key_padding_mask, attn_mask, is_causal, cache, backend,
                need_weights, average_attn_weights=True) -> tuple[Tensor, Tensor | None]:
        batched = check_inputs(query, key, value, query_width=("cq", self.cq), key_width=("ck", self.ck),
                               value_width=("cv", self.cv), batch_first=True)
        out_proj = self._modules["out_proj"]  # one dict read, not nn.Module.__getattr__
        weight = out_proj.weight
        if query.dtype != weight.dtype or query.device != weight.device:
            _checks.same_dtype_device("query", query, **{"the module's weight": weight})
        out, weights = pipeline(query, key, value, batched=batched, batch_first=True, project=self._project,
                                attend=self._attention_of(
                                    batched=batched, cache=cache, attn_mask=attn_mask, is_causal=is_causal,
                                    key_padding_mask=key_padding_mask, need_weights=need_weights,
                                    dropout_p=self.dropout if self.training else 0.0, backend=backend),
                                out_proj=out_proj, average_attn_weights=average_attn_weights)
        return out, weights

    def _project(self, x_q: Tensor, x_k: Tensor, x_v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(B, L, cq), (B, S, ck), (B, S, cv) -> q (B, h, L, dk), k (B, Hkv, S, dk), v (B, Hkv, S, dv).
        The submodules are called (not their weights read), so wrappers such as LoRA's keep working."""
        modules = self._modules
        q, k, v = modules["q_proj"](x_q), modules["k_proj"](x_k), modules["v_proj"](x_v)  # (B, L, h*dk), (B, S, Hkv*d)
        return split_heads(q, self.h), split_heads(k, self.num_kv_heads), split_heads(v, self.num_kv_heads)

    def _attention_of(self, *, batched, cache, attn_mask, is_causal, key_padding_mask, need_weights, **options):
        """attend(q, k, v) -> (o, weights) for this call: an efficient variant, masks from positions
        (RoPE, ALiBi, windows, a cache), or masks in torch's conventions."""
        if self.attention is not None:
            if attn_mask is not None or key_padding_mask is not None or cache is not None or need_weights:
                raise ValueError("an efficient attention variant takes is_causal only: no attn_mask, "
                                 "key_padding_mask, cache or weights (forward_with_weights)")
            return lambda q, k, v: (self._efficient(q, k, v, is_causal=is_causal), None)
        options.update(is_causal=is_causal, key_padding_mask=key_padding_mask, need_weights=need_weights,
                       terms=self._terms())
        if cache is not None or self.positional:
            return functools.partial(self._positional, cache=cache, attn_mask=attn_mask, batched=batched, **options)
        return functools.partial(attend, bias_k=self.bias_k, bias_v=self.bias_v, add_zero_attn=self.add_zero_attn,
                                 attn_mask=attn_mask, batched=batched, **options)

    def _terms(self) -> Contract:
        """The module's own score terms (ALiBi, softcap, sinks, logit_scale), for each call's contract."""
        alibi_slopes, sinks, logit_scale = own_tensors(self, "alibi_slopes", "sinks", "logit_scale")
        return contract_of(alibi_slopes=alibi_slopes, softcap=self.softcap, sinks=sinks, logit_scale=logit_scale)

    def _positional(self, q, k, v, *, cache, attn_mask, batched, key_padding_mask, **options):
        """RoPE, ALiBi, windows or a cache: masks come from positions (mha.modules.pipeline.attend_positional)."""
        if isinstance(cache, PagedStep):
            cache = cache.for_module(self)  # this module's layer of the pages
        elif cache is not None:
            if not isinstance(cache, KVCache):
                raise TypeError(f"cache must be an mha.KVCache or a PagedKVCache step (cache.step(...)), got "
                                f"{type(cache).__name__}")
            cache.attach(self, self.window)
        if attn_mask is not None:
            raise ValueError("with rope, alibi, window or a cache the masks come from positions: "
                             "pass key_padding_mask / is_causal, not attn_mask")
        if key_padding_mask is not None and not batched:
            key_padding_mask = key_padding_mask.unsqueeze(0)  # (S,) -> (1, S)
        return attend_positional(q, k, v, rope=self.rope, window=self.window, cache=cache,
                                 key_padding_mask=key_padding_mask, **options)

    def _efficient(self, q: Tensor, k: Tensor, v: Tensor, *, is_causal: bool) -> Tensor:
        """The selected mha.efficient variant on the heads q (B, h, L, dk), k, v (B, Hkv, S, d) -> (B, h, L, dv)."""
        k, v = share_kv_heads(k, self.h), share_kv_heads(v, self.h)  # (B, Hkv, S, d) -> (B, h, S, d)
        return self.attention(q, k, v, is_causal=is_causal)
