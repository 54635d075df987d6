"""The engine's front door: every check a request passes before the engine takes it, run once, here.

`RequestChecker.check` turns (prompt, SamplingParams) into a `CheckedRequest` or raises a
`ParamError` naming the field: the prompt (tokenized if text; not empty; ids in the vocabulary), its
length and max_tokens against the model's length (`ContextTooLong`) and the KV cache, min_tokens
against what may be generated, the structured-output spec (compiled, and cached, now), and the token
ids the parameters name (logit_bias, allowed_token_ids, stop_token_ids, bad words) against the
vocabulary. The output processor calls it from `add_request`, so `LLMEngine`, `LLM` and the
`AsyncEngine` all pass it; the server calls it while it prepares a request, off the event loop, and
hands the engine the `CheckedRequest` (which is not checked again). Behind the door nothing checks a
request again: the scheduler asserts what it relies on.

Thread-safe: it holds no per-request state (the grammar compiler has its own lock).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tokenmill.errors import ContextTooLong, EmptyPrompt, ParamError, TokenOutsideVocabulary
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured.grammar import COMPILE_TIMEOUT_S, GrammarCompiler
from tokenmill.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class EngineLimits:
    """What the front door checks a request against, as the core is sized."""

    max_model_len: int
    vocab_size: int
    block_size: int
    num_blocks: int
    prefix_caching: bool  # n > 1 children wait for child 0's prompt to be cached


@dataclass(frozen=True)
class CheckedRequest:
    """A request that passed the front door: what the engine registers without checking again."""

    prompt: str | None  # the text, when the prompt came as text
    prompt_token_ids: list[int]
    params: SamplingParams  # bad words turned into token sequences (`bad_words_token_ids`)
    max_tokens: int  # the effective limit: as asked, or as many as the model's length leaves
    pooling: PoolingParams | None = None  # a pooling request (prompt only, max_tokens 0): `check_pooling`


class RequestChecker:
    def __init__(self, tokenizer: Tokenizer, limits: EngineLimits, compile_timeout: float = COMPILE_TIMEOUT_S) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.compile_timeout = compile_timeout
        self._grammar: GrammarCompiler | None = None

    @property
    def grammar(self) -> GrammarCompiler:
        """The grammar compiler that validates structured-output specs (built on first use)."""
        if self._grammar is None:
            self._grammar = GrammarCompiler(self.tokenizer, self.limits.vocab_size, self.compile_timeout)
        return self._grammar

    def check(self, prompt: str | list[int], params: SamplingParams) -> CheckedRequest:
        """The request, checked (see the module docstring); a ParamError naming the field otherwise."""
        if not isinstance(prompt, str | list | tuple):  # (a dict's keys would pass for a list)
            raise ParamError("prompt", f"prompt: must be a string or a list of token ids, got {type(prompt).__name__}")
        text, ids = (prompt, self.tokenizer.encode(prompt)) if isinstance(prompt, str) else (None, list(prompt))
        max_tokens = self._check_length(ids, params)
        if params.structured_outputs is not None:
            self.grammar.check(params.structured_outputs)  # compiled (and cached) here: a bad spec is a 400
        return CheckedRequest(text, ids, self._with_token_constraints(params), max_tokens)

    def check_pooling(self, prompt: str | list[int], pooling: PoolingParams) -> CheckedRequest:
        """A pooling request (an embedding, a score), checked: a prompt of token ids in the vocabulary
        (text tokenized), at most the model's length (nothing is generated after it) and the KV cache."""
        if not isinstance(prompt, str | list | tuple):
            raise ParamError("prompt", f"prompt: must be a string or a list of token ids, got {type(prompt).__name__}")
        text, ids = (prompt, self.tokenizer.encode(prompt)) if isinstance(prompt, str) else (None, list(prompt))
        lim = self.limits
        if not ids:
            raise EmptyPrompt()
        bad = next((i for i, t in enumerate(ids) if not _is_token(t, lim.vocab_size)), None)
        if bad is not None:
            raise TokenOutsideVocabulary(ids[bad], lim.vocab_size)
        if len(ids) > lim.max_model_len:
            raise ParamError(
                "prompt", f"prompt: {len(ids)} tokens are more than the maximum model length ({lim.max_model_len})"
            )
        if -(-len(ids) // lim.block_size) > lim.num_blocks:
            raise ParamError("prompt", f"prompt: {len(ids)} tokens need more KV blocks than the cache holds")
        if pooling.task == "score" and not all(t < lim.vocab_size for t in pooling.score_token_ids):
            raise ParamError("score_token_ids", f"score_token_ids: outside the model's vocabulary ({lim.vocab_size})")
        return CheckedRequest(text, ids, SamplingParams(max_tokens=1, temperature=0.0), 0, pooling)

    def _check_length(self, ids: list[int], params: SamplingParams) -> int:
        """The effective max_tokens of a prompt that fits; a ParamError otherwise."""
        lim = self.limits
        if not ids:
            raise EmptyPrompt()
        bad = next((i for i, t in enumerate(ids) if not _is_token(t, lim.vocab_size)), None)
        if bad is not None:
            raise TokenOutsideVocabulary(ids[bad], lim.vocab_size)
        if len(ids) >= lim.max_model_len:
            raise ContextTooLong(len(ids), params.max_tokens, lim.max_model_len)
        max_tokens = params.max_tokens if params.max_tokens is not None else lim.max_model_len - len(ids)
        if params.min_tokens > max_tokens:
            raise ParamError(
                "min_tokens",
                f"min_tokens: {params.min_tokens} is more than the {max_tokens} tokens this request may generate",
            )
        total = len(ids) + max_tokens
        if total > lim.max_model_len:
            raise ContextTooLong(len(ids), params.max_tokens, lim.max_model_len)
        blocks = -(-total // lim.block_size)
        if blocks > lim.num_blocks:
            raise ParamError(
                "max_tokens",
                f"max_tokens: prompt + max_tokens ({total} tokens) needs {blocks} KV blocks; "
                f"the cache holds {lim.num_blocks}",
            )
        return max_tokens

    def _with_token_constraints(self, params: SamplingParams) -> SamplingParams:
        """Check the token ids a request names against the model's vocabulary (its embedding, which a
        tokenizer's added tokens may pass), and turn its bad words into token sequences: each word alone
        and after a space (barred at the start and mid-text)."""
        vocab = self.limits.vocab_size
        for name, ids in (
            ("logit_bias", list(params.logit_bias or ())),
            ("allowed_token_ids", list(params.allowed_token_ids or ())),
            ("stop_token_ids", list(params.stop_token_ids)),
        ):
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise ParamError(name, f"{name}: token id {bad} is outside the model's vocabulary ({vocab})")
        if not params.bad_words and not params.bad_words_token_ids:
            return params
        sequences: list[tuple[int, ...]] = list(params.bad_words_token_ids)
        seen = set(sequences)  # (a set: a list's `in` made 20,000 words quadratic)
        for word in params.bad_words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                if ids and ids not in seen:
                    seen.add(ids)
                    sequences.append(ids)
        # (a tokenizer may know ids the model has no embedding for: a token added to tokenizer.json)
        bad = next((t for ids in sequences for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ParamError(
                "bad_words", f"bad_words: a word becomes token id {bad}, outside the model's vocabulary ({vocab})"
            )
        return dataclasses.replace(params, bad_words_token_ids=tuple(sequences))


def _is_token(t: object, vocab_size: int) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size
