"""What a model path names, before anything is read: a Hugging Face folder or a GGUF file, and the
error for one that cannot be loaded; and where tokenmill keeps what it derives from a model file
(`cache_dir`, `file_key`). Plain and torch-free, so the tokenizer, the loaders and the server can all
ask without importing the model code."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


class ModelLoadError(ValueError):
    """A model folder that cannot be loaded; the message names the file and the field."""


def is_gguf(path: str | Path) -> bool:
    """Whether `path` names a GGUF file (by its suffix; the reader checks the magic)."""
    return Path(path).suffix.lower() == ".gguf"


def cache_home() -> Path:
    """Where tokenmill's caches live: `$TOKENMILL_CACHE_DIR`, or `~/.cache/tokenmill` where it is unset or
    empty (an empty value is not the working folder)."""
    return Path(os.environ.get("TOKENMILL_CACHE_DIR") or Path.home() / ".cache" / "tokenmill")


def cache_dir(room: str) -> Path:
    """The folder of one of tokenmill's caches (`room`: `quantized`, `gguf`): `$TOKENMILL_<ROOM>_CACHE_DIR`
    where set (that cache elsewhere: another disk, a test's folder), else `$TOKENMILL_CACHE_DIR/<room>`
    (default `~/.cache/tokenmill/<room>`)."""
    own = os.environ.get(f"TOKENMILL_{room.upper()}_CACHE_DIR")
    if own:
        return Path(own)
    return cache_home() / room


def file_key(path: str | Path, *parts: str, head: int = 0) -> tuple[str, str]:
    """(key, the text it hashes) of something derived from the file `path`: its resolved path, size and
    modification time (a rewritten or replaced file is a new key), with `head`, a digest of its first
    `head` bytes too (what a header cache reads from: a file rewritten within one tick of the clock
    is a new key as well), and `parts` (what else the derived value depends on: the deriving code's
    format, a library's version). The key is 24 hex digits."""
    file = Path(path).resolve()
    stat = file.stat()
    lines = [str(file), f"{stat.st_size} {stat.st_mtime_ns}", *parts]
    if head:
        with open(file, "rb") as f:
            lines.append(hashlib.sha256(f.read(head)).hexdigest())
    text = "\n".join(lines)
    return hashlib.sha256(text.encode()).hexdigest()[:24], text
