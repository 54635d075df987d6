"""Plain dataclasses that cross room boundaries: scheduler -> runner -> scheduler -> user.

`SchedulerOutput` says what to compute this step, `StepOutput` what the runner computed,
`RequestOutput` what a user sees. None of them holds a live object from another room.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """Sent to the runner once, the first time a request is scheduled."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int
    eos_token_ids: tuple[int, ...] = ()  # what min_tokens masks (with the stop token ids)
    output_token_ids: list[int] = field(default_factory=list)  # generated before (by a prefill engine)
    pooling: PoolingParams | None = None  # a pooling request: the runner pools its prompt, samples nothing


@dataclass
class ScheduledChunk:
    """One request's work this step: run `token_ids` at positions start_position, ... ."""

    request_id: str
    token_ids: list[int]
    start_position: int  # the request's num_computed_tokens before this step
    new_block_ids: list[int]  # blocks its table gained since it was last scheduled (the runner keeps the table)
    sample: bool  # the chunk reaches the request's last token: sample the next one
    replace_block_table: bool = False  # (re)started (first time, or after preemption): new_block_ids is the table
    num_draft_tokens: int = 0  # the last this many token_ids are drafts to verify (speculative decoding)
    # a decode the runner may run this many steps in a row, each feeding it the token it sampled (the
    # scheduler reserved the slots): it comes back with 1 to num_steps tokens, as the runner chose
    num_steps: int = 1


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData]
    chunks: list[ScheduledChunk]
    finished_request_ids: list[str]  # finished since the last step: the runner drops their state
    # the runner's proposer guesses drafts for the next step (speculative decoding: the drafts may still pay)
    draft_next: bool = False

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


@dataclass
class TokenLogprob:
    """Log-probability of one token (generated or prompt), its rank, and the top alternatives."""

    token_id: int
    logprob: float
    rank: int  # 1 = most likely
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


@dataclass
class StepOutput:
    sampled: dict[str, list[int]] = field(default_factory=dict)  # request id -> new tokens
    logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)  # one per new token
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)  # rows of this chunk
    forward_seconds: float = 0.0  # time in the model forward and the logits
    drafts: dict[str, list[int]] = field(default_factory=dict)  # the proposer's guesses for the next step
    draft_seconds: float = 0.0  # the proposer's share of the step (a draft model's pass over its tokens, the guesses)
    # request id -> why the runner failed it alone (its own processors, a NaN row); it sampled nothing
    failed: dict[str, str] = field(default_factory=dict)
    # request id -> a pooling request's vector (an embedding, or scores), once its prompt's last chunk ran
    pooled: dict[str, list[float]] = field(default_factory=dict)
    decode_steps: int = 1  # forwards this step ran in a row (runner/multi_step.py): each decode's tokens


@dataclass
class EngineStats:
    """The engine's gauges and running totals after a step (totals cumulative since start)."""

    running: int
    waiting: int  # queued, preempted, and n > 1 children waiting for child 0's prompt
    kv_blocks_total: int
    kv_blocks_free: int
    preemptions: int
    aborted: int  # requests aborted before they finished
    prompt_tokens: int  # prompt tokens computed (recomputation included)
    generated_tokens: int
    prefix_cache_queries: int  # tokens looked up
    prefix_cache_hits: int  # tokens found
    prefix_cache_evictions: int  # cached blocks taken for new tokens
    weight_bytes: int  # the model's weights as held (quantized where they are)
    kv_tokens: int  # tokens the KV cache holds (blocks x block size)
    # speculative decoding (vLLM's spec_decode_* counters): verification chunks, their draft tokens,
    # the drafts accepted, and the drafts accepted at each draft position
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    # prefill/decode disaggregation: KV copied out (a prefill engine) and in (a decode engine)
    kv_transfer_sent_bytes: int = 0
    kv_transfer_received_bytes: int = 0
    kv_transfer_sent: int = 0
    kv_transfer_received: int = 0
    kv_transfer_recomputed: int = 0  # handed over without their KV: the prompt was computed again
    kv_transfer_seconds: float = 0.0
    # structured output (the engine's side): grammars compiled and their time, compiles saved by the cache,
    # and the grammar rows' masks computed and applied, and their time
    structured_compiles: int = 0
    structured_compile_seconds: float = 0.0
    structured_cache_hits: int = 0
    structured_masks: int = 0
    structured_mask_seconds: float = 0.0
    step_failures: int = 0  # steps whose forward (or sampling) failed: their requests failed, the engine went on

    @property
    def spec_decode_acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0 without any)."""
        drafted = self.spec_decode_num_draft_tokens
        return self.spec_decode_num_accepted_tokens / drafted if drafted else 0.0

    @property
    def spec_decode_mean_accepted_length(self) -> float:
        """Tokens a verification step yields on average: 1 (the target's own) + the drafts accepted."""
        drafts = self.spec_decode_num_drafts
        return 1 + self.spec_decode_num_accepted_tokens / drafts if drafts else 0.0

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks in use (0-1)."""
        return 1 - self.kv_blocks_free / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


@dataclass
class StepStats:
    """What one engine step did and what it cost; the engine keeps the latest."""

    num_running: int
    num_batched_tokens: int
    total_seconds: float  # schedule + execute + update + detokenize
    forward_seconds: float  # the model forward and the logits only
    kv_live_tokens: int  # tokens whose KV is in the cache, over running requests
    kv_allocated_slots: int  # slots in the blocks those requests hold
    decode_steps: int = 1  # forwards it ran in a row (each decode took one token a forward)


class OutputKind(enum.Enum):
    """How a request's RequestOutputs are built (`LLMEngine.add_request(..., output_kind=)`)."""

    CUMULATIVE = "cumulative"  # each output holds everything so far (copies)
    DELTA = "delta"  # each output holds what is new since the previous one (streaming)
    FINAL_ONLY = "final_only"  # one output, when the request finishes


@dataclass
class CompletionOutput:
    """One choice of a request. Cumulative: `text`, `token_ids` and `logprobs` hold everything so
    far. Delta: only what is new since the previous output (tokens whose text is held back, e.g. a
    possible stop string, wait for it: logprobs never run ahead of the text)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or string that ended it
    text_delta: str = ""  # text added by the latest step (for streaming)


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]  # the engine's own list, shared by every output of the request: read-only
    prompt_logprobs: list[TokenLogprob | None] | None  # None for the first prompt token
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    pooled: list[float] | None = None  # a pooling request's vector (PoolingParams), when it finished
