"""`serve --models` with `--record-trace FILE`: each model records its finished requests to a file of its own
(FILE with the model's name before the suffix), with the same privacy and rotation options, each read back
by the doctor's trace reader as that model's trace."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.several_harness import start_several, write_models_file
from tokenmill.bench.workloads import WorkloadSpec
from tokenmill.doctor.traces.load import load_workload
from tokenmill.server.trace_recorder import model_trace_path, model_trace_paths, rotated_parts


def complete(base: str, model: str, prompt: list[int], max_tokens: int) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == model


def test_each_model_records_its_own_trace_and_the_doctor_reads_each(tiny_model_dir, tmp_path: Path) -> None:
    models = write_models_file(tmp_path, {"alpha": str(tiny_model_dir("llama")), "beta": str(tiny_model_dir("qwen3"))})
    trace = tmp_path / "traces" / "served.jsonl"
    options = {"record_trace": str(trace), "record_trace_privacy": "tokens", "record_trace_max_bytes": 400}
    sent = {
        "alpha": [([5 + i for i in range(20)], 3), ([7 + i for i in range(30)], 5)],
        "beta": [([9 + i for i in range(25)], 4)],
    }
    running = start_several(models, record_trace=options)
    try:
        for name, (prompt, max_tokens) in [
            ("alpha", sent["alpha"][0]),
            ("beta", sent["beta"][0]),
            ("alpha", sent["alpha"][1]),
        ]:
            complete(running.base_url, name, prompt, max_tokens)
        running.assert_no_leaks()
    finally:
        running.stop()

    paths = {name: model_trace_path(trace, name) for name in sent}
    assert paths == {
        "alpha": tmp_path / "traces" / "served.alpha.jsonl",
        "beta": tmp_path / "traces" / "served.beta.jsonl",
    }
    assert len(rotated_parts(paths["alpha"])) == 2  # (400 bytes hold one request line: the second starts a part)
    for name, path in paths.items():
        header = json.loads(path.read_text().splitlines()[0])
        assert (header["model"], header["privacy"]) == (name, "tokens")
        workload, _ = load_workload(WorkloadSpec(f"trace:{path}", None), None, 256, 512)
        got = [(r.prompt_token_ids, r.max_tokens) for r in workload.requests]
        assert got == sent[name], name


def test_model_names_become_safe_distinct_file_names(tmp_path: Path) -> None:
    assert model_trace_path(tmp_path / "t.jsonl", "org/model:1") == tmp_path / "t.org_model_1.jsonl"
    assert model_trace_path(tmp_path / "trace", "chat") == tmp_path / "trace.chat"
    with pytest.raises(ValueError, match="same trace file"):
        model_trace_paths(tmp_path / "t.jsonl", ["a/b", "a_b"])
