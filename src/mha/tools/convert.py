"""Convert the attention block of a weights file (.pt/.pth/.bin state_dict or .safetensors)
from one layout to another (mha.layouts); every other key is copied unchanged. What ``mha
convert`` runs.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from .. import layouts


def _is_safetensors(path: Path) -> bool:
    return path.suffix.lower() == ".safetensors"


def convert_file(source_path: Path, target_path: Path, *, source: str, target: str,
                 num_heads: int | None = None, prefix: str = "", out_prefix: str | None = None) -> dict:
    """Convert the block; returns {written key: shape} of the converted keys."""
    state, metadata = load_state(source_path)
    block = {k[len(prefix):]: t for k, t in state.items() if k.startswith(prefix)}
    if not block:
        raise ValueError(f"no key of {source_path} starts with the prefix {prefix!r}")
    num_heads = layouts.heads_in(block, source, num_heads)
    general = layouts.to_general(block, source, num_heads)
    consumed = {prefix + k for k in layouts.from_general(general, source, num_heads)}
    converted = layouts.from_general(general, target, num_heads)
    out_prefix = prefix if out_prefix is None else out_prefix
    result = {k: t for k, t in state.items() if k not in consumed}
    clashes = sorted(out_prefix + k for k in converted if out_prefix + k in result)
    if clashes:
        raise ValueError(f"the converted keys {clashes} would overwrite keys kept from the input")
    result.update({out_prefix + k: t for k, t in converted.items()})
    save_state(result, target_path, metadata)
    return {out_prefix + k: tuple(t.shape) for k, t in converted.items()}


def load_state(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str] | None]:
    """(tensors, safetensors metadata or None) of a .safetensors or torch file."""
    if not path.exists():
        raise ValueError(f"{path} does not exist")
    try:
        if _is_safetensors(path):
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # a corrupt or foreign file: say so, do not crash
        raise ValueError(f"could not read {path}: {type(error).__name__}: {error}") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path} must hold a flat state_dict (a dict of tensors), got {type(state).__name__}")
    return state, None


def save_state(state: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """Write atomically: a temporary file in the same folder, renamed when complete, with the
    permissions a plain new file gets. safetensors files carry {"format": "pt"} (and the
    source's metadata)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, suffix=path.suffix)
    os.close(handle)
    try:
        tensors = {k: t.detach().contiguous().clone() for k, t in state.items()}  # no shared storage
        if _is_safetensors(path):
            from safetensors.torch import save_file

            save_file(tensors, temporary, metadata={**(metadata or {}), "format": "pt"})
        else:
            torch.save(tensors, temporary)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temporary, 0o666 & ~umask)  # mkstemp made it 0600
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
