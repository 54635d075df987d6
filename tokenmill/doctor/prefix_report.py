"""`tokenmill prefix-report`: why a trace of prompts does (or does not) hit the prefix cache.

Replays the prompts of a JSONL trace through the tokenizer and the block hasher alone, no model:
the hit rate an unbounded cache would reach, the hit rate of an LRU cache of the given size, and
the most frequent first-divergence points (where a prompt stops matching the closest earlier one)
with the text around them, so that "a timestamp at the top of the system prompt broke caching" or
"the shared prefix is shorter than one block" is shown, not guessed. Requests replay one at a
time, as a cache sees them when each finishes before the next arrives.
"""

from __future__ import annotations

import json
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tokenmill.core.block_hash import chain_hashes

COMPARE_WINDOW = 256  # earlier prompts a prompt is compared with, to find where it diverges
CONTEXT_TOKENS = 8  # tokens shown on each side of a divergence


class TextTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...
    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]: ...


@dataclass
class Divergence:
    position: int  # token index where the prompt first differs from the closest earlier prompt
    count: int
    before: str
    after: str  # text from the divergence on


@dataclass
class PrefixReport:
    prompts: int
    prompt_tokens: int
    block_size: int
    achievable_hit_tokens: int  # with an unbounded cache
    cache_blocks: int | None
    lru_hit_tokens: int
    divergences: list[Divergence] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def achievable_hit_rate(self) -> float:
        return self.achievable_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def lru_hit_rate(self) -> float:
        return self.lru_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def render(self) -> str:
        lines = [
            f"{self.prompts} prompts, {self.prompt_tokens} tokens, blocks of {self.block_size}",
            f"achievable hit rate (unbounded cache): {self.achievable_hit_rate:.1%}",
        ]
        if self.cache_blocks is not None:
            lines.append(f"hit rate with {self.cache_blocks} cached blocks (LRU): {self.lru_hit_rate:.1%}")
        if self.divergences:
            lines.append("most frequent first divergences from the closest earlier prompt:")
            for d in self.divergences:
                lines.append(f"  token {d.position} ({d.count} prompts): ...{d.before!r} | {d.after!r}...")
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)


def read_trace(path: Path, tokenizer: TextTokenizer | None) -> list[tuple[list[int], str | None]]:
    """(token ids, cache salt) per line: `prompt` (text or ids), `prompt_token_ids`, or `messages`."""
    out = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row: Any = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{n}: expected a JSON object")
        salt = row.get("cache_salt")
        ids = row.get("prompt_token_ids", row.get("prompt"))
        messages = row.get("messages")
        if isinstance(ids, list) and all(isinstance(t, int) for t in ids):
            out.append((list(ids), salt))
        elif not isinstance(ids, str) and not isinstance(messages, list):
            raise ValueError(f"{path}:{n}: field 'prompt', 'prompt_token_ids' or 'messages' is missing")
        elif tokenizer is None:
            raise ValueError(f"{path}:{n}: text prompts and messages need --tokenizer DIR")
        elif isinstance(ids, str):
            out.append((tokenizer.encode(ids), salt))
        else:
            out.append((tokenizer.apply_chat_template(messages), salt))
    return out


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def analyse(
    prompts: list[tuple[list[int], str | None]],
    block_size: int = 16,
    cache_blocks: int | None = None,
    tokenizer: TextTokenizer | None = None,
    top: int = 5,
) -> PrefixReport:
    if block_size < 1:
        raise ValueError(f"block_size: expected a positive integer, got {block_size}")
    seen: set[bytes] = set()
    lru: OrderedDict[bytes, None] = OrderedDict()
    achievable = lru_hits = total = 0
    positions: Counter[int] = Counter()
    examples: dict[int, tuple[list[int], int]] = {}
    longest_shared = 0
    for i, (ids, salt) in enumerate(prompts):
        total += len(ids)
        hashes = chain_hashes(ids, block_size, salt)
        usable = (len(ids) - 1) // block_size  # the last token is always computed
        achievable += block_size * next((k for k, h in enumerate(hashes[:usable]) if h not in seen), usable)
        hit = 0
        for h in hashes[:usable]:
            if h not in lru:
                break
            lru.move_to_end(h)
            hit += 1
        lru_hits += hit * block_size
        seen.update(hashes)
        for h in hashes:
            lru[h] = None
            lru.move_to_end(h)
        while cache_blocks is not None and len(lru) > cache_blocks:
            lru.popitem(last=False)
        if i == 0:
            continue
        earlier = prompts[max(0, i - COMPARE_WINDOW) : i]
        candidates = [other for other, other_salt in earlier if other_salt == salt]
        shared = max((_common_prefix(ids, other) for other in candidates), default=0)
        longest_shared = max(longest_shared, shared)
        if shared < len(ids):
            positions[shared] += 1
            examples.setdefault(shared, (ids, shared))
    report = PrefixReport(len(prompts), total, block_size, achievable, cache_blocks, lru_hits)
    for position, count in positions.most_common(top):
        ids, at = examples[position]
        before = _text(tokenizer, ids[max(0, at - CONTEXT_TOKENS) : at])
        after = _text(tokenizer, ids[at : at + CONTEXT_TOKENS])
        report.divergences.append(Divergence(position, count, before, after))
    if len(prompts) > 1 and longest_shared < block_size:
        report.notes.append(
            f"the longest prefix any two prompts share is {longest_shared} tokens, shorter than one block "
            f"({block_size}): only whole blocks are cached, so nothing can hit"
        )
    if report.divergences and report.divergences[0].position < 4 * block_size and report.achievable_hit_rate < 0.1:
        report.notes.append(
            f"prompts diverge early (token {report.divergences[0].position}): something that changes per request "
            "(a timestamp, a session id, a name) near the start of the prompt breaks the cache for all that follows; "
            "move it after the shared part"
        )
    return report


def _text(tokenizer: TextTokenizer | None, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False) if tokenizer is not None else str(ids)
