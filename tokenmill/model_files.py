"""What a model path names, before anything is read: a Hugging Face folder or a GGUF file, and the
error for one that cannot be loaded. Plain and torch-free, so the tokenizer, the loaders and the
server can all ask without importing the model code."""

from __future__ import annotations

from pathlib import Path


class ModelLoadError(ValueError):
    """A model folder that cannot be loaded; the message names the file and the field."""


def is_gguf(path: str | Path) -> bool:
    """Whether `path` names a GGUF file (by its suffix; the reader checks the magic)."""
    return Path(path).suffix.lower() == ".gguf"
