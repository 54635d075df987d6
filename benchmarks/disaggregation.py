"""The interference experiment: short requests decoding while long prompts arrive, on one engine
(colocated) and on a prefill/decode split (`--disaggregate prefill=1,decode=1`), the same 2 threads
and KV memory in all on each side.

Each run starts its server fresh (the `small` model, float32, loopback): colocated, one engine with 2
threads and M bytes of KV; disaggregated, a prefill and a decode replica on a local Ray cluster with 1
thread and M/2 each. Load (one async client, streamed `/v1/completions` with token-id prompts, seed 0):
4 short requests in a closed loop (64-token prompts, 64 output tokens each) while 8 long prompts
(1,536 tokens, 4 output tokens) arrive one every 3 s; the shorts stop once the last long one is done.
A smaller pass (one long prompt) warms each server up first. Per run: the shorts' TPOT p50 / p99 and
inter-token p99, the longs' TTFT p50, all output tokens/s, and (split) the KV bytes moved a prompt
token and the time of a move a MB (the servers' own counters: copy out, fetch through Ray's object
store, copy in). The two interleaved in each of 3 repeats; medians and spread. Then the break-even
the doctor's question 6 weighs: what a long prompt's KV costs to move here, against what its prefill
chunks take from colocated decodes.

Writes benchmarks/results/disaggregation.json. Usage: python benchmarks/disaggregation.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import re
import signal
import statistics
import time
from pathlib import Path

import httpx
import numpy as np
from common import RESULTS, cell, ensure_model, kv_token_bytes
from serve import free_port, start_server

SHORT_PROMPT, SHORT_OUTPUT, SHORT_CONCURRENCY = 64, 64, 4
LONG_PROMPT, LONG_OUTPUT, LONG_COUNT, LONG_EVERY_S = 1536, 4, 8, 3.0
STEP_BUDGET = 512  # the engine's default max_num_batched_tokens: a long prompt runs in chunks of this
VARIANTS = {"colocated": [], "disaggregated": ["--disaggregate", "prefill=1,decode=1"]}


async def stream(client: httpx.AsyncClient, base: str, model: str, prompt: list[int], max_tokens: int) -> list[float]:
    """Arrival times of a streamed request's tokens (the send time first)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    times = [time.perf_counter()]
    async with client.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"text"' in line:
                times.append(time.perf_counter())
    return times


async def load(
    base: str, model: str, vocab: int, long_count: int = LONG_COUNT
) -> tuple[list[list[float]], list[list[float]], float]:
    rng = np.random.default_rng(long_count)
    shorts: list[list[float]] = []
    longs: list[list[float]] = []
    done = asyncio.Event()
    limits = httpx.Limits(max_connections=16)
    async with httpx.AsyncClient(timeout=600, limits=limits, transport=httpx.AsyncHTTPTransport(retries=0)) as client:

        async def short_loop() -> None:
            while not done.is_set():
                prompt = rng.integers(3, vocab, SHORT_PROMPT).tolist()
                shorts.append(await stream(client, base, model, prompt, SHORT_OUTPUT))

        async def long_arrivals() -> None:
            tasks = []
            for _ in range(long_count):
                prompt = rng.integers(3, vocab, LONG_PROMPT).tolist()
                tasks.append(asyncio.create_task(stream(client, base, model, prompt, LONG_OUTPUT)))
                await asyncio.sleep(LONG_EVERY_S)
            longs.extend(await asyncio.gather(*tasks))
            done.set()

        start = time.perf_counter()
        await asyncio.gather(long_arrivals(), *(short_loop() for _ in range(SHORT_CONCURRENCY)))
        wall = time.perf_counter() - start
    return shorts, longs, wall


def counters(port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    out = {}
    for name in ("kv_transfer_sent_bytes", "kv_transfer_sent", "kv_transfer_received", "kv_transfer_seconds"):
        found = re.search(rf"^tokenmill:{name}_total\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
        out[name] = float(found.group(1)) if found else 0.0
    return out


def one_run(model: Path, label: str, kv_bytes: int) -> dict[str, float]:
    port = free_port()
    replicas = 2 if VARIANTS[label] else 1
    server = start_server(
        model, port, "--dtype", "float32", "--max-model-len", "2048", "--cpu-threads", "2",
        "--kv-cache-memory", str(kv_bytes // replicas), "--log-interval", "600", *VARIANTS[label],
    )  # fmt: skip
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    base = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(load(base, model.name, vocab, long_count=1))  # warm-up, not measured
        before = counters(port)
        shorts, longs, wall = asyncio.run(load(base, model.name, vocab))
        after = counters(port)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
    tpot = [(t[-1] - t[1]) / (len(t) - 2) * 1e3 for t in shorts if len(t) > 2]
    itl = [(b - a) * 1e3 for t in shorts for a, b in itertools.pairwise(t[1:])]
    moved = {k: after[k] - before[k] for k in after}
    tokens = sum(len(t) - 1 for t in shorts) + sum(len(t) - 1 for t in longs)
    result = {
        "short_tpot_p50_ms": float(np.percentile(tpot, 50)),
        "short_tpot_p99_ms": float(np.percentile(tpot, 99)),
        "short_itl_p99_ms": float(np.percentile(itl, 99)),
        "long_ttft_p50_ms": float(np.percentile([(t[1] - t[0]) * 1e3 for t in longs], 50)),
        "output_tokens_per_s": tokens / wall,
        "short_requests": float(len(shorts)),
    }
    if moved["kv_transfer_sent"]:  # every request moves (prompts are whole blocks: 64 and 1,536 tokens)
        prompt_tokens = len(shorts) * SHORT_PROMPT + len(longs) * LONG_PROMPT
        result["requests_moved"] = moved["kv_transfer_sent"]
        result["kv_bytes_per_prompt_token"] = moved["kv_transfer_sent_bytes"] / prompt_tokens
        # the time of the moves on both sides (copy out on the prefill replica; fetch through the object
        # store and copy in on the decode one), per MB moved
        result["move_ms_per_mb"] = moved["kv_transfer_seconds"] * 1e3 / (moved["kv_transfer_sent_bytes"] / 1e6)
    return result


def summarize(runs: list[dict[str, float]]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for key in runs[0]:
        values = [r[key] for r in runs]
        out[key] = {"median": statistics.median(values), "min": min(values), "max": max(values), "samples": values}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = ensure_model()
    token_bytes = kv_token_bytes(model, "float32")
    tokens = 2 * (SHORT_CONCURRENCY * (SHORT_PROMPT + SHORT_OUTPUT) + 3 * (LONG_PROMPT + LONG_OUTPUT))
    kv_bytes = tokens * token_bytes
    runs: dict[str, list[dict[str, float]]] = {label: [] for label in VARIANTS}
    for repeat in range(args.repeats):
        for label in VARIANTS:
            runs[label].append(one_run(model, label, kv_bytes))
            print(f"[{repeat}] {label}: {runs[label][-1]}", flush=True)
    aggregate = {label: summarize(rs) for label, rs in runs.items()}
    split, together = aggregate["disaggregated"], aggregate["colocated"]
    long_mb = split["kv_bytes_per_prompt_token"]["median"] * LONG_PROMPT / 1e6
    move_ms = split["move_ms_per_mb"]["median"] * long_mb
    # what each of a long prompt's chunks takes from colocated decodes: the shorts' inter-token p99 (the
    # steps that carried a chunk) over their TPOT p50
    stall_ms = together["short_itl_p99_ms"]["median"] - together["short_tpot_p50_ms"]["median"]
    chunks = -(-LONG_PROMPT // STEP_BUDGET)
    result = {
        "model": "make-model --arch llama --size small --seed 0",
        "dtype": "float32",
        "kv_cache_memory_total": kv_bytes,
        "workload": {
            "short": {"prompt": SHORT_PROMPT, "output": SHORT_OUTPUT, "concurrency": SHORT_CONCURRENCY},
            "long": {"prompt": LONG_PROMPT, "output": LONG_OUTPUT, "count": LONG_COUNT, "every_s": LONG_EVERY_S},
        },
        "repeats": args.repeats,
        "runs": runs,
        "aggregate": aggregate,
        "break_even": {
            "kv_mb_per_long_prompt": long_mb,
            "move_ms_per_long_prompt": move_ms,
            "move_gb_per_s": long_mb / move_ms,
            "colocated_stall_ms_per_prompt_chunk": stall_ms,
            "colocated_stall_ms_per_long_prompt_per_decode": stall_ms * chunks,
        },
    }
    path = RESULTS / "disaggregation.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {path}\n| server | short TPOT p50 / p99, ms | short ITL p99, ms | long TTFT p50, ms | tokens/s |")
    for label, a in aggregate.items():
        cells = [cell(a[k], "{:.1f}") for k in ("short_tpot_p50_ms", "short_tpot_p99_ms", "short_itl_p99_ms")]
        cells += [cell(a[k], "{:.0f}") for k in ("long_ttft_p50_ms", "output_tokens_per_s")]
        print(f"| {label} | {cells[0]} / {cells[1]} | {cells[2]} | {cells[3]} | {cells[4]} |")
    print(
        f"a long prompt's KV: {long_mb:.1f} MB, moved in {move_ms:.1f} ms ({long_mb / move_ms:.2f} GB/s); colocated, "
        f"each of its {chunks} chunks stalls every decode ~{stall_ms:.1f} ms ({stall_ms * chunks:.0f} ms in all)"
    )


if __name__ == "__main__":
    main()
