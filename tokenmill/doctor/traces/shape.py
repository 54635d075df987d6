"""A parsed trace made into a workload the doctor replays: arrivals re-based and time-scaled, lengths scaled
and clipped to the model's context, and prompts made of token blocks that share exactly as the trace's
block ids do.

- Time: a row's arrival, minus the window's start, times `--time-scale` (0.5: the window in half the
  time, twice the rate).
- Lengths: prompt and output lengths (and the tokens a block id covers) times `--length-scale` (a
  number; `fit`: the factor at which the window's 99th-percentile request, prompt + output, fits
  max_model_len), each at least 1; then clipped: a prompt to max_model_len - 1 tokens (its head kept,
  so shared prefixes stay shared), an output to what is left of max_model_len. How many requests and
  tokens were clipped is stated in the report; nothing is refused for its length.
- Prompts: block k of a prompt is the tokens of its k-th block id (`BlockTokens`: random ids drawn from
  a generator seeded by the id, the same list for the same id), cut to what of the prompt falls in
  that block; a prompt without ids (Azure, BurstGPT), or beyond its ids, gets tokens of its own. Equal
  ids give equal blocks, distinct ids distinct ones, so the replay's prefix cache meets the trace's
  sharing at the trace's block granularity. A recorded trace's token ids are used as they are (clipped,
  never scaled).
- The trace's own block-level reuse: the share of prompt tokens in whole blocks whose id, and every id
  before it in the prompt, appeared in an earlier request (an unbounded cache of the trace's blocks),
  for the trace as read and as replayed.
"""

from __future__ import annotations

import hashlib
import math
import statistics
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np

from tokenmill.bench.workloads import BenchRequest, Workload, WorkloadSpec
from tokenmill.doctor.traces.rows import ParsedTrace, TraceRow, Window


@dataclass(frozen=True)
class Shaping:
    """How a parsed trace is fitted to the model (the doctor's trace flags)."""

    max_model_len: int
    vocab_size: int
    window: Window = field(default_factory=Window)
    time_scale: float = 1.0
    length_scale: float | None = 1.0  # None: "fit"
    seed: int = 0

    def __post_init__(self) -> None:
        if not (self.time_scale > 0 and math.isfinite(self.time_scale)):
            raise ValueError(f"--time-scale: must be a finite number above 0, got {self.time_scale}")
        if self.length_scale is not None and not (self.length_scale > 0 and math.isfinite(self.length_scale)):
            raise ValueError(f"--length-scale: must be a number above 0 or fit, got {self.length_scale}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len: at least 2 tokens to replay a trace, got {self.max_model_len}")


@dataclass
class TraceInfo:
    """What the report says about the trace beside its findings."""

    source: str
    notes: list[str] = field(default_factory=list)  # the report's preamble
    prefix_lines: list[str] = field(default_factory=list)  # question 2's evidence
    clipped_share: float = 0.0  # requests clipped to the model's context
    trace_reuse: float | None = None  # the trace's own block-level reuse, as read (None: no block ids)
    hash_block: int | None = None  # the tokens a block id covers, as read (None: no block ids)
    block_tokens: int | None = None  # ... and as replayed (lengths scaled)
    length_scale: float = 1.0  # the factor lengths were scaled by

    def block_warning(self, kv_block: int, replayed_share: float | None) -> str | None:
        """A pitfall when a block id, scaled, covers fewer tokens than a KV block: the replay's cache then
        shares only the whole KV blocks inside a common prefix of ids, so it finds less reuse than the
        trace holds (None when the scaled block is a KV block or more)."""
        if self.hash_block is None or self.block_tokens is None or self.block_tokens >= kv_block:
            return None
        smaller = 1 << (self.block_tokens.bit_length() - 1)  # the largest power of 2 within a block id
        hit = f"{replayed_share:.1%}" if replayed_share is not None else "the replayed hit rate"
        own = f"{self.trace_reuse:.1%}" if self.trace_reuse is not None else "the trace's own"
        return (
            f"the trace's {self.hash_block}-token hash block is {self.block_tokens} tokens after --length-scale "
            f"x{self.length_scale:.4g}, smaller than a KV block ({kv_block} tokens): a KV block spans more than "
            f"one block id, so prefixes the trace shares cache less here ({hit} of prompt tokens replayed from "
            f"the cache against the trace's own {own}); replay with --block-size {smaller} or less (a KV "
            f"block within a block id) or scale lengths less (--length-scale {kv_block / self.hash_block:.4g} "
            "or more)"
        )


class BlockTokens:
    """Token ids for block ids: the same ids for the same block id, drawn at random in [low, vocab_size)."""

    def __init__(self, vocab_size: int, seed: int, shared: Counter[Hashable]) -> None:
        self.low = min(3, vocab_size - 1)  # (past the usual special tokens)
        self.vocab = np.array(range(vocab_size), dtype=object)  # ids as shared Python ints: a list costs pointers
        self.vocab_size, self.seed, self.shared = vocab_size, seed, shared
        self.cache: dict[Hashable, list[int]] = {}

    def block(self, key: Hashable, size: int) -> list[int]:
        """`size` token ids for `key` (kept when `key` is shared, as a prefix of any later size asked)."""
        held = self.cache.get(key)
        if held is not None and len(held) >= size:
            return held[:size] if len(held) > size else held
        digest = hashlib.blake2b(repr((self.seed, key)).encode(), digest_size=8).digest()
        rng = np.random.default_rng(int.from_bytes(digest, "little"))
        ids: list[int] = self.vocab[rng.integers(self.low, self.vocab_size, size)].tolist()
        if self.shared[key] > 1:
            self.cache[key] = ids
        return ids


def fit_factor(rows: Sequence[TraceRow], max_model_len: int) -> float:
    """`--length-scale fit`: the factor at which the 99th-percentile request (prompt + output) fits."""
    totals = sorted(r.prompt_len + r.output_len for r in rows)
    p99 = totals[min(len(totals) - 1, int(0.99 * len(totals)))]
    return min(1.0, max_model_len / p99)


def block_reuse(rows: Sequence[TraceRow], block: int, lengths: Sequence[int] | None = None) -> float:
    """The share of prompt tokens in whole blocks of `block` tokens whose ids, up to and including
    theirs, appeared in an earlier request (`lengths`: the prompts' lengths, if not the rows')."""
    seen: set[Hashable] = set()
    hits = total = 0
    for i, r in enumerate(rows):
        length = r.prompt_len if lengths is None else lengths[i]
        ids = (r.blocks or [])[: -(-length // block)]
        total += length
        whole = length // block
        k = 0
        while k < min(whole, len(ids)) and ids[k] in seen:
            k += 1
        hits += k * block
        seen.update(ids)
    return hits / total if total else 0.0


def shape(parsed: ParsedTrace, how: Shaping) -> tuple[Workload, TraceInfo]:
    """The workload the doctor replays for `parsed` (see the module docstring), and what to report."""
    rows = parsed.rows
    if not rows:
        raise ValueError(f"{parsed.source}: no requests in {how.window.describe()}")
    factor = fit_factor(rows, how.max_model_len) if how.length_scale is None else how.length_scale
    block = max(1, round(parsed.block_size * factor)) if parsed.block_size else None
    limit = how.max_model_len
    prompts, outputs, clipped_prompts, clipped_outputs = [], [], 0, 0
    for r in rows:
        exact = r.token_ids is not None
        p = r.prompt_len if exact else max(1, round(r.prompt_len * factor))
        o = r.output_len if exact else max(1, round(r.output_len * factor))
        if p + o > limit:  # the output keeps what the prompt leaves, at least a quarter of the context
            kept = min(o, max(1, limit - p, limit // 4))
            clipped_outputs += kept < o
            clipped_prompts += p > limit - kept
            p, o = min(p, limit - kept), kept
        prompts.append(p)
        outputs.append(o)
    shared = Counter(key for r in rows for key in set(r.blocks or []))
    tokens = BlockTokens(how.vocab_size, how.seed, shared)
    requests = []
    for i, r in enumerate(rows):
        ids = _prompt(r, i, prompts[i], block, tokens)
        arrival = (r.arrival_s - how.window.start) * how.time_scale
        requests.append(BenchRequest(i, outputs[i], prompt_token_ids=ids, arrival_s=arrival))
    spec = WorkloadSpec(parsed.source, num_requests=None, seed=how.seed)
    info = _info(parsed, how, factor, block, prompts, outputs, clipped_prompts, clipped_outputs)
    return Workload(spec, requests), info


def _prompt(r: TraceRow, index: int, length: int, block: int | None, tokens: BlockTokens) -> list[int]:
    if r.token_ids is not None:
        return list(r.token_ids[:length])
    if not r.blocks or block is None:
        return tokens.block(("request", index), length)
    ids: list[int] = []
    for k in range(-(-length // block)):
        key = r.blocks[k] if k < len(r.blocks) else ("request", index, k)
        ids += tokens.block(key, block)[: length - k * block]
    return ids


def _info(
    parsed: ParsedTrace,
    how: Shaping,
    factor: float,
    block: int | None,
    prompts: list[int],
    outputs: list[int],
    clipped_prompts: int,
    clipped_outputs: int,
) -> TraceInfo:
    rows = parsed.rows
    n = len(rows)
    span = max(r.arrival_s for r in rows) - min(r.arrival_s for r in rows)
    rate = f", {(n - 1) / (span * how.time_scale):.2f} requests/s" if span > 0 and n > 1 else ""
    read_prompts = [r.prompt_len for r in rows]
    read_outputs = [r.output_len for r in rows]
    notes = [
        f"Trace `{parsed.source}`: {n} requests, {how.window.describe()}"
        + (f", arrival times x{how.time_scale:g} (--time-scale)" if how.time_scale != 1 else "")
        + f"{rate}; as read: prompts p50 {statistics.median(read_prompts):.0f} (max {max(read_prompts)}), outputs "
        f"p50 {statistics.median(read_outputs):.0f} (max {max(read_outputs)}) tokens."
    ]
    if factor != 1:
        notes.append(
            f"Lengths scaled x{factor:.4g} (--length-scale{' fit' if how.length_scale is None else ''})"
            + (f"; a block id covers {block} tokens" if block else "")
            + "."
        )
    clipped = sum(1 for r, p, o in zip(rows, prompts, outputs, strict=True) if _clipped(r, p, o, factor))
    kept = sum(prompts) / max(1, sum(max(1, round(r.prompt_len * factor)) for r in rows))
    notes.append(
        f"Clipped to the model's context (max_model_len {how.max_model_len}): {clipped} of {n} requests "
        f"({clipped / n:.1%}): {clipped_prompts} prompts and {clipped_outputs} outputs cut; {kept:.1%} of the "
        "(scaled) prompt tokens replayed."
    )
    notes += [f"Reading the trace: {note}." for note in parsed.notes]
    notes += _measured(rows)
    info = TraceInfo(parsed.source, notes, clipped_share=clipped / n)
    if parsed.block_size and any(r.blocks for r in rows) and block is not None:
        info.trace_reuse = block_reuse(rows, parsed.block_size)
        info.hash_block, info.block_tokens, info.length_scale = parsed.block_size, block, factor
        replayed = block_reuse(rows, block, prompts)
        info.prefix_lines.append(
            f"the trace's own block-level reuse (its block ids, {parsed.block_size}-token blocks, an unbounded "
            f"cache): {info.trace_reuse:.1%} of prompt tokens as read; {replayed:.1%} as replayed (lengths scaled "
            "and clipped)"
        )
    elif any(r.token_ids is not None for r in rows):
        info.prefix_lines.append("the trace holds the prompts' token ids: replayed as they were served")
    else:
        info.prefix_lines.append(
            f"the trace ({parsed.source.partition(':')[0]}) has no prompt content: every prompt is replayed as "
            "distinct tokens, so no prefix reuse can be replayed"
        )
    return info


def _clipped(r: TraceRow, prompt: int, output: int, factor: float) -> bool:
    scale = 1.0 if r.token_ids is not None else factor
    return prompt < max(1, round(r.prompt_len * scale)) or output < max(1, round(r.output_len * scale))


def _measured(rows: Sequence[TraceRow]) -> list[str]:
    """What the server measured, for a recorded trace."""
    measured = [r.measured for r in rows if r.measured is not None]
    if not measured:
        return []
    ttft = [m.ttft_s * 1e3 for m in measured if m.ttft_s is not None]
    tpot = [m.tpot_s * 1e3 for m in measured if m.tpot_s is not None]
    prompt = sum(r.prompt_len for r in rows if r.measured is not None)
    cached = sum(m.cached_tokens for m in measured)
    parts = []
    if ttft:
        parts.append(f"TTFT p50 {_pct(ttft, 50):.0f} ms, p99 {_pct(ttft, 99):.0f} ms")
    if tpot:
        parts.append(f"TPOT p50 {_pct(tpot, 50):.1f} ms, p99 {_pct(tpot, 99):.1f} ms")
    parts.append(f"the prefix cache served {cached / max(1, prompt):.1%} of prompt tokens")
    return [f"As served (recorded by the server): {'; '.join(parts)}."]


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))
