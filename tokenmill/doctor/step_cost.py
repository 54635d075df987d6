"""The step-cost model: what one engine step costs on this machine, by what the step runs; and its probe.

A step's wall time (schedule, forward, sampling, detokenizing: all of `LLMEngine.step`) is predicted
from the chunks it runs, each a (query length q, start position s):
- a step whose every chunk decodes one token (B requests): the measured decode curve D(B);
- any other step (prompt chunks, alone or with decodes): the measured one-request prompt curve P(T) at
  its T tokens, plus `per_request` for each request after the first;
plus attention beyond what the probe's steps had: a decoding chunk reads its s + 1 keys
(`per_decode_key` in a step of decodes only, `per_mixed_key` beside prompt chunks: memory-bound, K and
V read once per query), a prompt chunk scores its q s + q (q + 1) / 2 query-key pairs
(`per_prompt_pair`: many queries share each key read).
And what a step costs because of those before: the first decode-only step after a step that ran T prompt
tokens costs `after_prompt(T)` more than the same step among decode steps, the next one `after_prompt_decay`
times that, and so on for AFTER_DECAY_STEPS steps (measured, whatever its cause: most likely the caches
the prompt step's activations took over, which the decode steps fill back with the weights). With outputs
of a few tokens, as in code completion, most inter-token gaps are such steps. `StepCost.predict` prices a
step alone; the simulator and the step log add this term from the steps before.
Curves are piecewise linear in T (B) between the probed points, extended along their last segment,
and made non-decreasing (a busy moment during the probe must not make more tokens look cheaper).

`probe` measures them on a live engine (`probe_seconds` records how long): one-request prompts of 1 ..
max_num_batched_tokens tokens (each alone in its step), B requests decoding at a short context for
B = 1 .. max_num_seqs, a few at a long context (the decode attention term), one long prompt's chunks
at start 0 and at start one budget (the prompt attention term), and a prompt chunk run beside a few
decoding requests at a short and at a long context (the mixed steps' terms); random distinct prompts,
so the prefix cache never answers; medians of repeats; and the first decode step after one-request
prompts of 32 .. budget tokens against the same request's later decode steps (paired: the after-prompt
term). Where no chunk can join running requests (static batching) the mixed terms are not measured: 0
per request (a step's cost follows its tokens, not how many prompts they come in), decode attention's
per key. Nothing else should run on the
machine meanwhile.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.engine.engine import LLMEngine
    from tokenmill.outputs import SchedulerOutput
    from tokenmill.request import Request

AFTER_STEPS = 10  # decode steps the probe times after a prompt step: the first few, and the last four as steady
AFTER_DECAY_STEPS = 4  # decode steps after a prompt step that cost more (the after-prompt term); 0 after those


class CostModel(Protocol):
    def predict(self, chunks: Sequence[tuple[int, int]], decoding: bool) -> float:
        """Seconds for a step of these chunks ((query length, start position) each); `decoding`: every
        chunk decodes one token."""
        ...


def step_chunks(scheduled: SchedulerOutput, requests: Mapping[str, Request]) -> tuple[list[tuple[int, int]], bool]:
    """A scheduled step as the cost model takes it: its chunks as (query length, start position), and
    whether every chunk decodes one token (a chunk of one token past its request's prompt)."""
    chunks = [(len(c.token_ids), c.start_position) for c in scheduled.chunks]
    decoding = all(
        len(c.token_ids) == 1 and c.start_position >= requests[c.request_id].num_prompt_tokens for c in scheduled.chunks
    )
    return chunks, decoding


def after_prompt(cost: CostModel, tokens: int, since: int = 0) -> float:
    """What `cost` adds to a decode-only step that follows, by `since` decode-only steps, a step of `tokens`
    prompt tokens (0 with a cost model that does not price the steps before, as `StepCost.after_prompt` does)."""
    price = getattr(cost, "after_prompt", None)
    return float(price(tokens, since)) if price is not None and tokens > 0 else 0.0


def decode_keys(chunks: Sequence[tuple[int, int]]) -> float:
    """Keys the decoding chunks (query length 1) read: chunks as (query length, start position)."""
    return sum(s + 1 for q, s in chunks if q == 1)


def prompt_pairs(chunks: Sequence[tuple[int, int]]) -> float:
    """Query-key pairs the other chunks score."""
    return sum(q * s + q * (q + 1) / 2 for q, s in chunks if q > 1)


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
    per_decode_key: float  # seconds per key a decoding chunk reads (in a step of decodes only)
    per_prompt_pair: float  # seconds per query-key pair a prompt chunk scores
    per_mixed_key: float  # seconds per key a decoding chunk reads in a step with prompt chunks
    probe_seconds: float = 0.0  # what the probe took
    notes: list[str] = field(default_factory=list)
    calibration: dict[str, float] = field(default_factory=dict)  # factors a run of the trace set (calibrate.py)
    after_prompt_tokens: list[int] = field(default_factory=list)  # tokens of the prompt step before ...
    after_prompt_seconds: list[float] = field(default_factory=list)  # ... what the first decode step costs more
    after_prompt_decay: float = 0.0  # each next decode step's extra over the one before's (AFTER_DECAY_STEPS in all)

    def predict(self, chunks: Sequence[tuple[int, int]], decoding: bool) -> float:
        """Seconds for a step of these chunks ((query length, start position) each); `decoding`: every
        chunk decodes one token."""
        if decoding:
            work = self.per_decode_key * decode_keys(chunks)
            return interpolate(self.decode_batch, self.decode_seconds, len(chunks)) + work
        work = self.per_mixed_key * decode_keys(chunks) + self.per_prompt_pair * prompt_pairs(chunks)
        tokens = sum(q for q, _ in chunks)
        prompt = interpolate(self.prompt_tokens, self.prompt_seconds, tokens)
        return prompt + self.per_request * (len(chunks) - 1) + work

    def after_prompt(self, tokens: int, since: int = 0) -> float:
        """Seconds a decode-only step costs beyond a steady one when `since` decode-only steps separate it
        from a step of `tokens` prompt tokens: for the first (since 0) linear from 0 at 0 tokens through the
        probed points, then decaying by `after_prompt_decay` a step; 0 from AFTER_DECAY_STEPS on."""
        if tokens <= 0 or since >= AFTER_DECAY_STEPS or not self.after_prompt_tokens:
            return 0.0
        first = interpolate([0, *self.after_prompt_tokens], [0.0, *self.after_prompt_seconds], tokens)
        return first * self.after_prompt_decay**since

    def decode_step(self, batch: int, context: int) -> float:
        """Seconds for a step of `batch` requests decoding at `context` tokens each."""
        return self.predict([(1, context)] * batch, decoding=True)


def monotone(values: Sequence[float]) -> list[float]:
    """The non-decreasing sequence nearest `values` in squared error (pool adjacent violators): a step of
    more tokens never costs less, and one disturbed measurement is averaged with its neighbours rather
    than kept."""
    blocks: list[list[float]] = []  # [sum, count]
    for v in values:
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [b[0] / b[1] for b in blocks for _ in range(int(b[1]))]


def fine_grid(limit: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, 32, 48, 64, 96, ... below `limit`, and `limit` (step costs bend between powers
    of two: kernels switch at row counts, and pad)."""
    out = set(grid(limit)) | {x * 3 // 2 for x in grid(limit) if x >= 16 and x * 3 // 2 < limit}
    return sorted(out)


def grid(limit: int, start: int = 1) -> list[int]:
    """start, 2 start, 4 start, ... below `limit`, and `limit`."""
    out, x = [], start
    while x < limit:
        out.append(x)
        x *= 2
    return [*out, limit]


def fit_context(max_model_len: int, want: int, batch: int, budget: int, extra: int) -> int:
    """The longest context up to `want` at which `batch` requests, each asked for the steps their
    prompts take (`batch * context / budget`, rounded up) plus `extra` tokens, fit the model's length:
    context + those tokens <= max_model_len. At least 1 (a binary search: the total grows with it)."""

    def fits(context: int) -> bool:
        return context + -(-batch * context // budget) + extra <= max_model_len

    low, high = 1, max(1, want)
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


HEARTBEAT_S = 10.0  # a long phase of the probe or the calibration says where it is at least this often


class Heartbeat:
    """A long phase's progress: `beat(text)` says `text()` when `every` seconds (HEARTBEAT_S) have passed
    since the last line (`said` marks one said elsewhere, a phase's own)."""

    def __init__(
        self,
        progress: Callable[[str], None],
        every: float | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.progress, self.every, self.clock = progress, HEARTBEAT_S if every is None else every, clock
        self.last = clock()

    def said(self) -> None:
        self.last = self.clock()

    def beat(self, text: Callable[[], str]) -> None:
        if self.clock() - self.last >= self.every:
            self.progress(text())
            self.said()


class Prober:
    """Random distinct prompts into an idle engine, and its steps timed one by one (`heartbeat`, if
    given, beaten after each: the probe's progress inside a phase)."""

    def __init__(self, engine: LLMEngine, seed: int, heartbeat: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.rng = random.Random(seed)
        self.count = 0
        self.steps = 0  # steps timed
        self.heartbeat = heartbeat
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
        self.steps += 1
        if self.heartbeat is not None:
            self.heartbeat()
        last = self.engine.last_step
        return seconds, last.num_running, last.num_batched_tokens

    def drain(self) -> list[tuple[float, int, int]]:
        steps = []
        while self.engine.has_unfinished_requests():
            steps.append(self.step())
        return steps

    def decode(self, batch: int, context: int, budget: int, repeats: int) -> float:
        """Median forward time (runs off) of `batch` requests all decoding at about `context` tokens (nan if no step
        had them all decoding); their prompts take several steps when they exceed the `budget`, so each
        generates long enough that all decode at once."""
        prompt_steps = -(-batch * context // budget)
        for _ in range(batch):
            self.add(context, prompt_steps + 2 + 2 * repeats)
        with forward_a_step(self.engine):
            times = [s for s, running, tokens in self.drain() if running == batch and tokens == batch]
        return statistics.median(times) if times else float("nan")


@contextmanager
def forward_a_step(engine: LLMEngine) -> Iterator[None]:
    """`engine`'s scheduler grants no decode runs (`decode_steps` 1) within the block: what the probe and
    the stall time is a forward a step, the simulator's unit (a run's saving shows in calibration)."""
    scheduler = engine.core.scheduler
    granted = scheduler.config
    scheduler.config = dataclasses.replace(granted, decode_steps=1)
    try:
        yield
    finally:
        scheduler.config = granted


def probe(
    engine: LLMEngine,
    repeats: int = 3,
    long_context: int = 1024,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> StepCost:
    """Measure the curves on `engine` (idle; prefix caching does not matter: the prompts are random), a
    forward a step; `progress` is told each phase as it starts, the steps timed every HEARTBEAT_S
    seconds within one, and the end."""
    with forward_a_step(engine):
        return _probe(engine, repeats, long_context, seed, progress)


def _probe(
    engine: LLMEngine, repeats: int, long_context: int, seed: int, progress: Callable[[str], None] | None
) -> StepCost:
    if engine.has_unfinished_requests():
        raise ValueError("engine: busy; the step-cost probe needs an idle engine")
    t0 = time.perf_counter()
    beat = Heartbeat(progress) if progress is not None else None

    def phase(n: int, text: str) -> None:
        if progress is not None and beat is not None:
            progress(f"probe {n}/4 ({time.perf_counter() - t0:.0f} s): {text}")
            beat.said()

    config = engine.config
    budget = min(config.max_num_batched_tokens, engine.max_model_len - 1)
    p = Prober(engine, seed)
    if beat is not None:
        p.heartbeat = lambda: beat.beat(lambda: f"probe ({time.perf_counter() - t0:.0f} s): {p.steps} steps timed")
    p.add(min(32, budget), 4)  # warm-up
    p.drain()
    phase(1, f"prompt steps of 1 .. {budget} tokens")
    prompt_points, prompt_raw = _prompt_curve(p, budget, repeats)
    short = 16
    phase(2, f"decode steps of 1 .. {config.max_num_seqs} requests")
    measured = [(b, p.decode(b, short, budget, repeats)) for b in grid(config.max_num_seqs)]
    batches = [b for b, t in measured if t == t]  # (a batch whose steps never all decoded: dropped)
    decode_raw = [t for _, t in measured if t == t]
    notes: list[str] = []
    # decode attention: a few requests decoding at a long context against the same at the short one
    per_key = 0.0
    b = min(8, config.max_num_seqs)
    long_context = fit_context(engine.max_model_len, long_context, b, budget, 2 + 2 * repeats)
    phase(3, "attention at a long context")
    if long_context > 4 * short:
        slow, fast = p.decode(b, long_context, budget, repeats), interpolate(batches, decode_raw, b)
        per_key = max(0.0, (slow - fast) / (b * (long_context - short))) if slow == slow else 0.0
    else:
        notes.append(f"no long-context probe (max_model_len {engine.max_model_len}): decode attention taken as 0")
    per_pair = _prompt_attention(p, budget, repeats, engine.max_model_len, notes)
    prompt_seconds = [
        max(0.0, t - per_pair * prompt_pairs([(n, 0)])) for n, t in zip(prompt_points, prompt_raw, strict=True)
    ]
    decode_seconds = [max(0.0, t - per_key * n * (short + repeats)) for n, t in zip(batches, decode_raw, strict=True)]
    phase(4, "prompt chunks beside decoding requests")
    mixed = _Mixed(p, min(8, config.max_num_seqs - 1), budget, repeats, prompt_points, prompt_seconds)
    mixed_context = fit_context(engine.max_model_len, long_context, mixed.b, budget, 4 + 4 * repeats)
    per_request, per_mixed_key = mixed.costs(short, mixed_context, per_key)
    top = min(budget, engine.max_model_len - AFTER_STEPS - 1)
    after_tokens, after_seconds, decay = _after_prompt(p, top, max(5, repeats))
    if progress is not None:
        progress(f"probe done in {time.perf_counter() - t0:.0f} s")
    return StepCost(
        prompt_points,
        monotone(prompt_seconds),
        batches,
        monotone(decode_seconds),
        per_request,
        per_key,
        per_pair,
        per_mixed_key,
        time.perf_counter() - t0,
        notes,
        after_prompt_tokens=after_tokens,
        after_prompt_seconds=after_seconds,
        after_prompt_decay=decay,
    )


def _after_prompt(p: Prober, top: int, repeats: int) -> tuple[list[int], list[float], float]:
    """The first AFTER_DECAY_STEPS decode steps after a one-request prompt of T tokens (T = 32, 64, ... up to
    `top`), each beyond the median of the same request's last four decode steps (paired: the machine's
    mood of the moment cancels): (the T, the first step's median extra seconds, made non-decreasing in T,
    and how the extra decays a step: the next steps' summed median extras over the steps' before, pooled
    over T, within 0 .. 0.9). Nothing below 32 tokens."""
    points = grid(top, 32) if top >= 32 else []
    extra: dict[int, list[list[float]]] = {tokens: [] for tokens in points}
    for _ in range(repeats):
        for tokens in p.rng.sample(points, len(points)):
            p.add(tokens, 1 + AFTER_STEPS)  # (its first token comes from the prompt step)
            decodes = [seconds for seconds, _, batched in p.drain() if batched == 1]
            if len(decodes) == AFTER_STEPS:
                steady = statistics.median(decodes[-4:])
                extra[tokens].append([t - steady for t in decodes[:AFTER_DECAY_STEPS]])
    kept = [t for t in points if extra[t]]
    medians = [[max(0.0, statistics.median(x[j] for x in extra[t])) for j in range(AFTER_DECAY_STEPS)] for t in kept]
    earlier = sum(sum(m[:-1]) for m in medians)
    decay = min(0.9, sum(sum(m[1:]) for m in medians) / earlier) if earlier > 0 else 0.0
    return kept, monotone([m[0] for m in medians]), decay


def _prompt_curve(p: Prober, budget: int, repeats: int) -> tuple[list[int], list[float]]:
    """One-request prompts over a fine grid of lengths: (lengths, median step seconds).

    The grid runs in a new order each round and each round one token shorter: every step a length the
    engine has not run and another length just before it, as a server meets them (a length met again,
    right after itself, runs faster: benchmarks/prompt_lengths.py; oneDNN's kernel for that row count
    built, the caches warm with its shapes)."""
    prompt_points = fine_grid(budget)
    times: dict[int, list[float]] = {tokens: [] for tokens in prompt_points}
    for shorter in range(repeats):
        for tokens in p.rng.sample(prompt_points, len(prompt_points)):
            p.add(max(1, tokens - shorter), 1)
            times[tokens].append(p.drain()[0][0])
    return prompt_points, [statistics.median(times[tokens]) for tokens in prompt_points]


def _prompt_attention(p: Prober, budget: int, repeats: int, max_model_len: int, notes: list[str]) -> float:
    """Prompt attention per (query, key) pair: a long prompt's second chunk (start = budget) against its
    first (start 0); 0, with a note, where the context is too short to measure it."""
    if not (3 * budget < max_model_len and budget >= 64):
        notes.append(f"no long-prompt probe (max_model_len {max_model_len}): prompt attention taken as 0")
        return 0.0
    extra = []
    for _ in range(repeats):
        p.add(3 * budget, 1)
        steps = p.drain()
        extra.append(steps[1][0] - steps[0][0])
    return max(0.0, statistics.median(extra) / (budget * budget))


class _Mixed:
    """Mixed steps (a prompt chunk beside b decoding requests: the general path, not the decode one):
    what they cost beyond P(T) and the chunk's attention, at a short and at a long context: the
    decoding rows' attention per key there, and a cost per request."""

    def __init__(
        self, p: Prober, b: int, budget: int, repeats: int, prompt_points: list[int], prompt_seconds: list[float]
    ) -> None:
        self.p, self.b, self.budget, self.repeats = p, b, budget, repeats
        self.chunk = min(256, budget - b)
        self.prompt_points, self.prompt_seconds = prompt_points, prompt_seconds

    def costs(self, short: int, long_context: int, per_key: float) -> tuple[float, float]:
        """(cost per request, attention per key) of the decoding rows in a mixed step."""
        per_request, per_mixed_key = 0.0, per_key
        if self.b >= 1 and self.chunk >= 16:
            near = self.residual(short)
            if long_context > 4 * short:
                far = self.residual(long_context)
                if far == far and near == near:
                    per_mixed_key = max(0.0, (far - near) / (self.b * (long_context - short)))
            if near == near:
                per_request = max(0.0, (near - per_mixed_key * self.b * (short + 2 * self.repeats)) / self.b)
        return per_request, per_mixed_key

    def residual(self, context: int) -> float:
        """What a mixed step costs beyond the same chunk alone and the curve's price of b more rows: the
        chunk alone is timed just before (paired, so the chunk's attention and the machine's mood of
        the moment cancel), then beside b requests decoding at about `context` tokens."""
        p, b, chunk, repeats = self.p, self.b, self.chunk, self.repeats
        alone = []
        for shorter in range(repeats):
            p.add(chunk - shorter, 1)
            alone.append(p.drain()[0][0])
        prompt_steps = -(-b * context // self.budget)
        for _ in range(b):
            p.add(context, prompt_steps + 4 + 4 * repeats)
        while True:
            _, running, tokens = p.step()
            if running == b and tokens == b:
                break
        rows = interpolate(self.prompt_points, self.prompt_seconds, chunk + b)
        rows -= interpolate(self.prompt_points, self.prompt_seconds, chunk)
        residuals = []
        for shorter in range(repeats):
            p.add(chunk - shorter, 1)
            seconds, running, tokens = p.step()
            if running == b + 1 and tokens == b + chunk - shorter:
                residuals.append(seconds - statistics.median(alone) - rows)
            p.step()
        p.drain()
        return statistics.median(residuals) if residuals else float("nan")
