"""The OpenAI-compatible request schemas and their validation: the base both endpoints share, and
completions (the chat request builds on it in `chat_protocol.py`).

Owns: `_Request` and `CompletionRequest` (strict pydantic models: no string-to-number coercion;
fields tokenmill does not know are ignored and listed, or refused with `strict_fields`; OpenAI fields
that would change the output if ignored are refused unless they hold their default),
`parse_completion_request` (raw JSON value -> request, or a `RequestError` that is a 400 in OpenAI's
error shape naming the offending parameter), and the conversion of requests into `SamplingParams`.
Responses live in `responses.py`. No I/O here: the FastAPI app reads the body, calls these, and
writes what they return.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, TypeVar, get_args

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import PydanticCustomError, core_schema

from tokenmill.sampling_params import FLOAT32_MAX, MAX_LOGPROBS, SamplingParams, StructuredOutputsParams
from tokenmill.server.caps import check_count, check_specs
from tokenmill.server.structured_fields import ResponseFormat, StructuredOutputsField, structured_spec
from tokenmill.server.validation import (
    RequestCaps,
    RequestError,
    check_unsupported,
    custom_error,
    from_validation_error,
    integral,
    is_int,
    param_of,
    show,
    split_unknown,
    unsupported_schema,
)

CONTENT_PART_SEPARATOR = "\n"  # text parts of one message are joined with this (as vLLM does)
LOGIT_BIAS_KEY = re.compile(r"[0-9]{1,10}")  # a token id, in ASCII decimal (no vocabulary is 10^10)

# ------------------------------------------------------------------------------------ request pieces

# Numbers: ints are accepted where floats are expected (JSON has no other way), strings never are.
Temperature = Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]
MinP = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
Penalty = Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)]
RepetitionPenalty = Annotated[float, Field(gt=0, le=FLOAT32_MAX, allow_inf_nan=False)]  # (the sampler's float32)
# Integers take 7 and 7.0 alike (both integers to JSON Schema); one flat Annotated each, so that the
# JSON schema keeps its bounds.
JsonInt = Annotated[int, BeforeValidator(integral)]
PositiveInt = Annotated[int, Field(ge=1), BeforeValidator(integral)]
TokenId = Annotated[int, Field(ge=0), BeforeValidator(integral)]
Logprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS), BeforeValidator(integral)]
NonEmptyStr = Annotated[str, Field(min_length=1)]
StopStrings = NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Prompt = (
    NonEmptyStr
    | Annotated[list[NonEmptyStr], Field(min_length=1)]
    | TokenIds
    | Annotated[list[TokenIds], Field(min_length=1)]
)


class _Strict(BaseModel):
    """Strict parsing: no coercion (bool is not an int, "1.0" is not a number) and no unknown fields."""

    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk


class _Request(_Strict):
    """Shared by both requests: unsupported OpenAI fields, null meaning "the default", the sampling
    fields common to both endpoints, and the JSON schema that documents the nulls."""

    UNSUPPORTED: ClassVar[tuple[str, ...]] = (
        "functions",
        "function_call",
        "suffix",
        "best_of",
        "audio",
        "modalities",
        "prediction",
        "reasoning_effort",
        "web_search_options",
        "store",
        "metadata",
        "service_tier",
    )

    _ignored_fields: list[str] = PrivateAttr(default_factory=list)
    # the structured-output spec the fields ask for and the field that asks (structured_fields.py), read once
    _structured: tuple[StructuredOutputsParams | None, str | None] = PrivateAttr(default=(None, None))

    @property
    def ignored_fields(self) -> list[str]:
        """Unknown fields dropped from the body (vLLM's policy), in the body's order."""
        return self._ignored_fields

    model: str | None = None  # absent or null: the served model, as vLLM does
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: Annotated[int, Field(ge=-1), BeforeValidator(integral)] | None = (
        None  # -1 and 0 (vLLM's "no limit") are read as None
    )
    min_p: MinP = 0.0
    n: PositiveInt = 1
    stop: StopStrings | None = None
    seed: JsonInt | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    ignore_eos: bool = False
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: NonEmptyStr | None = None  # vLLM's: prefix-cache entries shared only with the same salt
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]] | None = None
    min_tokens: Annotated[int, Field(ge=0), BeforeValidator(integral)] = (
        0  # vLLM's: no EOS, stop token or stop string before this many
    )
    allowed_token_ids: TokenIds | None = None  # vLLM's: only these may be generated
    bad_words: Annotated[list[NonEmptyStr], Field(min_length=1)] | None = None  # vLLM's: words never generated
    # structured output (server/structured_fields.py): OpenAI's response_format, or vLLM's fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @classmethod
    def _null_means_default(cls) -> list[str]:
        """Optional fields that cannot be None: OpenAI clients may send null for them, meaning the default."""
        return [
            name
            for name, f in cls.model_fields.items()
            if not f.is_required() and type(None) not in get_args(f.annotation)
        ]

    @model_validator(mode="after")
    def _read_structured(self) -> Any:
        self._structured = structured_spec(self)  # (a RequestError naming the field passes through)
        return self

    @model_validator(mode="before")
    @classmethod
    def _prepare(cls, raw: Any) -> Any:
        raw = check_unsupported(raw, cls.UNSUPPORTED)
        if isinstance(raw, dict):
            nullable = cls._null_means_default()
            raw = {k: v for k, v in raw.items() if not (v is None and k in nullable)}
        return raw

    @classmethod
    def __get_pydantic_json_schema__(
        cls, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        json_schema = handler.resolve_ref_schema(handler(schema))
        properties = json_schema.get("properties", {})
        for name in cls._null_means_default():
            prop = properties.get(name)
            if prop is None:
                continue
            keep = {k: prop.pop(k) for k in ("title", "default", "description") if k in prop}
            properties[name] = {"anyOf": [prop, {"type": "null"}], **keep}
        for name in cls.UNSUPPORTED:  # accepted with their default only, which the schema says
            properties[name] = unsupported_schema(name)
        return json_schema

    @field_validator("top_k", mode="before")
    @classmethod
    def _top_k_no_limit(cls, value: Any) -> Any:
        value = integral(value)
        return None if is_int(value) and value in (-1, 0) else value

    @field_validator("logit_bias", mode="after")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not LOGIT_BIAS_KEY.fullmatch(key):
                raise custom_error(f"keys must be token ids (decimal integers as strings), got {show(key)}.")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, value: Any) -> Any:
        if value is None or (isinstance(value, str) and value):
            return value
        if isinstance(value, list) and value and all(isinstance(s, str) and s for s in value):
            return value
        if isinstance(value, list):
            for i, s in enumerate(value):
                if not (isinstance(s, str) and s):
                    raise custom_error(f"expected a non-empty string, got {show(s)}.", (i,))
        raise custom_error(f"expected a non-empty string or a non-empty array of them, got {show(value)}.")

    def _stream_options_check(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise custom_error(
                "'stream_options' is only allowed when 'stream' is true.", ("stream_options",), whole=True
            )

    def _common_sampling(self) -> dict[str, Any]:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return {
            "n": self.n,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "seed": self.seed,
            "stop": stop,
            "stop_token_ids": tuple(self.stop_token_ids),
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "min_tokens": self.min_tokens,
            "logit_bias": {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            "allowed_token_ids": tuple(self.allowed_token_ids) if self.allowed_token_ids is not None else None,
            "bad_words": tuple(self.bad_words or ()),
            "structured_outputs": self._structured[0],
        }

    @property
    def structured_field(self) -> str | None:
        """The request field that asked for structured output (a bad spec's 400 names it)."""
        return self._structured[1]

    def _sampling_params(
        self,
        fields: dict[str, Any],
        requested: int | None,
        max_tokens_param: str,
        max_model_len: int,
        default_max_tokens: int | None,
        renames: dict[str, str],
    ) -> SamplingParams:
        # (max_tokens against the model's length: the engine's front door, see validation.refusal)
        if requested is None and default_max_tokens is not None:
            requested = min(default_max_tokens, max_model_len)
        try:
            return SamplingParams(max_tokens=requested, **fields)
        except ValueError as exc:
            name = param_of(exc)
            param = max_tokens_param if name == "max_tokens" else renames.get(name, name)
            raise RequestError(f"Invalid value for '{param}': {exc}", param, "invalid_value") from exc


def _max_tokens_limit(value: int | None, param: str, limits: RequestCaps) -> None:
    if value is not None and limits.max_tokens is not None and value > limits.max_tokens:
        raise RequestError(
            f"Invalid value for '{param}': {value} is more than this server allows ({limits.max_tokens}).",
            param,
            "invalid_value",
        )


def _common_limits(request: _Request, limits: RequestCaps) -> None:
    """The caps of `limits` on the fields both endpoints share (caps.py; the schema's sizes are checked
    before validation)."""
    if request.n > limits.max_n:
        raise RequestError(
            f"Invalid value for 'n': {request.n} is more than this server allows ({limits.max_n}).",
            "n",
            "invalid_value",
        )
    if isinstance(request.stop, list):
        check_count("stop", len(request.stop), limits.max_stop, "stop strings")
    check_count("stop_token_ids", len(request.stop_token_ids), limits.max_stop_token_ids, "token ids")
    check_count("allowed_token_ids", len(request.allowed_token_ids or ()), limits.max_allowed_token_ids, "token ids")
    check_count("logit_bias", len(request.logit_bias or {}), limits.max_logit_bias, "entries")
    words = request.bad_words or []
    check_count("bad_words", len(words), limits.max_bad_words, "words")
    check_count("bad_words", sum(map(len, words)), limits.max_bad_words_chars, "characters in all")


# ---------------------------------------------------------------------------------------- completions


class CompletionRequest(_Request):
    """POST /v1/completions."""

    UNSUPPORTED: ClassVar[tuple[str, ...]] = (*_Request.UNSUPPORTED, "tools", "tool_choice", "parallel_tool_calls")

    prompt: Prompt
    max_tokens: PositiveInt | None = 16  # null: the server's default (up to the model's length)
    logprobs: Logprobs | None = None
    echo: bool = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, value: Any) -> Any:
        def bad(message: str, loc: tuple[str | int, ...] = ()) -> PydanticCustomError:
            return custom_error(message, loc)

        shape = "expected a non-empty string, array of strings, array of token ids or array of token id arrays"
        value = integral(value)
        if isinstance(value, str):
            if not value:
                raise bad("the prompt is empty.")
            return value
        if not isinstance(value, list):
            raise bad(f"{shape}, got {show(value)}.")
        if not value:
            raise bad("the prompt is empty.")
        first = value[0]
        for i, item in enumerate(value):
            if isinstance(first, str):
                if not (isinstance(item, str) and item):
                    raise bad("expected a non-empty string.", (i,))
            elif is_int(first) or isinstance(first, bool):
                if not (is_int(item) and item >= 0):
                    raise bad(f"expected a non-negative integer token id, got {show(item)}.", (i,))
            elif isinstance(first, list):
                if not (isinstance(item, list) and item):
                    raise bad("expected a non-empty array of token ids.", (i,))
                for j, token in enumerate(item):
                    if not (is_int(token) and token >= 0):
                        raise bad(f"expected a non-negative integer token id, got {show(token)}.", (i, j))
            else:
                raise bad(f"{shape}, got {show(value)}.")
        return value

    @model_validator(mode="after")
    def _cross_field(self) -> CompletionRequest:
        self._stream_options_check()
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request, one per entry (a request may batch several)."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if is_int(self.prompt[0]):
            return [list(self.prompt)]  # type: ignore[arg-type]
        return list(self.prompt)  # type: ignore[arg-type]

    def to_sampling_params(self, max_model_len: int, default_max_tokens: int | None) -> SamplingParams:
        fields = self._common_sampling()
        fields["logprobs"] = self.logprobs
        fields["prompt_logprobs"] = self.logprobs if self.echo else None
        return self._sampling_params(
            fields, self.max_tokens, "max_tokens", max_model_len, default_max_tokens, {"prompt_logprobs": "logprobs"}
        )


def parse_completion_request(raw: Any, limits: RequestCaps) -> CompletionRequest:
    """The parsed JSON body of POST /v1/completions -> a valid request, or a RequestError (400)."""
    request = _parse(CompletionRequest, raw, limits)
    _common_limits(request, limits)
    prompts = len(request.prompts())
    check_count("prompt", prompts, limits.max_prompts, "prompts")
    if prompts * request.n > limits.max_choices:
        raise RequestError(
            f"Invalid value for 'n': n ({request.n}) x {prompts} prompts is {prompts * request.n} sequences, "
            f"this server allows at most {limits.max_choices}.",
            "n",
            "invalid_value",
        )
    _max_tokens_limit(request.max_tokens, "max_tokens", limits)
    if limits.max_prompt_tokens is not None:
        for i, prompt in enumerate(request.prompts()):
            if isinstance(prompt, list) and len(prompt) > limits.max_prompt_tokens:
                param = "prompt" if is_int(request.prompt[0]) else f"prompt[{i}]"
                raise RequestError(
                    f"Invalid value for '{param}': {len(prompt)} prompt tokens, this server allows at most "
                    f"{limits.max_prompt_tokens}.",
                    param,
                    "invalid_value",
                )
    return request


RequestT = TypeVar("RequestT", bound=_Request)


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else type(value).__name__


StrictT = TypeVar("StrictT", bound=_Strict)


def parse_model(cls: type[StrictT], raw: Any) -> StrictT:
    """A raw JSON body -> a valid `cls`, or a RequestError (400) naming the parameter."""
    if not isinstance(raw, dict):
        raise RequestError(f"The request body must be a JSON object, got {_json_kind(raw)}.", None, "invalid_body")
    try:
        return cls.model_validate(raw)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def _parse(cls: type[RequestT], raw: Any, limits: RequestCaps) -> RequestT:
    """Validate a body; fields the request type does not know are dropped and listed in
    `ignored_fields` (vLLM's policy), or refused with `limits.strict_fields`."""
    if not isinstance(raw, dict):
        raise RequestError(f"The request body must be a JSON object, got {_json_kind(raw)}.", None, "invalid_body")
    ignored: list[str] = []
    if not limits.strict_fields:
        raw, ignored = split_unknown(raw, {*cls.model_fields, *cls.UNSUPPORTED})
    check_specs(raw, limits)  # depth and size of schemas, before anything recurses into them
    try:
        request = cls.model_validate(raw)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    request._ignored_fields = ignored
    return request


def check_prompt_cap(num_prompt_tokens: int, limits: RequestCaps, param: str) -> None:
    """After tokenizing: the prompt must fit the server's cap (`max_prompt_tokens`); whether it leaves
    room in the model's length is the engine's front door's to say. `param`: "prompt", "prompt[i]" or
    "messages"."""
    if limits.max_prompt_tokens is not None and num_prompt_tokens > limits.max_prompt_tokens:
        raise RequestError(
            f"Invalid value for '{param}': {num_prompt_tokens} prompt tokens, this server allows at most "
            f"{limits.max_prompt_tokens}.",
            param,
            "invalid_value",
        )
