"""GrammarCompiler: structured-output constraints compiled once per distinct spec, through llguidance.

llguidance (Microsoft's grammar engine, also vLLM's alternative to xgrammar; a 3 MB wheel with no
dependencies, where xgrammar's pulls torch and triton) turns a JSON schema, a regex, a choice or a
Lark / GBNF grammar into a matcher over the model's tokenizer: given the tokens so far, the bitmask of
the tokens that may come next, EOS included once the structure is complete and only EOS once it can
go no further. JSON comes out compact (no free whitespace between tokens): a weak model cannot pad
forever with spaces and newlines.

One compiler per process and tokenizer (its `LLTokenizer`, built on first use, costs time in proportion to
the vocabulary); specs compile once each (an LRU of template matchers, copied per request: a copy is
microseconds, a compile milliseconds to seconds). A bad spec is a ValueError naming the field.
Counters: compiles started and finished, their seconds, and cache hits.

A compile is bounded: it runs on one of the compiler's own threads (two), and a caller waits at most
`compile_timeout` seconds for it. A schema that takes longer (a very large one, e.g. of 10,000 properties, can) is
refused, and remembered as refused by its text, so sending it again costs nothing; the compile that
was cut off finishes on its thread and is dropped. Two callers asking for the same spec at once
share one compile. The caller's thread waits, so the server calls in from a worker thread, never
from its event loop.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from tokenmill.errors import ParamError
from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.text.tokenizer import Tokenizer

CACHE_SIZE = 256  # compiled specs kept (and refused ones remembered), least recently used dropped first
COMPILE_TIMEOUT_S = 5.0
COMPILE_THREADS = 2
JSON_OPTIONS = {"whitespace_flexible": False}  # compact: "," and ":" with no whitespace around them


class GrammarCompiler:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, compile_timeout: float = COMPILE_TIMEOUT_S) -> None:
        """`tokenizer`: the model's; `vocab_size`: the model's logits width (the tokenizer's length or
        more: the rest never allowed); `compile_timeout`: seconds a compile may take before the spec
        is refused."""
        self._model_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.compile_timeout = compile_timeout
        self._tokenizer: Any = None
        self._cache: OrderedDict[str, Any] = OrderedDict()  # spec key -> template LLMatcher
        self._refused: OrderedDict[str, str] = OrderedDict()  # spec key -> why (a compile past the limit)
        self._inflight: dict[str, Future[Any]] = {}  # spec key -> its compile, shared by those who wait
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar-compile")
        self._lock = threading.RLock()  # (a done compile's callback may run inside matcher's hold)
        self.compiles = 0
        self.compiles_started = 0
        self.compile_seconds = 0.0
        self.cache_hits = 0

    @classmethod
    def for_model(cls, model: str, vocab_size: int, compile_timeout: float = COMPILE_TIMEOUT_S) -> GrammarCompiler:
        """The compiler over the tokenizer of the model at `model` (a folder or GGUF file)."""
        return cls(Tokenizer(model), vocab_size, compile_timeout)

    @property
    def tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                model = self._model_tokenizer
                eos = list(model.info.eos_token_ids) or None
                self._tokenizer = llguidance.hf.from_tokenizer(model.hf, n_vocab=self.vocab_size, eos_token=eos)
            return self._tokenizer

    def matcher(self, spec: StructuredOutputsParams) -> Any:
        """A fresh matcher for `spec` (compiled on first use; a ValueError naming the field if invalid
        or if its compile takes longer than the limit)."""
        key = _key(spec)
        field = f"structured_outputs.{spec.kind}"
        _ = self.tokenizer  # (built here, once, outside the compile's deadline: it is no spec's cost)
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                self.cache_hits += 1
                return template.deep_copy()
            if key in self._refused:
                raise ParamError(field, f"{field}: {self._refused[key]}")
            future = self._inflight.get(key)
            if future is None:
                future = self._pool.submit(self._compile, spec)
                self.compiles_started += 1
                self._inflight[key] = future
                future.add_done_callback(lambda done: self._store(key, done))
        try:
            return future.result(timeout=self.compile_timeout).deep_copy()
        except FutureTimeout:
            why = f"compiling it took longer than this server allows ({self.compile_timeout:g} s); simplify it"
            with self._lock:
                self._remember(self._refused, key, why)
            raise ParamError(field, f"{field}: {why}") from None

    def check(self, spec: StructuredOutputsParams) -> None:
        """Raise a ValueError naming the field unless `spec` compiles (and cache it)."""
        self.matcher(spec)

    def _store(self, key: str, done: Future[Any]) -> None:
        """A compile ended: its matcher cached, unless it failed or was refused for its time."""
        with self._lock:
            self._inflight.pop(key, None)
            if done.exception() is None and key not in self._refused:
                self._remember(self._cache, key, done.result())

    @staticmethod
    def _remember(table: OrderedDict[str, Any], key: str, value: Any) -> None:
        table[key] = value
        table.move_to_end(key)
        while len(table) > CACHE_SIZE:
            table.popitem(last=False)

    def _compile(self, spec: StructuredOutputsParams) -> Any:
        import llguidance

        field = f"structured_outputs.{spec.kind}"
        start = time.perf_counter()
        try:
            grammar = _grammar(spec)
        except ValueError as e:
            raise ParamError(field, f"{field}: {e}") from None
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        with self._lock:
            self.compiles += 1
            self.compile_seconds += time.perf_counter() - start
        if matcher.is_error():
            raise ParamError(field, f"{field}: {_first_line(matcher.get_error())}")
        return matcher


def _key(spec: StructuredOutputsParams) -> str:
    return json.dumps([spec.kind, spec.json, spec.regex, spec.choice, spec.grammar])


def _grammar(spec: StructuredOutputsParams) -> str:
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    if spec.json is not None:
        try:
            schema = json.loads(spec.json)
        except json.JSONDecodeError as e:
            raise ValueError(f"not valid JSON ({e})") from None
        if not isinstance(schema, dict | bool):
            raise ValueError("a JSON schema is an object (or true / false)")
        return str(LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS))  # type: ignore[arg-type]
    if spec.json_object:
        return str(LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS))  # type: ignore[arg-type]
    if spec.regex is not None:
        return str(LLMatcher.grammar_from_regex(spec.regex))
    if spec.choice is not None:
        return str(LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice)))
    assert spec.grammar is not None
    try:
        lark = any_to_lark(spec.grammar)  # GBNF (llama.cpp's) to Lark; Lark as it is
    except Exception as e:
        raise ValueError(f"not a Lark or GBNF grammar ({_first_line(str(e))})") from None
    return str(LLMatcher.grammar_from_lark(lark))


def _first_line(message: str) -> str:
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return " ".join(lines[:3]) if lines else "invalid"
