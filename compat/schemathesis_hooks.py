"""Schemathesis hooks: valid values for the `format`s that /openapi.json gives structured-output specs
written as text (tokenmill/server/openapi.py). JSON Schema cannot say "a grammar that compiles", so a
fuzzer draws these instead of random text, which the server would rightly refuse with a 400.
Loaded by `hooks` in compat/schemathesis.toml; tests/chaos/test_fields.py checks that every value
compiles and that the format names are the schema's. Plain data and schemathesis only: it runs in
the compat venv, which does not have tokenmill."""

from __future__ import annotations

FORMATS = {
    "json-schema": [
        "{}",
        '{"type": "object"}',
        '{"type": "string", "maxLength": 8}',
        '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}',
        '{"type": "array", "items": {"type": "boolean"}, "maxItems": 3}',
        '{"enum": ["yes", "no"]}',
    ],
    "regex": ["[a-z]+", "\\\\d{1,3}", "(yes|no)", "[A-Z][a-z]{0,8}", "a*b", "x"],
    "lark-or-gbnf": [
        'start: "yes" | "no"',
        "start: /[a-z]+/",
        'start: "a" start | "b"',
        'root ::= "a" [0-9]+',
        'root ::= ("x" | "y")*',
    ],
}


def register() -> None:
    """Give schemathesis (and hypothesis strategies built from /openapi.json) these values."""
    import schemathesis
    from hypothesis import strategies as st

    for name, values in FORMATS.items():
        schemathesis.openapi.format(name, st.sampled_from(values))


register()
