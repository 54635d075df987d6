"""Reasoning output: a model's `<think>...</think>` part split from its answer (`--reasoning-parser`).

The chat answer's `message.reasoning_content` and the stream's `delta.reasoning_content` (vLLM's
fields) get the text inside the tags, `content` the rest. Two parsers, as vLLM names them:

- `qwen3`: the answer may open with `<think>` (after whitespace); if it does not, it is all content;
- `deepseek_r1`: the answer starts inside the reasoning (its template opens `<think>` itself; a leading
  `<think>` the model writes anyway is dropped); with no `</think>` it is all reasoning.

Either way the prompt decides first: a prompt that ends inside an open `<think>` (a template that
opens it) starts the answer inside the reasoning; one that ends with `</think>` (Qwen3's
`enable_thinking: false` writes an empty block) leaves nothing to split, the answer is all content.

Streamed text is split by one `ReasoningSplitter` per choice: a tag is never cut across two deltas
(text that may be the start of a tag is held back until the next delta tells, or the end). The
whole answer goes through the same splitter, so streamed and whole answers agree.

Structured output and forced tool calls apply after the reasoning part: the grammar waits for the
`</think>` tokens (`StructuredOutputsParams.after_tokens`) unless the prompt already closed the
reasoning. A model that never writes `</think>` is then never constrained (as in vLLM).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tokenmill.sampling_params import SamplingParams

REASONING_PARSERS = ("qwen3", "deepseek_r1")
START, END = "<think>", "</think>"
PROMPT_TAIL_TOKENS = 16  # prompt tokens decoded to see whether the template opened or closed the reasoning


@dataclass
class ReasoningSplitter:
    """Splits one answer's text, given delta by delta, into (reasoning, content). `state`: "lead" (the
    answer's start: an optional `<think>` may come; without it the answer is in `fallback`),
    "reasoning" or "content"."""

    state: str
    fallback: str = "content"
    held: str = ""  # text not yet given out: it may be (the start of) a tag
    reasoned: bool = False  # the answer had a reasoning part (then reasoning_content is a string, maybe empty)

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that `text` adds, as far as it can be told now."""
        self.held += text
        reasoning: list[str] = []
        content: list[str] = []
        while self.held:
            if self.state == "lead":
                stripped = self.held.lstrip()
                if stripped.startswith(START):
                    self.held, self.state, self.reasoned = stripped[len(START) :], "reasoning", True
                    continue
                if START.startswith(stripped):  # (whitespace, or the start of the tag: wait)
                    break
                self.state = self.fallback
                self.reasoned = self.reasoned or self.fallback == "reasoning"
                continue
            if self.state == "reasoning":
                end = self.held.find(END)
                if end >= 0:
                    reasoning.append(self.held[:end])
                    self.held, self.state = self.held[end + len(END) :], "content"
                    continue
                keep = _partial_tag(self.held, END)
                reasoning.append(self.held[: len(self.held) - keep])
                self.held = self.held[len(self.held) - keep :]
                break
            content.append(self.held)
            self.held = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """(reasoning, content) of the text held back at the end of the answer."""
        held, self.held = self.held, ""
        if self.state == "lead":
            self.state = self.fallback
            self.reasoned = self.reasoned or self.fallback == "reasoning"
        return (held, "") if self.state == "reasoning" else ("", held)


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (0 if none)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass
class ReasoningSplits:
    """A chat request's reasoning split: where its answers start (from the parser and the prompt),
    whether the reasoning is shown (`include_reasoning`), and one splitter per streamed choice."""

    start: str  # "lead" or "content"
    fallback: str  # where an answer without `<think>` is
    include: bool = True
    streams: dict[int, ReasoningSplitter] = field(default_factory=dict)  # choice index -> its splitter

    def splitter(self) -> ReasoningSplitter:
        return ReasoningSplitter(self.start, self.fallback)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole answer -> (reasoning_content, content); each None when absent (or empty content)."""
        s = self.splitter()
        r1, c1 = s.feed(text)
        r2, c2 = s.finish()
        reasoning = r1 + r2 if s.reasoned and self.include else None
        return reasoning, (c1 + c2) or None

    def delta(self, index: int, text: str, last: bool) -> tuple[str | None, str | None]:
        """Choice `index`'s next delta -> (reasoning, content) to send now (None: nothing of that kind)."""
        s = self.streams.setdefault(index, self.splitter())
        reasoning, content = s.feed(text)
        if last:
            r, c = s.finish()
            reasoning, content = reasoning + r, content + c
        return (reasoning or None) if self.include else None, content or None

    @property
    def constrains_later(self) -> bool:
        """Whether the answer may start inside a reasoning part (so a grammar waits for its end)."""
        return self.start != "content"


def reasoning_splits(parser: str, prompt_tail: str, include: bool = True) -> ReasoningSplits:
    """The split of a chat request's answers under `parser`, given the end of its rendered prompt."""
    if parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser: expected one of {', '.join(REASONING_PARSERS)}, got {parser!r}")
    tail = prompt_tail.rstrip()
    if tail.endswith(END):
        return ReasoningSplits("content", "content", include)
    opened = tail.endswith(START) or parser == "deepseek_r1"
    return ReasoningSplits("lead", "reasoning" if opened else "content", include)


def defer_grammar(params: SamplingParams, splits: ReasoningSplits, end_tokens: list[int]) -> SamplingParams:
    """`params` with its structured output (if any) waiting for the reasoning's end tokens."""
    spec = params.structured_outputs
    if spec is None or not splits.constrains_later or not end_tokens:
        return params
    return dataclasses.replace(params, structured_outputs=dataclasses.replace(spec, after_tokens=tuple(end_tokens)))
