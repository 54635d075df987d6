"""`tokenmill doctor --target`: the roofline against hand arithmetic, the calibration recovering factors
planted in synthetic measurements, the spec sheets and a user's YAML (and bad ones named), and the
per-target answers on the demo model: fits or not, replicas, cost, and the label saying which
calibration stands behind them."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

from tokenmill.bench.workloads import BenchRequest, Workload, WorkloadSpec
from tokenmill.cli import main
from tokenmill.config import EngineConfig
from tokenmill.doctor.diagnose import Diagnosis, Replays
from tokenmill.doctor.hardware import BUILT_IN, Target, TargetError, load_target, measure_here
from tokenmill.doctor.roofline import (
    Calibration,
    ModelShape,
    calibrate_here,
    fit,
    roofline_seconds,
    step_bytes,
    step_flops,
)
from tokenmill.doctor.step_cost import StepCost
from tokenmill.doctor.target_report import TargetOptions, append_targets, run_targets
from tokenmill.doctor.targets import (
    IDEAL,
    Trace,
    answer,
    capacity_p99,
    measured_steps_record,
    read_measured_steps,
)
from tokenmill.engine.engine import LLMEngine
from tokenmill.models.config import parse_config

DEMO = Path(__file__).resolve().parents[2] / "models" / "tokenmill-demo"
TINYLLAMA = {  # TinyLlama-1.1B's shape
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
}
LLAMA70B = {**TINYLLAMA, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80}
LLAMA70B |= {"num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256}


def tinyllama() -> ModelShape:
    return ModelShape.of(parse_config(TINYLLAMA, "tinyllama"))


def toy_target(bandwidth: float = 20e9, peak: float = 400e9, memory: float = 64e9) -> Target:
    return Target("toy", "a toy machine", int(memory), bandwidth, {"bfloat16": peak, "float32": peak}, "a test")


def test_a_tinyllama_decode_step_on_h100_reads_its_weights_at_3_35_tb_s():
    shape, h100 = tinyllama(), load_target("h100")
    layer = 2048 * 2048 * 2 + 2 * 2048 * 256 + 3 * 2048 * 5632  # q, o; k, v (4 KV heads x 64); gate, up, down
    assert shape.layer_weights == 22 * layer and shape.head_weights == 32000 * 2048
    kv_token = 22 * 4 * 64 * 2 * 2  # layers x KV heads x head_dim x (K, V) x bf16
    weights = (22 * layer + 32000 * 2048) * 2  # bf16: ~2.07 GB (the embedding is read a row a token)
    one = [(1, 511)]  # one request decoding at position 511: 512 keys read, 1 written
    assert step_bytes(shape, one) == weights + (511 + 2) * kv_token
    assert roofline_seconds(shape, h100, "bfloat16", one) == pytest.approx((weights + 513 * kv_token) / 3.35e12)
    assert roofline_seconds(shape, h100, "bfloat16", one) == pytest.approx(2.2e9 / 3.35e12, rel=0.07)  # ~0.63 ms
    # a 2048-token prompt is compute-bound: 2 FLOPs a weight a token, attention on the causal pairs
    prompt = [(2048, 0)]
    flops = 2 * 22 * layer * 2048 + 2 * 32000 * 2048 + 4 * 22 * 32 * 64 * (2048 * 2049 / 2)
    assert step_flops(shape, prompt) == pytest.approx(flops)
    assert roofline_seconds(shape, h100, "bfloat16", prompt) == pytest.approx(flops / 989e12)
    # fp8 weights: half the bytes, the fp8 peak
    fp8 = ModelShape.of(parse_config(TINYLLAMA, "tinyllama"), weight_bytes=1.0)
    assert roofline_seconds(fp8, h100, "fp8", prompt) == pytest.approx(flops / 1979e12)


def synthetic_probe(
    shape: ModelShape, here: Target, decode: tuple[float, float], other: tuple[float, float], noise=0.0
):
    """A StepCost whose probed points are the roofline / efficiency + overhead (times 1 +- noise)."""
    rng = random.Random(0)

    def seconds(chunks: list[tuple[int, int]], factors: tuple[float, float]) -> float:
        return (roofline_seconds(shape, here, "bfloat16", chunks) / factors[0] + factors[1]) * (
            1 + rng.uniform(-noise, noise)
        )

    batches, tokens = [1, 2, 4, 8, 16, 32, 64], [1, 16, 64, 128, 256, 512, 1024, 2048]
    return StepCost(
        tokens,
        [seconds([(t, 0)], other) for t in tokens],
        batches,
        [seconds([(1, 16)] * b, decode) for b in batches],
        0.0,
        0.0,
        0.0,
        0.0,
    )


@pytest.mark.parametrize("noise", [0.0, 0.02])
def test_the_calibration_recovers_planted_efficiencies_and_overheads(noise):
    shape, here = tinyllama(), toy_target()
    cost = synthetic_probe(shape, here, (0.6, 0.004), (0.45, 0.010), noise)
    c = calibrate_here(cost, shape, here, "bfloat16")
    tolerance = 1e-9 if noise == 0 else 0.05
    assert c.decode.efficiency == pytest.approx(0.6, rel=tolerance)
    assert c.other.efficiency == pytest.approx(0.45, rel=tolerance)
    assert c.decode.overhead == pytest.approx(0.004, rel=tolerance * 10, abs=1e-12)
    assert c.other.overhead == pytest.approx(0.010, rel=tolerance * 10, abs=1e-12)
    assert c.band <= 2.2 * noise + 1e-9  # the fit's own error on its points
    assert c.on == "here" and "probed steps" in c.source


def test_factors_carried_to_another_machine_never_beat_its_roofline():
    fast = fit([(0.010, 0.004), (0.020, 0.006)])  # this machine's measured roofline was low
    assert fast.efficiency == pytest.approx(5.0) and fast.overhead == pytest.approx(0.002)
    carried = Calibration(fast, fast, "a test", "here").carried()
    assert carried.decode.efficiency == 1.0 and carried.other.overhead == pytest.approx(0.002)


def test_steps_that_do_not_grow_with_their_roofline_are_overhead():
    flat = fit([(0.001, 0.030), (0.002, 0.030), (0.004, 0.029)])
    assert flat.efficiency == 1.0 and 0.027 < flat.overhead < 0.029


def test_the_built_in_sheets_load_with_their_sources_and_no_price():
    assert set(BUILT_IN) == {"h100", "h200", "a100-80g", "l40s", "l4"}
    for name in BUILT_IN:
        t = load_target(name)
        assert t.source.startswith("https://www.nvidia.com/") and t.price_per_hour is None
        assert t.memory_bytes > 0 and t.bandwidth > 0 and t.peak("bfloat16") > 0
    assert load_target("h200").bandwidth == 4.8e12 and load_target("l4").memory_bytes == 24e9
    with pytest.raises(TargetError, match="no fp8 peak"):
        load_target("a100-80g").peak("fp8")


@pytest.mark.parametrize(
    "text, message",
    [
        ("name: x\nmemory_gb: 16\ntflops: {bfloat16: 50}\nsource: me\n", "'bandwidth_gbs' must be a number above 0"),
        ("name: x\nmemory_gb: -1\nbandwidth_gbs: 1\ntflops: {bfloat16: 5}\nsource: me\n", "'memory_gb'"),
        ("name: x\nmemory_gb: 1\nbandwidth_gbs: 1\ntflops: {fp4: 5}\nsource: me\n", "'tflops' has fp4"),
        ("name: x\nmemory_gb: 1\nbandwidth_gbs: 1\ntflops: {bfloat16: 5}\n", "'source' must say"),
        ("name: x\nmemory: 1\n", "unknown field(s) memory"),
        ("name: [unclosed\n", "not valid YAML"),
        ("- a list\n", "expected a mapping"),
    ],
)
def test_a_bad_spec_sheet_is_named_with_its_field(tmp_path, text, message):
    path = tmp_path / "gpu.yaml"
    path.write_text(text)
    with pytest.raises(TargetError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_target(str(path))


def test_the_doctor_names_a_bad_target_before_measuring_anything(tmp_path, capsys):
    bad = tmp_path / "gpu.yaml"
    bad.write_text("name: x\nmemory_gb: 16\ntflops: {bfloat16: 50}\nsource: me\n")
    assert main(["doctor", str(DEMO), "--target", str(bad)]) == 2
    assert "'bandwidth_gbs' must be a number above 0" in capsys.readouterr().err
    assert main(["doctor", str(DEMO), "--target", "b200"]) == 2
    assert "--target: 'b200' is not here, a100-80g, h100, h200, l4, l40s or a YAML file" in capsys.readouterr().err
    assert main(["doctor", str(DEMO), "--model-config", str(DEMO)]) == 2
    assert "need --target" in capsys.readouterr().err


@pytest.fixture(scope="module")
def demo() -> LLMEngine:
    return LLMEngine(EngineConfig.from_kwargs(str(DEMO), max_num_seqs=16))


def synthetic_workload(count: int = 24, rate: float = 4.0) -> Workload:
    rng = random.Random(1)
    requests = [
        BenchRequest(
            i,
            rng.randint(8, 64),
            prompt_token_ids=[rng.randrange(5, 8000) for _ in range(rng.randint(16, 300))],
            arrival_s=i / rate,
        )
        for i in range(count)
    ]
    return Workload(WorkloadSpec("jsonl:synthetic.jsonl", None), requests)


def trace_of(engine: LLMEngine, workload: Workload, slos: dict[str, float] | None = None) -> Trace:
    largest = max(len(r.prompt_token_ids) + r.max_tokens for r in workload.requests)
    return Trace(engine.config, workload, engine.max_model_len, None, 4.0, slos or {}, largest)


def test_a_yaml_target_with_a_price_gets_replicas_and_cost_per_million(demo, tmp_path):
    sheet = tmp_path / "toy.yaml"
    sheet.write_text("name: toy\nmemory_gb: 8\nbandwidth_gbs: 0.05\ntflops: {bfloat16: 0.5}\nsource: a test\n")
    target = load_target(str(sheet), price_per_hour=2.0)
    cal = Calibration(*(fit([(0.001, 0.002), (0.002, 0.003)]),) * 2, "synthetic", "toy")  # efficiency 1, +1 ms
    workload = synthetic_workload()
    a = answer(
        trace_of(demo, workload, {"ttft": 2000.0, "tpot": 400.0}), demo.model_config, "bfloat16", target, cal, "x"
    )
    assert a.fits and a.summary is not None and a.summary["completed"] == len(workload.requests)
    # a decode step of the 5.4M-parameter demo at 50 MB/s: ~0.2 s, so 4 requests/s need several replicas
    assert a.replica_rate > 0 and a.replicas == -(-4.0 // a.replica_rate)
    mean_out = sum(r.max_tokens for r in workload.requests) / len(workload.requests)
    assert a.cost_per_million == pytest.approx(2.0 / (a.replica_rate * mean_out * 3600) * 1e6)
    assert a.best_case is None  # (calibrated on this target: no best case line)


def test_a_70b_model_does_not_fit_an_l4_and_fits_an_h200_in_fp8(demo, tmp_path):
    cfg = parse_config(LLAMA70B, "llama-70b")
    trace = trace_of(demo, synthetic_workload(8))
    on_l4 = answer(trace, cfg, "bfloat16", load_target("l4"), IDEAL, "x")
    assert not on_l4.fits and on_l4.summary is None and on_l4.fit_line.startswith("no: bfloat16 weights 141")
    on_h200 = answer(trace, cfg, "fp8", load_target("h200"), IDEAL, "x")
    assert on_h200.fits and on_h200.summary is not None and on_h200.best_case is not None


def test_measured_gpu_steps_calibrate_their_target(tmp_path):
    shape, h100 = tinyllama(), load_target("h100")
    steps = [
        {"chunks": c, "decoding": d, "seconds": roofline_seconds(shape, h100, "bfloat16", c) / e + o}
        for d, e, o, shapes in (
            (True, 0.7, 0.003, [[(1, 100)] * b for b in (1, 8, 64, 256)]),
            (False, 0.5, 0.006, [[(t, 0)] for t in (128, 1024, 4096, 8192)]),
        )
        for c in shapes
    ]
    path = tmp_path / "h100-steps.json"
    path.write_text(json.dumps({"target": "h100", "source": "a test", "model_config": TINYLLAMA, "steps": steps}))
    m = read_measured_steps(str(path), None)
    assert m.calibration.on == "h100" and m.target.name == "h100"
    assert m.calibration.decode.efficiency == pytest.approx(0.7) and m.calibration.other.overhead == pytest.approx(
        0.006
    )
    path.write_text(json.dumps({"target": "h100", "steps": []}))
    with pytest.raises(ValueError, match=r"--target-steps: .*model_config"):
        read_measured_steps(str(path), None)


def test_target_h100_on_the_demo_model_is_labelled_uncalibrated_and_here_calibrated(demo, tmp_path):
    workload = synthetic_workload()
    cost = StepCost([1, 64, 512], [0.02, 0.03, 0.08], [1, 4, 16], [0.015, 0.016, 0.02], 1e-4, 0.0, 0.0, 0.0)
    replays = Replays.of(demo, cost, workload, None)
    prompts = [len(r.prompt_token_ids) for r in workload.requests]
    outputs = [r.max_tokens for r in workload.requests]
    diagnosis = Diagnosis("demo", demo.config, "synthetic", cost, replays({}), [], prompts, outputs)
    opts = TargetOptions(["here", "h100"], price_per_hour=3.0, slos={"tpot": 100.0})
    answers = run_targets(demo, workload, cost, diagnosis, opts, tmp_path)
    here, h100 = answers
    assert here.label.startswith("roofline, calibrated on this machine's probed steps")
    assert h100.label.startswith("roofline, uncalibrated") and "this machine's" in h100.label
    assert h100.fits and h100.summary is not None and h100.best_case is not None
    assert h100.cost_per_million is not None and here.cost_per_million is not None
    # the uncalibrated answer gives no band of its own: this machine's band is named as the CPU's fit
    assert h100.band is None and here.band is not None
    assert "so no error band" in h100.label and "that is the CPU's fit, not a bound on h100's error" in h100.label
    h100_figures = next(line for line in h100.lines() if line.startswith("TTFT"))
    assert h100_figures.endswith("(predicted, roofline, uncalibrated: no error band)") and "±" not in h100_figures
    here_figures = next(line for line in here.lines() if line.startswith("TTFT"))
    assert f"within ±{here.band:.0%} on this calibration's own steps" in here_figures
    text = append_targets(tmp_path, answers)
    assert "predicted" in text and "**h100**" in text and "https://www.nvidia.com/en-us/data-center/h100/" in text
    report = json.loads((tmp_path / "report.json").read_text())
    assert [t["target"] for t in report["targets"]] == ["here", "h100"]
    stored = json.loads((tmp_path / "calibration.json").read_text())
    assert stored["calibrations"][0]["on"] == "here" and stored["here"]["bandwidth_gbs"] > 0
    assert demo.stats().kv_blocks_free == demo.stats().kv_blocks_total


def test_a_probe_on_the_target_round_trips_through_a_steps_file(tmp_path):
    """benchmarks/gpu/target_steps.py's record: a probe taken on an H100 (synthetic here) calibrates h100."""
    shape, h100 = tinyllama(), load_target("h100")
    cost = synthetic_probe(shape, h100, (0.8, 0.002), (0.55, 0.005))
    path = tmp_path / "steps.json"
    path.write_text(json.dumps(measured_steps_record(cost, "h100", TINYLLAMA, "bfloat16", "synthetic probe")))
    c = read_measured_steps(str(path), 2.5).calibration
    assert c.decode.efficiency == pytest.approx(0.8) and c.other.efficiency == pytest.approx(0.55)
    assert c.decode.overhead == pytest.approx(0.002) and c.band < 1e-9 and "synthetic probe" in c.source


@pytest.mark.parametrize(("dtype", "said"), [(torch.float32, "(float32)"), (torch.bfloat16, "(float32 or bfloat16)")])
def test_here_names_the_matmuls_it_timed_once_each(dtype, said):
    # (a float32 engine's "here" read "1024^3 matmul (float32 or float32)")
    here = measure_here(dtype, memory_bytes=2**30, mib=8, n=64)
    assert here.source.endswith(f"64^3 matmul {said}") and here.memory_bytes == 2**30


@pytest.mark.parametrize("limit", [0.0004, 0.3, 2.0, 7.5, 40.0, 900.0, 5e6])
@pytest.mark.parametrize("ceiling", [0.5, 6.0, 30.0, 1e5])
def test_the_capacity_search_capped_at_the_ceiling_answers_as_the_uncapped_one_with_fewer_replays(limit, ceiling):
    """The replica rate is min(capacity, ceiling): the search stops once a rate at the ceiling meets the
    SLOs (the doubling towards 1e6 saved) and the answer is the same, for every SLO limit and ceiling."""
    rates: list[float] = []

    def at_rate(rate: float) -> dict:
        rates.append(rate)  # (a replay whose p99 TPOT grows with the rate: meets the SLO up to `limit`)
        return {"completed": 1, "failed": 0, "tpot": {"p99": 10.0 * rate / limit}}

    slos = {"tpot": 10.0}
    uncapped = min(capacity_p99(at_rate, slos, 5.0), ceiling)
    searched = len(rates)
    rates.clear()
    assert min(capacity_p99(at_rate, slos, 5.0, cap=ceiling), ceiling) == uncapped
    assert len(rates) <= searched
    if limit > 2 * ceiling and ceiling > 5.0:
        assert len(rates) < searched  # (the SLOs hold past the ceiling: fewer replays)


def test_an_h100_answer_on_a_small_window_is_the_same_with_the_capacity_search_capped(demo, monkeypatch):
    """The demo model on an H100 meets loose SLOs even with the whole trace at once: the capped search
    stops at the ceiling, the uncapped one (as before) doubles on towards 1e6; every figure is the same."""
    from tokenmill.doctor import targets

    capped = targets.capacity_p99
    trace = trace_of(demo, synthetic_workload(12), {"ttft": 5000.0, "tpot": 500.0})
    h100 = load_target("h100", price_per_hour=3.0)

    def answered(search) -> tuple:
        rates: list[float] = []
        monkeypatch.setattr(targets, "capacity_p99", lambda f, slos, start, cap=math.inf: search(
            lambda r: rates.append(r) or f(r), slos, start, cap))  # fmt: skip
        a = answer(trace, demo.model_config, "bfloat16", h100, IDEAL, "x")
        return (
            a.fits,
            a.fit_line,
            a.summary,
            a.best_case,
            a.replica_rate,
            a.replicas,
            a.cost_per_million,
            a.notes,
        ), rates

    before, searched_before = answered(lambda f, slos, start, cap: capped(f, slos, start))
    after, searched_after = answered(capped)
    assert after == before and "the SLOs hold even with the whole trace at once" in after[-1][0]
    assert len(searched_after) < len(searched_before)
    assert demo.stats().kv_blocks_free == demo.stats().kv_blocks_total
