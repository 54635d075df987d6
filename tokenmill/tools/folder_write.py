"""Writing a model folder in one piece: into a staging folder beside its destination, then renamed into
place, so an interrupted write (`tokenmill convert`, `tokenmill quantize`) leaves no half-written model."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def write_folder(out: Path, write: Callable[[Path], None]) -> Path:
    """`write(staging)` fills a fresh folder; it then replaces `out` (returned)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        write(staging)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out
