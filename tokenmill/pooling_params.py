"""PoolingParams: what a prompt-only request wants from the model instead of new tokens (frozen, validated).

A pooling request runs through the same scheduler as generation: its prompt is computed (in chunks,
batched with other requests' prompts and decodes), nothing is sampled, and when the chunk that
reaches its last prompt token has run it finishes with one vector:

- `task="embed"`: the final norm's output (the hidden states the output projection reads) pooled over
  the prompt's positions: the last token's (`last`, as Qwen3-Embedding and other decoder embedders),
  their mean (`mean`), or the first token's (`cls`); then truncated to `dimensions` (a Matryoshka
  model's shorter embedding) and L2-normalized where `normalize`.
- `task="score"`: the probabilities of `score_token_ids` at the last position, softmax over those
  tokens' logits alone (a causal LM reranker's recipe: Qwen3-Reranker's p("yes") against "no").

Plain data: it crosses to the engine core and the runner inside the request's messages. Bad values
raise a ParamError naming the field (vLLM's `PoolingParams` names where they share one).
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.errors import ParamError

POOLING_TYPES = ("last", "mean", "cls")
POOLING_TASKS = ("embed", "score")


@dataclass(frozen=True)
class PoolingParams:
    task: str = "embed"  # embed: a pooled hidden state; score: probabilities of score_token_ids
    pooling: str = "last"  # embed: last | mean | cls
    normalize: bool = True  # embed: L2-normalize (after truncating to `dimensions`)
    dimensions: int | None = None  # embed: keep the first this many values (a Matryoshka embedding)
    score_token_ids: tuple[int, ...] = ()  # score: the tokens whose logits at the last position are compared

    def __post_init__(self) -> None:
        object.__setattr__(self, "score_token_ids", tuple(self.score_token_ids))
        if self.task not in POOLING_TASKS:
            raise ParamError("task", f"task: expected one of {', '.join(POOLING_TASKS)}, got {self.task!r}")
        if self.pooling not in POOLING_TYPES:
            raise ParamError("pooling", f"pooling: expected one of {', '.join(POOLING_TYPES)}, got {self.pooling!r}")
        if not isinstance(self.normalize, bool):
            raise ParamError("normalize", f"normalize: expected a boolean, got {self.normalize!r}")
        dims = self.dimensions
        if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or dims < 1):
            raise ParamError("dimensions", f"dimensions: expected a positive integer, got {dims!r}")
        ids = self.score_token_ids
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise ParamError("score_token_ids", f"score_token_ids: expected token ids, got {ids!r}")
        if (self.task == "score") != bool(ids):
            raise ParamError("score_token_ids", "score_token_ids: required with task score (two or more), only then")
        if self.task == "score" and len(ids) < 2:
            raise ParamError("score_token_ids", f"score_token_ids: a softmax needs two or more tokens, got {ids!r}")

    @property
    def needs_every_position(self) -> bool:
        """Whether the pooled value reads positions before the last (mean, cls): such a request
        computes its whole prompt (no prefix-cache hit skips any of it)."""
        return self.task == "embed" and self.pooling != "last"
