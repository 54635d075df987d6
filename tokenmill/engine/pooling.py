"""The front end's pooling: embeddings, rerank and score requests turned into pooling requests, and back.

`PoolingFrontEnd` holds the model's `PoolingConfig` (engine/pooling_config.py) and the tokenizer, and
gives what the offline `LLM` and the server share:

- `embed_params(dimensions)`: the `PoolingParams` of an embedding (the model's pooling and
  normalization; `dimensions` only where the model allows truncation, `UnsupportedTask` unless it embeds);
- `rerank_prompt(query, document)`: a causal LM reranker's prompt (its Jinja template rendered, tokenized
  as written: the template writes its own special tokens) and `score_params()`, the probability of the
  first answer token ("yes") against the others ("no") at its last position;
- `pairs(text_1, text_2)`: vLLM's pairing rules for score requests (one against many, or pairwise);
- `cosine(a, b)`: an embedding model's score of a pair.

Also the offline outputs in vLLM's shape: `EmbeddingRequestOutput` (`.outputs.embedding`) and
`ScoringRequestOutput` (`.outputs.score`). No torch here: the vectors come back as Python floats.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from tokenmill.engine.pooling_config import PoolingConfig
from tokenmill.errors import ParamError
from tokenmill.outputs import RequestOutput
from tokenmill.pooling_params import PoolingParams
from tokenmill.text.tokenizer import Tokenizer

logger = logging.getLogger("tokenmill")


class UnsupportedTask(ValueError):
    """The model does not serve this kind of request (an embedding from a generating model, say)."""


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    request_id: str
    prompt_token_ids: list[int]  # the reranker's prompt, or the two texts' token ids one after the other
    outputs: ScoringOutput
    finished: bool = True


class PoolingFrontEnd:
    def __init__(self, config: PoolingConfig, tokenizer: Tokenizer) -> None:
        """A reranker whose answer tokens (`rerank_tokens`) are not in the vocabulary fails here, at start."""
        self.config = config
        self.tokenizer = tokenizer
        self.hidden_size = config.hidden_size  # (None: not known; `dimensions` then unchecked above)
        self._score_ids = self._answer_ids() if config.task == "rerank" else None
        if config.task == "embed":
            how = "normalized" if config.normalize else "not normalized"
            logger.info("task embed: %s pooling, %s (from %s)", config.pooling, how, config.source)
        elif config.task == "rerank":
            logger.info(
                "task rerank: p(%r) against %s at the prompt's last position",
                config.rerank_tokens[0],
                ", ".join(map(repr, config.rerank_tokens[1:])),
            )

    @property
    def task(self) -> str:
        return self.config.task

    def embed_params(self, dimensions: int | None = None, normalize: bool | None = None) -> PoolingParams:
        """An embedding's PoolingParams; ParamError("dimensions") where the model allows no such truncation."""
        cfg = self.config
        if cfg.task != "embed":
            raise UnsupportedTask(f"this model serves task '{cfg.task}', not embeddings (start it with --task embed)")
        if dimensions is not None:
            if isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1:
                raise ParamError("dimensions", f"dimensions: expected a positive integer, got {dimensions!r}")
            if not cfg.matryoshka:
                raise ParamError(
                    "dimensions",
                    "dimensions: this model does not support truncated embeddings (no matryoshka_dimensions or "
                    "is_matryoshka in its config.json; start the server with --matryoshka to allow it)",
                )
            if cfg.matryoshka_dimensions and dimensions not in cfg.matryoshka_dimensions:
                allowed = ", ".join(map(str, cfg.matryoshka_dimensions))
                raise ParamError("dimensions", f"dimensions: this model supports {allowed}, got {dimensions}")
            if self.hidden_size is not None and dimensions > self.hidden_size:
                raise ParamError(
                    "dimensions", f"dimensions: {dimensions} is more than the model's {self.hidden_size} dimensions"
                )
        keep = cfg.normalize if normalize is None else normalize
        return PoolingParams(task="embed", pooling=cfg.pooling, normalize=keep, dimensions=dimensions)

    # -- scores ------------------------------------------------------------------------------------

    def check_scoring(self) -> None:
        """Score and rerank requests need an embedding model (cosine) or a reranker (its yes/no answer)."""
        if self.task not in ("embed", "rerank"):
            raise UnsupportedTask(
                f"this model serves task '{self.task}', not scores (start it with --task rerank or --task embed)"
            )

    @property
    def score_token_ids(self) -> tuple[int, ...]:
        """The vocabulary ids of the answer tokens (`rerank_tokens`), the positive one first."""
        if self._score_ids is None:
            self._score_ids = self._answer_ids()
        return self._score_ids

    def _answer_ids(self) -> tuple[int, ...]:
        """The answer tokens' vocabulary ids; a ValueError for one the vocabulary lacks."""
        hf: Any = self.tokenizer.hf
        ids = []
        for token in self.config.rerank_tokens:
            found = hf.convert_tokens_to_ids(token)
            if not isinstance(found, int) or found == hf.unk_token_id or found >= self.tokenizer.vocab_size:
                raise ValueError(f"rerank_tokens: {token!r} is not one token of the model's vocabulary")
            ids.append(found)
        return tuple(ids)

    def score_params(self) -> PoolingParams:
        return PoolingParams(task="score", score_token_ids=self.score_token_ids)

    def rerank_prompt(self, query: str, document: str, instruction: str | None = None) -> list[int]:
        """The reranker's prompt for one pair: the template rendered, encoded as written."""
        text = self._template.render(query=query, document=document, instruction=instruction)
        return self.tokenizer.encode(text, add_special_tokens=False)

    @cached_property
    def _template(self) -> Any:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(keep_trailing_newline=True)
        return env.from_string(self.config.rerank_template)

    @staticmethod
    def pairs(text_1: str | Sequence[str], text_2: str | Sequence[str]) -> list[tuple[str, str]]:
        """vLLM's score pairing: one text against one or many, or two lists of one length pairwise;
        a ParamError naming the field otherwise."""
        first = [text_1] if isinstance(text_1, str) else list(text_1)
        second = [text_2] if isinstance(text_2, str) else list(text_2)
        if not first:
            raise ParamError("text_1", "text_1: expected a text or a non-empty list of texts")
        if not second:
            raise ParamError("text_2", "text_2: expected a text or a non-empty list of texts")
        if len(first) == 1:
            return [(first[0], t) for t in second]
        if len(first) != len(second):
            raise ParamError(
                "text_2", f"text_2: {len(second)} texts for {len(first)} in text_1; give one text_1, or as many"
            )
        return list(zip(first, second, strict=True))

    @staticmethod
    def cosine(a: Sequence[float], b: Sequence[float]) -> float:
        """The cosine similarity of two embeddings (0 where either is all zeros)."""
        dot = math.fsum(x * y for x, y in zip(a, b, strict=True))
        norm = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
        return dot / norm if norm else 0.0


def embedding_output(out: RequestOutput) -> EmbeddingRequestOutput:
    """A finished embedding request's output in vLLM's offline shape."""
    assert out.pooled is not None, "a pooling request finished without its vector"
    return EmbeddingRequestOutput(out.request_id, out.prompt_token_ids, EmbeddingOutput(out.pooled))


def score_output(out: RequestOutput) -> ScoringRequestOutput:
    """A finished reranker request's output: p(the first answer token)."""
    assert out.pooled is not None, "a pooling request finished without its vector"
    return ScoringRequestOutput(out.request_id, out.prompt_token_ids, ScoringOutput(out.pooled[0]))


def cosine_output(
    a: RequestOutput, b: RequestOutput, cosine: Callable[[Sequence[float], Sequence[float]], float]
) -> ScoringRequestOutput:
    """A pair's score from two finished embedding requests: their cosine."""
    assert a.pooled is not None and b.pooled is not None, "a pooling request finished without its vector"
    ids = [*a.prompt_token_ids, *b.prompt_token_ids]
    return ScoringRequestOutput(f"{a.request_id}+{b.request_id}", ids, ScoringOutput(cosine(a.pooled, b.pooled)))
