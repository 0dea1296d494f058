"""The attention contract in plain NumPy: the float64 reference every backend is tested against.

    s   = q k^T * scale * logit_scale_h            a per-head factor (an inverse temperature; optional)
    s   = c tanh(s / c)                          softcap c (optional)
    s   = s - slope_h |rel|                      ALiBi (optional)
    s   = s + mask  |  -inf where not mask       the caller's float | bool (True = attend) mask
    s   = -inf where the band or padding hides the key
    P   = softmax over the keys and one sink logit per head (optional), the sink then dropped
    out = P v

The rule of positions is written here again, on purpose: the oracle imports nothing from mha,
so a bug in mha.positions cannot hide in the reference the tests compare against. A query at
position p_q sees the key at p_k when its distance rel = p_k - p_q lies in the band:
-left <= rel <= right (None: unbounded on that side; causal is (None, 0)). Positions default to
query i at i + offset, key j at j, or are given per sequence.
Shapes: q (B, H, L, D), k (B, H, S, D), v (B, H, S, Dv).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np

from .attention import softmax

__all__ = ["contract_attention", "contract_attention_vjp"]


def _band_edges(band) -> tuple[int | None, int | None]:
    """(left, right) of a band given as a pair or as any object with .left and .right."""
    if isinstance(band, (tuple, list)):
        return band[0], band[1]
    return band.left, band.right


def _hidden_by_band(band, rel: np.ndarray) -> np.ndarray:
    """True where the distance rel = key position - query position lies outside the band."""
    left, right = _band_edges(band)
    hidden = np.zeros(rel.shape, dtype=bool)
    if left is not None:
        hidden |= rel < -left
    if right is not None:
        hidden |= rel > right
    return hidden


def _steps(q, k, v, *, band=None, offset=0, query_positions=None, key_positions=None, key_valid=None,
           mask=None, alibi_slopes=None, scale=None, logit_scale=None, softcap=None, sinks=None):
    """The forward once, keeping what the VJP reuses."""
    B, H, L, D = q.shape
    S = k.shape[2]
    st = SimpleNamespace(scale=1.0 / math.sqrt(D) if scale is None else scale, softcap=softcap)
    if query_positions is None:
        query_positions, key_positions = np.arange(L) + offset, np.arange(S)  # (L,), (S,)
    rel = np.asarray(key_positions)[..., None, :] - np.asarray(query_positions)[..., :, None]  # (B|., L, S)
    st.rel = rel if rel.ndim == 2 else rel[:, None]  # (L, S) or (B, 1, L, S)
    s = (q @ np.swapaxes(k, -1, -2)) * st.scale  # (B, H, L, S)
    st.logit_scale, st.unscaled = logit_scale, s
    if logit_scale is not None:
        s = s * np.asarray(logit_scale, dtype=s.dtype)[:, None, None]  # (H,) -> (H, 1, 1)
    if softcap is not None:
        st.tanh = np.tanh(s / softcap)
        s = softcap * st.tanh
    if alibi_slopes is not None:
        distances = rel.astype(s.dtype)  # int64 distances would make a float32 bias float64
        slopes = np.asarray(alibi_slopes, dtype=s.dtype)[:, None, None]  # (H,) -> (H, 1, 1)
        s = s - slopes * np.abs(distances[..., None, :, :])  # ALiBi: (H, L, S) or (B, H, L, S)
    if mask is not None:
        s = np.where(mask, s, -np.inf) if mask.dtype == bool else s + mask
    hidden = np.zeros(st.rel.shape, dtype=bool) if band is None else _hidden_by_band(band, st.rel)
    if key_valid is not None:
        hidden = hidden | ~np.asarray(key_valid)[:, None, None, :]  # (B, S) -> (B, 1, 1, S)
    s = np.where(hidden, -np.inf, s)
    if sinks is None:
        st.P, st.p_sink = softmax(s, axis=-1), None
    else:
        column = np.broadcast_to(np.asarray(sinks, dtype=s.dtype)[:, None, None], (*s.shape[:-1], 1))  # (B, H, L, 1)
        both = softmax(np.concatenate([s, column], axis=-1), axis=-1)
        st.P, st.p_sink = both[..., :-1], both[..., -1]
    st.out = st.P @ v
    return st


def contract_attention(q, k, v, **contract):
    """(output (B, H, L, Dv), weights (B, H, L, S)) under the contract's keyword arguments:
    band ((left, right), or an object with .left and .right such as mha.positions.Band), offset,
    query_positions (B, L) and key_positions (B, S), key_valid (B, S), mask, alibi_slopes (H,),
    scale, logit_scale (H,), softcap, sinks (H,)."""
    st = _steps(q, k, v, **contract)
    return st.out, st.P


def contract_attention_vjp(q, k, v, grad_output, **contract):
    """Gradients of sum(output * grad_output), by hand: a dict with q, k, v, and alibi_slopes,
    sinks and logit_scale when given.

        dP = dO v^T,  dv = P^T dO,  delta = rowsum(dO * O),  dS = P (dP - delta)
        d sink_h = -sum P_sink delta,  d slope_h = -sum dS |rel|,  softcap: dS *= 1 - tanh^2
        logit_scale t: d t_h = sum dS (q k^T * scale), then dS *= t_h
        dq = dS k * scale,  dk = dS^T q * scale
    """
    st = _steps(q, k, v, **contract)
    d_P = grad_output @ np.swapaxes(v, -1, -2)  # (B, H, L, S)
    delta = np.sum(grad_output * st.out, axis=-1, keepdims=True)  # (B, H, L, 1)
    d_s = st.P * (d_P - delta)
    grads = {"v": np.swapaxes(st.P, -1, -2) @ grad_output}
    if contract.get("sinks") is not None:
        grads["sinks"] = -np.sum(st.p_sink * delta[..., 0], axis=(0, 2))  # (H,)
    if contract.get("alibi_slopes") is not None:
        distance = np.abs(st.rel).astype(d_s.dtype)  # (L, S) or (B, 1, L, S)
        grads["alibi_slopes"] = -np.sum(d_s * distance, axis=(-2, -1)).sum(axis=0)  # (B, H) -> (H,)
    if st.softcap is not None:
        d_s = d_s * (1.0 - st.tanh ** 2)
    if st.logit_scale is not None:
        grads["logit_scale"] = np.sum(d_s * st.unscaled, axis=(0, 2, 3))  # (B, H, L, S) -> (H,)
        d_s = d_s * np.asarray(st.logit_scale, dtype=d_s.dtype)[:, None, None]
    grads["q"] = (d_s @ k) * st.scale
    grads["k"] = (np.swapaxes(d_s, -1, -2) @ q) * st.scale
    return grads
