"""The tool-call streamer on fixed answers: fed in pieces of every size, it gives the same content and calls
as the whole answer read at once, each call's fragments joining to its arguments; text that turns out not
to be a call is never sent as one, and a `<tool_call>` tag is never split into content."""

from __future__ import annotations

import json
import random

import pytest

from tokenmill.server.tool_stream import ToolStreamer, call_deltas, read_calls

AUTO = [
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "q": "a}\\"]"}}\n</tool_call>',
    '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "parameters": {"x": [1, 2]}}'
    "</tool_call> after",
    'two <tool_call>{"arguments": {"k": 1}, "name": "later"}</tool_call> keys in another order',
    "No call here, only a < and <tool_ and <tool_call>{broken</tool_call>",
    '<tool_call>{"name": "n", "arguments": 42}</tool_call>',
]
REQUIRED = [
    '[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}, {"name": "get_time", "arguments": {}}]',
    ' [ {"arguments": {"zone": "UTC"}, "name": "get_time"} ]',
]


def fed(mode: str, name: str | None, text: str, sizes: list[int]) -> tuple[str, list]:
    streamer, content, pieces, at = ToolStreamer(mode, name), [], [], 0
    for size in sizes:
        c, p = streamer.feed(text[at : at + size])
        content.append(c)
        pieces += p
        at += size
    c, p = streamer.finish()
    return "".join(content) + c, pieces + p


def splits(text: str, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    ones = [1] * len(text)
    chunks = []
    while sum(chunks) < len(text):
        chunks.append(rng.randint(1, 7))
    return [ones, chunks, [len(text)]]


@pytest.mark.parametrize(
    ("mode", "name", "text"),
    [*[("auto", None, t) for t in AUTO], *[("required", None, t) for t in REQUIRED],
     ("named", "f", ' {"zone": "Europe/Oslo", "n": [1, {"a": "]"}]} ')],
)  # fmt: skip
def test_pieces_of_every_size_give_the_whole_answers_calls(mode, name, text):
    content, calls = read_calls(mode, name, text)
    for n, sizes in enumerate(splits(text, len(text))):
        got, pieces = fed(mode, name, text, sizes)
        assert got == content, sizes
        firsts = [p for p in pieces if p.id is not None]
        assert [(p.index, p.name, p.arguments) for p in firsts] == [(c.index, c.name, "") for c in calls]
        for call in calls:
            joined = "".join(p.arguments for p in pieces if p.index == call.index and p.id is None)
            assert joined == call.arguments, (n, call)
        assert "<tool_call" not in got or "{broken" in got  # (a tag is sent as content only in a block that is no call)


def test_what_each_answer_holds():
    content, calls = read_calls("auto", None, AUTO[0])
    assert content == "Let me check.\n" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "q": 'a}"]'})
    ]
    content, calls = read_calls("auto", None, AUTO[1])
    assert content == " after" and [(c.name, c.arguments) for c in calls] == [("a", "{}"), ("b", '{"x": [1, 2]}')]
    content, calls = read_calls("auto", None, AUTO[2])
    assert content == "two  keys in another order" and [(c.name, c.arguments) for c in calls] == [("later", '{"k": 1}')]
    assert read_calls("auto", None, AUTO[3]) == (AUTO[3], [])  # (nothing held back at the end, nothing a call)
    assert [(c.name, c.arguments) for c in read_calls("auto", None, AUTO[4])[1]] == [("n", "42")]
    assert [(c.name, c.arguments) for c in read_calls("required", None, REQUIRED[0])[1]] == [
        ("get_weather", '{"city": "Paris", "unit": "c"}'),
        ("get_time", "{}"),
    ]
    assert [(c.name, c.arguments) for c in read_calls("required", None, REQUIRED[1])[1]] == [
        ("get_time", '{"zone": "UTC"}')
    ]


def test_a_tag_is_held_back_until_it_is_told_and_a_call_starts_only_with_its_name():
    streamer = ToolStreamer("auto")
    assert streamer.feed("Hi <tool") == ("Hi ", [])
    assert streamer.feed('_call>{"name": "f", "argu') == ("", [])  # (not yet known to be a call)
    content, pieces = streamer.feed('ments": {"a": ')
    assert content == "" and call_deltas(pieces) == [
        {"index": 0, "id": pieces[0].id, "type": "function", "function": {"name": "f", "arguments": ""}},
        {"index": 0, "function": {"arguments": '{"a": '}},
    ]
    assert call_deltas(streamer.feed("1}}</tool_call>")[1]) == [{"index": 0, "function": {"arguments": "1}"}}]
    assert streamer.finish() == ("", [])
