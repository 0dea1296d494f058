"""The explorer page: one self-contained HTML file (inline script and style, data embedded).

The page gets a manifest (JSON: names, tokens, shapes, terms, quantisation scales, where each
array lies in the data) and the data: the arrays one after another, zlib-compressed, base64. The
weights are quantised to 8 bits per head, w ~ u8 * scale / 255 with scale the head's largest
weight (error <= scale / 510). q, k, v and the heads' outputs, which the page needs to break a row
down and check it against the real output, are stored in float32, or in float16 where float32
would make the page larger than ``max_bytes``.
"""

from __future__ import annotations

import base64
import html
import json
import math
import re
import zlib
from collections import Counter
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from .record import AttentionCall, Recording

__all__ = ["DEFAULT_MAX_BYTES", "PageTooLarge", "render", "write"]

DEFAULT_MAX_BYTES = 30_000_000
_ALIGN = 4  # every array starts at a multiple of 4 bytes: typed-array views need it


class PageTooLarge(ValueError):
    """The page would be larger than max_bytes even with float16 vectors."""


@dataclass(frozen=True)
class Page:
    html: str
    precision: str  # "float32" or "float16": how q, k, v and the outputs are stored

    @property
    def size(self) -> int:
        return len(self.html.encode())


class _Data:
    """The arrays of the page, laid end to end; add() returns where an array lies."""

    def __init__(self, precision: str) -> None:
        self.chunks: list[bytes] = []
        self.size = 0
        self.vector_dtype = np.float32 if precision == "float32" else np.float16

    def add(self, array: np.ndarray, kind: str) -> dict:
        raw = np.ascontiguousarray(array).tobytes()
        entry = {"offset": self.size, "length": int(np.asarray(array).size), "kind": kind}
        padding = (-len(raw)) % _ALIGN
        self.chunks.append(raw + b"\0" * padding)
        self.size += len(raw) + padding
        return entry

    def vectors(self, x: Tensor) -> dict:
        return self.add(x.numpy().astype(self.vector_dtype), "f32" if self.vector_dtype == np.float32 else "f16")

    def encoded(self) -> str:
        return base64.b64encode(zlib.compress(b"".join(self.chunks), 6)).decode("ascii")


def quantise(weights: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """(H, L, S) weights -> (u8 (H, L, S), scales (H,), count of non-finite weights, stored as 0)."""
    finite = np.isfinite(weights)
    clean = np.where(finite, weights, 0.0).astype(np.float64)
    scales = clean.reshape(clean.shape[0], -1).max(axis=1, initial=0.0) if clean.size else np.zeros(clean.shape[0])
    scales = np.maximum(scales, 0.0)
    safe = np.where(scales > 0, scales, 1.0)[:, None, None]
    codes = np.clip(np.rint(np.maximum(clean, 0.0) / safe * 255.0), 0, 255).astype(np.uint8)
    return codes, scales, int((~finite).sum())


def _call_entry(call: AttentionCall, name: str, sample: int, data: _Data,
                labels: tuple[list[str], list[str]]) -> dict:
    B, H, L, S = call.weights.shape
    codes, scales, nonfinite = quantise(call.weights[sample].numpy())
    entry = {"name": name, "H": H, "L": L, "S": S, "queries": labels[0], "keys": labels[1],
             "weights": data.add(codes, "u8"), "scales": scales.tolist(), "nonfinite": nonfinite,
             "dropout_p": call.dropout_p}
    if not call.detailed:
        return entry
    # what the page's recomputation can differ by (page.js, rowBound): the math backend computes in
    # float32 (float64 for float64), the vectors are stored in float32 or float16, the output was
    # rounded to the call's dtype
    model, stored = float(torch.finfo(getattr(torch, call.dtype)).eps), float(np.finfo(data.vector_dtype).eps)
    computed = model if call.dtype == "float64" else float(np.finfo(np.float32).eps)
    eps = {"computed": computed, "stored": stored, "out": max(model, stored)}
    entry.update(Hkv=call.k.shape[1], D=call.q.shape[-1], Dv=call.v.shape[-1], scale=_number(call.scale),
                 softcap=_number(call.softcap), q=data.vectors(call.q[sample]), k=data.vectors(call.k[sample]),
                 v=data.vectors(call.v[sample]), out=data.vectors(call.out[sample]), eps=eps,
                 q_pos=call.q_pos[sample].tolist(), k_pos=call.k_pos[sample].tolist(),
                 alibi_slopes=None if call.alibi_slopes is None else [_number(x) for x in call.alibi_slopes.tolist()],
                 sinks=None if call.sinks is None else [_number(x) for x in call.sinks.tolist()])
    entry["hidden"] = []
    for term, hidden in call.hidden.items():
        bits = hidden[sample].numpy()  # (H|1, L, S)
        entry["hidden"].append({"term": term, "heads": bits.shape[0],
                                "bits": data.add(np.packbits(bits.reshape(-1), bitorder="little"), "bits")})
    if call.additive is not None:
        additive = call.additive[sample].numpy().astype(np.float32)  # (H|1, L, S)
        entry["additive"] = data.add(additive, "f32")
        entry["additive_heads"] = additive.shape[0]
    return entry


def _number(x: float | None) -> float | str | None:
    """A number for the manifest: JSON has no infinity or NaN, so those go as the strings that
    JavaScript's Number() reads ("Infinity", "-Infinity", "NaN")."""
    if x is None or math.isfinite(x):
        return x
    return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")


def labels_for(call: AttentionCall, sample: int, tokens: list[str] | None,
               key_tokens: list[str] | None) -> tuple[list[str], list[str]]:
    """The query and key labels of a call. A side whose length the tokens (key_tokens first for the
    keys: cross-attention) match takes them; otherwise, where the contract places the call in its
    sequence (a decoding step with a band or ALiBi), the tokens at those positions, or the positions
    themselves; else the indices."""
    _, _, L, S = call.weights.shape

    def side(n: int, where: Tensor | None, *candidates: list[str] | None) -> list[str]:
        for labels in candidates:
            if labels is not None and len(labels) == n:
                return list(labels)
        if not call.placed or where is None:
            return [str(i) for i in range(n)]
        at = where[sample].tolist()
        labels = next((c for c in candidates if c is not None), None)
        if labels is not None and all(0 <= p < len(labels) for p in at):
            return [labels[p] for p in at]
        return [str(p) for p in at]

    return side(L, call.q_pos, tokens), side(S, call.k_pos, key_tokens, tokens)


def fits(call: AttentionCall, labels: list[str], queries: bool) -> bool:
    """Whether ``labels`` label a side of the call: one per position of the call, or of the
    sequence the contract places it in."""
    n, where = (call.weights.shape[2], call.q_pos) if queries else (call.weights.shape[3], call.k_pos)
    if len(labels) == n:
        return True
    return (call.placed and where is not None and where.numel() > 0
            and int(where.min()) >= 0 and int(where.max()) < len(labels))


def _names(calls: list[AttentionCall]) -> list[str]:
    """The calls' names, numbered where a module made several calls (decoding steps)."""
    counts = Counter(call.name for call in calls)
    seen: Counter = Counter()
    names = []
    for call in calls:
        seen[call.name] += 1
        names.append(call.name if counts[call.name] == 1 else f"{call.name} · call {seen[call.name]}")
    return names


def _check_runs(runs: list[Recording], sample: int, tokens, key_tokens) -> None:
    if not runs[0].calls:
        raise ValueError("the recording holds no attention call: did the forward run inside mha.explorer.record "
                         "(or through mha's attention at all)?")
    for call in (call for run in runs for call in run.calls):
        if 0 in call.weights.shape[1:]:
            raise ValueError(f"call {call.name!r} has weights {tuple(call.weights.shape)}: no head, query or key "
                             "to show (an empty sequence)")
    shapes = [call.weights.shape for call in runs[0].calls]
    if tokens is not None and not any(fits(call, tokens, queries=True) for call in runs[0].calls):
        raise ValueError(f"tokens has {len(tokens)} entries, but the calls have {sorted({s[2] for s in shapes})} "
                         "queries: one label per query position (or per position of the sequence)")
    if key_tokens is not None and not any(fits(call, key_tokens, queries=False) for call in runs[0].calls):
        raise ValueError(f"key_tokens has {len(key_tokens)} entries, but the calls have "
                         f"{sorted({s[3] for s in shapes})} keys: one label per key position")
    for call in runs[0].calls:
        if not 0 <= sample < call.weights.shape[0]:
            raise ValueError(f"sample must index the batch: 0 <= sample < {call.weights.shape[0]} "
                             f"(call {call.name!r}), got {sample}")
    if len(runs) == 2:
        first, second = runs
        if len(first.calls) != len(second.calls):
            raise ValueError(f"compare must record as many attention calls as the first run: "
                             f"{len(first.calls)} and {len(second.calls)}")
        for a, b in zip(first.calls, second.calls):
            if a.weights.shape[1:] != b.weights.shape[1:] or b.weights.shape[0] <= sample:
                raise ValueError(f"compare's call {b.name!r} has weights {tuple(b.weights.shape)}, the first run's "
                                 f"{a.name!r} {tuple(a.weights.shape)}: the diff needs the same heads and lengths")


def render(runs: list[Recording], *, run_labels: list[str], tokens: list[str] | None = None,
           key_tokens: list[str] | None = None, sample: int = 0, title: str = "attention",
           max_bytes: int = DEFAULT_MAX_BYTES, notes: list[str] | None = None) -> Page:
    """The page of one recording, or of two (the diff toggle) with the same calls' shapes; ``notes``
    are shown under the title (a text cut to the model's positions, say)."""
    _check_runs(runs, sample, tokens, key_tokens)
    for precision in ("float32", "float16"):
        data = _Data(precision)
        manifest = {"title": title, "notes": list(notes or []), "precision": precision, "sample": sample, "runs": [
            {"label": label, "layers": [_call_entry(call, name, sample, data, labels_for(call, sample, tokens, key_tokens))
                                        for call, name in zip(run.calls, _names(run.calls))]}
            for label, run in zip(run_labels, runs)]}
        page = Page(_html(manifest, data.encoded()), precision)
        if page.size <= max_bytes:
            return page
    raise PageTooLarge(
        f"the page would take {page.size / 1e6:.1f} MB even with float16 vectors, over max_bytes="
        f"{max_bytes / 1e6:.1f} MB: a shorter text, fewer calls (a Recording's calls can be sliced), or a higher "
        f"limit (max_bytes; mha view --max-mb)")


def write(page: Page, output: str | Path) -> Path:
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(page.html, encoding="utf-8")
    return output


def _asset(name: str) -> str:
    return resources.files("mha.explorer").joinpath("assets", name).read_text(encoding="utf-8")


def _html(manifest: dict, data: str) -> str:
    """The template with its /*@NAME@*/ markers filled in one pass (no filling is searched again)."""
    text = json.dumps(manifest, separators=(",", ":"), allow_nan=False)
    for character in "<>&":  # as JSON escapes: no "</script>" or "<!--" can end or swallow the script element
        text = text.replace(character, f"\\u{ord(character):04x}")
    parts = {"STYLE": _asset("page.css"), "SCRIPT": _asset("page.js"), "TITLE": html.escape(manifest["title"]),
             "MANIFEST": text, "DATA": data}
    return re.sub(r"/\*@([A-Z]+)@\*/", lambda marker: parts[marker.group(1)], _asset("page.html"))

