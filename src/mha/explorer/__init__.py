"""The attention explorer: one self-contained HTML page of a forward's attention.

    mha.view(model, x, tokens=words, output="attention.html")       # run model(x) and show it
    with mha.explorer.record(model) as recording:                     # or record first
        model(x)                                                      # (mha.explorer.recording_of(model, x) does both)
    mha.view(recording, tokens=words)
    with mha.capture_attention(model) as maps:                       # weights only: no breakdown
        model(x)
    mha.view(maps)

The page (docs/view.md): a layers x heads grid of maps, one head large with the tokens on both
axes, a query row broken down into the terms of its scores (q . k x scale, softcap, ALiBi, masks,
sinks), the softmax and the weighted values, checked against the real output; head and layer
averages, a diff between two runs, PNG export. ``mha view`` writes it from the command line.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from .. import _checks
from .page import DEFAULT_MAX_BYTES, PageTooLarge, render, write
from .record import AttentionCall, Recording, capture_attention, record

__all__ = ["AttentionCall", "DEFAULT_MAX_BYTES", "PageTooLarge", "Recording", "capture_attention", "record", "recording_of",
           "view"]


def view(source, *inputs, output: str | Path = "attention.html", tokens: list[str] | None = None,
         key_tokens: list[str] | None = None, compare=None, labels: tuple[str, str] = ("A", "B"),
         forward_kwargs: dict | None = None, sample: int = 0, title: str | None = None,
         max_bytes: int = DEFAULT_MAX_BYTES, notes: list[str] | None = None) -> Path:
    """Write the explorer page of ``source`` to ``output``; returns its path.

    source:        an nn.Module (run as ``source(*inputs, **forward_kwargs)`` under mha.explorer.record,
                   without gradients, in eval mode), a Recording, or mha.capture_attention's dict (maps only)
    tokens:        the query labels (key_tokens: the keys', when they differ), one per position
    compare:       a second run for the diff toggle: a module (run on the same inputs), a Recording
                   or a captured dict, with the same calls' shapes; ``labels`` name the two runs
    sample:        which sequence of the batch to show
    max_bytes:     the page's size limit (30 MB): q, k, v go to float16 past it, and a page still
                   larger raises PageTooLarge
    notes:         lines the page shows under its title, for what the reader must know (``mha view``
                   says there that a text was cut to the model's positions)
    """
    tokens, key_tokens = _labels("tokens", tokens), _labels("key_tokens", key_tokens)
    notes = _notes(notes)
    _check_options(output=output, labels=labels, sample=sample, title=title, max_bytes=max_bytes)
    runs = [_recording_of("source", source, inputs, forward_kwargs)]
    if compare is not None:
        runs.append(_recording_of("compare", compare, inputs, forward_kwargs))
    page = render(runs, run_labels=list(labels[: len(runs)]), tokens=tokens, key_tokens=key_tokens, sample=sample,
                  title=title or _title(source), max_bytes=max_bytes, notes=notes)
    return write(page, output)


def recording_of(model: nn.Module, *inputs, **forward_kwargs) -> Recording:
    """The recording of ``model(*inputs, **forward_kwargs)``, run without gradients and in eval
    mode (no dropout: a map after dropout is noise; the model's modes are restored after)."""
    import torch

    training = {module: module.training for module in model.modules()}
    try:
        with record(model) as recording, torch.no_grad():
            model.eval()
            model(*inputs, **forward_kwargs)
    finally:
        for module, mode in training.items():
            module.train(mode)
    if not recording.calls:
        raise ValueError(f"{type(model).__name__}'s forward made no attention call through mha (a torch module, "
                         "or a transformers model without attn_implementation='mha'?)")
    return recording


def _recording_of(name: str, source, inputs: tuple, forward_kwargs: dict | None) -> Recording:
    if isinstance(source, Recording):
        return source
    if isinstance(source, dict):
        return Recording.from_weights(source)
    if isinstance(source, nn.Module):
        if not inputs and not forward_kwargs:
            raise ValueError(f"{name} is a module: pass the inputs to run it on, mha.view(model, x, ...)")
        return recording_of(source, *inputs, **(forward_kwargs or {}))
    raise TypeError(f"{name} must be an nn.Module, an mha.explorer.Recording or mha.capture_attention's dict, "
                    f"got {type(source).__name__}")


def _labels(name: str, value) -> list[str] | None:
    """tokens / key_tokens: None, or any iterable of strings (one per position) as a list."""
    if value is None:
        return None
    labels = None if isinstance(value, str) or not hasattr(value, "__iter__") else list(value)
    if labels is None or not all(isinstance(t, str) for t in labels):
        raise TypeError(f"{name} must be a list of strings (one per position), got {value!r:.80}")
    for token in labels:
        _text(name, token)
    return labels


def _notes(value) -> list[str]:
    """notes: None, or a list (tuple) of strings, the page's lines under its title."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)) or not all(isinstance(note, str) for note in value):
        raise TypeError(f"notes must be a list of strings (lines for the page), got {value!r:.80}")
    for note in value:
        _text("notes", note)
    return list(value)


def _text(name: str, text: str) -> None:
    """Text the page can hold: UTF-8 (a lone surrogate such as '\\ud800' is not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"{name} must be text UTF-8 can write, got {text!r:.80} ({error.reason})") from None


def _check_options(*, output, labels, sample, title, max_bytes) -> None:
    """The options' types and values, before any model runs."""
    if not isinstance(output, (str, Path)):
        raise TypeError(f"output must be a path (str or pathlib.Path), got {type(output).__name__}")
    if Path(output).is_dir():
        raise ValueError(f"output must be a file to write, got the directory {str(output)!r}")
    if (not isinstance(labels, (tuple, list)) or len(labels) != 2
            or not all(isinstance(label, str) for label in labels)):
        raise ValueError(f"labels must be two strings (the runs' names), got {labels!r}")
    for label in labels:
        _text("labels", label)
    if _checks.integer("sample", sample) < 0:
        raise ValueError(f"sample must be an int >= 0 (a sequence of the batch), got {sample!r}")
    if title is not None and not isinstance(title, str):
        raise TypeError(f"title must be a string or None, got {type(title).__name__}")
    if title is not None:
        _text("title", title)
    _checks.positive_int("max_bytes", max_bytes)


def _title(source) -> str:
    return f"attention of {type(source).__name__}" if isinstance(source, nn.Module) else "attention"
