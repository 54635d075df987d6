"""The messages between the front end and the engine core survive a trip through bytes (no pickle)."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.engine.messages import (
    AbortRequests,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    Shutdown,
    StopRequests,
    decode,
    encode,
)
from tokenmill.outputs import EngineStats, StepStats, TokenLogprob


def roundtrip(message: object) -> object:
    data = encode(message)
    assert isinstance(data, bytes) and b"pickle" not in data
    return decode(data, type(message))


def test_every_message_round_trips_as_json():
    params = SamplingParams(n=2, temperature=0.7, top_k=5, stop=("\n\n",), logprobs=3, seed=4, max_tokens=9)
    request = EngineCoreRequest("7", [1, 2, 3], params, 99, 9, [2], 12.5, cache_salt="t", wait_for="6")
    assert roundtrip(request) == request
    assert roundtrip(AbortRequests(["1", "2"])) == AbortRequests(["1", "2"])
    assert roundtrip(StopRequests(["3"])) == StopRequests(["3"])
    assert roundtrip(Shutdown()) == Shutdown()
    lp = TokenLogprob(5, -0.25, 1, [(5, -0.25), (9, -1.5)])
    outputs = EngineCoreOutputs(
        [EngineCoreOutput("7", [5], [lp], None, "length", None, 16, 1.0, 2.0, 3.0), EngineCoreOutput("8", error="no")],
        EngineStats(1, 2, 64, 60, 0, 1, 10, 5, 20, 16, 0, 1000, 1024),
        StepStats(2, 3, 0.01, 0.008, 40, 64),
    )
    assert roundtrip(outputs) == outputs


def test_a_bad_message_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="EngineCoreRequest"):
        decode(b'{"request_id": 7}', EngineCoreRequest)
    data = encode(EngineCoreRequest("1", [1], SamplingParams(), 0, 4, [], 0.0)).replace(b'"top_p":1.0', b'"top_p":0')
    with pytest.raises(ValueError, match="top_p"):  # SamplingParams validates on the way in
        decode(data, EngineCoreRequest)


def test_a_real_core_step_round_trips(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), max_model_len=128, kv_cache_memory=64 * 24576)
    core = llm.engine.core
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=2, prompt_logprobs=1)
    for request in llm.engine.processor.add_request("r", [5, 6, 7, 8], params):
        core.add_request(roundtrip(request))  # type: ignore[arg-type]
    seen = []
    while core.has_unfinished():
        out = core.step()
        assert roundtrip(out) == out
        seen += out.outputs
    assert [len(o.new_token_ids) for o in seen] == [1, 1, 1] and seen[-1].finish_reason == "length"
    assert seen[0].new_prompt_logprobs is not None and len(seen[0].new_prompt_logprobs) == 3
