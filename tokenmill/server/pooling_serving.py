"""Serving the pooling endpoints: `/v1/embeddings`, `/v1/rerank` (and `/rerank`, `/v2/rerank`), `/v1/score`
(and `/score`) — inputs tokenized and checked, run through the AsyncEngine as pooling requests, answered
in OpenAI's and vLLM's shapes.

Each input (an embedding's text, a reranker's (query, document) prompt, a text to embed for a cosine
score) is one engine request through the same scheduler as generation: its prompt computed, batched
with other requests, nothing generated, its KV freed at the end (the prefix cache keeps full blocks).
The inputs of one request start together or not at all, and whatever ends one early (a refusal, a
failure, the client gone) ends them all, as for completions. Refusals are 400s in OpenAI's shape
naming the field (`input[2]`, `documents`, `dimensions`, ...), a model that does not serve the task
included. The routes sit behind the API key like every endpoint but /health (auth.py).

A rerank or score request is answered by the model's task: a reranker (`--task rerank`) scores each
(query, document) prompt by p(yes) at its last position (`PoolingFrontEnd`); an embedding model scores
a pair by the cosine of the two embeddings (each distinct text embedded once).
"""

from __future__ import annotations

import struct
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tokenmill.engine import CheckedRequest, PoolingFrontEnd, UnsupportedTask
from tokenmill.errors import EmptyPrompt, ParamError, RequestFailed, TokenOutsideVocabulary
from tokenmill.outputs import OutputKind, RequestOutput
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.pooling_protocol import (
    EmbeddingRequest,
    EmbeddingResponse,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
    parse_pooling_request,
)
from tokenmill.server.protocol import check_prompt_cap
from tokenmill.server.serving import Server, _all_or_none, _close_all, _last, request_error
from tokenmill.server.tenancy import cache_salt
from tokenmill.server.validation import RequestError, refusal

if TYPE_CHECKING:
    from tokenmill.server.app import Handling

UNSUPPORTED_TASK = "unsupported_task"
T = TypeVar("T")


@dataclass
class PoolingJob:
    """One pooling request's engine requests, checked, ready to start together."""

    request_id: str
    model: str
    checked: list[CheckedRequest]
    cache_salt: str | None

    @property
    def prompt_tokens(self) -> int:
        return sum(len(c.prompt_token_ids) for c in self.checked)


class PoolingServer:
    """The pooling endpoints' work over the `Server` (its engine, tokenizer, caps and isolation)."""

    def __init__(self, server: Server) -> None:
        self.server = server

    @property
    def pooling(self) -> PoolingFrontEnd:
        pooling = self.server.engine.processor.pooling
        if pooling is None:
            raise RequestError("This server's model serves generation only.", "model", UNSUPPORTED_TASK)
        return pooling

    def _job(self, prefix: str, model: str | None, salt: str | None, tenant: str | None) -> PoolingJob:
        name = self.server._check_model(model)
        return PoolingJob(f"{prefix}-{uuid.uuid4().hex}", name, [], cache_salt(self.server.isolation, tenant, salt))

    def _check(
        self, prompt: str | list[int], params: PoolingParams, param: str, truncate: int | None, special: bool = True
    ) -> CheckedRequest:
        """One input tokenized, truncated (vLLM's truncate_prompt_tokens: its last tokens kept) and
        checked against the caps and the model (a 400 naming `param` otherwise)."""
        server = self.server
        ids = server.tokenizer.encode(prompt, add_special_tokens=special) if isinstance(prompt, str) else list(prompt)
        if truncate is not None:
            ids = ids[-(server.max_model_len if truncate == -1 else truncate) :]
        check_prompt_cap(len(ids), server.limits, param)
        if len(ids) > server.max_model_len:
            raise RequestError(
                f"This model's maximum context length is {server.max_model_len} tokens. However, the {param} "
                f"has {len(ids)} tokens. Please reduce its length (or set truncate_prompt_tokens).",
                param,
                "context_length_exceeded",
            )
        try:
            return server.engine.processor.checker.check_pooling(ids, params)
        except (EmptyPrompt, TokenOutsideVocabulary) as e:
            raise refusal(e, param, "max_tokens", None) from None
        except ParamError as e:
            raise invalid(param, e) from None

    @staticmethod
    def _params(build: Callable[[], T]) -> T:
        """The request's PoolingParams (or its task checked); a model that does not serve the task, or a
        field it refuses, is a 400."""
        try:
            return build()
        except UnsupportedTask as e:
            raise RequestError(f"{e}.", "model", UNSUPPORTED_TASK) from None
        except ParamError as e:
            raise invalid(e.param, e) from None

    async def run(self, job: PoolingJob) -> list[RequestOutput]:
        """Every input of the job to its end (each output's `pooled` set), or none: the first refusal,
        failure or cancellation ends the others."""
        prompts = [(f"{job.request_id}-{i}", checked) for i, checked in enumerate(job.checked)]
        try:
            streams = self.server.engine.submit(prompts, SamplingParams(), job.cache_salt, OutputKind.FINAL_ONLY)
        except ValueError as e:
            raise request_error(e) from None
        try:
            return await _all_or_none([_last(s) for s in streams])
        except (ValueError, RequestFailed) as e:
            raise request_error(e) from None
        finally:
            _close_all(streams)

    # -- embeddings --------------------------------------------------------------------------------

    def prepare_embeddings(self, req: EmbeddingRequest, tenant: str | None) -> PoolingJob:
        job = self._job("embd", req.model, req.cache_salt, tenant)
        params = self._params(lambda: self.pooling.embed_params(req.dimensions, req.normalize))
        for i, prompt in enumerate(req.inputs()):
            param = req.input_param(i)
            job.checked.append(self._check(prompt, params, param, req.truncate_prompt_tokens, req.add_special_tokens))
        return job

    async def embeddings(self, req: EmbeddingRequest, job: PoolingJob) -> dict[str, Any]:
        outs = await self.run(job)
        encode = base64_floats if req.encoding_format == "base64" else list
        data = [{"object": "embedding", "index": i, "embedding": encode(o.pooled or [])} for i, o in enumerate(outs)]
        return {
            "id": job.request_id,
            "object": "list",
            "created": int(time.time()),
            "model": job.model,
            "data": data,
            "usage": usage(job.prompt_tokens),
        }

    # -- rerank and score --------------------------------------------------------------------------

    def prepare_pairs(
        self, prefix: str, req: RerankRequest | ScoreRequest, pairs: list[tuple[str, str]], tenant: str | None
    ) -> tuple[PoolingJob, list[tuple[int, int]]]:
        """The engine requests that score `pairs`, and for pair k the outputs its score reads: a
        reranker's prompt (k, k); or, for an embedding model, each distinct text once (a, b)."""
        job = self._job(prefix, req.model, req.cache_salt, tenant)
        pooling = self.pooling
        self._params(pooling.check_scoring)
        truncate = req.truncate_prompt_tokens
        if pooling.task == "rerank":
            params = self._params(pooling.score_params)
            for k, (query, document) in enumerate(pairs):
                prompt = pooling.rerank_prompt(query, document, req.instruction)
                job.checked.append(self._check(prompt, params, _pair_param(req, k), truncate))
            return job, [(k, k) for k in range(len(pairs))]
        params = self._params(pooling.embed_params)
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))  # each distinct text embedded once
        where = {t: i for i, t in enumerate(texts)}
        first_pair: dict[str, int] = {}  # (an error names the first pair a text is in)
        for k, pair in enumerate(pairs):
            for text in pair:
                first_pair.setdefault(text, k)
        for text in texts:
            job.checked.append(self._check(text, params, _pair_param(req, first_pair[text]), truncate))
        return job, [(where[a], where[b]) for a, b in pairs]

    async def scores(self, job: PoolingJob, reads: list[tuple[int, int]]) -> list[float]:
        """Each pair's score: p(yes) of its reranker prompt, or the cosine of its two embeddings."""
        outs = await self.run(job)
        vectors = [o.pooled or [] for o in outs]
        if self.pooling.task == "rerank":
            return [vectors[a][0] for a, _ in reads]
        return [self.pooling.cosine(vectors[a], vectors[b]) for a, b in reads]

    def score_pairs(self, req: ScoreRequest) -> list[tuple[str, str]]:
        try:
            return self.pooling.pairs(req.text_1, req.text_2)
        except ParamError as e:
            raise invalid(e.param, e) from None


def invalid(param: str, e: ParamError) -> RequestError:
    """A 400 naming `param` for a value the engine refused (its message without its own field prefix)."""
    detail = str(e).removeprefix(f"{e.param}: ")
    return RequestError(f"Invalid value for '{param}': {detail}", param, "invalid_value")


def _pair_param(req: RerankRequest | ScoreRequest, k: int) -> str:
    """The field naming pair k's input in an error."""
    if isinstance(req, RerankRequest):
        return f"documents[{k}]"
    return f"text_2[{k}]" if isinstance(req.text_2, list) else "text_2"


def base64_floats(values: list[float]) -> str:
    """The values as little-endian float32 bytes in base64, as OpenAI's encoding_format "base64"."""
    import base64

    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")


def usage(prompt_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}


def rerank_results(req: RerankRequest, scores: list[float]) -> list[dict[str, Any]]:
    """The documents by relevance, most relevant first (ties in document order), the first top_n."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    if req.top_n:
        order = order[: req.top_n]
    texts = req.texts()
    return [
        {"index": i, "relevance_score": scores[i], **({"document": {"text": texts[i]}} if req.return_documents else {})}
        for i in order
    ]


def _doc(request_model: type, response_model: type) -> dict[str, Any]:
    """OpenAPI for a route whose body the handler reads itself (errors in OpenAI's shape)."""

    def ref(name: str) -> dict[str, Any]:
        return {"schema": {"$ref": f"#/components/schemas/{name}"}}

    error = {"content": {"application/json": ref("ErrorResponse")}}
    return {
        "requestBody": {"required": True, "content": {"application/json": ref(request_model.__name__)}},
        "responses": {
            "200": {"description": "OK", "content": {"application/json": ref(response_model.__name__)}},
            **{
                code: {"description": text, **error}
                for code, text in (
                    ("400", "Invalid request"),
                    ("401", "Missing or wrong API key"),
                    ("413", "Request body too large"),
                    ("429", "Too many requests waiting"),
                    ("503", "Shutting down"),
                )
            },
        },
    }


def add_pooling_routes(app: FastAPI, handling: Handling) -> None:
    """POST /v1/embeddings, /v1/rerank (/rerank, /v2/rerank) and /v1/score (/score)."""
    from tokenmill.server.app import (
        CLIENT_CLOSED_REQUEST,
        IGNORED_FIELDS_HEADER,
        ignored_fields_header,
        tenant_of,
        until_disconnected,
    )

    pooling = PoolingServer(handling.server)

    async def answer(request: Request, req: Any, work: Any) -> Response:
        headers = {}
        if req.ignored_fields:
            handling.server.note_ignored(req.ignored_fields)
            headers[IGNORED_FIELDS_HEADER] = ignored_fields_header(req.ignored_fields)
        answered, result = await until_disconnected(request, work)
        if not answered:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return JSONResponse(result, headers=headers)

    @app.post("/v1/embeddings", openapi_extra=_doc(EmbeddingRequest, EmbeddingResponse))
    async def embeddings(request: Request) -> Response:
        parsed, tenant = await handling.read_json(request), tenant_of(request)

        def prepare() -> tuple[EmbeddingRequest, PoolingJob]:
            req = parse_pooling_request(EmbeddingRequest, parsed(), handling.server.limits)
            return req, pooling.prepare_embeddings(req, tenant)

        req, job = await handling.off_loop(prepare)
        return await answer(request, req, pooling.embeddings(req, job))

    async def rerank(request: Request) -> Response:
        parsed, tenant = await handling.read_json(request), tenant_of(request)

        def prepare() -> tuple[RerankRequest, PoolingJob, list[tuple[int, int]]]:
            req = parse_pooling_request(RerankRequest, parsed(), handling.server.limits)
            return req, *pooling.prepare_pairs("rerank", req, [(req.query, t) for t in req.texts()], tenant)

        req, job, reads = await handling.off_loop(prepare)

        async def work() -> dict[str, Any]:
            results = rerank_results(req, await pooling.scores(job, reads))
            return {"id": job.request_id, "model": job.model, "results": results, "usage": usage(job.prompt_tokens)}

        return await answer(request, req, work())

    async def score(request: Request) -> Response:
        parsed, tenant = await handling.read_json(request), tenant_of(request)

        def prepare() -> tuple[ScoreRequest, PoolingJob, list[tuple[int, int]]]:
            req = parse_pooling_request(ScoreRequest, parsed(), handling.server.limits)
            return req, *pooling.prepare_pairs("score", req, pooling.score_pairs(req), tenant)

        req, job, reads = await handling.off_loop(prepare)

        async def work() -> dict[str, Any]:
            data = [{"object": "score", "index": k, "score": s} for k, s in enumerate(await pooling.scores(job, reads))]
            created = int(time.time())
            return {
                "id": job.request_id,
                "object": "list",
                "created": created,
                "model": job.model,
                "data": data,
                "usage": usage(job.prompt_tokens),
            }

        return await answer(request, req, work())

    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        app.post(path, openapi_extra=_doc(RerankRequest, RerankResponse), include_in_schema=path == "/v1/rerank")(
            rerank
        )
    for path in ("/v1/score", "/score"):
        app.post(path, openapi_extra=_doc(ScoreRequest, ScoreResponse), include_in_schema=path == "/v1/score")(score)
