"""Question 6's stall, measured: what prompts arriving as in the trace do to the tokens of requests
already decoding, in one engine.

`measure_stall` runs, on the engine with the current settings, `batch` requests decoding at a given
context (the trace's decode batch and a context from its prompts), and times their steps twice: a run
of steps with nothing else to do (every step decodes one token for each: the inter-token time without
prefills), then as many steps with prompts arriving before a share of them (the share of the replay's
steps that carried a prompt chunk; the trace's prompt lengths in order, random tokens so that the
prefix cache never answers, each generating one token), where every step still gives each decoding
request its token: the inter-token time with prefills. The two distributions' p50 and p99 say how
much prefills stall the decodes, from the machine and not from the cost model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from tokenmill.doctor.step_cost import Prober, fit_context, forward_a_step

if TYPE_CHECKING:
    from tokenmill.engine.engine import LLMEngine


@dataclass
class StallMeasurement:
    batch: int  # requests decoding
    context: int  # their prompt tokens
    prompt_share: float  # share of the second run's steps a prompt arrived before
    prompts: int  # prompts that arrived
    decode_only_ms: list[float]  # the first run's step times: decodes only
    with_prompts_ms: list[float]  # the second run's step times: the same decodes, prompts arriving

    def p(self, which: str, q: float) -> float:
        """Percentile q (0-100) of the step times with (`which` = "with") or without ("without") prompts."""
        times = self.with_prompts_ms if which == "with" else self.decode_only_ms
        return float(np.percentile(times, q))


def measure_stall(
    engine: LLMEngine, prompt_lens: Sequence[int], batch: int, share: float, context: int, steps: int = 48
) -> StallMeasurement | None:
    """`batch` requests decoding at `context` tokens, `steps` steps of decodes only, then `steps` with a
    prompt of the trace's next length (`prompt_lens`, cycled) arriving before `share` of them, a forward
    a step; None where they never all decode in one step (a cache too small for them)."""
    with forward_a_step(engine):
        return _measure(engine, prompt_lens, batch, share, context, steps)


def _measure(
    engine: LLMEngine, prompt_lens: Sequence[int], batch: int, share: float, context: int, steps: int
) -> StallMeasurement | None:
    if engine.has_unfinished_requests():
        raise ValueError("engine: busy; the stall is measured on an idle engine")
    config = engine.config
    batch = max(1, min(batch, config.max_num_seqs - 1))
    budget = min(config.max_num_batched_tokens, engine.max_model_len - 1)
    longest = engine.max_model_len - 2
    context = fit_context(engine.max_model_len, context, batch, budget, 2 * steps + 8)
    prober = Prober(engine, seed=2)
    prompt_steps = -(-batch * context // budget)
    for _ in range(batch):
        prober.add(context, prompt_steps + 2 * steps + 8)
    for _ in range(prompt_steps + 16):  # to where every request decodes
        _, running, tokens = prober.step()
        if running == batch and tokens == batch:
            break
    else:  # (a cache too small to hold them all)
        prober.drain()
        return None
    alone = []
    for _ in range(steps):
        seconds, running, tokens = prober.step()
        alone.append(seconds * 1e3)
    mixed, due, arrived = [], 0.0, 0
    lengths = [min(max(1, n), longest) for n in prompt_lens] or [budget]
    for _ in range(steps):
        due += share
        if due >= 1:
            due -= 1
            prober.add(lengths[arrived % len(lengths)], 1)
            arrived += 1
        seconds, _, _ = prober.step()
        mixed.append(seconds * 1e3)
    prober.drain()
    return StallMeasurement(batch, context, share, arrived, alone, mixed)
