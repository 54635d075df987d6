"""Held-out text that every machine has: the CPython standard library's Python sources (PSF license),
split by file into training and held-out sets by a hash of each file's path (one file in 20 held
out). The demo models were trained on the training split (scripts/demo_data.py), so the held-out
files are text they never saw; `tokenmill eval-quant` reads them when no --text is given."""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

STDLIB = Path(sysconfig.get_paths()["stdlib"])
HELD_OUT_EVERY = 20  # one file in 20 is held out


def stdlib_files() -> list[str]:
    """Paths of the standard library's .py files relative to it, sorted (no site-packages)."""
    files = [p.relative_to(STDLIB).as_posix() for p in STDLIB.rglob("*.py") if "site-packages" not in p.parts]
    if not files:
        raise ValueError(f"no Python sources under {STDLIB}")
    return sorted(files)


def is_held_out(relative: str) -> bool:
    return int(hashlib.sha256(relative.encode()).hexdigest(), 16) % HELD_OUT_EVERY == 0


def split() -> tuple[list[str], list[str]]:
    """(training files, held-out files), relative to the standard library's folder."""
    files = stdlib_files()
    return [f for f in files if not is_held_out(f)], [f for f in files if is_held_out(f)]


def read(relative: str) -> str:
    return (STDLIB / relative).read_text(encoding="utf-8", errors="replace")
