"""The routes of the APIs served on the chat path: `POST /v1/messages` (Anthropic's Messages API,
server/anthropic.py) and `POST /v1/responses` (OpenAI's Responses API, stateless, server/responses_api.py).

Each route reads the body, translates it into a chat request and prepares it off the event loop (as
the chat route does), runs it through `serving.Server` until it answers or its client goes away (then
its engine request is aborted), and writes the chat answer back in the API's shape: JSON, or the API's
server-sent events. A refusal of the chat path names the field as the API calls it. Their
/openapi.json entries reference the API's request, response and error schemas.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from tokenmill.server.anthropic import MessagesRequest, parse_messages_request
from tokenmill.server.anthropic_answer import AnthropicErrorResponse, AnthropicMessageResponse
from tokenmill.server.responses import ErrorResponse
from tokenmill.server.responses_api import ResponsesRequest, parse_responses_request
from tokenmill.server.responses_api_answer import ResponseObject
from tokenmill.server.serving import Job
from tokenmill.server.translation import Translated, chat_chunks
from tokenmill.server.validation import RequestCaps, RequestError

if TYPE_CHECKING:
    from tokenmill.server.app import Handling


@dataclass(frozen=True)
class TranslatedApi:
    path: str
    parse: Callable[[Any, RequestCaps], Translated]
    request: type[BaseModel]
    response: type[BaseModel]
    error: type[BaseModel]
    events: str  # what its stream's events are, for /openapi.json


APIS = (
    TranslatedApi(
        "/v1/messages",
        parse_messages_request,
        MessagesRequest,
        AnthropicMessageResponse,
        AnthropicErrorResponse,
        "Anthropic's events: message_start, ping, content_block_start, content_block_delta, content_block_stop, "
        "message_delta, message_stop (error on a failure mid-stream)",
    ),
    TranslatedApi(
        "/v1/responses",
        parse_responses_request,
        ResponsesRequest,
        ResponseObject,
        ErrorResponse,
        "the Responses API's events: response.created, response.in_progress, response.output_item.added, "
        "response.content_part.added, response.output_text.delta / .done, response.function_call_arguments.delta "
        "/ .done, response.content_part.done, response.output_item.done, response.completed or response.incomplete",
    ),
)


def translated_models() -> tuple[type[BaseModel], ...]:
    """The schemas /openapi.json documents for these routes."""
    return tuple(m for api in APIS for m in (api.request, api.response, api.error))


def add_translated_routes(app: FastAPI, handling: Handling) -> None:
    """POST /v1/messages and /v1/responses."""
    for api in APIS:
        _add_route(app, handling, api)


def _add_route(app: FastAPI, handling: Handling, api: TranslatedApi) -> None:
    # (app.py imports this module: its helpers are read once it is loaded, when the app is built)
    from tokenmill.server.app import (
        CLIENT_CLOSED_REQUEST,
        IGNORED_FIELDS_HEADER,
        ignored_fields_header,
        tenant_of,
        until_disconnected,
    )

    server = handling.server

    async def route(request: Request) -> Response:
        parsed, tenant = await handling.read_json(request), tenant_of(request)

        def prepare() -> tuple[Translated, Job]:
            translated = api.parse(parsed(), server.limits)
            try:
                return translated, server.prepare_chat(translated.chat, tenant)
            except RequestError as e:
                raise translated.in_its_words(e) from None

        translated, job = await handling.off_loop(prepare)
        headers = {}
        if translated.ignored_fields:
            server.note_ignored(translated.ignored_fields)
            headers[IGNORED_FIELDS_HEADER] = ignored_fields_header(translated.ignored_fields)
        work = server.stream(job) if translated.stream else server.complete(job)
        answered, result = await until_disconnected(request, work)
        if not answered:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        if translated.stream:
            events = _events(translated, job, result)
            return StreamingResponse(
                events, media_type="text/event-stream", headers={**headers, "Cache-Control": "no-cache"}
            )
        return JSONResponse(translated.answer(result, job.request_id), headers=headers)

    route.__name__ = api.path.strip("/").replace("/", "_")
    app.post(api.path, openapi_extra=_documented(api))(route)


async def _events(translated: Translated, job: Job, sse: AsyncIterator[str]) -> AsyncIterator[str]:
    """The API's events of a chat stream; the chat stream closed with them (which aborts its request)."""
    try:
        async for event in translated.events(chat_chunks(sse), job.request_id, len(job.prompts[0])):
            yield event
    finally:
        close = getattr(sse, "aclose", None)
        if close is not None:
            await close()


def _documented(api: TranslatedApi) -> dict[str, Any]:
    def ref(model: type[BaseModel]) -> dict[str, Any]:
        return {"$ref": f"#/components/schemas/{model.__name__}"}

    def error(description: str) -> dict[str, Any]:
        return {"description": description, "content": {"application/json": {"schema": ref(api.error)}}}

    stream = {
        "type": "object",
        "required": ["data"],
        "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
    }
    stream["description"] = api.events
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": ref(api.request)}}},
        "responses": {
            "200": {
                "description": "The answer (JSON), or server-sent events when stream is true.",
                "content": {"application/json": {"schema": ref(api.response)}, "text/event-stream": {"schema": stream}},
            },
            "400": error("Invalid request"),
            "401": error("Missing or wrong API key"),
            "413": error("Request body too large"),
            "429": error("Too many requests waiting"),
            "503": error("Shutting down"),
        },
    }
