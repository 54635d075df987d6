"""The request fields that ask for structured output, as OpenAI and vLLM spell them, to one spec.

OpenAI's `response_format` (`{"type": "text"}`, `{"type": "json_object"}`, `{"type": "json_schema",
"json_schema": {"name", "schema", "strict", "description"}}`) and vLLM's `structured_outputs` (`json`,
`json_object`, `regex`, `choice`, `grammar`) and older `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar`: at most one of them per request (a 400 naming both otherwise), turned into the
engine's `StructuredOutputsParams` and the request field it came from (which a 400 about a bad schema
or regex names).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.server.validation import RequestError

GUIDED = (
    ("guided_json", "json"),
    ("guided_regex", "regex"),
    ("guided_choice", "choice"),
    ("guided_grammar", "grammar"),
)


class _Fields(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)


class JsonSchemaFormat(_Fields):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Fields):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Fields):
    """vLLM's `structured_outputs` request field."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


def structured_spec(request: Any) -> tuple[StructuredOutputsParams | None, str | None]:
    """The spec a request's fields ask for, and the field that asked; (None, None) for plain text."""
    asked: list[tuple[str, StructuredOutputsParams]] = []
    fmt: ResponseFormat | None = request.response_format
    if fmt is not None and fmt.type == "json_object":
        asked.append(("response_format", StructuredOutputsParams(json_object=True)))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise RequestError(
                "Invalid value for 'response_format': type 'json_schema' needs 'json_schema': {'name', 'schema'}.",
                "response_format",
                "invalid_value",
            )
        asked.append(("response_format", StructuredOutputsParams(json=fmt.json_schema.schema_)))  # type: ignore[arg-type]
    so: StructuredOutputsField | None = request.structured_outputs
    if so is not None:
        asked.append(
            (
                "structured_outputs",
                _spec("structured_outputs", so.json_, so.json_object, so.regex, so.choice, so.grammar),
            )
        )
    for name, kind in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        value = getattr(request, name)
        if value is not None:
            asked.append((name, _spec(name, **{kind: value})))
    if len(asked) > 1:
        names = ", ".join(f"'{n}'" for n, _ in asked)
        raise RequestError(f"Only one structured-output field per request; got {names}.", asked[1][0], "invalid_value")
    return (asked[0][1], asked[0][0]) if asked else (None, None)


def _spec(
    field: str,
    json: dict[str, Any] | str | None = None,
    json_object: bool | None = None,
    regex: str | None = None,
    choice: list[str] | None = None,
    grammar: str | None = None,
) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(
            json=json,  # type: ignore[arg-type]
            json_object=bool(json_object),
            regex=regex,
            choice=tuple(choice) if choice is not None else None,
            grammar=grammar,
        )
    except ValueError as e:
        raise RequestError(f"Invalid value for '{field}': {e}", field, "invalid_value") from None
