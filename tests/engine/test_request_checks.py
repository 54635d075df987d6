"""The engine's front door (engine/request_checks.py): each limit of a request checked once, before the
engine takes it, as a ParamError naming the field. No model: the limits are given."""

from __future__ import annotations

import pytest

from tokenmill.engine.request_checks import EngineLimits, RequestChecker
from tokenmill.errors import ContextTooLong, EmptyPrompt, TokenOutsideVocabulary
from tokenmill.sampling_params import SamplingParams


def checker(max_model_len: int = 20, num_blocks: int = 4, block_size: int = 4) -> RequestChecker:
    # (no tokenizer: prompts of token ids, no bad words)
    return RequestChecker(None, EngineLimits(max_model_len, 100, block_size, num_blocks, False))  # type: ignore[arg-type]


def test_model_length_and_cache_limits_are_clear_errors():
    # (moved from the scheduler, which now trusts what passed here)
    door = checker(max_model_len=20, num_blocks=4, block_size=4)
    with pytest.raises(ContextTooLong, match=r"max_tokens: prompt \(18 tokens\) \+ max_tokens \(4\) exceeds") as info:
        door.check([1] * 18, SamplingParams(max_tokens=4))
    assert (info.value.param, info.value.num_prompt_tokens, info.value.max_tokens) == ("max_tokens", 18, 4)
    with pytest.raises(ValueError, match="needs 5 KV blocks; the cache holds 4") as kv:
        door.check([1] * 15, SamplingParams(max_tokens=4))
    assert kv.value.param == "max_tokens"  # type: ignore[attr-defined]
    ok = door.check([1] * 12, SamplingParams(max_tokens=4))
    assert (ok.prompt, ok.prompt_token_ids, ok.max_tokens) == (None, [1] * 12, 4)
    assert checker(num_blocks=5).check([1] * 3, SamplingParams(max_tokens=None)).max_tokens == 17


def test_prompt_refusals_carry_their_figures():
    door = checker(num_blocks=5)
    with pytest.raises(EmptyPrompt, match="prompt: must not be empty"):
        door.check([], SamplingParams())
    with pytest.raises(TokenOutsideVocabulary, match=r"prompt: token ids must be integers in \[0, 100\)") as info:
        door.check([1, 2, 100, 3], SamplingParams())
    assert (info.value.param, info.value.token_id, info.value.vocab_size) == ("prompt", 100, 100)
    with pytest.raises(TokenOutsideVocabulary):
        door.check([1, True], SamplingParams())
    with pytest.raises(ContextTooLong, match="prompt: 20 tokens leave no room") as too_long:
        door.check([1] * 20, SamplingParams(max_tokens=None))
    assert (too_long.value.param, too_long.value.max_tokens, too_long.value.max_model_len) == ("prompt", None, 20)
    with pytest.raises(ValueError, match="min_tokens: 18 is more than the 17 tokens") as few:
        door.check([1] * 3, SamplingParams(max_tokens=None, min_tokens=18))
    assert few.value.param == "min_tokens"  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"logit_bias: token id 100 is outside the model's vocabulary \(100\)"):
        door.check([1], SamplingParams(logit_bias={100: 1.0}))
