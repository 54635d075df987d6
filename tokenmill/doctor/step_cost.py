"""The step-cost model: what one engine step costs on this machine, by what the step runs; and its probe.

A step's wall time (schedule, forward, sampling, detokenizing: all of `LLMEngine.step`) is predicted
from the chunks it runs, each a (query length q, start position s):
- a step whose every chunk decodes one token (B requests): the measured decode curve D(B), plus
  `per_attention` x the attention work beyond what the probe's steps of B had;
- any other step (prompt chunks, alone or with decodes): the measured one-request prompt curve P(T) at
  its T tokens, plus `per_request` for each request after the first, plus the attention work beyond
  the probe's;
where the attention work of a chunk is the query-key pairs it scores, q x s + q (q + 1) / 2.
Curves are piecewise linear in T (B) between the probed points, extended along their last segment.

`probe` measures them on a live engine in a few seconds: one-request prompts of 1 .. max_num_batched_tokens
tokens (each alone in its step), B requests decoding at a short context for B = 1 .. max_num_seqs, the
same B at a long context (the attention term), and R short prompts in one step (the per-request
term); random distinct prompts, so the prefix cache never answers; the median of repeats.
"""

from __future__ import annotations

import random
import statistics
import time
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.engine.engine import LLMEngine


def attention_work(chunks: Sequence[tuple[int, int]]) -> float:
    """Query-key pairs a step scores: chunks as (query length, start position)."""
    return sum(q * s + q * (q + 1) / 2 for q, s in chunks)


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise linear through (xs, ys) (xs ascending), extended along the first and last segments."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclass
class StepCost:
    prompt_tokens: list[int]  # P's points: tokens of a one-request prompt step
    prompt_seconds: list[float]  # P(T), the probe's attention work taken out
    decode_batch: list[int]  # D's points: requests decoding
    decode_seconds: list[float]  # D(B), the probe's attention work taken out
    per_request: float  # seconds for each request after the first in a prompt step
    per_attention: float  # seconds per query-key pair
    probe_seconds: float = 0.0  # what the probe took
    notes: list[str] = field(default_factory=list)

    def predict(self, chunks: Sequence[tuple[int, int]], decoding: bool) -> float:
        """Seconds for a step of these chunks ((query length, start position) each); `decoding`: every
        chunk decodes one token."""
        work = self.per_attention * attention_work(chunks)
        if decoding:
            return interpolate(self.decode_batch, self.decode_seconds, len(chunks)) + work
        tokens = sum(q for q, _ in chunks)
        prompt = interpolate(self.prompt_tokens, self.prompt_seconds, tokens)
        return prompt + self.per_request * (len(chunks) - 1) + work

    def decode_step(self, batch: int, context: int) -> float:
        """Seconds for a step of `batch` requests decoding at `context` tokens each."""
        return self.predict([(1, context)] * batch, decoding=True)


def grid(limit: int, start: int = 1) -> list[int]:
    """start, 2 start, 4 start, ... below `limit`, and `limit`."""
    out, x = [], start
    while x < limit:
        out.append(x)
        x *= 2
    return [*out, limit]


class _Prober:
    def __init__(self, engine: LLMEngine, seed: int) -> None:
        self.engine = engine
        self.rng = random.Random(seed)
        self.count = 0
        vocab = engine.model_config.vocab_size
        self.low, self.high = min(100, vocab - 1), vocab - 1

    def add(self, prompt_len: int, max_tokens: int) -> None:
        self.count += 1
        prompt = [self.rng.randint(self.low, self.high) for _ in range(prompt_len)]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.engine.add_request(f"probe-{self.count}", prompt, params)

    def step(self) -> tuple[float, int, int]:
        """One timed step: (seconds, requests in it, tokens it ran)."""
        start = time.perf_counter()
        self.engine.step()
        seconds = time.perf_counter() - start
        last = self.engine.last_step
        return seconds, last.num_running, last.num_batched_tokens

    def drain(self) -> list[tuple[float, int, int]]:
        steps = []
        while self.engine.has_unfinished_requests():
            steps.append(self.step())
        return steps


def probe(engine: LLMEngine, repeats: int = 3, long_context: int = 1024, seed: int = 0) -> StepCost:
    """Measure the curves on `engine` (idle; prefix caching does not matter: the prompts are random)."""
    if engine.has_unfinished_requests():
        raise ValueError("engine: busy; the step-cost probe needs an idle engine")
    t0 = time.perf_counter()
    config = engine.config
    budget = min(config.max_num_batched_tokens, engine.max_model_len - 1)
    p = _Prober(engine, seed)
    p.add(min(32, budget), 4)  # warm-up
    p.drain()
    # attention work per step is known exactly from the probe's shapes
    prompt_points, prompt_seconds = [], []
    for tokens in grid(budget):
        times = []
        for _ in range(repeats):
            p.add(tokens, 1)
            times.append(p.drain()[0][0])
        prompt_points.append(tokens)
        prompt_seconds.append(statistics.median(times))
    short = 16

    def decode(batch: int, context: int) -> float:
        for _ in range(batch):
            p.add(context, 2 + 2 * repeats)
        times = [s for s, running, tokens in p.drain() if running == batch and tokens == batch]
        return statistics.median(times) if times else float("nan")

    measured = [(b, decode(b, short)) for b in grid(config.max_num_seqs)]
    batches = [b for b, t in measured if t == t]  # (a batch whose steps never all decoded: dropped)
    decode_raw = [t for _, t in measured if t == t]
    # the attention term: a few requests decoding at a long context against the same at the short one
    notes = []
    per_attention = 0.0
    long_context = min(long_context, engine.max_model_len - 2 - 2 * repeats)
    b = min(8, config.max_num_seqs)
    if long_context > 4 * short:
        slow = decode(b, long_context)
        fast = interpolate(batches, decode_raw, b)
        extra = attention_work([(1, long_context + repeats)] * b) - attention_work([(1, short + repeats)] * b)
        per_attention = max(0.0, (slow - fast) / extra)
    else:
        notes.append(f"no long-context probe (max_model_len {engine.max_model_len}): attention cost taken as 0")
    prompt_seconds = [
        max(0.0, t - per_attention * attention_work([(n, 0)]))
        for n, t in zip(prompt_points, prompt_seconds, strict=True)
    ]
    decode_seconds = [
        max(0.0, t - per_attention * attention_work([(1, short + repeats)] * n))
        for n, t in zip(batches, decode_raw, strict=True)
    ]
    # the per-request term: R short prompts computed in one step against one prompt of their tokens
    rates = []
    for requests in (4, 16):
        if requests > config.max_num_seqs or requests * short > budget:
            continue
        times = []
        for _ in range(repeats):
            for _ in range(requests):
                p.add(short, 1)
            first = p.drain()[0]
            if first[1] == requests:
                times.append(first[0])
        if times:
            one = interpolate(prompt_points, prompt_seconds, requests * short)
            work = per_attention * attention_work([(short, 0)] * requests)
            rates.append(max(0.0, (statistics.median(times) - one - work) / (requests - 1)))
    per_request = statistics.median(rates) if rates else 0.0
    return StepCost(
        prompt_points,
        prompt_seconds,
        batches,
        decode_seconds,
        per_request,
        per_attention,
        time.perf_counter() - t0,
        notes,
    )
