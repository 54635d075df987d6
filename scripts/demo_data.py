"""The demo models' data: the CPython standard library's Python sources (PSF license), split by file
into training and held-out sets by a hash of each file's path (5% held out), and turned into token
streams (`<s>` file `</s>`, as the engine's prompts start with `<s>`). Shared by the training script
and the held-out evaluation (benchmarks/demo_models.py)."""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np

STDLIB = Path(sysconfig.get_paths()["stdlib"])
HELD_OUT_EVERY = 20  # one file in 20 is held out


def stdlib_files() -> list[str]:
    """Paths of the standard library's .py files relative to it, sorted (no site-packages)."""
    files = [p.relative_to(STDLIB).as_posix() for p in STDLIB.rglob("*.py") if "site-packages" not in p.parts]
    if not files:
        raise SystemExit(f"no Python sources under {STDLIB}")
    return sorted(files)


def is_held_out(relative: str) -> bool:
    return int(hashlib.sha256(relative.encode()).hexdigest(), 16) % HELD_OUT_EVERY == 0


def split() -> tuple[list[str], list[str]]:
    files = stdlib_files()
    return [f for f in files if not is_held_out(f)], [f for f in files if is_held_out(f)]


def read(relative: str) -> str:
    return (STDLIB / relative).read_text(encoding="utf-8", errors="replace")


def token_stream(tokenizer: Any, files: list[str]) -> np.ndarray:
    """Every file as `<s>` + its tokens + `</s>`, concatenated: int32 [total tokens]."""
    eos = tokenizer.token_to_id("</s>")
    parts = []
    for batch_start in range(0, len(files), 64):
        batch = [read(f) for f in files[batch_start : batch_start + 64]]
        for enc in tokenizer.encode_batch(batch):  # the post-processor adds <s>
            parts.append(np.asarray([*enc.ids, eos], dtype=np.int32))
    return np.concatenate(parts)
