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
import json
import re
import zlib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
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


def _call_entry(call: AttentionCall, sample: int, data: _Data, labels: tuple[list[str], list[str]]) -> dict:
    B, H, L, S = call.weights.shape
    codes, scales, nonfinite = quantise(call.weights[sample].numpy())
    entry = {"name": call.name, "H": H, "L": L, "S": S, "queries": labels[0], "keys": labels[1],
             "weights": data.add(codes, "u8"), "scales": scales.tolist(), "nonfinite": nonfinite}
    if not call.detailed:
        return entry
    entry.update(Hkv=call.k.shape[1], D=call.q.shape[-1], Dv=call.v.shape[-1], scale=call.scale,
                 softcap=call.softcap, q=data.vectors(call.q[sample]), k=data.vectors(call.k[sample]),
                 v=data.vectors(call.v[sample]), out=data.vectors(call.out[sample]),
                 q_pos=call.q_pos[sample].tolist(), k_pos=call.k_pos[sample].tolist(),
                 alibi_slopes=None if call.alibi_slopes is None else call.alibi_slopes.tolist(),
                 sinks=None if call.sinks is None else call.sinks.tolist())
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


def labels_for(L: int, S: int, tokens: list[str] | None, key_tokens: list[str] | None) -> tuple[list[str], list[str]]:
    """The query and key labels of a call of L queries and S keys: the tokens where they fit; keys
    past the tokens (bias_k, a zero key) are named as such; otherwise the index."""
    queries = list(tokens) if tokens is not None and len(tokens) == L else [str(i) for i in range(L)]
    keys_given = key_tokens if key_tokens is not None else tokens
    if keys_given is not None and len(keys_given) == S:
        keys = list(keys_given)
    elif keys_given is not None and len(keys_given) < S:
        keys = list(keys_given) + [f"[extra {j}]" for j in range(S - len(keys_given))]
    else:
        keys = [str(j) for j in range(S)]
    return queries, keys


def _check_runs(runs: list[Recording], sample: int) -> None:
    if not runs[0].calls:
        raise ValueError("the recording holds no attention call: did the forward run inside mha.explorer.record "
                         "(or through mha's attention at all)?")
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
           max_bytes: int = DEFAULT_MAX_BYTES) -> Page:
    """The page of one recording, or of two (the diff toggle) with the same calls' shapes."""
    _check_runs(runs, sample)
    for precision in ("float32", "float16"):
        data = _Data(precision)
        manifest = {"title": title, "precision": precision, "sample": sample, "runs": [
            {"label": label, "layers": [_call_entry(call, sample, data, labels_for(*call.weights.shape[2:], tokens,
                                                                                   key_tokens))
                                        for call in run.calls]}
            for label, run in zip(run_labels, runs)]}
        page = Page(_html(manifest, data.encoded()), precision)
        if page.size <= max_bytes:
            return page
    raise PageTooLarge(
        f"the page would take {page.size / 1e6:.1f} MB even with float16 vectors, over max_bytes="
        f"{max_bytes / 1e6:.1f} MB: view fewer layers or heads (a Recording's calls can be sliced), a shorter "
        f"text, or raise max_bytes")


def write(page: Page, output: str | Path) -> Path:
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(page.html, encoding="utf-8")
    return output


def _asset(name: str) -> str:
    return resources.files("mha.explorer").joinpath("assets", name).read_text(encoding="utf-8")


def _html(manifest: dict, data: str) -> str:
    """The template with its /*@NAME@*/ markers filled in one pass (no filling is searched again)."""
    parts = {"STYLE": _asset("page.css"), "SCRIPT": _asset("page.js"), "TITLE": _escape(manifest["title"]),
             "MANIFEST": json.dumps(manifest, separators=(",", ":"), allow_nan=False).replace("</", "<\\/"),
             "DATA": data}
    return re.sub(r"/\*@([A-Z]+)@\*/", lambda marker: parts[marker.group(1)], _asset("page.html"))


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")
