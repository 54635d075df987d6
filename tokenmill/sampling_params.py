"""SamplingParams: how one request is sampled and when it stops (frozen; validated on creation).

Also owns `generator_seed`, the fixed integer mix that makes sampling a pure function of
(seed, output position): the engine seeds the children of an n > 1 request with it, the sampler
each row's generator.

Field names and meanings follow vLLM's `SamplingParams` and the OpenAI API, so users of either
find what they expect. Every bad value raises a ValueError that names the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.errors import ParamError

MAX_LOGPROBS = 20
FLOAT32_MAX = 3.4028234663852886e38
_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """SplitMix64's finaliser: a bijective, well-mixed map of 64-bit integers."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def generator_seed(seed: int, output_position: int) -> int:
    """The 64-bit seed (in [0, 2**64)) of the generator that samples output token `output_position`.

    A fixed integer mix, identical in every process (unlike Python's salted `hash()`); any int seed
    is accepted, negative or wider than 64 bits ones are reduced modulo 2**64.
    """
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (output_position & _MASK64))


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on a request's output, enforced by a grammar engine (vLLM's `StructuredOutputsParams`):
    exactly one of a JSON schema (`json`, as a dict or its JSON text), any JSON object (`json_object`), a
    regular expression, a choice among strings, or a grammar (Lark, or llama.cpp's GBNF)."""

    json: str | None = None  # the schema as JSON text (a dict given is serialized)
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    after_tokens: tuple[int, ...] = ()  # () : from the first output token

    def __post_init__(self) -> None:
        object.__setattr__(self, "after_tokens", tuple(self.after_tokens))
        if isinstance(self.json, dict):
            import json as json_module

            object.__setattr__(self, "json", json_module.dumps(self.json))  # (its order: the output follows it)
        if self.choice is not None and not isinstance(self.choice, str):
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ParamError(
                    f"structured_outputs.{name}",
                    f"structured_outputs.{name}: expected a non-empty string, got {value!r}",
                )
        if not isinstance(self.json_object, bool):
            raise ParamError(
                "structured_outputs.json_object",
                f"structured_outputs.json_object: expected a boolean, got {self.json_object!r}",
            )
        if self.choice is not None and (
            isinstance(self.choice, str) or not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ParamError(
                "structured_outputs.choice",
                f"structured_outputs.choice: expected a non-empty list of non-empty strings, got {self.choice!r}",
            )
        given = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ParamError(
                "structured_outputs",
                "structured_outputs: expected exactly one of json, json_object, regex, choice, grammar; got "
                + (", ".join(given) or "none"),
            )

    @property
    def kind(self) -> str:
        """Which constraint this is: json, json_object, regex, choice or grammar."""
        if self.json_object:
            return "json_object"
        return next(n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None)


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # completions per prompt; child i is seeded from (seed, i)
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens with this much probability
    top_k: int | None = None  # keep the k most likely tokens; None keeps all
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability
    repetition_penalty: float = 1.0  # > 1 discourages tokens seen in the prompt or the output
    presence_penalty: float = 0.0  # subtracted once from tokens already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    seed: int | None = None  # randomness is a pure function of (seed, output position)
    max_tokens: int | None = 16  # None: up to the model's maximum length
    stop: tuple[str, ...] = ()  # stop strings, left out of the output
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N log-probabilities per generated token (plus the chosen one)
    prompt_logprobs: int | None = None  # the same for each prompt token
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    min_tokens: int = 0  # EOS and stop token ids are masked (and stop strings not checked) until this many
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: tuple[int, ...] | None = None  # only these may be sampled
    bad_words: tuple[str, ...] = ()  # words never generated (as words: at the start or after a space)
    # bad_words as token-id sequences: filled in by the engine's front end (which has the tokenizer)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    structured_outputs: StructuredOutputsParams | None = None  # output held to a schema, regex, choice or grammar
    extra: dict[str, object] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if isinstance(self.bad_words, str):
            object.__setattr__(self, "bad_words", (self.bad_words,))
        else:
            object.__setattr__(self, "bad_words", tuple(self.bad_words))
        object.__setattr__(self, "bad_words_token_ids", tuple(tuple(w) for w in self.bad_words_token_ids))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", dict(self.logit_bias))
        if isinstance(self.structured_outputs, dict):  # LLM(...) users pass vLLM's keys as a dict
            object.__setattr__(self, "structured_outputs", StructuredOutputsParams(**self.structured_outputs))
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, expected: str) -> ParamError:
            return ParamError(name, f"{name}: expected {expected}, got {getattr(self, name)!r}")

        def number(name: str) -> float:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not abs(value) <= FLOAT32_MAX:
                raise bad(name, "a finite number (within float32's range)")  # the sampler's tensors are float32
            return float(value)

        def integer(name: str) -> int:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise bad(name, "an integer")
            return value

        if integer("n") < 1:
            raise bad("n", "an integer >= 1")
        if number("temperature") < 0:
            raise bad("temperature", "a number >= 0")
        if not 0 < number("top_p") <= 1:
            raise bad("top_p", "a number in (0, 1]")
        if self.top_k is not None and integer("top_k") < 1:
            raise bad("top_k", "an integer >= 1, or None for no limit")
        if not 0 <= number("min_p") <= 1:
            raise bad("min_p", "a number in [0, 1]")
        if number("repetition_penalty") <= 0:
            raise bad("repetition_penalty", "a number > 0")
        if not -2 <= number("presence_penalty") <= 2:
            raise bad("presence_penalty", "a number in [-2, 2]")
        if not -2 <= number("frequency_penalty") <= 2:
            raise bad("frequency_penalty", "a number in [-2, 2]")
        if self.seed is not None:
            integer("seed")
        if self.max_tokens is not None and integer("max_tokens") < 1:
            raise bad("max_tokens", "an integer >= 1, or None for up to the model's maximum length")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "non-empty strings")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "non-negative integers")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and not 0 <= integer(name) <= MAX_LOGPROBS:
                raise bad(name, f"an integer in [0, {MAX_LOGPROBS}], or None")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "a boolean")
        if integer("min_tokens") < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise bad("min_tokens", "an integer in [0, max_tokens]")
        if self.logit_bias is not None:
            for token, bias in self.logit_bias.items():
                if not _token_id(token):
                    raise ParamError(
                        "logit_bias", f"logit_bias: keys must be token ids (non-negative integers), got {token!r}"
                    )
                if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100 <= bias <= 100:
                    raise ParamError(
                        "logit_bias",
                        f"logit_bias: the bias of token {token} must be a number in [-100, 100], got {bias!r}",
                    )
        if self.allowed_token_ids is not None and (
            not self.allowed_token_ids or not all(_token_id(t) for t in self.allowed_token_ids)
        ):
            raise bad("allowed_token_ids", "a non-empty list of token ids, or None")
        if not all(isinstance(w, str) and w.strip() for w in self.bad_words):
            raise bad("bad_words", "non-empty strings")
        if not all(w and all(_token_id(t) for t in w) for w in self.bad_words_token_ids):
            raise bad("bad_words_token_ids", "non-empty sequences of token ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
