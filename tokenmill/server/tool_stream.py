"""Tool calls read from an answer as it is generated: one `ToolStreamer` per choice, fed its text delta by
delta (after any reasoning part), giving content text and the pieces of each call as they can be told.

A call's first piece carries its index, a new id and its function's name (arguments ""); the following
pieces carry fragments of its arguments, the text of the JSON value the model writes after the name, as
written. How the answer holds its calls depends on the tool mode (server/tools.py):

- `auto`: `<tool_call>{"name": "N", "arguments": VALUE}</tool_call>` blocks (Hermes style; `parameters`
  for `arguments` too) among content. Text that may begin `<tool_call>` is held back until the next delta
  tells; a block is a call once its opening `{"name": "N", "arguments":` has been read whole (nothing of
  the block is sent before), then VALUE streams. A block whose keys come in another order waits for its
  `</tool_call>` and is then a call in one piece if it parses, else content;
- `named`: the whole answer is VALUE (generated under the function's schema);
- `required`: the answer is a JSON array of `{"name": N, "arguments": VALUE}` objects (generated under
  their schema); each call streams as in `auto`; objects whose keys come in another order are read
  whole at the end.

VALUE's end is found by a scan of JSON's strings and brackets (whitespace before it is not part of the
arguments). The whole answer goes through the same streamer (`read_calls`), so a streamed call's
fragments join to exactly the arguments of the answer not streamed. A call whose answer is cut short
(finish `length`) has streamed what was generated; the answer not streamed is then left as text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from tokenmill.server.caps import parse_json

OPEN, CLOSE = "<tool_call>", "</tool_call>"
HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"([a-zA-Z0-9_.:-]{1,64})"\s*,\s*"(?:arguments|parameters)"\s*:')


@dataclass
class CallPiece:
    """A piece of a streamed call: the first has `id` and `name` (arguments ""), the rest arguments."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass
class ValueScan:
    """Where a JSON value ends, char by char: strings (with escapes) and bracket depth."""

    started: bool = False
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    done: bool = False

    def take(self, text: str) -> tuple[str, str]:
        """(the part of `text` in the value, the rest after it); leading whitespace skipped."""
        i = 0
        if not self.started:
            while i < len(text) and text[i].isspace():
                i += 1
            if i == len(text):
                return "", ""
            self.started = True
        start = i
        while i < len(text) and not self.done:
            ch = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    self.done = self.depth == 0
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]" and self.depth == 0:
                self.done = True
                break  # (a number or literal ends before this)
            elif ch in "}]":
                self.depth -= 1
                self.done = self.depth == 0
            elif self.depth == 0 and (ch.isspace() or ch in ","):
                self.done = True
                break  # (a number or literal ends before this)
            i += 1
        return text[start:i], text[i:]


@dataclass
class ToolStreamer:
    """One choice's calls and content, read delta by delta (see the module docstring)."""

    mode: str  # "auto", "named" or "required"
    name: str | None = None  # the named function
    state: str = ""
    held: str = ""
    scan: ValueScan = field(default_factory=ValueScan)
    calls: list[CallPiece] = field(default_factory=list)  # each call's first piece, arguments joined in
    whole_tail: bool = False  # required: an object not in name-then-arguments order: the rest read at the end

    def __post_init__(self) -> None:
        self.state = {"auto": "text", "named": "named", "required": "array"}[self.mode]

    def feed(self, text: str) -> tuple[str, list[CallPiece]]:
        """(content, call pieces) that `text` adds, as far as it can be told now."""
        self.held += text
        content: list[str] = []
        pieces: list[CallPiece] = []
        while self._step(content, pieces):
            pass
        return "".join(content), pieces

    def finish(self) -> tuple[str, list[CallPiece]]:
        """(content, call pieces) of what was held back, at the end of the answer."""
        content, pieces = "", []
        if self.state == "text":
            content = self.held
        elif self.state == "header" and self.mode == "auto":
            content = OPEN + self.held
        elif self.whole_tail or self.state == "element":
            pieces = self._read_rest()
        self.held, self.state = "", "done"
        return content, pieces

    # -- the states ------------------------------------------------------------------------------------

    def _step(self, content: list[str], pieces: list[CallPiece]) -> bool:
        """One move of the state machine; False when it must wait for more text."""
        if (not self.held and self.state != "named") or self.whole_tail or self.state == "done":
            return False
        if self.state == "text":
            at = self.held.find(OPEN)
            if at < 0:
                keep = _partial(self.held, OPEN)
                content.append(self.held[: len(self.held) - keep])
                self.held = self.held[len(self.held) - keep :]
                return False
            content.append(self.held[:at])
            self.held, self.state = self.held[at + len(OPEN) :], "header"
            return True
        if self.state == "named":
            pieces.append(self._start(self.name or ""))
            self.state = "value"
            return True
        if self.state in ("header", "element"):
            return self._header(content, pieces)
        if self.state == "value":
            part, self.held = self.scan.take(self.held)
            if part:
                self.calls[-1].arguments += part
                pieces.append(CallPiece(len(self.calls) - 1, part))
            if not self.scan.done:
                return False
            self.state = {"auto": "block_end", "named": "done", "required": "object_end"}[self.mode]
            return True
        return self._between(content)

    def _header(self, content: list[str], pieces: list[CallPiece]) -> bool:
        m = HEADER.match(self.held)
        if m is not None:
            pieces.append(self._start(m.group(1)))
            self.held, self.state, self.scan = self.held[m.end() :], "value", ValueScan()
            return True
        if self.mode == "required":  # (an object in another order, or the array's end)
            stripped = self.held.lstrip()
            if stripped.startswith("]"):
                self.state = "done"
            elif '"arguments"' in stripped or '"parameters"' in stripped:
                self.whole_tail = True
            return False
        end = self.held.find(CLOSE)
        if end < 0:
            return False
        block, self.held, self.state = self.held[:end], self.held[end + len(CLOSE) :], "text"
        call = _parsed_call(block)
        if call is None:
            content.append(OPEN + block + CLOSE)
        else:
            pieces += self._whole(*call)
        return True

    def _between(self, content: list[str]) -> bool:
        """After a call's value: to the end of its block (auto) or its object and the next (required)."""
        if self.state == "block_end":
            end = self.held.find(CLOSE)
            if end < 0:
                return False
            self.held, self.state = self.held[end + len(CLOSE) :], "text"
            return True
        if self.state == "object_end":
            end = self.held.find("}")
            if end < 0:
                return False
            self.held, self.state = self.held[end + 1 :], "separator"
            return True
        if self.state == "separator":
            stripped = self.held.lstrip()
            if not stripped:
                return False
            self.held, self.state = stripped[1:], "element" if stripped[0] == "," else "done"
            return True
        # array: the opening bracket
        stripped = self.held.lstrip()
        if not stripped:
            return False
        self.held, self.state = stripped[1:] if stripped[0] == "[" else stripped, "element"
        return True

    # -- calls -----------------------------------------------------------------------------------------

    def _start(self, name: str) -> CallPiece:
        call = CallPiece(len(self.calls), "", f"call_{uuid.uuid4().hex[:24]}", name)
        self.calls.append(call)
        return CallPiece(call.index, "", call.id, name)

    def _whole(self, name: str, arguments: str) -> list[CallPiece]:
        first = self._start(name)
        self.calls[-1].arguments = arguments
        return [first, CallPiece(first.index, arguments)]

    def _read_rest(self) -> list[CallPiece]:
        """required: the objects left (in whatever key order), parsed whole: `{...}, {...}]`."""
        try:
            rest = parse_json("[" + self.held.lstrip().rstrip().removesuffix("]") + "]")
        except ValueError:
            return []
        pieces: list[CallPiece] = []
        for item in rest if isinstance(rest, list) else []:
            call = _call_of(item)
            if call is not None:
                pieces += self._whole(*call)
        return pieces


def _parsed_call(block: str) -> tuple[str, str] | None:
    try:
        return _call_of(parse_json(block))
    except ValueError:
        return None


def _call_of(item: object) -> tuple[str, str] | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    args = item.get("arguments", item.get("parameters", {}))
    return item["name"], args if isinstance(args, str) else json.dumps(args)


def _partial(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (0 if none)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def read_calls(mode: str, name: str | None, text: str) -> tuple[str, list[CallPiece]]:
    """A whole answer through the streamer: (its content, its calls, arguments joined)."""
    streamer = ToolStreamer(mode, name)
    content, _ = streamer.feed(text)
    rest, _ = streamer.finish()
    return content + rest, streamer.calls


def call_deltas(pieces: list[CallPiece]) -> list[dict[str, Any]]:
    """Call pieces as a chunk's `delta.tool_calls` (OpenAI's shape: a call's first entry with its id, type,
    name and arguments "", its arguments' fragments in entries of their own)."""
    out: list[dict[str, Any]] = []
    for p in pieces:
        if p.id is not None:
            out.append(
                {"index": p.index, "id": p.id, "type": "function", "function": {"name": p.name, "arguments": ""}}
            )
        elif out and out[-1]["index"] == p.index and "id" not in out[-1]:  # (fragments in one chunk: joined)
            out[-1]["function"]["arguments"] += p.arguments
        else:
            out.append({"index": p.index, "function": {"arguments": p.arguments}})
    return out
