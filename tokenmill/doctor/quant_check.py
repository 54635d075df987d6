"""Question 1's measurements of a quantization: its speed at the trace's batch, and its quality.

A way of storing the weights is judged where the trace runs: the engine is built with it (as `serve`
would) and timed on decode steps at the trace's own decode batch (the median of the replay's steps),
against the same steps of 16-bit weights. Weight-only quantization reads fewer bytes a step but
dequantizes; at a batch where a step is not bound by reading the weights it can bring no speed-up,
the pitfall the doctor names. The quality of a recommended quantization is `tokenmill eval-quant`'s
(perplexity and top-1 agreement against the unquantized model on held-out text, a few windows).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.doctor.step_cost import Prober

CONTEXT = 128


def decode_seconds(config: EngineConfig, batch: int, repeats: int = 3) -> float:
    """Median time of a decode step of `batch` requests at about CONTEXT tokens, on an engine built
    with `config` (loaded here, dropped after)."""
    from tokenmill.engine.engine import LLMEngine

    engine = LLMEngine(dataclasses.replace(config, enable_prefix_caching=False))
    p = Prober(engine, seed=1)
    p.add(16, 4)  # warm-up
    p.drain()
    batch = max(1, min(batch, config.max_num_seqs))
    return p.decode(batch, CONTEXT, config.max_num_batched_tokens, repeats)


def speed_lines(config: EngineConfig, storages: dict[str, dict[str, Any]], batch: int) -> dict[str, float]:
    """storage -> seconds a decode step at `batch`, each storage's settings applied to `config`."""
    return {name: decode_seconds(dataclasses.replace(config, **settings), batch) for name, settings in storages.items()}


def quality_line(model: str, method: str, windows: int = 4, length: int = 256) -> str:
    """eval-quant's verdict on `method` for `model`, in one line."""
    from tokenmill.eval.quant_eval import evaluate
    from tokenmill.quant.quantize import QuantSpec

    report = evaluate(model, QuantSpec(method), "auto", None, windows, length)
    return (
        f"{method} quality (tokenmill eval-quant, {windows} windows of {length} tokens): perplexity "
        f"{report.perplexity_unquantized:.3f} -> {report.perplexity_quantized:.3f} "
        f"({100 * report.perplexity_change:+.2f}%)"
    )
