"""GrammarCompiler: structured-output constraints compiled once per distinct spec, through llguidance.

llguidance (Microsoft's grammar engine, also vLLM's alternative to xgrammar; a 3 MB wheel with no
dependencies, where xgrammar's pulls torch and triton) turns a JSON schema, a regex, a choice or a
Lark / GBNF grammar into a matcher over the model's tokenizer: given the tokens so far, the bitmask of
the tokens that may come next, EOS included once the structure is complete and only EOS once it can
go no further. JSON comes out compact (no free whitespace between tokens): a weak model cannot pad
forever with spaces and newlines.

One compiler per process and tokenizer (its `LLTokenizer`, built on first use, takes ~0.3 s for a 50k
vocabulary); specs compile once each (an LRU of template matchers, copied per request: a copy is
microseconds, a compile milliseconds to seconds). A bad spec is a ValueError naming the field.
Counters: compiles, their seconds, and cache hits.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from typing import Any

from tokenmill.engine.tokenizer import Tokenizer
from tokenmill.errors import ParamError
from tokenmill.sampling_params import StructuredOutputsParams

CACHE_SIZE = 256
JSON_OPTIONS = {"whitespace_flexible": False}  # compact: "," and ":" with no whitespace around them


class GrammarCompiler:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        """`tokenizer`: the model's; `vocab_size`: the model's logits width (the tokenizer's length or
        more: the rest never allowed)."""
        self._model_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._tokenizer: Any = None
        self._cache: OrderedDict[str, Any] = OrderedDict()  # spec key -> template LLMatcher
        self._lock = threading.Lock()
        self.compiles = 0
        self.compile_seconds = 0.0
        self.cache_hits = 0

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            import llguidance.hf

            model = self._model_tokenizer
            eos = list(model.info.eos_token_ids) or None
            self._tokenizer = llguidance.hf.from_tokenizer(model.hf, n_vocab=self.vocab_size, eos_token=eos)
        return self._tokenizer

    def matcher(self, spec: StructuredOutputsParams) -> Any:
        """A fresh matcher for `spec` (compiled on first use; a ValueError naming the field if invalid)."""
        key = _key(spec)
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                self.cache_hits += 1
                return template.deep_copy()
        template = self._compile(spec)
        with self._lock:
            self._cache[key] = template
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return template.deep_copy()

    def check(self, spec: StructuredOutputsParams) -> None:
        """Raise a ValueError naming the field unless `spec` compiles (and cache it)."""
        self.matcher(spec)

    def _compile(self, spec: StructuredOutputsParams) -> Any:
        import llguidance

        field = f"structured_outputs.{spec.kind}"
        start = time.perf_counter()
        try:
            grammar = _grammar(spec)
        except ValueError as e:
            raise ParamError(field, f"{field}: {e}") from None
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
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
