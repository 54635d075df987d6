"""Issue 42 items 4 and 5: what one request's constraints may cost the server.

A structured-output spec compiles on the grammar compiler's own threads under a deadline: a schema
past it is refused (and refused at once when sent again), callers of one spec share one compile, and a
bad spec is refused naming its field.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from tokenmill.engine.tokenizer import Tokenizer
from tokenmill.errors import ParamError
from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured.grammar import GrammarCompiler

DEMO = Path(__file__).resolve().parents[2] / "models" / "tokenmill-demo"


def schema(properties: int) -> StructuredOutputsParams:
    props = {f"p{i}": {"type": "integer"} for i in range(properties)}
    return StructuredOutputsParams(json=json.dumps({"type": "object", "properties": props}))


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(str(DEMO))


def test_a_schema_past_the_compile_deadline_is_refused_and_remembered(tokenizer):
    compiler = GrammarCompiler(tokenizer, 8192, compile_timeout=0.2)
    compiler.check(schema(3))  # (a small one compiles: the LLTokenizer built, not counted below)
    start = time.perf_counter()
    with pytest.raises(ParamError) as info:
        compiler.check(schema(3000))  # (compiles for seconds)
    waited = time.perf_counter() - start
    assert info.value.param == "structured_outputs.json" and "took longer" in str(info.value)
    assert waited < 0.2 + 1.0  # the caller waited for the deadline, not for the compile
    start = time.perf_counter()
    with pytest.raises(ParamError):
        compiler.check(schema(3000))  # remembered: refused without a second compile
    assert time.perf_counter() - start < 0.2
    compiler.check(schema(4))  # others still compile


def test_callers_of_one_spec_share_one_compile(tokenizer):
    compiler = GrammarCompiler(tokenizer, 8192, compile_timeout=30)
    compiler.check(schema(2))
    before = compiler.compiles
    errors: list[BaseException] = []

    def ask() -> None:
        try:
            compiler.matcher(schema(400))
        except BaseException as e:  # (collected: the assertion below names it)
            errors.append(e)

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and compiler.compiles == before + 1


def test_a_bad_spec_names_its_field(tokenizer):
    compiler = GrammarCompiler(tokenizer, 8192)
    with pytest.raises(ParamError) as info:
        compiler.check(StructuredOutputsParams(regex="(unclosed"))
    assert info.value.param == "structured_outputs.regex"
    with pytest.raises(ParamError) as info:
        compiler.check(StructuredOutputsParams(json="{not json"))
    assert info.value.param == "structured_outputs.json"
