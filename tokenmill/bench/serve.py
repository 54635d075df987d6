"""The HTTP load generator: a workload against any OpenAI-compatible server, streamed, timed per chunk
(or, with `--no-stream`, one JSON response per request, timed whole).

Requests go out when due (Poisson arrivals at a request rate, all at once, or a trace's own times),
under an optional concurrency cap (closed loop when no rate is given); multi-turn turns go out when
their previous turn has finished. Each request streams (`stream_options.include_usage`): TTFT is the
first chunk carrying text, ITL the gaps between such chunks, E2E the end of the stream. Output
tokens come from the server's `usage`, or from `--tokenizer` where a server sends none, never from
the number of chunks (some servers put several tokens in one). A request that gets an HTTP error,
an error event, a dropped connection, a timeout or a stream without `[DONE]` is a failure with its
reason; the run always finishes and reports. The clock that times requests can be injected (a test's
fake time) and defaults to `time.perf_counter`; timeouts are the event loop's own, always real.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import httpx
from tqdm import tqdm

from tokenmill.bench.records import RequestRecord, Run
from tokenmill.bench.workloads import BenchRequest, BenchTokenizer, Workload, send_times


@dataclass
class ServeTarget:
    base_url: str  # e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)
    model: str
    api_key: str | None = None
    timeout_s: float = 600.0
    ignore_eos: bool = True  # vLLM, llama.cpp and tokenmill accept it; exact output lengths
    stream: bool = True  # False: one JSON response per request (TTFT = E2E then, as vLLM's bench counts it)

    def url(self, endpoint: str) -> str:
        base = self.base_url.rstrip("/")
        base = base[: -len("/v1")] if base.endswith("/v1") else base
        return f"{base}/v1/{endpoint}"


def payload(target: ServeTarget, request: BenchRequest) -> tuple[str, dict[str, Any]]:
    """(endpoint, JSON body): chat for requests with messages, completions otherwise; greedy."""
    body: dict[str, Any] = {
        "model": target.model,
        "max_tokens": request.max_tokens,
        "temperature": 0.0,
    }
    if target.stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    if target.ignore_eos:
        body["ignore_eos"] = True
    if request.messages is not None:
        return "chat/completions", {**body, "messages": request.messages}
    return "completions", {**body, "prompt": request.prompt}


def _chunk_text(chunk: dict[str, Any]) -> str:
    text = ""
    for choice in chunk.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        piece = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        if isinstance(piece, str):
            text += piece
    return text


def _error_message(status: int, body: bytes) -> str:
    """OpenAI's {"error": {"message"}}, FastAPI's {"detail"}, or the start of the body."""
    message: Any = None
    try:
        data = json.loads(body)
        if isinstance(data, dict):
            error = data.get("error")
            message = error.get("message") if isinstance(error, dict) else error
            message = message or data.get("detail") or data.get("message")
    except ValueError:
        pass
    if not message:
        message = body[:200].decode("utf-8", "replace") or "(empty body)"
    return f"HTTP {status}: {str(message)[:200]}"


async def send_one(
    client: httpx.AsyncClient,
    target: ServeTarget,
    request: BenchRequest,
    record: RequestRecord,
    t0: float,
    tokenizer: BenchTokenizer | None,
    clock: Callable[[], float] = time.perf_counter,
) -> None:
    """Send one request (streamed unless the target says not), filling `record`; never raises for
    what the server does."""
    endpoint, body = payload(target, request)
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    start = clock()
    record.start_s = start - t0
    if not target.stream:
        await _send_whole(client, target.url(endpoint), body, headers, request, record, start, tokenizer, clock)
        return
    text, usage, last, done = "", None, start, False
    try:
        async with client.stream("POST", target.url(endpoint), json=body, headers=headers) as resp:
            if resp.status_code != 200:
                record.error = _error_message(resp.status_code, await resp.aread())
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if not isinstance(chunk, dict):
                    continue
                if chunk.get("error"):
                    record.error = f"error event: {str(chunk['error'])[:200]}"
                    return
                now = clock()
                piece = _chunk_text(chunk)
                if piece:
                    if record.ttft_s is None:
                        record.ttft_s = now - start
                    else:
                        record.itl_s.append(now - last)
                    last = now
                    text += piece
                if isinstance(chunk.get("usage"), dict):
                    usage = chunk["usage"]
    except (httpx.HTTPError, json.JSONDecodeError, UnicodeDecodeError) as e:
        detail = str(e) or "no detail"
        record.error = f"{type(e).__name__}: {detail}"[:200]
        return
    if not done:
        record.error = "the stream ended before [DONE]"
        return
    record.e2e_s = (
        last if record.ttft_s is not None else clock()
    ) - start  # the last token's arrival, as vLLM measures (not the usage chunk or [DONE])
    _count_tokens(record, usage, text, request, tokenizer)


async def _send_whole(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    request: BenchRequest,
    record: RequestRecord,
    start: float,
    tokenizer: BenchTokenizer | None,
    clock: Callable[[], float],
) -> None:
    """A non-streamed request: one JSON response; its arrival is both the first and the last token's."""
    try:
        resp = await client.post(url, json=body, headers=headers)
        if resp.status_code != 200:
            record.error = _error_message(resp.status_code, resp.content)
            return
        data = resp.json()
    except (httpx.HTTPError, json.JSONDecodeError, UnicodeDecodeError) as e:
        record.error = f"{type(e).__name__}: {str(e) or 'no detail'}"[:200]
        return
    end = clock()
    if not isinstance(data, dict) or not isinstance(data.get("choices"), list):
        record.error = "the response has no choices"
        return
    text = ""
    for choice in data["choices"]:
        if isinstance(choice, dict):
            message = choice.get("message")
            piece = message.get("content") if isinstance(message, dict) else choice.get("text")
            text += piece if isinstance(piece, str) else ""
    record.ttft_s = record.e2e_s = end - start
    usage = data.get("usage")
    _count_tokens(record, usage if isinstance(usage, dict) else None, text, request, tokenizer)


def _count_tokens(
    record: RequestRecord,
    usage: dict[str, Any] | None,
    text: str,
    request: BenchRequest,
    tokenizer: BenchTokenizer | None,
) -> None:
    if usage is not None and isinstance(usage.get("completion_tokens"), int):
        record.output_tokens = usage["completion_tokens"]
        record.prompt_tokens = usage.get("prompt_tokens") if isinstance(usage.get("prompt_tokens"), int) else None
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        record.cached_tokens = cached if isinstance(cached, int) else None
    elif tokenizer is not None:
        record.output_tokens = len(tokenizer.encode(text, add_special_tokens=False))
        record.prompt_tokens = request.prompt_len
    else:
        record.error = "the server sent no usage; pass --tokenizer to count tokens"
        return
    if record.prompt_tokens is None:
        record.prompt_tokens = request.prompt_len
    record.ok = True


async def _bounded(sending: Coroutine[Any, Any, None], target: ServeTarget, record: RequestRecord) -> None:
    """The whole request within the timeout (httpx's own timeout bounds each read, not the total)."""
    try:
        await asyncio.wait_for(sending, target.timeout_s)
    except TimeoutError:
        record.ok, record.error = False, f"timeout: no complete response within {target.timeout_s:g} s"


async def run_serve_async(
    target: ServeTarget,
    workload: Workload,
    label: str,
    repeat: int = 0,
    settings: dict[str, Any] | None = None,
    request_rate: float | None = None,
    max_concurrency: int | None = None,
    tokenizer: BenchTokenizer | None = None,
    progress: bool = True,
    clock: Callable[[], float] = time.perf_counter,
) -> Run:
    reqs = workload.requests
    due = send_times(reqs, request_rate, workload.spec.seed)
    finished = [asyncio.Event() for _ in reqs]
    records = [RequestRecord(index=i, ok=False) for i in range(len(reqs))]
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    timeout = httpx.Timeout(target.timeout_s, connect=min(target.timeout_s, 30.0))
    transport = httpx.AsyncHTTPTransport(retries=0, limits=limits)
    bar = tqdm(total=len(reqs), desc=label, unit="req", disable=not progress, leave=False)
    async with httpx.AsyncClient(transport=transport, timeout=timeout) as client:
        t0 = clock()

        async def one(i: int) -> None:
            when = due[i]
            if when is None:
                await finished[reqs[i].after].wait()  # type: ignore[index]
            else:
                await asyncio.sleep(max(0.0, t0 + when - clock()))
            try:
                if gate is None:
                    await _bounded(
                        send_one(client, target, reqs[i], records[i], t0, tokenizer, clock), target, records[i]
                    )
                else:
                    async with gate:
                        await _bounded(
                            send_one(client, target, reqs[i], records[i], t0, tokenizer, clock), target, records[i]
                        )
            except Exception as e:  # anything unforeseen is this request's failure, never the run's
                records[i].ok, records[i].error = False, f"client error: {type(e).__name__}: {e}"[:200]
            finally:
                finished[i].set()
                bar.update(1)

        await asyncio.gather(*(one(i) for i in range(len(reqs))))
        duration = clock() - t0
    bar.close()
    return Run(label, repeat, dict(settings or {}), duration, records)


def run_serve(target: ServeTarget, workload: Workload, label: str, **kwargs: Any) -> Run:
    return asyncio.run(run_serve_async(target, workload, label, **kwargs))
