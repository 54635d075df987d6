"""Several decode steps in a row (`decode_steps`, runner/multi_step.py): the same tokens as a step a token,
stops and lengths honoured mid-run, runs only where granted (nobody waiting, greedy, no logprobs), the
run's length kept within its time, and no leaked KV blocks."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.gguf_files import q4_k_m_types, write_gguf
from tokenmill import LLM, SamplingParams
from tokenmill.engine_args import DEMO_MODEL
from tokenmill.outputs import ScheduledChunk
from tokenmill.quant.gguf_method import GGUFEmbedding
from tokenmill.quant.int_methods import HeadRows
from tokenmill.runner.multi_step import MultiStepDecode


@pytest.fixture(scope="module")
def llama(tiny_model_dir) -> str:
    return str(tiny_model_dir("llama"))


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 4096) for _ in range(rng.randint(3, 40))] for _ in range(count)]


def run(llm: LLM, ps: list[list[int]], params: list[SamplingParams]) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """Every request's tokens, and each engine step's (requests waiting, forwards in a row)."""
    engine = llm.engine
    for i, (p, sp) in enumerate(zip(ps, params, strict=True)):
        engine.add_request(str(i), p, sp)
    steps: list[tuple[int, int]] = []
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        waiting = engine.stats().waiting
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        steps.append((waiting, engine.last_step.decode_steps))
    stats = llm.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total and stats.running == 0  # no leaked blocks
    return [done[str(i)] for i in range(len(ps))], steps


def greedy(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)  # type: ignore[arg-type]


def counting_native_runs(llm: LLM) -> list[int]:
    """The steps of each run the model's one native call made (runs it declined are not counted)."""
    model = llm.engine.core.worker.runner.model
    made: list[int] = []
    inner = model.greedy_run

    def greedy_run(*args, **kwargs):
        out = inner(*args, **kwargs)
        if out is not None:
            made.append(out.shape[1])
        return out

    model.greedy_run = greedy_run
    return made


CASES = [  # (fused decode layers, dtype, a tied head)
    (True, "float32", False),
    (True, "bfloat16", False),
    (True, "float32", True),
    (False, "float32", False),
]


@pytest.mark.parametrize(
    ("fused_decode", "dtype", "tied"),
    CASES,
    ids=["native call", "native call bf16", "native call tied head", "forward by forward"],
)
def test_runs_give_the_tokens_of_single_steps_and_end_at_each_length(tiny_model_dir, fused_decode, dtype, tied):
    model = str(tiny_model_dir("llama", tied))
    ps = prompts(6)
    lengths = [18, 18, 18, 1, 5, 13]  # not multiples of the run: the last run of each is shorter
    params = [greedy(n) for n in lengths]
    single, single_steps = run(LLM(model, max_model_len=128, dtype=dtype, decode_steps=1), ps, params)
    llm = LLM(model, max_model_len=128, dtype=dtype, decode_steps=4, fused_decode=fused_decode)
    llm.engine.core.worker.runner.multi_step.run_seconds = 60.0  # (runs as granted, on a loaded machine too)
    native = counting_native_runs(llm)
    multi, multi_steps = run(llm, ps, params)
    assert multi == single
    assert [len(t) for t in multi] == lengths
    assert {k for _, k in single_steps} == {1}
    assert max(k for _, k in multi_steps) == 4 and len(multi_steps) < len(single_steps)
    # the runs went through the model's one native call where its layers are fused, else forward by forward
    assert (max(native, default=0) == 4) == fused_decode


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("gguf-runs")
    return {
        "Q8_0": write_gguf(DEMO_MODEL, folder / "demo-q8_0.gguf", "Q8_0"),
        "Q4_1": write_gguf(DEMO_MODEL, folder / "demo-q4_1.gguf", "Q4_1"),
        "q4_k_m": write_gguf(DEMO_MODEL, folder / "demo-q4_k_m.gguf", q4_k_m_types("Q4_K", tied=True)),
    }


@pytest.mark.parametrize(
    ("name", "repack"), [("Q8_0", "file"), ("Q8_0", "x16"), ("Q4_1", "x16"), ("q4_k_m", "file"), ("q4_k_m", "x16")]
)
def test_a_gguf_files_table_runs_in_the_one_native_call(gguf_files, name, repack):
    """A table kept in the file's blocks (tied to the head, as SmolLM2's Q4_1 file that `make serve` serves):
    the run's embeddings dequantized in the native call give the tokens a step a token gives."""
    path, kept = str(gguf_files[name]), {"gguf_layout": "blocks", "gguf_repack": repack}
    ps, params = prompts(3, seed=2), [greedy(n) for n in (11, 6, 14)]
    single, _ = run(LLM(path, max_model_len=128, decode_steps=1, **kept), ps, params)
    llm = LLM(path, max_model_len=128, decode_steps=4, **kept)
    llm.engine.core.worker.runner.multi_step.run_seconds = 60.0
    assert isinstance(llm.engine.core.worker.runner.model.embed_tokens, GGUFEmbedding)
    native = counting_native_runs(llm)
    multi, _ = run(llm, ps, params)
    assert multi == single
    assert max(native, default=0) == 4


def test_a_stop_token_mid_run_ends_its_request_there(llama):
    ps = prompts(3, seed=1)
    single, _ = run(LLM(llama, max_model_len=128, decode_steps=1), ps, [greedy(20)] * 3)
    stop = single[0][6]  # the 7th token of the first request: a run of 4 passes it
    first = single[0].index(stop)
    params = [SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop])] + [greedy(20)] * 2
    multi, steps = run(LLM(llama, max_model_len=128, decode_steps=4), ps, params)
    assert multi[0] == single[0][: first + 1]  # the stop token is its last (the run's later tokens dropped)
    assert multi[1:] == single[1:]
    assert max(k for _, k in steps) == 4


def test_runs_only_while_nobody_waits_and_never_for_logprobs(llama):
    ps = prompts(4, seed=2)
    llm = LLM(llama, max_model_len=128, max_num_seqs=2, decode_steps=4)
    _, steps = run(llm, ps, [greedy(12)] * 4)
    assert all(k == 1 for waiting, k in steps if waiting)  # two wait while the first two decode
    assert any(k > 1 for waiting, k in steps if not waiting)
    _, steps = run(llm, ps[:2], [greedy(12, logprobs=2)] * 2)
    assert {k for _, k in steps} == {1}


def chunk(num_steps: int) -> ScheduledChunk:
    return ScheduledChunk("r", [7], 10, [], sample=True, num_steps=num_steps)


def test_a_run_stays_within_its_time_and_its_grant():
    policy = MultiStepDecode(run_seconds=0.02)
    assert policy.steps([chunk(4)]) == 1  # never timed at this batch size: one forward
    policy.observe(1, 0.003)
    assert policy.steps([chunk(4)]) == 4  # 6 fit in 20 ms: the grant bounds it
    assert policy.steps([chunk(4), chunk(2)]) == 1  # (a batch of two was never timed)
    policy.observe(2, 0.008)
    assert policy.steps([chunk(4), chunk(3)]) == 2  # 2 fit
    policy.observe(1, 0.05)
    assert policy.steps([chunk(4)]) == 1  # a forward past the run's time: one at a time


@pytest.mark.parametrize(
    ("quantization", "layout"),
    [("int8", "blocks"), ("int4", "blocks"), ("int8", "int"), ("int4", "int"), ("w8a8", "int")],
)
def test_a_tied_quantized_head_gives_the_runs_table(tiny_model_dir, tmp_path, monkeypatch, quantization, layout):
    """`--quantization int8 / int4` on a tied model drops the table and reads its rows from the head
    (HeadRows); where the head is kept in Q8_0 / Q4_1 blocks those blocks are the run's table in the
    native call, and so are tokenmill's int8 and int4 formats (which AMX keeps, and AVX2 for int8, and
    W8A8's), each row dequantized in the call with the head's scales: the tokens a step a token gives."""
    monkeypatch.setenv("TOKENMILL_AUTOTUNE_CACHE_DIR", str(tmp_path))  # (the defaults: no choice another test timed)
    model = str(tiny_model_dir("llama", True))
    kept = {"quantization": quantization, "gguf_layout": layout, "dtype": "float32"}
    ps, params = prompts(3, seed=3), [greedy(n) for n in (9, 14, 5)]
    single, _ = run(LLM(model, max_model_len=128, decode_steps=1, **kept), ps, params)
    llm = LLM(model, max_model_len=128, decode_steps=4, **kept)
    llm.engine.core.worker.runner.multi_step.run_seconds = 60.0
    table = llm.engine.core.worker.runner.model.embed_tokens
    assert isinstance(table, HeadRows)
    native = counting_native_runs(llm)
    multi, _ = run(llm, ps, params)
    assert multi == single
    assert max(native, default=0) == 4
    # (int8 stays in its own format on AVX2 whatever the layout: quant/config.py in_blocks)
    assert (table.int_weights() is not None) == (table.blocks() is None)
