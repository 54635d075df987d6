"""`tokenmill doctor`: the simulator on the real scheduler, the step-cost probe, and planted traces where
the doctor must name the right cause and the right setting (a system prompt behind a per-request
timestamp; prompts sharing less than a block; long-tailed outputs under static batching; a memory
budget the float32 weights do not fit; a repetitive code-edit trace at batch 1 and at batch 32; a clean
trace where it recommends nothing new; a draft model that agrees with the target and one that does not).
Step costs in the planted cases are a fixed curve (a small
model's shape: flat at small batches, linear in tokens beyond), so the verdicts do not depend on the
machine; the CLI test probes for real."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import random
import re
from pathlib import Path

import pytest
import yaml

from tokenmill.bench.metrics import summarize
from tokenmill.bench.offline import run_offline
from tokenmill.bench.workloads import BenchRequest, Workload, WorkloadSpec
from tokenmill.cli import main
from tokenmill.config import EngineConfig
from tokenmill.doctor import step_cost
from tokenmill.doctor.calibrate import StepLog, calibrate
from tokenmill.doctor.diagnose import Replays, diagnose
from tokenmill.doctor.draft_check import DraftAgreement, draft_agreement
from tokenmill.doctor.findings import serve_flags
from tokenmill.doctor.latency import latency_finding
from tokenmill.doctor.model_fit import STORAGE, activation_reserve, count_parameters, weight_bytes
from tokenmill.doctor.simulator import SimulatedEngine
from tokenmill.doctor.stall import measure_stall
from tokenmill.doctor.step_cost import AFTER_STEPS, Heartbeat, StepCost, fit_context, probe
from tokenmill.doctor.verify import METRICS
from tokenmill.engine.engine import LLMEngine
from tokenmill.engine_args import engine_config, read_config_file
from tokenmill.tools.make_model import make_model


def curve(per_token_ms: float = 0.2, base_ms: float = 10.0) -> StepCost:
    """A step costs base + per_token x tokens (and decode steps as many tokens as requests)."""
    xs = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    ms = [base_ms + per_token_ms * x for x in xs]
    return StepCost(xs, [m / 1e3 for m in ms], xs[:7], [m / 1e3 for m in ms[:7]], 0.05e-3, 0.0, 0.0, 0.0)


def workload(prompts: list[list[int]], outputs: list[int], arrivals: list[float] | None = None) -> Workload:
    requests = [
        BenchRequest(i, o, prompt_token_ids=p, arrival_s=None if arrivals is None else arrivals[i])
        for i, (p, o) in enumerate(zip(prompts, outputs, strict=True))
    ]
    return Workload(WorkloadSpec("jsonl:planted.jsonl", None), requests)


def random_prompts(count: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 4096) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig.from_kwargs(str(tiny_model_dir("llama")), dtype="float32", max_num_seqs=32))


def by_question(diagnosis, number: int):
    return next(f for f in diagnosis.findings if f.question.startswith(f"{number}."))


# ----------------------------------------------------------------------------- the simulator


def test_the_simulator_runs_the_schedulers_rule_on_the_cost_model():
    """Four requests at once: one prompt step of all their tokens, then decode steps of four; every
    token accounted for, every block given back, and static batching slower on uneven outputs."""
    config = EngineConfig.from_kwargs("unused", max_num_seqs=4)
    cost = curve()
    w = workload(random_prompts(4, 20, 20), [2, 10, 10, 40])
    sim = SimulatedEngine(config, 100, 512, cost)
    run = run_offline(sim, w, "sim", clock=sim.clock, sleep=sim.sleep)
    s = summarize(run.records, run.duration_s)
    assert s["completed"] == 4 and s["output_tokens"] == 62
    first = cost.predict([(20, 0)] * 4, decoding=False)
    assert s["ttft"]["median"] == pytest.approx(first * 1e3)  # every first token comes from the prompt step
    assert sim.record.steps == 1 + 39  # the longest request decodes 39 more steps
    stats = sim.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total
    static = SimulatedEngine(EngineConfig.from_kwargs("unused", max_num_seqs=2, scheduling="static"), 100, 512, cost)
    run2 = run_offline(static, w, "static", clock=static.clock, sleep=static.sleep)
    assert summarize(run2.records, run2.duration_s)["output_throughput"] < s["output_throughput"]


def test_a_short_context_probe_notes_what_it_could_not_measure(tiny_model_dir):
    short = LLMEngine(
        EngineConfig.from_kwargs(str(tiny_model_dir("llama")), dtype="float32", max_num_seqs=4, max_model_len=96)
    )
    cost = probe(short, repeats=2)
    assert any("no long-prompt probe" in n for n in cost.notes) and cost.calibration == {}
    assert cost.per_prompt_pair == 0.0 and not short.has_unfinished_requests()


def test_the_simulator_preempts_when_the_cache_runs_out():
    config = EngineConfig.from_kwargs("unused", max_num_seqs=8)
    sim = SimulatedEngine(config, 12, 512, curve())  # 12 blocks of 16: two requests' worth at their end
    run = run_offline(sim, workload(random_prompts(6, 40, 40), [60] * 6), "tight", clock=sim.clock, sleep=sim.sleep)
    assert all(r.ok and r.output_tokens == 60 for r in run.records)
    assert sim.stats().preemptions > 0
    assert sim.stats().kv_blocks_free == 12


# ----------------------------------------------------------------------------- planted traces


def test_a_timestamp_in_front_of_the_system_prompt_is_named(engine):
    tok = engine.tokenizer
    system = tok.encode(" ".join(["You are a careful assistant who answers questions about Python code."] * 8))
    prompts = [
        tok.encode(f"[request at 2026-12-01 10:{i // 60:02d}:{i % 60:02d}]", add_special_tokens=False)
        + system
        + tok.encode(f" Question {i}: what does the function number {i * 7} return?", add_special_tokens=False)
        for i in range(24)
    ]
    d = diagnose(engine, workload(prompts, [16] * 24), curve())
    f = by_question(d, 2)
    assert "per-request value" in f.verdict and "move it after the shared part" in f.verdict
    assert "block_size" not in f.settings
    assert any("prefix hits: prompts part at token" in p for p in f.pitfalls)


def test_prompts_sharing_less_than_a_block_get_a_smaller_block(engine):
    shared = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]  # 12 tokens: under a block of 16
    prompts = [shared + p for p in random_prompts(24, 60, 120, seed=3)]
    d = diagnose(engine, workload(prompts, [16] * 24), curve())
    f = by_question(d, 2)
    assert "shorter than a block" in f.verdict
    assert f.settings == {"block_size": 8, "enable_prefix_caching": True}


def test_long_tailed_outputs_under_static_batching_get_continuous_batching(tiny_model_dir):
    static = LLMEngine(
        EngineConfig.from_kwargs(str(tiny_model_dir("llama")), dtype="float32", max_num_seqs=16, scheduling="static")
    )
    rng = random.Random(5)
    outputs = [max(2, min(400, int(rng.lognormvariate(3.0, 1.2)))) for _ in range(48)]
    d = diagnose(static, workload(random_prompts(48, 32, 64, seed=5), outputs), curve())
    f = by_question(d, 3)
    assert f.settings == {"scheduling": "continuous"}
    assert "static batching is configured" in f.verdict
    assert f.predicted_gain is not None


def test_a_budget_the_float32_weights_do_not_fit_gets_16_bit_weights(engine):
    cfg = engine.model_config
    params = count_parameters(cfg)
    reserve = activation_reserve(cfg, engine.config.max_num_batched_tokens)
    fp32 = weight_bytes(params, "float32")
    bf16 = weight_bytes(params, "bfloat16")
    memory = bf16 + reserve + (fp32 - bf16) // 2  # room for bfloat16 and some KV, not for float32
    assert fp32 + reserve > memory
    prompts = random_prompts(8, 16, 32, seed=7)
    d = diagnose(engine, workload(prompts, [8] * 8), curve(), memory=memory)
    f = by_question(d, 1)
    assert "do not fit" in f.verdict
    assert f.settings["dtype"] == "bfloat16" and f.settings["quantization"] == STORAGE["bfloat16"][0]["quantization"]
    assert 0 < f.settings["kv_cache_memory"] < memory - bf16


def code_edit_prompts(engine: LLMEngine, count: int) -> list[list[int]]:
    """An edit request: a function, and its previous version (the same code with one name changed)."""
    tok = engine.tokenizer
    out = []
    for i in range(count):
        body = "".join(f"    total_{i} = total_{i} + values[{j}] * weights[{j}]\n" for j in range(6))
        new = f"def score_{i}(values, weights):\n    total_{i} = 0\n{body}    return total_{i}\n"
        old = new.replace(f"score_{i}", f"old_score_{i}")
        out.append(tok.encode(f"Rewrite this function:\n{new}\nIt was:\n{old}"))
    return out


def test_a_repetitive_trace_gets_speculation_at_batch_1_and_not_at_batch_32(engine):
    prompts = code_edit_prompts(engine, 32)
    one_at_a_time = workload(prompts[:6], [64] * 6, arrivals=[100.0 * i for i in range(6)])
    d1 = diagnose(engine, one_at_a_time, curve())
    f1 = by_question(d1, 5)
    assert "speculative_config" in f1.settings
    assert json.loads(f1.settings["speculative_config"])["method"] == "ngram"
    d32 = diagnose(engine, workload(prompts, [64] * 32), curve(per_token_ms=1.0))
    f32 = by_question(d32, 5)
    assert not f32.settings
    assert "not worth it" in f32.verdict and "batch of 32" in f32.verdict


def test_prompt_lookup_configured_for_a_code_edit_trace_at_batch_32_is_switched_off(tiny_model_dir, engine):
    """Its drafts cost a batch of 32 more than they bring (the same trace at batch 1 gets it recommended)."""
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 5})
    config = EngineConfig.from_kwargs(
        str(tiny_model_dir("llama")), dtype="float32", max_num_seqs=32, speculative_config=spec
    )
    speculating = LLMEngine(config)
    trace = workload(code_edit_prompts(engine, 32), [64] * 32)
    d = diagnose(speculating, trace, curve(per_token_ms=1.0), measure_quantization=False, measure_stalls=False)
    f = by_question(d, 5)
    assert f.settings == {"speculative_config": None}, f.verdict
    assert "switch it off" in f.verdict and any("prompt lookup at the trace's load" in p for p in f.pitfalls)
    assert "(without --speculative-config)" in serve_flags(f.settings)
    assert dataclasses.replace(config, **f.settings).speculative_config is None


def test_a_draft_is_measured_against_the_target_on_the_traces_prompts(engine, tiny_model_dir, tmp_path):
    prompts = random_prompts(6, 40, 120, seed=4)
    itself = LLMEngine(EngineConfig.from_kwargs(str(tiny_model_dir("llama")), dtype="float32", max_num_seqs=4))
    same = draft_agreement(engine, itself, prompts, [1, 2, 4, 8])
    assert same.alpha == 1.0 and same.positions == sum(len(p) - 1 - (len(p) - 1) // 2 for p in prompts)
    assert same.decode_batch == [1, 2, 4] and all(t > 0 for t in same.decode_seconds)
    assert same.decode_seconds == sorted(same.decode_seconds)
    assert same.tokens_per_step(5) == 6.0
    other_dir = make_model("llama", "tiny", tmp_path / "other", seed=7)
    other = LLMEngine(EngineConfig.from_kwargs(str(other_dir), dtype="float32", max_num_seqs=4))
    unrelated = draft_agreement(engine, other, prompts, [1])
    assert unrelated.alpha < 0.2  # random weights of another seed: as good as chance
    assert not itself.has_unfinished_requests() and not other.has_unfinished_requests()


def test_a_draft_that_agrees_gets_draft_speculation_at_batch_1_and_one_that_does_not_gets_none(engine):
    prompts = random_prompts(8, 64, 256, seed=5)  # nothing repeats: prompt lookup has nothing to offer
    steps = [1, 2, 4, 8, 16, 32], [1e-3 * (2 + 0.1 * b) for b in (1, 2, 4, 8, 16, 32)]  # a fifth of the target's
    agreeing = DraftAgreement("drafts/good", 500, 0.8, *steps)
    current = diagnose(engine, workload(prompts[:1], [64]), curve()).current
    f1 = latency_finding(prompts, current, 1, curve(), {}, None, agreeing)
    assert json.loads(f1.settings["speculative_config"]) == {
        "method": "draft_model", "model": "drafts/good", "num_speculative_tokens": 5
    }  # fmt: skip
    assert f1.verdict.startswith("draft model drafts/good is predicted")
    f32 = latency_finding(prompts, current, 32, curve(per_token_ms=1.0), {}, None, agreeing)
    assert not f32.settings and "batch of 32" in f32.verdict
    poor = DraftAgreement("drafts/poor", 500, 0.1, *steps)
    f_poor = latency_finding(prompts, current, 1, curve(), {}, None, poor)
    assert not f_poor.settings
    assert "the draft agrees with the target on only 10%" in f_poor.verdict
    assert "the prompts repeat too little" in f_poor.verdict


def test_the_stall_is_measured_on_the_engine_with_the_traces_prompts_arriving(engine):
    prompts = [480, 400, 450]
    m = measure_stall(engine, prompts, batch=4, share=1.0, context=40, steps=24)
    assert m is not None and (m.batch, m.context, m.prompts) == (4, 40, 24)
    assert len(m.decode_only_ms) == len(m.with_prompts_ms) == 24
    assert m.p("with", 50) > 1.5 * m.p("without", 50)  # a 400-token prompt in every step: far slower steps
    half = measure_stall(engine, prompts, batch=4, share=0.5, context=40, steps=24)
    assert half is not None and half.prompts == 12
    stats = engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total and stats.running == 0 and stats.waiting == 0


def test_the_step_log_sees_every_step_and_calibration_rescales_the_cost_model(engine):
    prompts = random_prompts(6, 20, 60, seed=6)
    trace = workload(prompts, [12] * 6)  # all at once: one prompt step, then 11 decode-only steps
    log = StepLog(engine)
    run_offline(engine, trace, "logged")
    log.close()
    assert "step" not in vars(engine) and "schedule" not in vars(engine.core.scheduler)  # the wrappers gone
    assert sum(q for s in log.steps for q, _ in s.chunks) == sum(map(len, prompts)) + 6 * (12 - 1)
    assert any(s.decoding for s in log.steps) and all(s.seconds > 0 for s in log.steps)
    decodes = [s for s in log.steps if s.decoding]  # the steps before each: the prompt step, then decodes
    assert [s.after for s in decodes[:3]] == [(sum(map(len, prompts)), j) for j in range(3)]
    slow = curve(base_ms=100.0)  # ten times a tiny model's step, and more
    ratios = log.measured_over_predicted(slow)
    assert ratios["all"][1] == len(log.steps) and 0 < ratios["all"][0] < 0.5
    tuned = calibrate(engine, trace, slow, None)
    assert 0 < tuned.calibration["decode"] < 0.5
    assert tuned.calibration["other"] == 1.0  # (fewer than MIN_STEPS such steps: left as probed)
    assert tuned.decode_seconds == [t * tuned.calibration["decode"] for t in slow.decode_seconds]
    assert tuned.prompt_seconds == [t * tuned.calibration["other"] for t in slow.prompt_seconds]
    assert slow.calibration == {}  # (a copy: the probe's own curve kept)
    stats = engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total and stats.running == 0


def test_a_run_of_decode_forwards_is_logged_as_the_forwards_a_step_a_forward_would_run(tiny_model_dir):
    """With `decode_steps` 4 the engine runs fewer steps; the log holds the same forwards (chunks) as with
    1, each a share of its run's time; the probe and the stall time forwards with runs on or off."""
    prompts = random_prompts(3, 20, 40, seed=7)
    logged = {}
    for runs in (1, 4):
        engine = LLMEngine(
            EngineConfig.from_kwargs(str(tiny_model_dir("llama")), dtype="float32", max_num_seqs=4, decode_steps=runs)
        )
        calls = []
        log = StepLog(engine, heartbeat=lambda calls=calls: calls.append(1))
        run_offline(engine, workload(prompts, [10] * 3), "logged")
        log.close()
        logged[runs] = ([(s.chunks, s.decoding) for s in log.steps], len(calls))
        assert all(s.seconds > 0 for s in log.steps)
        with step_cost.forward_a_step(engine):
            assert engine.core.scheduler.config.decode_steps == 1
        assert engine.core.scheduler.config.decode_steps == runs  # (given back after)
    assert logged[4][0] == logged[1][0]
    assert logged[4][1] < logged[1][1]  # fewer engine steps


def test_a_heartbeat_says_where_a_long_phase_is_at_most_that_often():
    now = [0.0]
    said: list[str] = []
    beat = Heartbeat(said.append, every=10.0, clock=lambda: now[0])
    for t in (1.0, 9.9, 10.0, 15.0, 19.9, 20.5, 31.0):
        now[0] = t
        beat.beat(lambda: f"at {now[0]:g}")
    assert said == ["at 10", "at 20.5", "at 31"]
    now[0] = 35.0
    beat.said()  # (a phase's own line: the next beat counts from it)
    now[0] = 44.0
    beat.beat(lambda: "too soon")
    assert said[-1] == "at 31"


def test_the_probe_and_the_calibration_say_where_they_are_within_a_phase(engine, monkeypatch):
    """With the heartbeat at every step: the steps timed between the probe's phase lines, the steps run
    between the calibration's first and last lines, counting up."""
    monkeypatch.setattr(step_cost, "HEARTBEAT_S", 0.0)
    said: list[str] = []
    cost = probe(engine, repeats=1, progress=said.append)
    beats = [i for i, line in enumerate(said) if re.fullmatch(r"probe \(\d+ s\): \d+ steps timed", line)]
    phases = [i for i, line in enumerate(said) if line.startswith("probe ") and "/4 (" in line]
    assert len(phases) == 4 and said[-1].startswith("probe done in ")
    assert any(phases[1] < b < phases[2] for b in beats)  # (inside a phase)
    counts = [int(said[i].split(": ")[1].split()[0]) for i in beats]
    assert counts == sorted(counts) and len(set(counts)) == len(counts)
    said.clear()
    calibrate(engine, workload(random_prompts(4, 20, 40, seed=3), [6] * 4), cost, None, progress=said.append)
    runs = [line for line in said if re.fullmatch(r"calibrating \(\d+ s\): \d+ forwards run", line)]
    assert said[0].startswith("calibrating: the trace's first 4 requests") and said[-1].startswith("calibrated on ")
    counts = [int(r.split(": ")[1].split()[0]) for r in runs]  # (a step of a run of decodes: its forwards)
    assert runs and counts[0] == 1 and all(a < b for a, b in itertools.pairwise(counts))


def test_a_clean_trace_gets_nothing_new(engine):
    rng = random.Random(9)
    d = diagnose(
        engine, workload(random_prompts(32, 64, 256, seed=9), [rng.randint(60, 80) for _ in range(32)]), curve()
    )
    assert [f.settings for f in d.findings] == [{}] * 6
    assert by_question(d, 1).verdict.startswith("fits")


# ----------------------------------------------------------------------------- the command


def test_fit_context_is_the_longest_context_whose_requests_fit_the_model():
    rng = random.Random(5)
    for _ in range(500):
        max_len, batch, budget, extra = (
            rng.randrange(8, 5000),
            rng.randrange(1, 65),
            rng.randrange(1, 4097),
            rng.randrange(0, 60),
        )
        want = rng.randrange(1, 6000)

        c = fit_context(max_len, want, batch, budget, extra)
        total = [x + -(-batch * x // budget) + extra for x in (c, c + 1)]
        assert 1 <= c <= want and (total[0] <= max_len or c == 1)
        assert c == want or total[1] > max_len  # the longest: one more token would not fit


@pytest.mark.parametrize("max_model_len", [160, 300, 1024])
def test_the_probe_and_the_stall_fit_any_model_length(tiny_model_dir, max_model_len):
    # (the mixed probe asked for more tokens than a 1,024-token model holds: the doctor ended in an error)
    engine = LLMEngine(
        EngineConfig.from_kwargs(
            str(tiny_model_dir("llama")),
            dtype="float32",
            max_num_seqs=9,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_model_len - 1,
        )
    )
    cost = probe(engine, repeats=1)
    assert cost.decode_batch[-1] == 9 and not engine.has_unfinished_requests()
    assert cost.after_prompt_tokens[0] == 32 and cost.after_prompt_tokens[-1] + 1 + AFTER_STEPS <= max_model_len
    stall = measure_stall(engine, [max_model_len], 8, 0.5, max_model_len, steps=4)
    assert stall is not None and stall.context + 8 <= max_model_len
    assert engine.stats().kv_blocks_free == engine.stats().kv_blocks_total


def test_the_doctor_runs_on_the_bundled_demo_model(tmp_path, capsys):
    demo = Path(__file__).resolve().parents[2] / "models" / "tokenmill-demo"
    out = tmp_path / "report"
    args = ["doctor", str(demo), "--workload", "mixed", "--num-requests", "16", "--out", str(out), "--target", "h100"]
    code = main(args)
    assert code == 0, capsys.readouterr()
    report = json.loads((out / "report.json").read_text())
    assert len(report["findings"]) == 6
    assert report["targets"][0]["target"] == "h100" and report["targets"][0]["label"].startswith(
        "roofline, uncalibrated"
    )
    assert "## Targets (predicted" in (out / "report.md").read_text()
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("tokenmill doctor: ")]
    steps = [next(i for i, line in enumerate(said) if f"probe {n}/4" in line) for n in (1, 2, 3, 4)]
    probed = next(i for i, line in enumerate(said) if re.fullmatch(r"tokenmill doctor: probe done in \d+ s", line))
    calibrating = next(i for i, line in enumerate(said) if "calibrating: the trace's first 16 requests" in line)
    calibrated = next(i for i, line in enumerate(said) if line.startswith("tokenmill doctor: calibrated on "))
    # the probe and the calibration say where they are, and how long they took
    assert steps == sorted(steps) and steps[-1] < probed < calibrating < calibrated
    assert re.match(r"tokenmill doctor: calibrated on \d+ steps in \d+ s: decode x", said[calibrated])
    assert any("replay 1 (current settings): 16 requests in" in line for line in said[calibrated:])


@pytest.mark.slow  # (tens of seconds: `make test-all` runs it)
def test_the_doctor_command_probes_and_writes_a_loadable_config(tiny_model_dir, tmp_path, capsys):
    rng = random.Random(11)
    trace = tmp_path / "trace.jsonl"
    lines = [
        {"prompt": [rng.randrange(5, 4096) for _ in range(40)], "max_tokens": 12, "arrival_time": i * 0.01}
        for i in range(16)
    ]
    trace.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "report"
    config = tmp_path / "current.yaml"
    config.write_text("scheduling: static\nmax_num_seqs: 8\ndtype: float32\nmax_num_batched_tokens: 256\n")
    code = main(
        [
            "doctor",
            str(tiny_model_dir("llama")),
            "--workload",
            f"jsonl:{trace}",
            "--config",
            str(config),
            "--draft",
            str(tiny_model_dir("llama")),
            "--verify",
            "--repeats",
            "2",
            "--budget-s",
            "30",
            "--apply",
            "--max-num-batched-tokens",
            "128",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    assert report["step_cost"]["prompt_tokens"][-1] == 128 and report["step_cost"]["decode_batch"][-1] == 8
    assert all(s > 0 for s in report["step_cost"]["decode_seconds"])
    assert len(report["findings"]) == 6
    q5 = report["findings"][4]
    assert any("draft model" in e and "at 100% of them" in e for e in q5["evidence"])  # (itself as its draft)
    assert any(e.startswith("measured on this engine") for e in report["findings"][5]["evidence"])
    assert report["verified"]  # (static batching is configured: continuous is recommended, and run)
    for v in report["verified"]:  # each recommendation measured; what stays is what recommended.yaml holds
        assert len(v["gains"]["output_throughput"]) == 2 and set(v["sim_error"]) == set(METRICS)
        if not v["kept"] and v["label"] != "all recommended":
            assert not set(v["settings"]) & set(report["recommended"])
    applied = yaml.safe_load((out / "recommended.yaml").read_text())  # --apply: the whole configuration
    current = {"scheduling": "static", "max_num_seqs": 8, "dtype": "float32", "max_num_batched_tokens": 128}
    assert applied == {"model": str(tiny_model_dir("llama")), **current, **report["recommended"]}
    served = engine_config(
        argparse.Namespace(model=None), read_config_file(str(out / "recommended.yaml"), EngineConfig)
    )
    assert served.max_num_batched_tokens == 128 and served.dtype == "float32"  # (the flag given, the file's)
    assert served.scheduling == report["recommended"].get("scheduling", "static")
    assert "## 1. Model fit" in (out / "report.md").read_text()
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 4 and "1. Model fit" in page
    for chart in ("lengths", "prefix_hit_rate", "step_cost", "latency_cdf"):
        assert (out / f"{chart}.png").read_bytes()[:4] == b"\x89PNG"
    assert "tokenmill doctor: wrote" in capsys.readouterr().out


def test_the_doctor_names_bad_input(tiny_model_dir, capsys):
    model = str(tiny_model_dir("llama"))
    assert main(["doctor", model, "--memory", "lots"]) == 2
    assert "--memory: 'lots' is not a size" in capsys.readouterr().err
    assert main(["doctor", model, "--slo", "ttft=5"]) == 2
    assert "--slo:" in capsys.readouterr().err
    assert main(["doctor", model, "--verify", "--repeats", "1"]) == 2  # (before anything is measured)
    assert "--repeats: at least 2" in capsys.readouterr().err
    assert main(["doctor", model, "--apply"]) == 2
    assert "--apply: needs --verify" in capsys.readouterr().err


def test_prefills_that_stretch_tpot_past_the_slo_get_a_smaller_step_budget(engine):
    """Long prompts arriving while others decode: each prompt step stalls every decode in it. With a
    TPOT SLO between what the current budget gives and what a quarter of it gives, the doctor
    recommends the smaller budget (and says by how much the prefills stretch TPOT)."""
    cost = curve(per_token_ms=0.5)
    w = workload(random_prompts(40, 380, 400, seed=13), [48] * 40, arrivals=[0.25 * i for i in range(40)])
    replays = Replays(engine.config, 10**8, 1.0, engine.max_model_len, cost, w, None)
    as_served = replays({})["tpot"]["p99"]
    quarter = replays({"max_num_batched_tokens": engine.config.max_num_batched_tokens // 4})["tpot"]["p99"]
    assert quarter < as_served
    d = diagnose(engine, w, cost, slos={"tpot": (as_served + quarter) / 2})
    f = by_question(d, 6)
    assert f.settings["max_num_batched_tokens"] < engine.config.max_num_batched_tokens
    assert "past the SLO" in f.verdict
    assert "prefills stretch the slowest tokens" in f.evidence[0]


def test_a_shared_system_prompt_with_the_cache_off_gets_it_on(tiny_model_dir):
    off = LLMEngine(
        EngineConfig.from_kwargs(str(tiny_model_dir("llama")), dtype="float32", enable_prefix_caching=False)
    )
    system = random_prompts(1, 256, 256, seed=17)[0]
    prompts = [system + p for p in random_prompts(32, 8, 24, seed=19)]
    d = diagnose(off, workload(prompts, [8] * 32, arrivals=[0.05 * i for i in range(32)]), curve())
    f = by_question(d, 2)
    assert f.settings == {"enable_prefix_caching": True}
    assert "lower" in (f.predicted_gain or "")
    rates = [r for _, r in d.hit_curve]
    assert rates == sorted(rates) and rates[-1] > 0.8  # more cache never hits less; the whole one holds it
    assert "recommended" in d.runs and len(d.runs["recommended"]) == 32


@pytest.mark.slow  # (tens of seconds: `make test-all` runs it)
def test_weight_only_quantization_is_timed_at_the_traces_batch_and_its_quality_measured(tiny_model_dir, engine):
    """In use (int8 weights now): timed against 16-bit weights at the trace's batch, and named a pitfall
    exactly when it brings no speed-up there. Recommended (a budget only int8 fits): timed against the
    current weights, with eval-quant's perplexity."""
    int8 = LLMEngine(
        EngineConfig.from_kwargs(str(tiny_model_dir("llama")), dtype="bfloat16", quantization="int8", max_num_seqs=8)
    )
    prompts = random_prompts(8, 16, 32, seed=23)
    d = diagnose(int8, workload(prompts, [24] * 8), curve())
    f = by_question(d, 1)
    timed = next(e for e in f.evidence if e.startswith("a decode step at the trace's batch"))
    speedup = float(timed.rsplit("(", 1)[1].split("x")[0])
    assert any("brings no speed-up" in p for p in f.pitfalls) == (speedup < 1.05)

    cfg = engine.model_config
    params = count_parameters(cfg)
    reserve = activation_reserve(cfg, engine.config.max_num_batched_tokens)
    int8_bytes, bf16_bytes = weight_bytes(params, "int8"), weight_bytes(params, "bfloat16")
    memory = int8_bytes + reserve + (bf16_bytes - int8_bytes) // 2  # int8 fits, bfloat16 does not
    d = diagnose(engine, workload(prompts, [8] * 8), curve(), memory=memory)
    f = by_question(d, 1)
    assert f.settings["quantization"] == "int8"
    assert any(e.startswith("int8 quality (tokenmill eval-quant") and "perplexity" in e for e in f.evidence)
    assert any(e.startswith("a decode step at the trace's batch") for e in f.evidence)
