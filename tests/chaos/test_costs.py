"""Issue 42 items 4 and 5: what one request's constraints may cost the server.

A structured-output spec compiles on the grammar compiler's own threads under a deadline: a schema
past it is refused (and refused at once when sent again), callers of one spec share one compile, and a
bad spec is refused naming its field. Through the server: `/health` answers while a schema compiles,
and the schema's 400 comes at the deadline. A token-constraint step costs the same with 50,000 bad
words as with 100.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server_harness import start_server
from tokenmill.errors import ParamError
from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured.grammar import GrammarCompiler
from tokenmill.text.tokenizer import Tokenizer

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
    started = compiler.compiles_started
    with pytest.raises(ParamError):
        compiler.check(schema(3000))  # remembered: refused without a second compile
    assert compiler.compiles_started == started
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


def test_health_answers_while_a_schema_compiles_and_its_400_comes_at_the_deadline(tiny_model_dir):
    deadline = 0.8
    running = start_server(str(tiny_model_dir("llama")), grammar_compile_timeout=deadline)
    url = f"{running.base_url}/v1/completions"

    def ask(properties: int) -> httpx.Response:
        schema = {"type": "object", "properties": {f"p{i}": {} for i in range(properties)}}
        return httpx.post(url, json={"prompt": "x", "max_tokens": 4, "guided_json": schema}, timeout=30)

    try:
        assert ask(3).status_code == 200  # (the LLTokenizer built, not counted below)
        done, health = threading.Event(), []

        def poll() -> None:
            while not done.is_set():
                start = time.perf_counter()
                assert httpx.get(f"{running.base_url}/health", timeout=30).status_code == 200
                health.append(time.perf_counter() - start)

        poller = threading.Thread(target=poll)
        poller.start()
        try:
            start = time.perf_counter()
            refused = ask(6000)  # (65 KB, under the size cap: compiles for seconds, which go on after the 400)
            took = time.perf_counter() - start
        finally:
            done.set()
            poller.join()
        error = refused.json()["error"]
        assert refused.status_code == 400 and error["param"] == "guided_json" and "took longer" in error["message"]
        assert took < deadline + 1.5, took  # the deadline, not the compile
        assert len(health) >= 5 and max(health) < deadline, (took, health)  # not held by the compile
        started = running.server.engine.processor.grammar.compiles_started
        assert ask(6000).status_code == 400  # remembered: refused without a second compile
        assert running.server.engine.processor.grammar.compiles_started == started
        assert ask(4).status_code == 200  # others still compile
        stats = running.wait_all_free()
        assert stats.kv_blocks_free == stats.kv_blocks_total and stats.running == stats.waiting == 0, stats
    finally:
        running.stop()
