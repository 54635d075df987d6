"""The messages between the front end (tokenizer, output processor, server) and the engine core.

Plain dataclasses of plain values — ids, numbers, strings, lists, `SamplingParams`, `TokenLogprob`,
`EngineStats` — so that they can leave the process: `encode` / `decode` turn any of them into JSON
bytes and back (msgspec; no pickle). Today the core runs on a thread of the server's process; a
later issue can put it in another process or on another machine without touching either side.

Into the core: `EngineCoreRequest` (a request's token ids, sampling parameters, seed, salt, arrival),
`AbortRequests` (clients gone), `StopRequests` (a stop string matched in the front end; the core
finishes them as stopped and frees their blocks), `Shutdown`. Out of the core, once per step:
`EngineCoreOutputs`, one `EngineCoreOutput` per request that changed (the *new* token ids and
logprobs, the prompt-logprob rows of the chunk just run, finish and stop reason, cached tokens and
timestamps; or a refusal (`error`, naming the field) or a failure (`fault`)), with the engine's stats
after the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

import msgspec

from tokenmill.outputs import EngineStats, StepStats, TokenLogprob
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams

T = TypeVar("T")


@dataclass
class KVTransferParams:
    """A request's part in prefill/decode disaggregation."""

    send: bool = False  # a prefill: keep its prompt's KV for a decode engine when it finishes by length
    output_token_ids: list[int] = field(default_factory=list)  # a decode: the tokens the prefill generated


@dataclass
class EngineCoreRequest:
    request_id: str  # the core's id (one per child of an n > 1 request)
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int  # the effective seed of this sequence
    max_tokens: int  # effective: capped by the model's maximum length
    eos_token_ids: list[int]
    arrival_time: float  # time.monotonic() on the front end
    cache_salt: str | None = None
    # Start only once this request has computed (and so cached) its prompt: the other children of
    # an n > 1 request then share child 0's blocks instead of computing the prompt n times.
    wait_for: str | None = None
    kv_transfer: KVTransferParams | None = None  # disaggregated serving only
    pooling: PoolingParams | None = None  # a pooling request: prompt only, one vector back (max_tokens 0)


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class StopRequests:
    request_ids: list[str]  # finished by a stop string the front end matched


@dataclass
class Shutdown:
    pass


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprob] | None = None  # one per new token, when asked for
    new_prompt_logprobs: list[TokenLogprob] | None = None  # rows of the prompt chunk just run
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | None = None  # the stop token id that ended it
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    error: str | None = None  # the core refused the request (it never ran)
    error_param: str | None = None  # the request field the refusal names
    fault: str | None = None  # the engine failed the request (finish_reason "error"; its blocks are free)
    pooled: list[float] | None = None  # a pooling request's vector, with its finish


@dataclass
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput]
    stats: EngineStats  # after this step
    step: StepStats  # what this step did and cost


def encode(message: object) -> bytes:
    """Any message (or value) of this module as JSON bytes."""
    return msgspec.json.encode(message)


def decode(data: bytes, kind: type[T]) -> T:
    """JSON bytes back into a message of type `kind` (validated: a wrong shape raises ValueError)."""
    try:
        return msgspec.json.decode(data, type=kind)
    except msgspec.ValidationError as e:
        raise ValueError(f"{kind.__name__}: {e}") from None
