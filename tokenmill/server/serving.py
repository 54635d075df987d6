"""Serving one OpenAI request: tokenize, run through the AsyncEngine, and build the JSON or the SSE
stream. Completions and chat share the flow; they differ in how the prompt is made and in the shape
of what comes back.

A request with several prompts runs them concurrently as separate engine requests, started together
or not at all (`AsyncEngine.submit`); choice indices follow OpenAI (prompt i, child j -> i * n + j).
Whatever ends one of them early ends them all: a prompt refused or failed by the engine, a client gone
(streaming or not: the engine streams are closed, which aborts their requests). A request the engine
failed alone (`RequestFailed`) is a 500 in OpenAI's shape, or an error event mid-stream.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tokenmill.engine import CheckedRequest
from tokenmill.engine.async_engine import AsyncEngine, EngineUnavailable
from tokenmill.engine.request_stream import RequestStream
from tokenmill.errors import ParamError, RequestFailed
from tokenmill.outputs import CompletionOutput, OutputKind, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.chat_protocol import ChatCompletionRequest
from tokenmill.server.protocol import (
    CompletionRequest,
    RequestCaps,
    RequestError,
    check_prompt_cap,
)
from tokenmill.server.reasoning import END, PROMPT_TAIL_TOKENS, ReasoningSplits, defer_grammar, reasoning_splits
from tokenmill.server.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatMessage,
    CompletionChoice,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaMessage,
    UsageInfo,
    chat_logprobs,
    completion_logprobs,
    usage_info,
)
from tokenmill.server.tenancy import cache_salt
from tokenmill.server.tool_stream import ToolStreamer, call_deltas
from tokenmill.server.tools import ToolMode, template_tools, tools_system_message
from tokenmill.server.validation import ignored_fields_warning, param_of, refusal
from tokenmill.text.tokenizer import Tokenizer

logger = logging.getLogger("tokenmill")
T = TypeVar("T")
REQUEST_FAILED = "request_failed"  # the error code of a request the engine failed alone (500)


@dataclass
class Job:
    """One OpenAI request on its way through the engine."""

    chat: bool
    request_id: str
    model: str
    created: int
    prompts: list[list[int]]
    prompt_texts: list[str]  # for echo
    checked: list[CheckedRequest]  # each prompt as the engine's front door passed it (a CheckedRequest), to submit
    params: SamplingParams
    echo: bool
    include_usage: bool
    cache_salt: str | None
    continuous_usage: bool = False  # usage (so far) in every chunk: vLLM's continuous_usage_stats
    tool_mode: ToolMode | None = None  # a chat request with tools (server/tools.py)
    reasoning: ReasoningSplits | None = None  # a chat request's reasoning split (server/reasoning.py)
    tool_streams: dict[int, ToolStreamer] = field(default_factory=dict)  # streamed choice -> its calls so far


@dataclass
class Server:
    engine: AsyncEngine
    tokenizer: Tokenizer
    model_name: str
    max_model_len: int
    limits: RequestCaps
    isolation: str = "api-key"  # which requests share prefix-cache entries (server/tenancy.py)
    warned_fields: set[str] = field(default_factory=set)  # unknown request fields already logged (bounded)
    reasoning_parser: str | None = None  # --reasoning-parser: qwen3, deepseek_r1 (server/reasoning.py)

    def note_ignored(self, names: list[str]) -> None:
        """Log each unknown request field once per server (it is ignored, as vLLM ignores it)."""
        line = ignored_fields_warning(names, self.warned_fields)  # (bounded: names, their length, the set)
        if line is not None:
            logger.warning("%s", line)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def prepare_completion(self, req: CompletionRequest, tenant: str | None = None) -> Job:
        model = self._check_model(req.model)
        params = self._params(lambda: req.to_sampling_params(self.max_model_len, None))
        prompts, texts, checked = [], [], []
        listed = isinstance(req.prompt, list) and not isinstance(req.prompt[0], int)  # several prompts' form
        for i, p in enumerate(req.prompts()):
            param = f"prompt[{i}]" if listed else "prompt"
            ids = self.tokenizer.encode(p) if isinstance(p, str) else list(p)
            check_prompt_cap(len(ids), self.limits, param)
            checked.append(self._check(ids, params, param, "max_tokens", req.structured_field))
            prompts.append(ids)
            texts.append(p if isinstance(p, str) else self.tokenizer.decode(ids))
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        return Job(
            False,
            f"cmpl-{uuid.uuid4().hex}",
            model,
            int(time.time()),
            prompts,
            texts,
            checked,
            params,
            req.echo,
            include_usage,
            cache_salt(self.isolation, tenant, req.cache_salt),
            continuous,
        )

    def prepare_chat(self, req: ChatCompletionRequest, tenant: str | None = None) -> Job:
        model = self._check_model(req.model)
        params = self._params(lambda: req.to_sampling_params(self.max_model_len, None))
        tools = template_tools(req.tools) if req.tools else None
        explain = tools_system_message(req.tools) if req.tools else None
        try:
            ids = self.tokenizer.apply_chat_template(
                req.conversation(), req.add_generation_prompt, tools, explain, req.template_variables()
            )
        except ValueError as e:
            raise RequestError(str(e), param_of(e) or "messages", "invalid_value") from None
        check_prompt_cap(len(ids), self.limits, "messages")
        reasoning = None
        if self.reasoning_parser is not None:
            tail = self.tokenizer.decode(ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
            reasoning = reasoning_splits(self.reasoning_parser, tail, req.include_reasoning)
            params = defer_grammar(params, reasoning, self.tokenizer.encode(END, add_special_tokens=False))
        checked = self._check(ids, params, "messages", req.max_tokens_param, req.structured_field)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        return Job(
            True,
            f"chatcmpl-{uuid.uuid4().hex}",
            model,
            int(time.time()),
            [ids],
            [""],
            [checked],
            params,
            False,
            include_usage,
            cache_salt(self.isolation, tenant, req.cache_salt),
            continuous,
            req.tool_mode,
            reasoning,
        )

    def _check_model(self, model: str | None) -> str:
        """The model a request names (absent: the served one, as vLLM does); 404 for another."""
        if model is None:
            return self.model_name
        if model != self.model_name:
            raise RequestError(
                f"The model '{model}' does not exist; this server serves '{self.model_name}'.",
                "model",
                "model_not_found",
            )
        return model

    def _check(
        self, ids: list[int], params: SamplingParams, param: str, max_tokens_param: str, structured_field: str | None
    ) -> CheckedRequest:
        """One prompt through the engine's front door (here, off the event loop: a grammar compiles
        now); its refusal as the server words it (`validation.refusal`)."""
        try:
            return self.engine.processor.check(ids, params)
        except ParamError as e:
            raise refusal(e, param, max_tokens_param, structured_field) from None

    @staticmethod
    def _params(build: Callable[[], SamplingParams]) -> SamplingParams:
        try:
            return build()
        except ValueError as e:
            raise RequestError(str(e), param_of(e), "invalid_value") from None

    # -- running -------------------------------------------------------------------------------

    def _start(self, job: Job, kind: OutputKind) -> list[RequestStream]:
        """Every prompt of the job started together, or none (the refusal raised, nothing left running)."""
        prompts = [(f"{job.request_id}-{i}", checked) for i, checked in enumerate(job.checked)]
        try:
            return self.engine.submit(prompts, job.params, job.cache_salt, kind)
        except ValueError as e:
            raise request_error(e) from None

    async def complete(self, job: Job) -> dict[str, Any]:
        """Run every prompt to the end; the whole response as JSON. A prompt that fails (or the
        caller cancelled) ends the others: none runs on for an answer nobody gets."""
        streams = self._start(job, OutputKind.FINAL_ONLY)
        try:
            finals = await _all_or_none([_last(s) for s in streams])
        except (ValueError, RequestFailed) as e:
            raise request_error(e) from None
        finally:
            _close_all(streams)
        usage = usage_info(finals)
        n = job.params.n
        if job.chat:
            choices = [self._chat_choice(job, i * n + c.index, c) for i, out in enumerate(finals) for c in out.outputs]
            return ChatCompletionResponse(
                id=job.request_id, created=job.created, model=job.model, choices=choices, usage=usage
            ).model_dump(mode="json")
        completions = [
            self._completion_choice(job, i, out, c, c.text, c.logprobs, first=True)
            for i, out in enumerate(finals)
            for c in out.outputs
        ]
        return CompletionResponse(
            id=job.request_id, created=job.created, model=job.model, choices=completions, usage=usage
        ).model_dump(mode="json")

    def _chat_choice(self, job: Job, index: int, c: CompletionOutput) -> ChatChoice:
        reasoning, content = job.reasoning.split(c.text) if job.reasoning is not None else (None, c.text)
        calls, finish = [], c.finish_reason
        if job.tool_mode is not None:  # (calls are read from the answer after its reasoning)
            content, calls, finish = job.tool_mode.answer(content or "", c.finish_reason)
        return ChatChoice(
            index=index,
            message=ChatMessage(content=content, reasoning_content=reasoning, tool_calls=calls or None),
            logprobs=chat_logprobs(c.logprobs, self.token_text) if c.logprobs is not None else None,
            finish_reason=finish,
            stop_reason=c.stop_reason,
        )

    def _completion_choice(
        self, job: Job, i: int, out: RequestOutput, c: CompletionOutput, text: str, entries: Any, first: bool
    ) -> CompletionChoice:
        logprobs = None
        prefix = job.prompt_texts[i] if job.echo and first else ""
        if entries is not None:
            prompt_entries = list(out.prompt_logprobs or []) if job.echo and first else []
            ids = [*job.prompts[i], *(e.token_id for e in entries)] if prompt_entries else None
            logprobs = completion_logprobs([*prompt_entries, *entries], self.token_text, 0, ids)
        return CompletionChoice(
            index=i * job.params.n + c.index,
            text=prefix + text,
            logprobs=logprobs,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )

    async def stream(self, job: Job) -> AsyncIterator[str]:
        """SSE events for a streaming request, ending with `data: [DONE]`. Nothing is sent before the
        engine accepts every prompt, so a refused request still gets its error status. A chat request
        with tools streams its calls as they are generated (server/tool_stream.py)."""
        streams = self._start(job, OutputKind.DELTA)
        try:  # the first item (or the refusal) of each prompt, all submitted at once
            results = await asyncio.gather(*(anext(s, None) for s in streams), return_exceptions=True)
        except BaseException:
            _close_all(streams)
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            _close_all(streams)
            if isinstance(errors[0], ValueError | RequestFailed):
                raise request_error(errors[0]) from None
            raise errors[0]
        firsts = [r for r in results if not isinstance(r, BaseException)]
        return self._events(job, streams, firsts)

    async def _events(
        self, job: Job, streams: list[RequestStream], firsts: list[RequestOutput | None]
    ) -> AsyncIterator[str]:
        merged: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(i: int, s: AsyncIterator[RequestOutput], first: RequestOutput | None) -> None:
            try:
                if first is not None:
                    await merged.put((i, first))
                    async for out in s:
                        await merged.put((i, out))
            except Exception as e:  # the engine failed or shut down mid-stream: tell the client
                await merged.put((i, e))
            await merged.put((i, None))

        tasks = [asyncio.create_task(pump(i, s, f)) for i, (s, f) in enumerate(zip(streams, firsts, strict=True))]
        finals: dict[int, RequestOutput] = {}  # prompt i -> its latest (delta) output
        generated = 0  # completion tokens over every choice (deltas: each token counted once)
        started: set[int] = set()
        prompt_tokens = sum(len(p) for p in job.prompts)

        def emit(chunk: ChatCompletionChunk | CompletionStreamResponse) -> str:
            # pydantic's own JSON writer: one pass per token's chunk, no dict built in between
            if not job.continuous_usage:
                return f"data: {chunk.model_dump_json(exclude={'usage'})}\n\n"
            chunk.usage = UsageInfo(
                prompt_tokens=prompt_tokens, completion_tokens=generated, total_tokens=prompt_tokens + generated
            )
            return f"data: {chunk.model_dump_json()}\n\n"

        try:
            if job.chat:
                for i in range(len(streams)):
                    for j in range(job.params.n):
                        yield emit(
                            self._chat_chunk(job, i * job.params.n + j, DeltaMessage(role="assistant", content=""))
                        )
            open_streams = len(streams)
            while open_streams:
                i, out = await merged.get()
                if out is None:
                    open_streams -= 1
                    continue
                if isinstance(out, BaseException):  # OpenAI-shaped error event, then the end of the stream
                    yield _sse(stream_error(out))
                    yield "data: [DONE]\n\n"
                    return
                finals[i] = out
                generated += sum(len(c.token_ids) for c in out.outputs)
                for c in out.outputs:
                    chunk = self._chunk_for(job, i, out, c, first=(i, c.index) not in started)
                    if chunk is not None:
                        started.add((i, c.index))
                        yield emit(chunk)
            if job.include_usage:
                usage = usage_info([finals[i] for i in sorted(finals)], completion_tokens=generated)
                cls = ChatCompletionChunk if job.chat else CompletionStreamResponse
                chunk = cls(id=job.request_id, created=job.created, model=job.model, choices=[], usage=usage)
                yield _sse(chunk.model_dump(mode="json"))
            yield "data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()
            # the pumps stopped (each abort its stream's request as it is cancelled), the rest closed
            await asyncio.gather(*tasks, return_exceptions=True)
            _close_all(streams)

    def _chunk_for(
        self, job: Job, i: int, out: RequestOutput, c: CompletionOutput, first: bool
    ) -> ChatCompletionChunk | CompletionStreamResponse | None:
        """The chunk of one choice's delta (its text, and the logprobs of the tokens that made it)."""
        key = i * job.params.n + c.index
        if not c.text and c.finish_reason is None and not (job.echo and first):
            return None
        entries = c.logprobs
        if job.chat:
            logprobs = chat_logprobs(entries, self.token_text) if entries else None
            reasoning, content, calls, finish = None, c.text, None, c.finish_reason
            if job.reasoning is not None:  # (text that may start a tag waits for the next delta)
                reasoning, content = job.reasoning.delta(key, c.text, c.finish_reason is not None)
            if job.tool_mode is not None:  # (calls are read after the reasoning; text that may be one waits)
                content, calls, finish = self._tool_delta(job, key, content or "", c.finish_reason)
            if reasoning is None and content is None and not calls and c.finish_reason is None and not entries:
                return None
            delta = DeltaMessage(content=content, reasoning_content=reasoning, tool_calls=calls)
            if job.reasoning is None and job.tool_mode is None:
                delta = DeltaMessage(content=c.text)
            choice = ChatChunkChoice(
                index=key,
                delta=delta,
                logprobs=logprobs,
                finish_reason=finish,
                stop_reason=c.stop_reason,
            )
            return self._chat_chunk_choice(job, choice)
        choice = self._completion_choice(job, i, out, c, c.text, entries, first)
        return CompletionStreamResponse(id=job.request_id, created=job.created, model=job.model, choices=[choice])

    @staticmethod
    def _tool_delta(
        job: Job, key: int, text: str, finish_reason: str | None
    ) -> tuple[str | None, list[dict[str, Any]] | None, str | None]:
        """(content, delta.tool_calls, finish reason) of choice `key`'s next delta with tools."""
        assert job.tool_mode is not None
        streamer = job.tool_streams.setdefault(key, job.tool_mode.streamer())
        content, pieces = streamer.feed(text)
        if finish_reason is not None:
            rest, more = streamer.finish()
            content, pieces = content + rest, pieces + more
        if finish_reason == "stop" and streamer.calls:
            finish_reason = "tool_calls"
        return content or None, call_deltas(pieces) or None, finish_reason

    def _chat_chunk(self, job: Job, index: int, delta: DeltaMessage) -> ChatCompletionChunk:
        return self._chat_chunk_choice(job, ChatChunkChoice(index=index, delta=delta))

    @staticmethod
    def _chat_chunk_choice(job: Job, choice: ChatChunkChoice) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=job.request_id, created=job.created, model=job.model, choices=[choice])


def stream_error(e: BaseException) -> dict[str, Any]:
    """The body of an error event in a stream already under way (OpenAI's error shape)."""
    if isinstance(e, EngineUnavailable):
        kind, code = "service_unavailable", e.code
    elif isinstance(e, RequestFailed):
        kind, code = "internal_error", REQUEST_FAILED
    else:
        kind, code = "internal_error", None
    return {"error": {"message": f"The request did not finish: {e}.", "type": kind, "param": None, "code": code}}


def request_error(e: ValueError | RequestFailed) -> RequestError:
    """What a request refused by the engine (400, naming the field) or failed by it alone (500) answers."""
    if isinstance(e, RequestFailed):
        return RequestError(f"The request failed: {e}.", None, REQUEST_FAILED, 500, "internal_error")
    return RequestError(str(e), param_of(e), "invalid_value")


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def _last(stream: RequestStream) -> RequestOutput:
    last = None
    async for out in stream:
        last = out
    assert last is not None and last.finished
    return last


async def _all_or_none(aws: list[Awaitable[T]]) -> list[T]:
    """Every result in order; on the first failure (or when cancelled) the others are cancelled
    before it is raised (asyncio.gather alone leaves them running)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _close_all(streams: list[RequestStream]) -> None:
    """Abort every stream's request that has not finished."""
    for s in streams:
        s.close()
