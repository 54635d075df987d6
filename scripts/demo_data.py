"""The demo models' data: the CPython standard library's Python sources (PSF license), split by file
into training and held-out sets by a hash of each file's path (5% held out: tokenmill/eval/stdlib_text.py,
which `tokenmill eval-quant` reads too), and turned into token streams (`<s>` file `</s>`, as the
engine's prompts start with `<s>`). Shared by the training script and the held-out evaluation
(benchmarks/demo_models.py)."""

from __future__ import annotations

from typing import Any

import numpy as np

from tokenmill.eval.stdlib_text import HELD_OUT_EVERY, STDLIB, is_held_out, read, split, stdlib_files

__all__ = ["HELD_OUT_EVERY", "STDLIB", "is_held_out", "read", "split", "stdlib_files", "token_stream"]


def token_stream(tokenizer: Any, files: list[str]) -> np.ndarray:
    """Every file as `<s>` + its tokens + `</s>`, concatenated: int32 [total tokens]."""
    eos = tokenizer.token_to_id("</s>")
    parts = []
    for batch_start in range(0, len(files), 64):
        batch = [read(f) for f in files[batch_start : batch_start + 64]]
        for enc in tokenizer.encode_batch(batch):  # the post-processor adds <s>
            parts.append(np.asarray([*enc.ids, eos], dtype=np.int32))
    return np.concatenate(parts)
