"""Benchmark workloads: built in, deterministic by seed, exact in tokens; or a user's own trace.

A workload is a list of `BenchRequest`s, each a prompt (text, and its token ids under the model's
tokenizer) with a `max_tokens`, optionally an arrival time (traces) or a request it must wait for
(multi-turn). Built-in prompts are made of "word tokens" (a space and a lowercase word, one token
each, that re-encode to themselves), so the text a server receives encodes to exactly the planned
length; where a tokenizer does not round-trip them, words are added or removed until it does.

- `random`: input and output lengths uniform in their ranges.
- `mixed`: input and output lengths log-normal (median the geometric mean of the range, sigma 1,
  clipped to it): long tails, like chat traffic.
- `shared-prefix`: `--num-groups` system prompts of `--prefix-len` tokens; each request is one
  group's prompt plus a distinct question (input-len range), groups taking turns.
- `multi-turn`: conversations of `--turns` turns; each turn resends the whole history (earlier
  questions and fixed synthetic answers) plus a new question, and waits for the previous turn.
- `code-edit`: a Python snippet from the standard library's sources (input-len tokens) after an
  instruction to rewrite it; max_tokens is the snippet's length, as the answer mostly repeats it.
- `jsonl:PATH`: one request per line: `prompt` (text or token ids) or `messages`, `max_tokens`, and
  optionally `arrival_time` (seconds from the start).
"""

from __future__ import annotations

import json
import math
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

BUILT_IN = ("random", "mixed", "shared-prefix", "multi-turn", "code-edit")
# traces only `tokenmill doctor` reads (tokenmill/doctor/traces/): a recorded server trace and the public formats
DOCTOR_TRACES = ("trace", "azure", "burstgpt", "mooncake")
# A vocabulary piece that is a space marker (byte-level "Ġ" or SentencePiece "▁") and a lowercase word.
WORD = re.compile(r"[\u0120\u2581][a-z]{2,12}")
CODE_INSTRUCTION = "Rewrite the following Python code with the same behaviour and clearer names:\n\n"


class BenchTokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...
    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]: ...
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...
    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]: ...


@dataclass
class BenchRequest:
    index: int
    max_tokens: int
    prompt: str | None = None  # text, for /v1/completions
    prompt_token_ids: list[int] | None = None  # what the prompt encodes to, when a tokenizer is known
    messages: list[dict[str, str]] | None = None  # for /v1/chat/completions (traces only)
    arrival_s: float | None = None  # a trace's send time, from the start
    after: int | None = None  # multi-turn: send once this request has finished

    @property
    def prompt_len(self) -> int | None:
        return None if self.prompt_token_ids is None else len(self.prompt_token_ids)

    def token_ids(self, tokenizer: BenchTokenizer) -> list[int]:
        """The prompt in tokens: as planned, else the chat template's or the text's encoding."""
        if self.prompt_token_ids is not None:
            return list(self.prompt_token_ids)
        if self.messages is not None:
            return tokenizer.apply_chat_template(self.messages)
        assert self.prompt is not None
        return tokenizer.encode(self.prompt)


@dataclass
class WorkloadSpec:
    """What to build; the CLI's workload flags."""

    name: str  # one of BUILT_IN, "jsonl:PATH", or (built by the doctor) "KIND:PATH" for KIND in DOCTOR_TRACES
    num_requests: int | None = 100  # None: every line of a trace
    seed: int = 0
    input_len: tuple[int, int] = (32, 512)
    output_len: tuple[int, int] = (8, 512)
    prefix_len: int = 1024
    num_groups: int = 4
    turns: int = 4

    def __post_init__(self) -> None:
        if self.name not in BUILT_IN and not is_trace(self.name):
            raise ValueError(f"--workload: {self.name!r} is not one of {', '.join(BUILT_IN)} or jsonl:PATH")
        if self.num_requests is None and not is_trace(self.name):
            raise ValueError(f"--num-requests: the {self.name} workload needs a count")
        count = self.num_requests if self.num_requests is not None else 1
        for flag, value in (("--num-requests", count), ("--prefix-len", self.prefix_len)):
            if value < 1:
                raise ValueError(f"{flag}: must be at least 1, got {value}")
        if self.num_groups < 1 or self.turns < 1:
            raise ValueError("--num-groups and --turns: must be at least 1")
        for flag, (lo, hi) in (("--input-len", self.input_len), ("--output-len", self.output_len)):
            if not 1 <= lo <= hi:
                raise ValueError(f"{flag}: need 1 <= MIN <= MAX, got {lo}:{hi}")


@dataclass
class Workload:
    spec: WorkloadSpec
    requests: list[BenchRequest] = field(default_factory=list)

    def describe(self) -> dict[str, Any]:
        lens = [r.prompt_len for r in self.requests]
        return {
            "name": self.spec.name,
            "seed": self.spec.seed,
            "spec": {k: v for k, v in vars(self.spec).items() if k not in ("name", "seed")},
            "num_requests": len(self.requests),
            "prompt_tokens": sum(n for n in lens if n is not None) if all(n is not None for n in lens) else None,
            "max_output_tokens": sum(r.max_tokens for r in self.requests),
        }


def is_trace(name: str) -> bool:
    """A trace's workload name: jsonl:PATH, or KIND:PATH for one of DOCTOR_TRACES."""
    return name.partition(":")[0] in ("jsonl", *DOCTOR_TRACES) and ":" in name


def parse_range(text: str, flag: str) -> tuple[int, int]:
    """ "32:512" -> (32, 512); "64" -> (64, 64)."""
    lo, sep, hi = text.partition(":")
    try:
        pair = (int(lo), int(hi) if sep else int(lo))
    except ValueError:
        raise ValueError(f"{flag}: {text!r} is not N or MIN:MAX in tokens") from None
    return pair


def build_workload(spec: WorkloadSpec, tokenizer: BenchTokenizer | None) -> Workload:
    if spec.name.startswith("jsonl:"):
        return Workload(spec, read_jsonl(Path(spec.name[len("jsonl:") :]), spec.num_requests, tokenizer))
    if is_trace(spec.name):
        raise ValueError(f"--workload: {spec.name.partition(':')[0]}: traces are read by tokenmill doctor")
    if tokenizer is None:
        raise ValueError(f"--tokenizer: the {spec.name} workload is built in tokens; give the model folder")
    words = WordSource(tokenizer)
    rng = random.Random(f"{spec.name}/{spec.seed}")
    builders = {
        "random": _random,
        "mixed": _mixed,
        "shared-prefix": _shared_prefix,
        "multi-turn": _multi_turn,
        "code-edit": _code_edit,
    }
    return Workload(spec, builders[spec.name](spec, rng, words))


class WordSource:
    """Word tokens of a tokenizer, and prompts of an exact token count made from them."""

    def __init__(self, tokenizer: BenchTokenizer) -> None:
        self.tokenizer = tokenizer
        self.specials = len(tokenizer.encode("x")) - len(tokenizer.encode("x", add_special_tokens=False))
        ids = []
        pieces = tokenizer.convert_ids_to_tokens(list(range(tokenizer.vocab_size)))
        for i, piece in enumerate(pieces):  # " word" must encode to this one token
            if WORD.fullmatch(piece) and tokenizer.encode(" " + piece[1:], add_special_tokens=False) == [i]:
                ids.append(i)
        if len(ids) < 50:
            raise ValueError("--tokenizer: too few single-token words in its vocabulary to build prompts")
        self.word_ids = ids

    def words(self, rng: random.Random, count: int) -> str:
        pieces = self.tokenizer.convert_ids_to_tokens([rng.choice(self.word_ids) for _ in range(count)])
        return "".join(" " + p[1:] for p in pieces)

    def prompt(self, rng: random.Random, length: int, head: str = "") -> tuple[str, list[int]]:
        """Text of exactly `length` tokens (specials included) that starts with `head`."""
        head_len = len(self.tokenizer.encode(head, add_special_tokens=False)) if head else 0
        text = head + self.words(rng, max(0, length - self.specials - head_len))
        ids = self.tokenizer.encode(text)
        for _ in range(64):  # a tokenizer that merges across words: add or drop words until exact
            if len(ids) == length:
                return text, ids
            if len(ids) < length:
                text += self.words(rng, 1)
            elif text.rfind(" ") > len(head):
                text = text[: text.rfind(" ")]  # drop the last word
            else:
                break
            ids = self.tokenizer.encode(text)
        raise ValueError(f"--tokenizer: cannot build a prompt of exactly {length} tokens with this tokenizer")


def _log_normal(rng: random.Random, lo: int, hi: int) -> int:
    median = math.sqrt(lo * hi)
    return min(hi, max(lo, round(math.exp(rng.gauss(math.log(median), 1.0)))))


def _random(spec: WorkloadSpec, rng: random.Random, words: WordSource) -> list[BenchRequest]:
    out = []
    for i in range(spec.num_requests):
        text, ids = words.prompt(rng, rng.randint(*spec.input_len))
        out.append(BenchRequest(i, rng.randint(*spec.output_len), text, ids))
    return out


def _mixed(spec: WorkloadSpec, rng: random.Random, words: WordSource) -> list[BenchRequest]:
    out = []
    for i in range(spec.num_requests):
        text, ids = words.prompt(rng, _log_normal(rng, *spec.input_len))
        out.append(BenchRequest(i, _log_normal(rng, *spec.output_len), text, ids))
    return out


def _shared_prefix(spec: WorkloadSpec, rng: random.Random, words: WordSource) -> list[BenchRequest]:
    prefixes = [words.prompt(rng, spec.prefix_len)[0] for _ in range(spec.num_groups)]
    out = []
    for i in range(spec.num_requests):
        length = spec.prefix_len + rng.randint(*spec.input_len)
        text, ids = words.prompt(rng, length, head=prefixes[i % spec.num_groups])
        out.append(BenchRequest(i, rng.randint(*spec.output_len), text, ids))
    return out


def _multi_turn(spec: WorkloadSpec, rng: random.Random, words: WordSource) -> list[BenchRequest]:
    conversations = -(-spec.num_requests // spec.turns)
    history = [""] * conversations
    previous: list[int | None] = [None] * conversations
    out: list[BenchRequest] = []
    for _turn in range(spec.turns):  # turn-major: every conversation's first turn comes first
        for c in range(conversations):
            if len(out) == spec.num_requests:
                break
            question_len = rng.randint(*spec.input_len)
            head_len = len(words.tokenizer.encode(history[c], add_special_tokens=False)) if history[c] else 0
            text, ids = words.prompt(rng, words.specials + head_len + question_len, head=history[c])
            max_tokens = rng.randint(*spec.output_len)
            out.append(BenchRequest(len(out), max_tokens, text, ids, after=previous[c]))
            previous[c] = len(out) - 1
            history[c] = text + words.words(rng, max_tokens)  # a fixed synthetic answer, resent next turn
    return out


def _code_edit(spec: WorkloadSpec, rng: random.Random, words: WordSource) -> list[BenchRequest]:
    from tokenmill.models.train_tokenizer import corpus

    try:
        texts = corpus(spec.seed, max_bytes=2_000_000)
    except RuntimeError as e:
        raise ValueError(f"--workload code-edit: {e}") from None
    files = [lines for t in texts if len(lines := t.splitlines(keepends=True)) > 40]
    tok = words.tokenizer
    out = []
    for i in range(spec.num_requests):
        lines = files[rng.randrange(len(files))]
        start = rng.randrange(len(lines) - 20)
        target = rng.randint(*spec.input_len)
        snippet, n = "", 0
        for line in lines[start:]:  # whole lines, up to about the target length
            if n + len(line) // 3 > target and snippet:
                break
            snippet += line
            n = len(tok.encode(snippet, add_special_tokens=False))
        text = CODE_INSTRUCTION + snippet
        ids = tok.encode(text)
        max_tokens = min(spec.output_len[1], max(spec.output_len[0], n))
        out.append(BenchRequest(i, max_tokens, text, ids))
    return out


def read_jsonl(path: Path, limit: int | None, tokenizer: BenchTokenizer | None) -> list[BenchRequest]:
    """A user's trace; every bad line is a ValueError naming the file, the line and the field."""
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ValueError(f"--workload: cannot read {path} ({e.strerror or e})") from None
    out: list[BenchRequest] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if limit is not None and len(out) == limit:
            break
        where = f"{path} line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected an object with prompt or messages, and max_tokens")
        out.append(_trace_request(row, len(out), where, tokenizer))
    if not out:
        raise ValueError(f"{path}: no requests in the trace")
    return out


def _trace_request(row: dict[str, Any], index: int, where: str, tokenizer: BenchTokenizer | None) -> BenchRequest:
    max_tokens = row.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError(f"{where}: max_tokens must be an integer >= 1, got {max_tokens!r}")
    arrival = row.get("arrival_time")
    number = isinstance(arrival, int | float) and not isinstance(arrival, bool)
    if arrival is not None and not (number and math.isfinite(arrival) and arrival >= 0):
        raise ValueError(f"{where}: arrival_time must be a finite number of seconds >= 0, got {arrival!r}")
    request = BenchRequest(index, max_tokens, arrival_s=None if arrival is None else float(arrival))
    prompt, messages = row.get("prompt"), row.get("messages")
    if (prompt is None) == (messages is None):
        raise ValueError(f"{where}: give exactly one of prompt or messages")
    if isinstance(prompt, str) and prompt:
        request.prompt = prompt
        request.prompt_token_ids = tokenizer.encode(prompt) if tokenizer else None
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if tokenizer is None:
            raise ValueError(f"{where}: a prompt of token ids needs --tokenizer to be sent as text")
        if not all(0 <= t < tokenizer.vocab_size for t in prompt):
            raise ValueError(f"{where}: prompt token ids must be in [0, {tokenizer.vocab_size})")
        request.prompt_token_ids = list(prompt)
        request.prompt = tokenizer.decode(list(prompt))
    elif messages is not None:
        ok = (
            isinstance(messages, list)
            and messages
            and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages
            )
        )
        if not ok:
            raise ValueError(f"{where}: messages must be a non-empty list of {{role, content}} strings")
        request.messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        request.prompt_token_ids = tokenizer.apply_chat_template(request.messages) if tokenizer else None
    else:
        raise ValueError(f"{where}: prompt must be non-empty text or a non-empty list of token ids")
    return request


def send_times(requests: list[BenchRequest], request_rate: float | None, seed: int) -> list[float | None]:
    """When each request is due, in seconds from the start: a trace's own arrival times, else Poisson
    arrivals at `request_rate` per second (seeded; the first at 0), else all at once. Requests that
    wait for another (multi-turn) get None: they are sent when that one finishes."""
    rng = random.Random(f"arrivals/{seed}")
    times: list[float | None] = []
    clock = 0.0
    for r in requests:
        if r.after is not None:
            times.append(None)
        elif r.arrival_s is not None:
            times.append(r.arrival_s)
        elif request_rate is None:
            times.append(0.0)
        else:
            times.append(clock)
            clock += rng.expovariate(request_rate)
    return times
