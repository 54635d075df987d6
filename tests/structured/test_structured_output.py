"""Structured output: on a random-weight tiny model, where nothing but the grammar's mask can make an
output valid, every output under a JSON schema parses and validates (jsonschema), regexes match and
choices are chosen; batching, n > 1, seeded sampling and preemption keep them valid, and requests
without a grammar in the same batch are untouched. Bad specs are ValueErrors naming the field."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from tokenmill.llm import LLM
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMAS = [
    {  # nested objects, required fields, bounded numbers
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "owner": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 8}, "admin": {"type": "boolean"}},
                "required": ["name", "admin"],
                "additionalProperties": False,
            },
        },
        "required": ["id", "owner"],
        "additionalProperties": False,
    },
    {  # arrays of enums, a number with bounds
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
            "score": {"type": "number", "minimum": -1, "maximum": 1, "multipleOf": 0.25},  # (else a random model
            # can draw decimals without end)
        },
        "required": ["tags", "score"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"kind": {"const": "point"}, "xy": {"type": "array", "prefixItems": [
        {"type": "integer", "minimum": 0, "maximum": 99}, {"type": "integer", "minimum": 0, "maximum": 99}],
        "items": False}}, "required": ["kind", "xy"], "additionalProperties": False},
]  # fmt: skip

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [40, 41]]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir("llama")), max_model_len=256, kv_cache_memory=64 * 24576)


def texts(outs) -> list[str]:
    return [c.text for o in outs for c in o.outputs]


@pytest.mark.parametrize("schema", SCHEMAS, ids=["nested", "enums", "array", "tuple"])
def test_every_output_validates_against_its_schema(llm, schema):
    spec = {"json": schema}
    greedy = SamplingParams(max_tokens=120, temperature=0, structured_outputs=spec)
    sampled = SamplingParams(max_tokens=120, temperature=1.0, seed=3, n=3, structured_outputs=spec)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy)
    outs += llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sampled)
    for out in outs:
        for c in out.outputs:
            assert c.finish_reason == "stop", (c.text, c.finish_reason)
            jsonschema.validate(json.loads(c.text), schema)
            assert not re.search(r"\s", re.sub(r'"(\\.|[^"\\])*"', "", c.text))  # compact: no space between tokens


def test_regex_choice_and_grammar(llm):
    pattern = r"[A-Z][a-z]{2,5}-\d{3}"
    reg = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(
        max_tokens=40, temperature=1.0, seed=2, n=2, structured_outputs={"regex": pattern}))  # fmt: skip
    assert all(re.fullmatch(pattern, t) for t in texts(reg))
    choices = ("alpha", "beta gamma", "δelta")
    pick = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(
        max_tokens=20, temperature=1.0, seed=4, n=3, structured_outputs={"choice": choices}))  # fmt: skip
    assert set(texts(pick)) <= set(choices)
    lark = 'start: "(" num ("," num)* ")"\nnum: /[0-9]/'
    gram = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(
        max_tokens=40, temperature=1.0, seed=5, n=2, structured_outputs={"grammar": lark}))  # fmt: skip
    assert all(re.fullmatch(r"\(\d(,\d)*\)", t) for t in texts(gram))


def test_plain_requests_beside_structured_ones_are_untouched_and_ignore_eos_does_not_outlive_the_grammar(llm):
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], plain)
    structured = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True, structured_outputs={"regex": "[ab]{3}"})
    mixed = llm.generate([{"prompt_token_ids": p} for p in PROMPTS] * 2, [plain] * 3 + [structured] * 3)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == [o.outputs[0].token_ids for o in alone]
    for o in mixed[3:]:  # the grammar ended the request at its end, EOS ignored or not
        assert re.fullmatch("[ab]{3}", o.outputs[0].text) and o.outputs[0].finish_reason == "stop"


def test_running_out_of_tokens_mid_structure_ends_with_length(llm):
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(
        max_tokens=3, temperature=0, structured_outputs={"json": SCHEMAS[0]}))[0].outputs[0]  # fmt: skip
    assert out.finish_reason == "length" and out.text.startswith("{")


def test_preempted_requests_keep_their_grammar_state(tiny_model_dir):
    small = LLM(str(tiny_model_dir("llama")), max_model_len=256, kv_cache_memory=18 * 24576, max_num_seqs=8)
    spec = {"json": SCHEMAS[1]}
    params = SamplingParams(max_tokens=100, temperature=1.0, seed=9, structured_outputs=spec)
    outs = small.generate([{"prompt_token_ids": [7 + i] * 30} for i in range(8)], params)
    assert small.engine.stats().preemptions > 0
    for out in outs:
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMAS[1])
    stats = small.engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({"json": '{"type": "wat"}'}, "structured_outputs.json"),
        ({"json": "{not json"}, "structured_outputs.json: not valid JSON"),
        ({"regex": "[a-"}, "structured_outputs.regex"),
        ({"grammar": "start: (("}, "structured_outputs.grammar"),
        ({"choice": []}, "structured_outputs.choice"),
        ({"regex": "a", "choice": ["a"]}, "exactly one of"),
    ],
)
def test_bad_specs_name_the_field(llm, spec, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(**spec)))


SMOLLM2 = Path(__file__).resolve().parents[2] / "models" / "smollm2-135m-instruct"


@pytest.mark.skipif(not (SMOLLM2 / "config.json").is_file(), reason="SmolLM2 not fetched (make serve fetches it)")
def test_smollm2_answers_in_json_under_a_schema_and_as_any_object():
    llm = LLM(str(SMOLLM2), max_model_len=512, kv_cache_memory=64 * 1024**2)
    ask = llm.engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Describe a fictional person (name, age, hobbies) as JSON."}]
    )
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 4},
        },
        "required": ["name", "age", "hobbies"],
        "additionalProperties": False,
    }
    params = SamplingParams(max_tokens=150, temperature=0.7, seed=0, n=2, structured_outputs={"json": schema})
    for c in llm.generate([ask], params)[0].outputs:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), schema)
    short = llm.engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Reply with a JSON object whose only key is answer and value is yes."}]
    )
    obj = SamplingParams(max_tokens=100, temperature=0, structured_outputs={"json_object": True})
    out = llm.generate([short], obj)[0].outputs[0]
    assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict)


def test_speculative_drafts_follow_the_grammar(tiny_model_dir, llm):
    """Prompt lookup proposes from the prompt; the grammar's masks follow each draft prefix, so drafts it
    refuses are rejected and the outputs equal those without speculation (greedy and seeded)."""
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    fast = LLM(str(tiny_model_dir("llama")), max_model_len=256, kv_cache_memory=64 * 24576, speculative_config=spec)
    prompts = [{"prompt_token_ids": [40, 41, 40, 41, 42] * 4}, {"prompt_token_ids": PROMPTS[1] * 3}]
    for params in (
        SamplingParams(max_tokens=60, temperature=0, structured_outputs={"json": SCHEMAS[2]}),
        SamplingParams(max_tokens=60, temperature=1.0, seed=11, structured_outputs={"json": SCHEMAS[0]}),
        SamplingParams(max_tokens=30, temperature=0, structured_outputs={"regex": "([a-z]{2} ){1,8}"}),
    ):
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        got = [o.outputs[0].token_ids for o in fast.generate(prompts, params)]
        assert got == want
    stats = fast.engine.stats()
    assert stats.spec_decode_num_draft_tokens > 0  # drafts were made and verified


def test_a_grammar_after_a_start_sequence_waits_for_it(tiny_model_dir, llm):
    """`after_tokens` (the end of a reasoning part): the tokens up to and including the sequence are the
    unconstrained output's (the oracle: the same greedy request without a grammar); what follows holds
    to the grammar. Through speculative drafts (outputs equal to those without) and preemption."""
    prompts = [{"prompt_token_ids": [40, 41, 40, 41, 42] * 4}, {"prompt_token_ids": PROMPTS[1] * 3}]
    free = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0))]
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    fast = LLM(str(tiny_model_dir("llama")), max_model_len=256, kv_cache_memory=64 * 24576, speculative_config=spec)
    for i, tokens in enumerate(free):
        for after in ((tokens[3],), (tokens[2], tokens[3])):
            start = next(k + len(after) for k in range(len(tokens)) if tuple(tokens[k : k + len(after)]) == after)
            structured = StructuredOutputsParams(json=json.dumps(SCHEMAS[2]), after_tokens=after)
            params = SamplingParams(max_tokens=60, temperature=0, structured_outputs=structured)
            out = llm.generate([prompts[i]], params)[0].outputs[0]
            assert list(out.token_ids[:start]) == list(tokens[:start])
            rest = llm.engine.tokenizer.decode(out.token_ids[start:])
            jsonschema.validate(json.loads(rest), SCHEMAS[2])
            assert out.finish_reason == "stop"
            assert fast.generate([prompts[i]], params)[0].outputs[0].token_ids == out.token_ids
    assert fast.engine.stats().spec_decode_num_draft_tokens > 0
