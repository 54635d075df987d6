"""OutputProcessor: the front end's side of a request — text in, RequestOutputs out.

Owns, per user request: passing it through the front door (`request_checks`: tokenized and checked,
once), the `n` fan-out into core requests (child i seeded from (seed, i); children 1..n-1 wait in
the core for child 0's prompt to be cached), gathering the children's `EngineCoreOutput`s back into
one `RequestOutput`, incremental detokenization and stop strings. A stop string ends a child here and
is reported back (`stop_ids`) so that the core finishes it and frees its blocks: nothing here touches
a `Request`.

RequestOutputs are built as copies, never views of state that keeps changing: cumulative (everything
so far; `LLM.generate`), deltas (what is new since the last output; streaming) or final only. In a
delta, a choice's tokens and logprobs go out once all their text has (`num_settled_tokens`): a token
whose text is partly held back (a possible stop string, an incomplete character) waits for it.

A request the core refused or failed, or whose output cannot be processed here (its detokenizer, its
stop strings), is forgotten with the error its caller gets (`ProcessedOutputs.errors`), and its other
children are finished in the core: the rest go on.

Runs wherever the front end runs (the server's event loop): it never calls the core directly.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field

from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from tokenmill.engine.pooling import PoolingFrontEnd
from tokenmill.engine.request_checks import CheckedRequest, EngineLimits, RequestChecker
from tokenmill.errors import ParamError, RequestFailed, describe
from tokenmill.outputs import CompletionOutput, OutputKind, RequestMetrics, RequestOutput, TokenLogprob
from tokenmill.sampling_params import SamplingParams, generator_seed
from tokenmill.structured.grammar import COMPILE_TIMEOUT_S, GrammarCompiler
from tokenmill.text.tokenizer import Tokenizer

__all__ = ["CheckedRequest", "EngineLimits", "OutputProcessor", "ProcessedOutputs"]

logger = logging.getLogger("tokenmill")


@dataclass
class Child:
    core_id: str
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text_delta: str = ""  # text not yet sent in an output
    sent_tokens: int = 0  # tokens (and logprobs) already sent in delta outputs
    sent_finish: bool = False  # its finish reason went out in a delta output
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None


@dataclass
class Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float
    kind: OutputKind
    children: list[Child]
    prompt_logprobs: list[TokenLogprob | None] | None
    num_cached_tokens: int = 0
    prompt_logprobs_sent: bool = False
    pooled: list[float] | None = None  # a pooling request's vector, once it finished


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    stop_ids: list[str]  # core requests to finish in the core: a stop string matched, or a sibling failed
    # request id -> what its caller gets instead of outputs: a refusal (ValueError, ParamError naming the
    # field) or a failure of the engine's (RequestFailed); the request is forgotten here
    errors: dict[str, Exception]


class OutputProcessor:
    def __init__(
        self,
        tokenizer: Tokenizer,
        limits: EngineLimits,
        seed: int = 0,
        compile_timeout: float = COMPILE_TIMEOUT_S,
        pooling: PoolingFrontEnd | None = None,
    ) -> None:
        """`pooling`: the model's embeddings / rerank / score side (None: it generates only)."""
        self.tokenizer = tokenizer
        self.pooling = pooling
        self.limits = limits
        self.checker = RequestChecker(tokenizer, limits, compile_timeout)  # the front door
        self._rng = random.Random(seed)  # draws the seeds of requests that bring none
        self._parents: dict[str, Parent] = {}
        self._children: dict[str, tuple[Parent, int]] = {}  # core id -> (parent, child index)
        self._next_id = 0

    # -- requests in -----------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | CheckedRequest,
        params: SamplingParams,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        kind: OutputKind = OutputKind.CUMULATIVE,
    ) -> list[EngineCoreRequest]:
        """Check (at the front door, `request_checks`) and register a request; the core requests to send
        (one per child). A ParamError (a ValueError naming the field) for a request that cannot run;
        nothing is registered then. A `CheckedRequest` passed the door already: it is registered with
        its own params (those it was checked with), not checked again."""
        if request_id in self._parents:
            raise ParamError("request_id", f"request_id: {request_id!r} is already in use")
        checked = prompt if isinstance(prompt, CheckedRequest) else self.checker.check(prompt, params)
        params, ids = checked.params, checked.prompt_token_ids
        arrival = time.monotonic() if arrival_time is None else arrival_time
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        # (an EOS id past the embedding can never be sampled: masking it would index past the logits)
        eos = [t for t in self.tokenizer.info.eos_token_ids if t < self.limits.vocab_size]
        children, requests = [], []
        for i in range(params.n):
            core_id = str(self._next_id)
            self._next_id += 1
            detok = IncrementalDetokenizer(
                self.tokenizer, ids, params.stop, params.skip_special_tokens, params.include_stop_str_in_output
            )
            children.append(Child(core_id, detok, logprobs=[] if params.logprobs is not None else None))
            wait_for = requests[0].request_id if i and self.limits.prefix_caching else None
            requests.append(
                EngineCoreRequest(
                    request_id=core_id,
                    prompt_token_ids=ids,
                    sampling_params=params,
                    seed=generator_seed(base_seed, i),  # child i seeded from (seed, i)
                    max_tokens=checked.max_tokens,
                    eos_token_ids=eos,
                    arrival_time=arrival,
                    cache_salt=cache_salt,
                    wait_for=wait_for,
                    pooling=checked.pooling,
                )
            )
        prompt_logprobs: list[TokenLogprob | None] | None = [None] if params.prompt_logprobs is not None else None
        parent = Parent(request_id, checked.prompt, ids, params, arrival, kind, children, prompt_logprobs)
        self._parents[request_id] = parent
        for i, child in enumerate(children):
            self._children[child.core_id] = (parent, i)
        return requests

    def check(self, prompt: str | list[int], params: SamplingParams) -> CheckedRequest:
        """The front door alone (any thread): the request checked, to add later; see `request_checks`."""
        return self.checker.check(prompt, params)

    @property
    def grammar(self) -> GrammarCompiler:
        """This front end's grammar compiler (validates structured-output specs; built on first use)."""
        return self.checker.grammar

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a request; the core ids to abort (none if it is unknown or already finished)."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return []
        for child in parent.children:
            self._children.pop(child.core_id, None)
        return [c.core_id for c in parent.children if c.finish_reason is None]

    def has_unfinished(self) -> bool:
        return bool(self._parents)

    def running(self, core_id: str) -> bool:
        """Whether an open core request's child is still running here (not ended by a stop string)."""
        found = self._children.get(core_id)
        return found is not None and found[0].children[found[1]].finish_reason is None

    def parent_of(self, core_id: str) -> str | None:
        """The request id of an open core request (None once its request is finished or aborted)."""
        found = self._children.get(core_id)
        return found[0].request_id if found is not None else None

    @property
    def num_open(self) -> int:
        return len(self._parents)

    # -- outputs ---------------------------------------------------------------------------------

    def process(self, outputs: EngineCoreOutputs) -> ProcessedOutputs:
        """One core step's outputs folded into their requests. An error processing one request's
        output (its detokenizer, its stop strings) fails that request alone."""
        touched: dict[str, Parent] = {}
        stop_ids: list[str] = []
        errors: dict[str, Exception] = {}

        def fail(parent: Parent, error: Exception, core_id: str | None = None) -> None:
            errors[parent.request_id] = error
            touched.pop(parent.request_id, None)
            stop_ids.extend(c for c in self.abort_request(parent.request_id) if c != core_id)

        for out in outputs.outputs:
            found = self._children.get(out.request_id)
            if found is None:
                continue  # aborted, or stopped by a stop string, while the step ran
            parent, index = found
            if out.error is not None or out.fault is not None:  # (finished in the core already)
                fail(parent, self._refusal(parent, out), out.request_id)
                continue
            try:
                if self._apply(parent, parent.children[index], out):
                    stop_ids.append(out.request_id)
            except Exception as e:
                logger.warning("request %s: its output could not be processed", parent.request_id, exc_info=True)
                fail(parent, RequestFailed(parent.request_id, describe("its output could not be processed", e)))
                continue
            touched[parent.request_id] = parent
        results = []
        for parent in touched.values():
            try:
                output = self._finish(parent)
            except Exception as e:
                logger.warning("request %s: its output could not be built", parent.request_id, exc_info=True)
                fail(parent, RequestFailed(parent.request_id, describe("its output could not be built", e)))
                continue
            if output is not None:
                results.append(output)
        return ProcessedOutputs(results, stop_ids, errors)

    def _finish(self, parent: Parent) -> RequestOutput | None:
        """The request's output after this step (None: nothing to hand over yet); forgotten once done."""
        finished = all(c.finish_reason is not None for c in parent.children)
        if finished:
            self._parents.pop(parent.request_id, None)
            for child in parent.children:
                self._children.pop(child.core_id, None)
        return self._output(parent, finished)

    @staticmethod
    def _refusal(parent: Parent, out: EngineCoreOutput) -> Exception:
        if out.fault is not None:
            return RequestFailed(parent.request_id, out.fault)
        message = out.error or ""
        return ParamError(out.error_param, message) if out.error_param else ValueError(message)

    def _apply(self, parent: Parent, child: Child, out: EngineCoreOutput) -> bool:
        """Fold one core output into a child; True when a stop string ended it here."""
        if child.finish_reason is not None:
            return False  # stopped here by a stop string; the core ran a step before it heard
        if out.new_prompt_logprobs and parent.prompt_logprobs is not None and child is parent.children[0]:
            parent.prompt_logprobs.extend(out.new_prompt_logprobs)
        if child is parent.children[0]:
            parent.num_cached_tokens = out.num_cached_tokens
            parent.pooled = out.pooled if out.pooled is not None else parent.pooled
        # the first engine's times (a request that moved from a prefill engine keeps that one's)
        child.first_scheduled = child.first_scheduled or out.first_scheduled_time
        child.first_token = child.first_token or out.first_token_time
        if not out.new_token_ids and out.finish_reason is None:
            return False
        # A token at a time (a speculative step brings several): the tokens after the one that completes
        # a stop string are dropped, as they would never have been generated one token a step.
        for j, token in enumerate(out.new_token_ids):
            child.token_ids.append(token)
            if child.logprobs is not None and out.new_logprobs:
                child.logprobs.append(out.new_logprobs[j])
            check_stop = len(child.token_ids) > parent.params.min_tokens  # vLLM: no stop strings before min_tokens
            update = child.detokenizer.add_tokens([token], check_stop=check_stop)
            child.text_delta += update.text_delta
            if update.stop_string is not None:  # a stop string wins over EOS or length in the same step
                child.finish_reason, child.stop_reason = "stop", update.stop_string
                child.finished = out.finished_time if out.finished_time is not None else time.monotonic()
                return out.finish_reason is None  # still running in the core: stop it there
        if out.finish_reason is not None:
            child.text_delta += child.detokenizer.flush()
            child.finish_reason, child.stop_reason = out.finish_reason, out.stop_reason
            child.finished = out.finished_time
        return False

    def _output(self, parent: Parent, finished: bool) -> RequestOutput | None:
        kind = parent.kind
        if kind is OutputKind.FINAL_ONLY and not finished:
            return None
        completions = []
        for i, child in enumerate(parent.children):
            if kind is OutputKind.DELTA:
                if child.sent_finish or (not child.text_delta and child.finish_reason is None):
                    continue  # done, or nothing to show yet: its tokens go with the text they make
                child.sent_finish = child.finish_reason is not None
                start = child.sent_tokens
                child.sent_tokens = len(child.token_ids) if child.sent_finish else child.detokenizer.num_settled_tokens
                text, token_ids = child.text_delta, child.token_ids[start : child.sent_tokens]
                logprobs = child.logprobs[start : child.sent_tokens] if child.logprobs is not None else None
            else:
                text, token_ids = child.detokenizer.output_text, list(child.token_ids)
                logprobs = list(child.logprobs) if child.logprobs is not None else None
            completions.append(
                CompletionOutput(
                    index=i,
                    text=text,
                    token_ids=token_ids,
                    logprobs=logprobs,
                    finish_reason=child.finish_reason,
                    stop_reason=child.stop_reason,
                    text_delta=child.text_delta,
                )
            )
            child.text_delta = ""
        if kind is OutputKind.DELTA and not completions:
            return None
        prompt_logprobs = None
        if parent.prompt_logprobs is not None and not (kind is OutputKind.DELTA and parent.prompt_logprobs_sent):
            prompt_logprobs = list(parent.prompt_logprobs)
            parent.prompt_logprobs_sent = True
        firsts = [c.first_scheduled for c in parent.children if c.first_scheduled is not None]
        tokens = [c.first_token for c in parent.children if c.first_token is not None]
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,  # shared, not copied each step: read-only to callers
            prompt_logprobs=prompt_logprobs,
            outputs=completions,
            finished=finished,
            num_cached_tokens=parent.num_cached_tokens,
            pooled=parent.pooled,
            metrics=RequestMetrics(
                arrival_time=parent.arrival,
                first_scheduled_time=min(firsts) if firsts else None,
                first_token_time=min(tokens) if tokens else None,
                finished_time=max(c.finished or 0.0 for c in parent.children) if finished else None,
            ),
        )
