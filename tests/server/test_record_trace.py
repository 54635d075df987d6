"""`serve --record-trace`: a line per finished request with its measured times, the prompt as keyed block
hashes (or token ids), rotation by size, a failing disk that stops the recording and not the server; and
the round trip: the doctor reads the file back with the prompts' prefix sharing exactly as served."""

from __future__ import annotations

import json
import logging
import random
import time

import httpx
import pytest

from tests.server_harness import start_server
from tokenmill.bench.workloads import WorkloadSpec
from tokenmill.doctor.traces.load import load_workload
from tokenmill.server.trace_recorder import BLOCK_SIZE, TraceRecorder, block_hashes, rotated_parts


def prompts(seed: int = 3) -> list[list[int]]:
    """Prompts that share a 40-token system prompt in pairs, 20 tokens more in one pair, and nothing at all."""
    rng = random.Random(seed)
    system = [rng.randrange(5, 400) for _ in range(40)]
    more = [rng.randrange(5, 400) for _ in range(20)]

    def tail(n: int) -> list[int]:
        return [rng.randrange(5, 400) for _ in range(n)]

    return [system + tail(30), system + tail(25), system + more + tail(7), system + more + tail(19), tail(50)]


def complete(base: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def leading(a: list, b: list) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def served(model: str, tmp_path, privacy: str, sent: list[list[int]]) -> tuple[list[dict], dict, TraceRecorder]:
    path = tmp_path / f"{privacy}.jsonl"
    running = start_server(model, record_trace=(str(path), privacy))
    try:
        for i, prompt in enumerate(sent):
            complete(running.base_url, prompt, 4 + i)
        assert running.wait_all_free().kv_blocks_free == running.stats().kv_blocks_total
    finally:
        running.stop()
    header, *lines = [json.loads(line) for line in path.read_text().splitlines()]
    return lines, header, running.recorder


@pytest.fixture
def model(tiny_model_dir) -> str:
    return str(tiny_model_dir("llama"))


@pytest.mark.parametrize("privacy", ["hashes", "tokens"])
def test_each_finished_request_is_a_line_with_its_times_and_its_prompt(tmp_path, model, privacy):
    sent = prompts()
    lines, header, recorder = served(model, tmp_path, privacy, sent)
    assert header["tokenmill_trace"] == 1 and header["block_size"] == BLOCK_SIZE and header["privacy"] == privacy
    assert len(lines) == len(sent)
    arrivals = [line["arrival"] for line in lines]
    assert arrivals == sorted(arrivals) and arrivals[0] >= 0
    for i, (line, prompt) in enumerate(zip(lines, sent, strict=True)):
        assert (line["prompt_len"], line["output_len"], line["n"], line["finish"]) == (len(prompt), 4 + i, 1, "length")
        assert line["ttft"] > 0 and line["tpot"] > 0
        if privacy == "tokens":
            assert line["prompt_token_ids"] == prompt and "hashes" not in line
        else:
            assert "prompt_token_ids" not in line
            assert line["hashes"] == block_hashes(prompt, BLOCK_SIZE, recorder._salt)
            assert len(line["hashes"]) == -(-len(prompt) // BLOCK_SIZE)
    assert lines[1]["cached"] == 32  # the system prompt's two whole blocks, served by the prefix cache
    text = (tmp_path / f"{privacy}.jsonl").read_text()
    assert recorder._salt.hex() not in text and recorder.failed is None and recorder.dropped == 0


def test_the_doctor_reads_the_hashes_back_with_the_prefix_sharing_as_served(tmp_path, model):
    """Round trip: the synthetic prompts share whole blocks with each other exactly as the served
    prompts did (the 40-token system prompt: 2 blocks; 60 tokens in one pair: 3 blocks; nothing else)."""
    sent = prompts()
    served(model, tmp_path, "hashes", sent)
    workload, info = load_workload(WorkloadSpec(f"trace:{tmp_path / 'hashes.jsonl'}", None), None, 256, 512)
    replayed = [r.prompt_token_ids for r in workload.requests]
    assert [len(p) for p in replayed] == [len(p) for p in sent]
    assert [r.max_tokens for r in workload.requests] == [4 + i for i in range(len(sent))]
    for i in range(len(sent)):
        for j in range(i):
            assert leading(replayed[i], replayed[j]) // BLOCK_SIZE == leading(sent[i], sent[j]) // BLOCK_SIZE
    assert leading(replayed[3], replayed[2]) // BLOCK_SIZE == 3 and leading(replayed[4], replayed[0]) < BLOCK_SIZE
    assert any("As served (recorded by the server): TTFT p50" in note for note in info.notes)
    assert info.trace_reuse == pytest.approx((2 + 2 + 3) * BLOCK_SIZE / sum(len(p) for p in sent))


def test_the_token_ids_come_back_as_they_were_served(tmp_path, model):
    sent = prompts()
    served(model, tmp_path, "tokens", sent)
    workload, _ = load_workload(WorkloadSpec(f"trace:{tmp_path / 'tokens.jsonl'}", None), None, 256, 512)
    assert [r.prompt_token_ids for r in workload.requests] == sent


def finished(prompt: list[int], output: int = 3):
    from tokenmill.engine.async_engine import FinishedRequest
    from tokenmill.outputs import RequestMetrics

    now = time.monotonic()
    return FinishedRequest(prompt, output, 1, "length", RequestMetrics(now, now + 0.1, now + 0.2, now + 0.5), 0)


def test_the_file_rotates_by_size_and_the_doctor_reads_every_part_in_order(tmp_path):
    path = tmp_path / "t.jsonl"
    recorder = TraceRecorder(path, "hashes", max_bytes=600)
    for i in range(12):
        recorder.record(finished(list(range(i + 1, i + 40)), output=i + 1))
    recorder.close()
    parts = rotated_parts(path)
    assert len(parts) > 2 and parts[-1] == path and parts[0].name == "t.jsonl.1"
    for part in parts:
        header, *rest = part.read_text().splitlines()
        assert json.loads(header)["run"] == recorder.header["run"] and rest
        assert part.stat().st_size <= 600 or len(rest) == 1
    workload, _ = load_workload(WorkloadSpec(f"trace:{path}", None), None, 256, 512)
    assert [r.max_tokens for r in workload.requests] == list(range(1, 13))


def test_a_failing_disk_stops_the_recording_not_the_server(tmp_path, model, caplog):
    path = tmp_path / "full.jsonl"
    running = start_server(model, record_trace=(str(path), "hashes"))
    try:
        complete(running.base_url, [5, 6, 7, 8], 2)
        recorder = running.recorder
        recorder._file = open("/dev/full", "wb", buffering=0)  # noqa: SIM115 (every write: no space left)
        with caplog.at_level(logging.ERROR, logger="tokenmill"):
            for _ in range(3):
                complete(running.base_url, [5, 6, 7, 8, 9], 2)
            recorder.close()
        assert recorder.failed is not None and "No space left" in recorder.failed
        assert "trace recording stopped" in caplog.text
        assert complete(running.base_url, [9, 9, 9], 2)["usage"]["completion_tokens"] == 2  # serving goes on
        assert running.wait_all_free().kv_blocks_free == running.stats().kv_blocks_total
    finally:
        running.stop()
    assert len(path.read_text().splitlines()) >= 1
