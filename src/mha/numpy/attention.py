"""Attention in plain NumPy, written to be read beside the formula.

    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k) + M) V
    MultiHead(Q, K, V) = concat(head_1, ..., head_h) W^O,
    head_i             = Attention(Q W_i^Q, K W_i^K, V W_i^V)

This is the project's oracle: every other implementation is tested against it in float64.
It is deliberately plain (no blocking, no fusion) so that each line can be checked by eye.

Shape legend:
    B batch, H heads, L query length, S key length (the legend of the whole package, see mha),
    E embed dim (= H * D), D head dim, Ek / Ev key / value input widths.

Mask conventions (the same as torch at the same entry point):
    scaled_dot_product_attention  bool True = ATTEND (torch.nn.functional.scaled_dot_product_attention)
    multi_head_attention          bool True = MASKED OUT (torch.nn.MultiheadAttention)
    float masks are added to the scores in both.
A query row whose keys are all masked gives zeros (torch gives NaN on some paths).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np

__all__ = [
    "softmax",
    "causal_mask",
    "scaled_dot_product_attention",
    "blocked_attention",
    "multi_head_attention",
    "multi_head_attention_vjp",
]


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """exp(x - max) / sum(exp(x - max)) along ``axis``; a row of only -inf gives zeros."""
    row_max = np.max(x, axis=axis, keepdims=True, initial=-np.inf)  # initial: rows may be empty
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)  # all -inf row: shift by 0
    e = np.exp(x - row_max)
    total = np.sum(e, axis=axis, keepdims=True)
    return e / np.where(total == 0.0, 1.0, total)


def causal_mask(L: int, S: int) -> np.ndarray:
    """(L, S) bool, True = attend: query i sees keys j <= i (top-left aligned, as SDPA's is_causal)."""
    return np.tril(np.ones((L, S), dtype=bool))


def _additive(mask: np.ndarray | None, true_means_attend: bool, dtype) -> np.ndarray | float:
    """A bool or float mask as a float array to add to the scores (0 = attend, -inf = masked)."""
    if mask is None:
        return 0.0
    if mask.dtype == bool:
        masked_out = ~mask if true_means_attend else mask
        return np.where(masked_out, -np.inf, 0.0).astype(dtype)
    return mask.astype(dtype)


def scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=False, scale=None):
    """softmax(q k^T * scale + mask) v for q (..., L, D), k (..., S, D), v (..., S, Dv).

    attn_mask: bool (True = attend) or float (added), broadcastable to (..., L, S).
    Returns (output (..., L, Dv), weights (..., L, S)).
    """
    L, S = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale  # a Python float keeps the dtype
    scores = (q @ np.swapaxes(k, -1, -2)) * scale  # (..., L, S)
    scores = scores + _additive(attn_mask, True, scores.dtype)
    if is_causal:
        scores = scores + _additive(causal_mask(L, S), True, scores.dtype)
    weights = softmax(scores, axis=-1)
    return weights @ v, weights


# ---------------------------------------------------------------------------------------------
# Multi-head attention in NumPy. `params` holds a module's state_dict as arrays, in either naming:
#   torch.nn.MultiheadAttention: in_proj_weight (3E, E) or q_proj_weight (E, E), k_proj_weight
#     (E, Ek), v_proj_weight (E, Ev); in_proj_bias (3E,); out_proj.weight (E, E), out_proj.bias
#   mha.GeneralAttention: q_proj.weight (H*D, Eq), k_proj.weight (H*D, Ek), v_proj.weight
#     (H*Dv, Ev), their .bias, out_proj.weight (E, H*Dv), out_proj.bias
# and in both bias_k (1, 1, H*D), bias_v (1, 1, H*Dv). Missing optional entries mean "off".
# ---------------------------------------------------------------------------------------------

_GENERAL = ("q_proj", "k_proj", "v_proj")


def _projection_weights(params: dict):
    """The three input projections (H*D, E_in) and their biases (or None), in q, k, v order."""
    if "q_proj.weight" in params:  # the general module's naming
        return ([params[f"{n}.weight"] for n in _GENERAL], [params.get(f"{n}.bias") for n in _GENERAL])
    if params.get("in_proj_weight") is not None:
        weights = np.split(params["in_proj_weight"], 3, axis=0)
    else:
        weights = [params["q_proj_weight"], params["k_proj_weight"], params["v_proj_weight"]]
    b = params.get("in_proj_bias")
    return weights, ([None] * 3 if b is None else np.split(b, 3))


def _projection_grads(params: dict, g_w: list, g_b: list) -> dict:
    """Gradients of the input projections under the names ``params`` uses."""
    if "q_proj.weight" in params:
        grads = {f"{n}.weight": g for n, g in zip(_GENERAL, g_w)}
        if params.get("q_proj.bias") is not None:
            grads.update({f"{n}.bias": g for n, g in zip(_GENERAL, g_b)})
        return grads
    if params.get("in_proj_weight") is not None:
        grads = {"in_proj_weight": np.concatenate(g_w, axis=0)}  # (3E, E)
    else:
        grads = dict(zip(("q_proj_weight", "k_proj_weight", "v_proj_weight"), g_w))
    if params.get("in_proj_bias") is not None:
        grads["in_proj_bias"] = np.concatenate(g_b)
    return grads


def _linear(x, w, b):
    """x @ w^T + b, as torch.nn.functional.linear."""
    y = x @ w.T
    return y if b is None else y + b


def _to_batch_first(x: np.ndarray, batched: bool, batch_first: bool) -> np.ndarray:
    """(L, E) | (L, B, E) | (B, L, E) -> (B, L, E)."""
    if not batched:
        return x[None]  # (L, E) -> (1, L, E)
    return x if batch_first else np.swapaxes(x, 0, 1)  # (L, B, E) -> (B, L, E)


def _from_batch_first(x: np.ndarray, batched: bool, batch_first: bool) -> np.ndarray:
    """(B, L, E) -> the caller's layout."""
    if not batched:
        return x[0]  # (1, L, E) -> (L, E)
    return x if batch_first else np.swapaxes(x, 0, 1)  # (B, L, E) -> (L, B, E)


def _mha_mask(B, H, L, S, *, attn_mask, key_padding_mask, is_causal, extra_columns, dtype):
    """One additive mask (B|1, H|1, L, S + extra_columns) from torch.nn.MultiheadAttention's masks.

    Bool True = masked out. attn_mask is (L, S), (B*H, L, S) indexed n*H + h, or (H, L, S) when
    the input is unbatched (B == 1); key_padding_mask is (B, S). Appended keys (bias_k,
    zero attention) are always attended.
    """
    mask = np.zeros((1, 1, L, S), dtype=dtype)
    if attn_mask is not None:
        am = _additive(attn_mask, False, dtype)
        mask = mask + (am.reshape(-1, H, L, S) if am.ndim == 3 else am)  # (B*H, L, S) -> (B, H, L, S)
    if key_padding_mask is not None:
        kpm = _additive(key_padding_mask, False, dtype)
        mask = mask + kpm.reshape(B, 1, 1, S)  # (B, S) -> (B, 1, 1, S)
    if is_causal:
        mask = mask + _additive(causal_mask(L, S), True, dtype)
    pad = [(0, 0)] * 3 + [(0, extra_columns)]
    return np.pad(mask, pad)  # extra keys get 0 = attend


def _mha_steps(query, key, value, params, num_heads, *, key_padding_mask=None, attn_mask=None,
               is_causal=False, add_zero_attn=False, batch_first=False):
    """Run the forward once and keep every intermediate (the VJP reuses them)."""
    s = SimpleNamespace()
    s.batched = query.ndim == 3
    s.batch_first = batch_first
    x_q, x_k, x_v = (_to_batch_first(x, s.batched, batch_first) for x in (query, key, value))
    if not s.batched and key_padding_mask is not None:
        key_padding_mask = key_padding_mask[None]  # (S,) -> (1, S)
    B, L, _ = x_q.shape
    S0 = x_k.shape[1]
    w_o, b_o = params["out_proj.weight"], params.get("out_proj.bias")
    (w_q, w_k, w_v), (b_q, b_k, b_v) = _projection_weights(params)
    H = num_heads
    D, Dv = w_q.shape[0] // H, w_v.shape[0] // H
    q, k, v = _linear(x_q, w_q, b_q), _linear(x_k, w_k, b_k), _linear(x_v, w_v, b_v)  # (B, L|S, H*D)

    s.bias_kv = params.get("bias_k") is not None
    if s.bias_kv:
        k = np.concatenate([k, np.broadcast_to(params["bias_k"], (B, 1, H * D))], axis=1)  # (B, S+1, H*D)
        v = np.concatenate([v, np.broadcast_to(params["bias_v"], (B, 1, H * Dv))], axis=1)

    q_h = q.reshape(B, L, H, D).transpose(0, 2, 1, 3)  # (B, L, H*D) -> (B, H, L, D)
    k_h = k.reshape(B, -1, H, D).transpose(0, 2, 1, 3)  # (B, S, H*D) -> (B, H, S, D)
    v_h = v.reshape(B, -1, H, Dv).transpose(0, 2, 1, 3)  # (B, S, H*Dv) -> (B, H, S, Dv)
    s.zero_attn = add_zero_attn
    if add_zero_attn:
        k_h = np.concatenate([k_h, np.zeros((B, H, 1, D), dtype=k_h.dtype)], axis=2)  # (B, H, S+1, D)
        v_h = np.concatenate([v_h, np.zeros((B, H, 1, Dv), dtype=v_h.dtype)], axis=2)

    extra = int(s.bias_kv) + int(add_zero_attn)
    mask = _mha_mask(B, H, L, S0, attn_mask=attn_mask, key_padding_mask=key_padding_mask, is_causal=is_causal,
                     extra_columns=extra, dtype=q.dtype)
    s.scale = 1.0 / math.sqrt(D)
    scores = (q_h @ k_h.transpose(0, 1, 3, 2)) * s.scale + mask  # (B, H, L, S)
    s.P = softmax(scores, axis=-1)
    o_h = s.P @ v_h  # (B, H, L, Dv)
    s.o = _merge(o_h)  # (B, H, L, Dv) -> (B, L, H*Dv)
    s.out = _linear(s.o, w_o, b_o)  # (B, L, E)
    s.x = (x_q, x_k, x_v)
    s.w_in = (w_q, w_k, w_v)
    s.heads = (q_h, k_h, v_h)
    s.w_o = w_o
    return s


def multi_head_attention(query, key, value, params, num_heads, *, key_padding_mask=None,
                         attn_mask=None, is_causal=False, add_zero_attn=False, need_weights=True,
                         average_attn_weights=True, batch_first=False):
    """The forward of torch.nn.MultiheadAttention (eval, no dropout) in NumPy.

    query (L, B, E) or (B, L, E) with batch_first, or unbatched (L, E); key/value likewise with S.
    Masks as torch.nn.MultiheadAttention (bool True = masked out). ``is_causal`` applies the
    top-left causal mask in addition to ``attn_mask``.
    Returns (output like query, weights (B, L, S) averaged or (B, H, L, S) per head, or None).
    """
    s = _mha_steps(query, key, value, params, num_heads, key_padding_mask=key_padding_mask,
                   attn_mask=attn_mask, is_causal=is_causal, add_zero_attn=add_zero_attn,
                   batch_first=batch_first)
    out = _from_batch_first(s.out, s.batched, batch_first)
    if not need_weights:
        return out, None
    weights = s.P.mean(axis=1) if average_attn_weights else s.P  # (B, L, S) or (B, H, L, S)
    return out, (weights if s.batched else weights[0])


def multi_head_attention_vjp(query, key, value, params, num_heads, grad_output, grad_weights=None,
                             *, average_attn_weights=True, **options):
    """Gradients of sum(output * grad_output) + sum(weights * grad_weights), by hand.

    Takes the arguments of :func:`multi_head_attention`. Returns a dict with the gradients of
    ``query``, ``key``, ``value`` and of every entry of ``params`` (same names and shapes).
    """
    s = _mha_steps(query, key, value, params, num_heads, **options)
    (x_q, x_k, x_v), (w_q, w_k, w_v) = s.x, s.w_in
    q_h, k_h, v_h = s.heads
    B, H, L, _ = q_h.shape
    Dv = v_h.shape[-1]
    g_out = _to_batch_first(grad_output, s.batched, s.batch_first)  # (B, L, E)
    grads = {"out_proj.weight": np.einsum("nle,nlf->ef", g_out, s.o)}
    if params.get("out_proj.bias") is not None:
        grads["out_proj.bias"] = g_out.sum(axis=(0, 1))

    g_o = (g_out @ s.w_o).reshape(B, L, H, Dv).transpose(0, 2, 1, 3)  # (B, L, H*Dv) -> (B, H, L, Dv)
    g_P = g_o @ v_h.transpose(0, 1, 3, 2)  # (B, H, L, S)
    if grad_weights is not None:
        g_w = grad_weights if s.batched else grad_weights[None]
        g_P = g_P + (g_w[:, None] / H if average_attn_weights else g_w)  # (B, L, S) -> (B, 1, L, S)
    g_v_h = s.P.transpose(0, 1, 3, 2) @ g_o  # (B, H, S, Dv)
    g_scores = s.P * (g_P - np.sum(g_P * s.P, axis=-1, keepdims=True))  # softmax backward
    g_q_h = (g_scores @ k_h) * s.scale  # (B, H, L, D)
    g_k_h = (g_scores.transpose(0, 1, 3, 2) @ q_h) * s.scale  # (B, H, S, D)
    if s.zero_attn:
        g_k_h, g_v_h = g_k_h[:, :, :-1], g_v_h[:, :, :-1]  # the zero key has no parameters

    g_q = _merge(g_q_h)  # (B, H, L, D) -> (B, L, H*D)
    g_k = _merge(g_k_h)  # (B, H, S, D) -> (B, S, H*D)
    g_v = _merge(g_v_h)  # (B, H, S, Dv) -> (B, S, H*Dv)
    if s.bias_kv:
        grads["bias_k"] = g_k[:, -1].sum(axis=0)[None, None]  # (H*D,) -> (1, 1, H*D)
        grads["bias_v"] = g_v[:, -1].sum(axis=0)[None, None]
        g_k, g_v = g_k[:, :-1], g_v[:, :-1]

    pairs = ((g_q, x_q), (g_k, x_k), (g_v, x_v))
    grads.update(_projection_grads(params, [np.einsum("nle,nlc->ec", g, x) for g, x in pairs],
                                   [g.sum(axis=(0, 1)) for g, _ in pairs]))
    for name, g, w in (("query", g_q, w_q), ("key", g_k, w_k), ("value", g_v, w_v)):
        grads[name] = _from_batch_first(g @ w, s.batched, s.batch_first)  # (B, L|S, E_in)
    return grads


def _merge(x: np.ndarray) -> np.ndarray:
    B, H, T, D = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, T, H * D)  # (B, H, T, D) -> (B, T, H*D)


def blocked_attention(q, k, v, attn_mask=None, is_causal=False, scale=None, *, block_q=256, block_k=256):
    """scaled_dot_product_attention computed in tiles with an online softmax (never L x S at once).

    Same arguments and conventions as :func:`scaled_dot_product_attention` (bool mask: True =
    attend), but returns (output (..., L, Dv), log-sum-exp (..., L)). Per query block, a running
    max m, sum l and unnormalised output acc take in one key tile at a time:

        m' = max(m, rowmax(S_tile));  P = exp(S_tile - m')
        l  = l * exp(m - m') + rowsum(P);  acc = acc * exp(m - m') + P V_tile
        out = acc / l;  lse = m' + log(l)
    """
    L, S, Dv = q.shape[-2], k.shape[-2], v.shape[-1]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    mask = None if attn_mask is None else _additive(attn_mask, True, q.dtype)
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    out = np.zeros((*batch, L, Dv), dtype=q.dtype)
    lse = np.full((*batch, L), -np.inf, dtype=q.dtype)
    qs, kT = q * q.dtype.type(scale), np.swapaxes(k, -1, -2)
    for i0 in range(0, L, block_q):
        i1 = min(i0 + block_q, L)
        m = np.full((*batch, i1 - i0, 1), -np.inf, dtype=q.dtype)
        l = np.zeros_like(m)
        acc = np.zeros((*batch, i1 - i0, Dv), dtype=q.dtype)
        for j0 in range(0, min(S, i1) if is_causal else S, block_k):
            j1 = min(j0 + block_k, min(S, i1) if is_causal else S)
            s = qs[..., i0:i1, :] @ kT[..., :, j0:j1]  # (..., r, c)
            if mask is not None:
                s += np.broadcast_to(mask, (*mask.shape[:-2], L, S))[..., i0:i1, j0:j1]
            if is_causal and j1 - 1 > i0:
                s = np.where(np.arange(j0, j1) > np.arange(i0, i1)[:, None], -np.inf, s)
            m_new = np.maximum(m, s.max(axis=-1, keepdims=True))  # stays -inf while a row sees nothing
            shift = np.where(m_new == -np.inf, 0.0, m_new)  # those rows shift by 0: exp(-inf - 0) = 0
            alpha = np.exp(m - shift)
            p = np.exp(s - shift)  # (*batch, r, c): v may carry batch axes q and k broadcast
            l = l * alpha + p.sum(axis=-1, keepdims=True)
            acc = acc * alpha + p @ v[..., j0:j1, :]
            m = m_new
        out[..., i0:i1, :] = acc / np.where(l == 0, 1, l)
        with np.errstate(divide="ignore"):
            lse[..., i0:i1] = (m + np.log(l))[..., 0]
    return out, lse
