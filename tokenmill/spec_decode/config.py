"""SpeculativeConfig: which proposer guesses tokens ahead, and how many, in vLLM's shape.

`--speculative-config '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'`
(`LLM(..., speculative_config={...})`, a dict or its JSON). `method`: `ngram` (prompt lookup: the
longest suffix n-gram of prompt + output found earlier in them proposes the tokens that followed it)
or `draft_model` (`model`: a smaller model's folder, with the target's vocabulary, guesses greedily).
Bad keys and values are a ValueError naming `speculative_config.<key>`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 15  # 1 + k query rows a sequence: the native attention kernel takes up to 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int  # k: the most drafts a request gets a step
    prompt_lookup_min: int = 1  # ngram: the shortest suffix matched
    prompt_lookup_max: int = 4  # ngram: the longest suffix matched (tried first)
    model: str | None = None  # draft_model: the draft's folder (the target's vocabulary)
    # verify only the drafts the measured rule expects to pay this step (spec_decode/policy.py); False:
    # every draft, up to k (what tests of losslessness pin)
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method: expected one of {', '.join(METHODS)}, got {self.method!r}")
        for name, low, high in (
            ("num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS),
            ("prompt_lookup_min", 1, None),
            ("prompt_lookup_max", 1, None),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low or (high and value > high):
                span = f"from {low} to {high}" if high else f">= {low}"
                raise ValueError(f"speculative_config.{name}: expected an integer {span}, got {value!r}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError(
                "speculative_config.model: the draft's folder, required with method draft_model and only then"
            )
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"speculative_config.model: expected a folder path, got {self.model!r}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config.adaptive: expected true or false, got {self.adaptive!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config.prompt_lookup_min: {self.prompt_lookup_min} is more than prompt_lookup_max "
                f"({self.prompt_lookup_max})"
            )

    @classmethod
    def parse(cls, value: str | dict[str, Any]) -> SpeculativeConfig:
        """From the flag's JSON or a dict."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not valid JSON ({e.msg})") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config: expected a JSON object, got {type(value).__name__}")
        known = [f.name for f in fields(cls)]
        for key in value:
            if key not in known:
                raise ValueError(f"speculative_config.{key}: unknown key; expected one of {', '.join(known)}")
        for required in ("method", "num_speculative_tokens"):
            if required not in value:
                raise ValueError(f"speculative_config.{required}: required")
        return cls(**value)

    def to_json(self) -> str:
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)})
