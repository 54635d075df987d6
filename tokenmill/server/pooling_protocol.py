"""The request and response schemas of the pooling endpoints: `/v1/embeddings` (OpenAI's), `/v1/rerank`
(vLLM's, as Cohere and Jina shape it) and `/v1/score` (vLLM's), their validation and their OpenAPI caps.

Owns: `EmbeddingRequest` (`input` as a text, texts, token ids or lists of them; `encoding_format` float
or base64; `dimensions`; vLLM's `truncate_prompt_tokens`, `normalize`, `add_special_tokens`),
`RerankRequest` (`query`, `documents` as texts or `{"text": ...}` objects, `top_n`, `return_documents`),
`ScoreRequest` (`text_1`, `text_2`: a text or a list each), their responses, `parse_pooling_request`
(raw JSON -> request, or a 400 in OpenAI's shape naming the field: strict types, caps, unknown fields
ignored and listed unless the server is strict), and `constrain_pooling` (/openapi.json states the
caps: the served model, inputs per request, token ids within the vocabulary). Serving lives in
`pooling_serving.py`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from tokenmill.server.caps import check_count
from tokenmill.server.validation import (
    RequestCaps,
    RequestError,
    custom_error,
    from_validation_error,
    integral,
    is_int,
    show,
    split_unknown,
)

TokenId = Annotated[int, Field(ge=0), BeforeValidator(integral)]
NonEmptyStr = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Input = (
    NonEmptyStr
    | Annotated[list[NonEmptyStr], Field(min_length=1)]
    | TokenIds
    | Annotated[list[TokenIds], Field(min_length=1)]
)
# (-1: the model's length, as vLLM's truncate_prompt_tokens)
Truncate = Annotated[int, Field(ge=1), BeforeValidator(integral)] | Literal[-1]


class _Pooling(BaseModel):
    """Strict parsing (no coercion), unknown fields refused by the model (dropped before it, and
    listed, unless the server is strict); what every pooling request shares."""

    model_config = ConfigDict(strict=True, extra="forbid")
    _ignored_fields: list[str] = PrivateAttr(default_factory=list)

    model: str | None = None  # absent or null: the served model
    user: str | None = None
    truncate_prompt_tokens: Truncate | None = None  # vLLM's: keep each input's last this many tokens
    cache_salt: NonEmptyStr | None = None  # vLLM's: prefix-cache entries shared only with the same salt

    @property
    def ignored_fields(self) -> list[str]:
        return self._ignored_fields


class EmbeddingRequest(_Pooling):
    """POST /v1/embeddings."""

    input: Input
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1), BeforeValidator(integral)] | None = None
    normalize: bool | None = None  # vLLM's: None is the model's own
    add_special_tokens: bool = True  # vLLM's: a text input's BOS (as the tokenizer adds it)

    @field_validator("input", mode="before")
    @classmethod
    def _check_input(cls, value: Any) -> Any:
        shape = "expected a non-empty string, array of strings, array of token ids or array of token id arrays"
        value = integral(value)
        if isinstance(value, str):
            if not value:
                raise custom_error("the input is empty.")
            return value
        if not isinstance(value, list) or not value:
            raise custom_error(f"{shape}, got {show(value)}.")
        first = value[0]
        for i, item in enumerate(value):
            if isinstance(first, str):
                if not (isinstance(item, str) and item):
                    raise custom_error("expected a non-empty string.", (i,))
            elif is_int(first):
                if not (is_int(item) and item >= 0):
                    raise custom_error(f"expected a non-negative integer token id, got {show(item)}.", (i,))
            elif isinstance(first, list):
                if not (isinstance(item, list) and item):
                    raise custom_error("expected a non-empty array of token ids.", (i,))
                for j, token in enumerate(item):
                    if not (is_int(token) and token >= 0):
                        raise custom_error(f"expected a non-negative integer token id, got {show(token)}.", (i, j))
            else:
                raise custom_error(f"{shape}, got {show(value)}.")
        return value

    def inputs(self) -> list[str | list[int]]:
        """The inputs, one per embedding."""
        if isinstance(self.input, str):
            return [self.input]
        if is_int(self.input[0]):
            return [list(self.input)]  # type: ignore[arg-type]
        return list(self.input)  # type: ignore[arg-type]

    def input_param(self, i: int) -> str:
        """The field naming input i in an error: `input` for one input, `input[i]` among several."""
        one = isinstance(self.input, str) or is_int(self.input[0])
        return "input" if one else f"input[{i}]"


class RerankDocument(BaseModel):
    """A document given as an object (Cohere's and Jina's form)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    text: NonEmptyStr


class RerankRequest(_Pooling):
    """POST /v1/rerank (also /rerank and /v2/rerank, as vLLM serves it)."""

    query: NonEmptyStr
    documents: Annotated[list[NonEmptyStr | RerankDocument], Field(min_length=1)]
    top_n: Annotated[int, Field(ge=0), BeforeValidator(integral)] | None = None  # 0 or absent: every document
    return_documents: bool = True
    instruction: NonEmptyStr | None = None  # a reranker template's task instruction (Qwen3-Reranker's)

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class ScoreRequest(_Pooling):
    """POST /v1/score (also /score): text_1 against each text_2, or two lists pairwise."""

    text_1: NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)]
    text_2: NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)]
    instruction: NonEmptyStr | None = None


# ------------------------------------------------------------------------------------------ responses


class PoolingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # base64: the little-endian float32 values' bytes


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankResponse(BaseModel):
    id: str
    model: str
    results: list[RerankResult]  # most relevant first
    usage: PoolingUsage


class ScoreData(BaseModel):
    object: Literal["score"] = "score"
    index: int
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


POOLING_MODELS = (EmbeddingRequest, EmbeddingResponse, RerankRequest, RerankResponse, ScoreRequest, ScoreResponse)
RequestT = TypeVar("RequestT", bound=_Pooling)


def parse_pooling_request(cls: type[RequestT], raw: Any, limits: RequestCaps) -> RequestT:
    """A raw JSON body -> a valid request of `cls`, or a RequestError (400) naming the field; unknown
    fields are dropped and listed (`ignored_fields`) unless the server is strict about fields. At most
    `limits.max_pooling_inputs` inputs, documents, or texts a side."""
    max_inputs = limits.max_pooling_inputs
    if not isinstance(raw, dict):
        raise RequestError("The request body must be a JSON object.", None, "invalid_body")
    ignored: list[str] = []
    if not limits.strict_fields:
        raw, ignored = split_unknown(raw, set(cls.model_fields))
    try:
        request = cls.model_validate(raw)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    request._ignored_fields = ignored
    if isinstance(request, EmbeddingRequest):
        check_count("input", len(request.inputs()), max_inputs, "inputs")
    elif isinstance(request, RerankRequest):
        check_count("documents", len(request.documents), max_inputs, "documents")
    elif isinstance(request, ScoreRequest):
        for name in ("text_1", "text_2"):
            value = getattr(request, name)
            check_count(name, len(value) if isinstance(value, list) else 1, max_inputs, "texts")
    return request


def constrain_pooling(components: dict[str, Any], model_name: str, limits: RequestCaps, vocab_size: int) -> None:
    """The pooling requests' schemas in `components` (in place) as this server accepts them: the served
    model, inputs per request, token ids within the vocabulary and the server's prompt cap."""
    for name, lists in (
        ("EmbeddingRequest", ("input",)),
        ("RerankRequest", ("documents",)),
        ("ScoreRequest", ("text_1", "text_2")),
    ):
        schema = components[name]
        props = schema["properties"]
        props["model"] = {"anyOf": [{"type": "string", "enum": [model_name]}, {"type": "null"}], "title": "Model"}
        for field in lists:
            for option in props[field].get("anyOf", [props[field]]):
                if option.get("type") != "array":
                    continue
                one_prompt = option["items"].get("type") == "integer"  # one input as token ids
                cap = limits.max_prompt_tokens if one_prompt else limits.max_pooling_inputs
                if cap is not None:
                    option["maxItems"] = cap
                inner = option["items"]
                if inner.get("type") == "array" and limits.max_prompt_tokens is not None:
                    inner["maxItems"] = limits.max_prompt_tokens
        _token_ids_below(props.get("input"), vocab_size)
        schema["additionalProperties"] = not limits.strict_fields


def _token_ids_below(prop: Any, vocab_size: int) -> None:
    if isinstance(prop, dict):
        if prop.get("type") == "integer" and prop.get("minimum") == 0:
            prop["maximum"] = vocab_size - 1
        for value in prop.values():
            _token_ids_below(value, vocab_size)
    elif isinstance(prop, list):
        for value in prop:
            _token_ids_below(value, vocab_size)
