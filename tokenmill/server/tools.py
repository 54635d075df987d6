"""Tool calls on chat completions: the request's `tools` and `tool_choice`, and the calls in the answer.

- `tool_choice: "none"` (or no tools): a plain answer; the tools still reach the chat template.
- `"required"`: the answer is generated under a JSON schema, an array of calls (at most one with
  `parallel_tool_calls: false`), each `{"name": <one of the tools>, "arguments": <its parameters>}`.
- a named function (`{"type": "function", "function": {"name": ...}}`): the answer is that function's
  arguments, generated under its `parameters` schema.
- `"auto"` (the default with tools): the model decides; its `<tool_call>{"name", "arguments"}</tool_call>`
  blocks (Hermes-style, as Qwen's templates ask for) become `tool_calls`, the rest stays `content`.

The calls are read from the answer by `tool_stream.ToolStreamer`, streamed or not: a stream sends each
call's name first and then its arguments as they are generated.

The chat template gets the tools (`tools=` of transformers' `apply_chat_template`); a template that
has no tools section gets them described in a system message, with the `<tool_call>` format to use.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.server.tool_stream import ToolStreamer, read_calls


class _Fields(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class FunctionDef(_Fields):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolParam(_Fields):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Fields):
    name: str


class NamedToolChoice(_Fields):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


@dataclass(frozen=True)
class ToolMode:
    """How a chat request's answer relates to its tools."""

    choice: str  # "auto", "required", or "named"
    tools: tuple[ToolParam, ...]
    name: str | None = None  # the named function
    parallel: bool = True

    def spec(self) -> StructuredOutputsParams | None:
        """The schema the answer is generated under (None for "auto": the model decides)."""
        if self.choice == "named":
            return StructuredOutputsParams(json=json.dumps(_parameters(self._tool(self.name))))
        if self.choice != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": t.function.name}, "arguments": _parameters(t)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in self.tools
        ]
        schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=json.dumps(schema))

    def _tool(self, name: str | None) -> ToolParam:
        return next(t for t in self.tools if t.function.name == name)

    def answer(self, text: str, finish_reason: str | None) -> tuple[str | None, list[ToolCall], str | None]:
        """(content, tool calls, finish reason) of a finished answer, read by the same streamer as a streamed
        answer (server/tool_stream.py). An answer cut short (length) stays text."""
        if finish_reason == "length":
            return text, [], finish_reason
        content, calls = read_calls(self.choice, self.name, text)
        if not calls:
            return text, [], finish_reason
        found = [
            ToolCall(id=c.id or "", function=CalledFunction(name=c.name or "", arguments=c.arguments)) for c in calls
        ]
        return content.strip() or None, found, "tool_calls"

    def streamer(self) -> ToolStreamer:
        return ToolStreamer(self.choice, self.name)


def tool_mode(tools: list[ToolParam] | None, choice: ToolChoice | None, parallel: bool | None) -> ToolMode | None:
    """The request's mode; None when it answers in plain text (no tools, or `tool_choice: "none"`)."""
    if not tools or choice == "none":
        return None
    if isinstance(choice, NamedToolChoice):
        return ToolMode("named", tuple(tools), choice.function.name, parallel is not False)
    return ToolMode(choice or "auto", tuple(tools), None, parallel is not False)


def template_tools(tools: list[ToolParam]) -> list[dict[str, Any]]:
    """The tools as chat templates take them (OpenAI's shape)."""
    return [t.model_dump(exclude_none=True) for t in tools]


def tools_system_message(tools: list[ToolParam]) -> str:
    """For a template without a tools section: what the tools are and how to call one."""
    listed = "\n".join(json.dumps(t.function.model_dump(exclude_none=True)) for t in tools)
    return (
        "You can call these functions:\n"
        f"{listed}\n"
        'To call one, answer with <tool_call>{"name": <function name>, "arguments": <arguments object>}'
        "</tool_call> (one block per call)."
    )


def _parameters(tool: ToolParam) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}
