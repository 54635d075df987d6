"""`tokenmill prefix-report`: why a trace of prompts does (or does not) hit the prefix cache.

Replays the requests of a JSONL trace through the tokenizer, the block hasher and the engine's own
KV manager (`KVManager` over `BlockPool`), no model: the hit rate an unbounded cache would reach,
the hit rate a KV cache of N blocks (the engine's block count) reaches, and the most frequent
first-divergence points (where a prompt stops matching the closest earlier one) with the text
around them, so that "a timestamp at the top of the system prompt broke caching" or "the shared
prefix is shorter than one block" is shown, not guessed.

The N-block replay serves the requests one at a time, in trace order, each finishing before the
next arrives, and does for each what the scheduler does: on admission it adopts the longest cached
prefix, whole blocks only, at most (prompt length - 1) // block_size of them; it allocates blocks
for its prompt (in chunks of `max_num_batched_tokens`) and then for each generated token it
computes, hashing and caching every block as it fills; at the end it frees its blocks, tail first,
so a cached chain loses its end before its head. A request with max_tokens M computes
prompt length + M - 1 tokens (the last sampled token's KV is never computed); M is the row's
`max_tokens`, else the report's default (`--max-tokens`, 1), and every request is taken to
generate all M tokens (as with `ignore_eos`): one that stops early holds fewer blocks. A request
whose prompt + max_tokens needs more blocks than the cache holds is refused by the engine; the
replay skips it, counts it as a miss and says so in a note. Requests that run concurrently hold
blocks at the same time and so evict more than this replay shows.

The report does not know the model's output tokens: it stands in for them with negative token ids,
unique per request, which no prompt can contain. Their blocks take room in the cache as the real
ones do, but a later prompt that contains an earlier output (a multi-turn conversation replaying
the assistant's answer) is not credited with the hit the engine would give it.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tokenmill.config import EngineConfig
from tokenmill.sched.block_hash import chain_hashes
from tokenmill.sched.kv_manager import KVManager

COMPARE_WINDOW = 256  # earlier prompts a prompt is compared with, to find where it diverges
CONTEXT_TOKENS = 8  # tokens shown on each side of a divergence


class TextTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...
    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]: ...


@dataclass
class TraceRequest:
    token_ids: list[int]
    cache_salt: str | None = None
    max_tokens: int | None = None  # the row's max_tokens; None: the report's default


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
    cache_blocks: int | None  # the KV cache's size in blocks, for the LRU replay
    lru_hit_tokens: int
    divergences: list[Divergence] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    skipped_requests: int = 0  # requests the N-block cache cannot hold (refused by the engine)

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
            lines.append(
                f"hit rate with a KV cache of {self.cache_blocks} blocks (LRU, one request at a time): "
                f"{self.lru_hit_rate:.1%}"
            )
        if self.divergences:
            lines.append("most frequent first divergences from the closest earlier prompt:")
            for d in self.divergences:
                lines.append(f"  token {d.position} ({d.count} prompts): ...{d.before!r} | {d.after!r}...")
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)


def read_trace(path: Path, tokenizer: TextTokenizer | None) -> list[TraceRequest]:
    """One request per line: `prompt` (text or ids), `prompt_token_ids` or `messages`; optional
    `cache_salt` and `max_tokens`."""
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
        if salt is not None and not isinstance(salt, str):
            raise ValueError(f"{path}:{n}: cache_salt: expected a string, got {salt!r}")
        max_tokens = row.get("max_tokens")
        if max_tokens is not None and (
            isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
        ):
            raise ValueError(f"{path}:{n}: max_tokens: expected a positive integer, got {max_tokens!r}")
        ids: Any = row.get("prompt_token_ids", row.get("prompt"))
        messages: Any = row.get("messages")
        if isinstance(ids, list):
            if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
                raise ValueError(f"{path}:{n}: token ids must be non-negative integers")
            tokens = list(ids)
        elif not isinstance(ids, str) and not isinstance(messages, list):
            raise ValueError(f"{path}:{n}: field 'prompt', 'prompt_token_ids' or 'messages' is missing")
        elif tokenizer is None:
            raise ValueError(f"{path}:{n}: text prompts and messages need --tokenizer DIR")
        elif isinstance(ids, str):
            tokens = tokenizer.encode(ids)
        else:
            tokens = tokenizer.apply_chat_template(messages)
        if not tokens:
            raise ValueError(f"{path}:{n}: the prompt is empty")
        out.append(TraceRequest(tokens, salt, max_tokens))
    return out


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _step_ends(start: int, prompt_len: int, computed: int, block_size: int, chunk: int) -> list[int]:
    """The request's computed-token count after each step that may allocate or fill a block: prefill
    chunks of at most `chunk` tokens, then decode steps of one token, merged up to each block boundary
    (of a block's decode steps only the first allocates and only the last fills it)."""
    ends = []
    done = start
    while done < prompt_len:
        done = min(done + chunk, prompt_len)
        ends.append(done)
    while done < computed:
        done = min((done // block_size + 1) * block_size, computed)
        ends.append(done)
    return ends


def block_chains(requests: Sequence[TraceRequest], block_size: int, max_tokens: int = 1) -> list[list[bytes]]:
    """Per request, the chained hashes of every full block of the tokens the replay computes for it (its
    prompt, then its stand-in outputs: negative ids, distinct across the requests): hashed once, they
    serve every replay of the same requests (the cache sizes of a hit-rate curve, the report's own)."""
    chains: list[list[bytes]] = []
    next_output = -1
    for request in requests:
        outputs = request.max_tokens if request.max_tokens is not None else max_tokens
        computed = [
            *request.token_ids,
            *range(next_output, next_output - (outputs - 1), -1),
        ]  # the last sample never is
        next_output -= outputs - 1
        chains.append(chain_hashes(computed, block_size, request.cache_salt))
    return chains


def replay_kv_cache(
    requests: Sequence[TraceRequest],
    block_size: int,
    num_blocks: int,
    max_tokens: int = 1,
    max_num_batched_tokens: int = EngineConfig.max_num_batched_tokens,
    chains: list[list[bytes]] | None = None,
) -> tuple[int, int]:
    """(prefix-hit tokens, skipped requests) of the engine's KV manager with `num_blocks` blocks
    serving `requests` one at a time, as the scheduler does (see the module docstring); `chains`: their
    `block_chains` (of the same block size and max_tokens), if hashed already."""
    kv = KVManager(num_blocks, block_size, enable_prefix_caching=True)
    chains = chains if chains is not None else block_chains(requests, block_size, max_tokens)
    hits = skipped = 0
    for n, request in enumerate(requests):
        prompt = request.token_ids
        outputs = request.max_tokens if request.max_tokens is not None else max_tokens
        if kv.blocks_for(len(prompt) + outputs) > kv.num_blocks:  # Scheduler.add_request refuses it
            skipped += 1
            continue
        request_id, chain = str(n), chains[n]
        usable = (len(prompt) - 1) // block_size  # Scheduler._prefix_hit: the last token is always computed
        blocks = kv.lookup_prefix(chain[:usable])  # (a prompt's leading blocks hash as the chain's do)
        if blocks:
            kv.adopt_prefix(request_id, blocks, chain[: len(blocks)])
        hits += len(blocks) * block_size
        computed = len(prompt) + max(0, outputs - 1)
        for end in _step_ends(len(blocks) * block_size, len(prompt), computed, block_size, max_num_batched_tokens):
            if not kv.allocate(request_id, end):
                raise AssertionError("a request that fits the KV cache alone must always get its blocks")
            kv.cache_blocks(request_id, chain[: end // block_size])  # the blocks it has filled
        kv.free(request_id)  # Scheduler.finish_request: tail first
    return hits, skipped


def analyse(
    prompts: Sequence[TraceRequest | tuple[list[int], str | None]],
    block_size: int = 16,
    cache_blocks: int | None = None,
    tokenizer: TextTokenizer | None = None,
    top: int = 5,
    *,
    max_tokens: int = 1,
    max_num_batched_tokens: int = EngineConfig.max_num_batched_tokens,
    chains: list[list[bytes]] | None = None,
) -> PrefixReport:
    """The report on `prompts` (`read_trace`'s requests, or (token ids, cache salt) pairs);
    `cache_blocks`: also replay a KV cache of that many blocks, `max_tokens` tokens generated by each
    request whose row gives none, prompts computed in chunks of `max_num_batched_tokens`; `chains`:
    the requests' `block_chains`, if hashed already."""
    for name, value in (("block_size", block_size), ("max_tokens", max_tokens)):
        if isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: expected a positive integer, got {value}")
    if cache_blocks is not None and (isinstance(cache_blocks, bool) or cache_blocks < 1):
        raise ValueError(f"cache_blocks: expected a positive integer, got {cache_blocks}")
    requests = [p if isinstance(p, TraceRequest) else TraceRequest(list(p[0]), p[1]) for p in prompts]
    for n, request in enumerate(requests):
        if not request.token_ids:
            raise ValueError(f"request {n}: the prompt is empty")
    if chains is None and cache_blocks is not None:  # (hashed once for both)
        chains = block_chains(requests, block_size, max_tokens)
    seen: set[bytes] = set()
    achievable = total = 0
    positions: Counter[int] = Counter()
    examples: dict[int, tuple[list[int], int]] = {}
    longest_shared = 0
    for i, request in enumerate(requests):
        ids, salt = request.token_ids, request.cache_salt
        total += len(ids)
        hashes = chains[i][: len(ids) // block_size] if chains else chain_hashes(ids, block_size, salt)
        usable = (len(ids) - 1) // block_size  # the last token is always computed
        achievable += block_size * next((k for k, h in enumerate(hashes[:usable]) if h not in seen), usable)
        seen.update(hashes)
        if i == 0:
            continue
        earlier = requests[max(0, i - COMPARE_WINDOW) : i]
        first = ids[0]  # (a prompt whose first token differs shares nothing: not compared)
        candidates = [o.token_ids for o in earlier if o.cache_salt == salt and o.token_ids and o.token_ids[0] == first]
        shared = max((common_prefix(ids, other) for other in candidates), default=0)
        longest_shared = max(longest_shared, shared)
        if shared < len(ids):
            positions[shared] += 1
            examples.setdefault(shared, (ids, shared))
    lru_hits = skipped = 0
    if cache_blocks is not None:
        lru_hits, skipped = replay_kv_cache(
            requests, block_size, cache_blocks, max_tokens, max_num_batched_tokens, chains
        )
    report = PrefixReport(
        len(requests), total, block_size, achievable, cache_blocks, lru_hits, skipped_requests=skipped
    )
    for position, count in positions.most_common(top):
        ids, at = examples[position]
        before = _text(tokenizer, ids[max(0, at - CONTEXT_TOKENS) : at])
        after = _text(tokenizer, ids[at : at + CONTEXT_TOKENS])
        report.divergences.append(Divergence(position, count, before, after))
    if len(requests) > 1 and longest_shared < block_size:
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
    if skipped:
        report.notes.append(
            f"{skipped} of {len(requests)} requests need more KV blocks for prompt + max_tokens than the "
            f"{cache_blocks} the cache holds: the engine refuses them, so the replay skips them (counted as misses)"
        )
    return report


def _text(tokenizer: TextTokenizer | None, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False) if tokenizer is not None else str(ids)
