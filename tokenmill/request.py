"""Request: the only mutable per-request state, owned by the scheduler.

A request carries its prompt, its sampled output, and `num_computed_tokens` (how many of its
tokens have their KV in the cache). The scheduler moves `num_computed_tokens` toward
`num_tokens` within a token budget per step; nothing else mutates a request.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks freed; waits to be recomputed
    FINISHED_STOPPED = "stop"  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or the model's maximum length
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # the engine failed it (its own processing, or a step it was in)

    @property
    def finished(self) -> bool:
        return self._value_ in _FINISHED_VALUES  # (by value: a str hashes in C, an Enum member in Python)


FINISHED = frozenset(
    (
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    )
)
_FINISHED_VALUES = frozenset(status.value for status in FINISHED)


@dataclass
class RequestTimes:
    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int  # the effective seed: the user's, or one the engine drew
    max_tokens: int  # effective: capped by the model's maximum length
    eos_token_ids: tuple[int, ...]
    times: RequestTimes
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_preemptions: int = 0
    cache_salt: str | None = None  # isolates this request's prefix-cache entries (per tenant)
    send_kv: bool = False  # a prefill whose prompt's KV goes to another engine when it finishes by length
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    # chained hashes of the request's first full blocks, computed once each (kept across preemption and
    # failed admissions: the tokens and the salt do not change)
    block_hashes: list[bytes] = field(default_factory=list)
    num_sent_blocks: int = 0  # blocks of its table the runner has been sent (0: send the whole table)
    # tokens a proposer guessed to follow its last one, for this step only (speculative decoding)
    draft_token_ids: list[int] = field(default_factory=list)
    # per draft position j: how often its draft j was verified with every draft before it kept, and kept
    spec_reached: list[int] = field(default_factory=list)
    spec_kept: list[int] = field(default_factory=list)
    # a pooling request (embedding, score): prompt only, finished with one vector once its prompt is computed
    pooling: PoolingParams | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]
