"""A GGUF file's header, its metadata and its tensor records, read once and cached.

The `gguf` package's reader parses every element of every metadata array on its own (a 32,000-token
vocabulary: some 100,000 small numpy views), which takes seconds on each start. `read_header` parses
the file with that reader the first time and writes what tokenmill keeps of it (the metadata's
values, and each tensor's name, type, shape, byte count and offset) as one JSON file,
`$TOKENMILL_CACHE_DIR/gguf/<key>.json` (`$TOKENMILL_GGUF_CACHE_DIR` moves the folder), the key a hash
of the file's resolved path, size and modification time, of its first 16 MiB (where the header is:
a file rewritten within one tick of the clock is a new key too) and of this file's `FORMAT`. Later
starts read the JSON (the values round-trip exactly: JSON keeps ints and floats apart and writes
floats to the last bit). A cache file that does not read back (cut short, another key's) is a
warning, and the file is parsed again and the cache rewritten; one that cannot be written (a
read-only disk) leaves the start as it was.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.model_files import ModelLoadError, cache_dir, file_key

logger = logging.getLogger("tokenmill")

FORMAT = "tokenmill gguf header 1"  # this file's layout; a change makes every key new
HEAD = 16 << 20  # the key hashes the file's first bytes: the header, unless its metadata is larger


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as the file stores it: `shape` in GGUF's order (innermost first), `data_offset` from
    the start of the file."""

    name: str
    type_name: str  # as gguf.GGMLQuantizationType spells it
    shape: tuple[int, ...]
    n_bytes: int
    data_offset: int


@dataclass(frozen=True)
class GGUFHeader:
    metadata: dict[str, Any]
    tensors: list[StoredTensor]


def read_header(path: Path) -> GGUFHeader:
    """The header of the GGUF file `path`: from the cache when it holds this file's, else parsed (and
    cached). A file the reader cannot parse is a ModelLoadError."""
    key, text = file_key(path, FORMAT, head=HEAD)
    cached = cache_dir("gguf") / f"{key}.json"
    if cached.is_file():
        try:
            return _from_json(json.loads(cached.read_text(encoding="utf-8")), text)
        except (ValueError, KeyError, TypeError, OSError) as e:
            logger.warning("GGUF header cache %s unusable (%s): reading the file again", cached, e)
    header = parse_header(path)
    _write(cached, header, text)
    return header


def parse_header(path: Path) -> GGUFHeader:
    """The header as the `gguf` package's reader parses it."""
    import gguf

    try:
        # (the reader is not kept: its parse of the metadata, a few numpy arrays an entry of every
        # array, is ~100 MiB for a 32,000-token vocabulary; the values and tensor records are)
        reader = gguf.GGUFReader(str(path))
        metadata = {name: _value(field) for name, field in reader.fields.items()}
        tensors = [
            StoredTensor(
                t.name, t.tensor_type.name, tuple(int(d) for d in t.shape.tolist()), int(t.n_bytes), int(t.data_offset)
            )
            for t in reader.tensors
        ]
        del reader
    except (ValueError, IndexError, KeyError, OverflowError, struct.error, UnicodeDecodeError, OSError) as e:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    return GGUFHeader(metadata, tensors)


def _value(field: Any) -> Any:
    value = field.contents()
    if isinstance(value, np.generic):
        return value.item()
    return value


def _from_json(data: dict[str, Any], text: str) -> GGUFHeader:
    if data["key"] != text:
        raise ValueError("written for another file")
    tensors = [StoredTensor(n, t, tuple(s), b, o) for n, t, s, b, o in data["tensors"]]
    return GGUFHeader(data["metadata"], tensors)


def _write(cached: Path, header: GGUFHeader, text: str) -> None:
    """The header as JSON, written beside its place and renamed in (a reader never sees half of it)."""
    staging = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")
    tensors = [[t.name, t.type_name, list(t.shape), t.n_bytes, t.data_offset] for t in header.tensors]
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        staging.write_text(json.dumps({"key": text, "metadata": header.metadata, "tensors": tensors}), "utf-8")
        os.replace(staging, cached)
    except (OSError, TypeError, ValueError) as e:  # a full or read-only disk, a value JSON cannot hold
        logger.warning("GGUF header not cached in %s (%s)", cached, e)
        staging.unlink(missing_ok=True)
