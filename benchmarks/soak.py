"""Soak test: a `tokenmill serve` process under mixed, misbehaving traffic for a long time, its RSS sampled.

Starts the server on the bundled demo model (loopback, a free port) and runs `--clients` concurrent
clients for `--minutes`, each drawing one scenario at a time (seeded): streams read to the end,
non-streamed completions with n > 1 and several prompts, structured output (guided_json), streams
dropped after a few chunks, clients that time out before the answer, refusals (bad JSON, a wrong
model, bad values, a lone surrogate, an oversized bad_words list) and /tokenize. Every request has a
deadline; one that passes it without an answer counts as unanswered (a hang), a 5xx as a server error.
At the end the server must be idle: nothing running or waiting and every KV block free (/metrics).

The server's RSS (/proc/PID/status VmRSS) is sampled every `--sample-s` seconds. The verdict: every
request answered, no 5xx, idle at the end, and RSS flat after warm-up — the median of the last 5
minutes within `--rss-slack-mib` of the median of the 5 minutes after warm-up. Writes
benchmarks/results/soak.json (the samples, the counts by scenario and outcome, the verdict).

Not part of `make test` (30 minutes by default). Usage:
    python benchmarks/soak.py [--minutes 30] [--clients 8] [--model models/tokenmill-demo]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import re
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent
REPO = ROOT.parent
RESULTS = ROOT / "results"
DEADLINE_S = 120.0  # a request unanswered after this long is a hang
WARMUP_S = 300.0
# The KV cache's pages are committed by the OS when first written, so RSS climbs until traffic has
# used every block once: bounded, but no leak. The soak serves with a cache small enough (256 MiB,
# 262,144 tokens of the demo model) that its traffic has cycled through it well within the warm-up.
KV_CACHE_BYTES = 256 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def start_server(model: str, port: int, log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "tokenmill.cli", "serve", model, "--port", str(port), "--log-interval", "60"]
    cmd += ["--kv-cache-memory", str(KV_CACHE_BYTES)]
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=REPO)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}); see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not come up in 300 s")


# -- scenarios: each returns its outcome ("ok", "refused", "dropped", ...) ------------------------------

Scenario = Callable[[httpx.AsyncClient, random.Random], Awaitable[str]]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(("the", "mill", "token", "grain", "river", "stone", "wheel")) for _ in range(n))


def _status(r: httpx.Response) -> str:
    if r.status_code == 200:
        return "ok"
    if r.status_code >= 500:
        return f"server_error_{r.status_code}"
    body = r.json()
    if "error" not in body or "message" not in body["error"]:
        return f"bad_error_shape_{r.status_code}"
    return "refused" if r.status_code in (400, 404, 413, 429) else f"status_{r.status_code}"


async def stream_chat(client: httpx.AsyncClient, rng: random.Random) -> str:
    body = {
        "messages": [{"role": "user", "content": _words(rng, rng.randint(3, 200))}],
        "max_tokens": rng.randint(8, 96),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with client.stream("POST", CHAT, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return _status(r)
        done = False
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: ") and "error" in json.loads(line[6:]):  # (not a token "error")
                return "stream_error"
        return "ok" if done else "stream_cut"


async def multi_prompt(client: httpx.AsyncClient, rng: random.Random) -> str:
    body = {
        "prompt": [_words(rng, rng.randint(2, 60)) for _ in range(rng.randint(2, 4))],
        "n": rng.randint(1, 3),
        "max_tokens": rng.randint(4, 48),
        "temperature": 0.8,
    }
    return _status(await client.post(COMPLETIONS, json=body))


async def guided(client: httpx.AsyncClient, rng: random.Random) -> str:
    props = {f"f{i}": {"type": rng.choice(("integer", "boolean", "string"))} for i in range(rng.randint(1, 4))}
    schema = {"type": "object", "properties": props, "required": list(props)}
    body = {"messages": [{"role": "user", "content": "json please"}], "max_tokens": 64, "guided_json": schema}
    return _status(await client.post(CHAT, json=body))


async def dropped_stream(client: httpx.AsyncClient, rng: random.Random) -> str:
    body = {"prompt": _words(rng, 20), "n": rng.randint(1, 8), "max_tokens": 400, "ignore_eos": True, "stream": True}
    keep = rng.randint(1, 6)
    async with client.stream("POST", COMPLETIONS, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return _status(r)
        async for _ in r.aiter_lines():
            keep -= 1
            if keep <= 0:
                break
    return "dropped"


async def timed_out(client: httpx.AsyncClient, rng: random.Random) -> str:
    body = {"prompt": _words(rng, 30), "n": rng.randint(1, 5), "max_tokens": 500, "ignore_eos": True}
    try:
        r = await client.post(COMPLETIONS, json=body, timeout=rng.uniform(0.05, 0.8))
    except httpx.TimeoutException:
        return "timed_out"
    return _status(r)


BAD_BODIES: list[tuple[str, bytes | dict[str, object]]] = [
    (COMPLETIONS, b"{not json"),
    (COMPLETIONS, b"[" * 20000),
    (COMPLETIONS, {"prompt": "x", "model": "no-such-model"}),
    (COMPLETIONS, {"prompt": "x", "max_tokens": -3}),
    (COMPLETIONS, {"prompt": [[7, 8, 9], [5] * 5000], "min_tokens": 10}),
    (CHAT, {"messages": [{"role": "user", "content": "\ud800"}]}),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "bad_words": ["w"] * 100000}),
    (CHAT, {"messages": []}),
]


async def bad_input(client: httpx.AsyncClient, rng: random.Random) -> str:
    path, body = rng.choice(BAD_BODIES)
    if isinstance(body, bytes):
        r = await client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = await client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    outcome = _status(r)
    return "refused" if outcome == "refused" else f"bad_input_{outcome}"


async def tokenize(client: httpx.AsyncClient, rng: random.Random) -> str:
    return _status(await client.post("/tokenize", json={"prompt": _words(rng, rng.randint(1, 2000))}))


SCENARIOS: dict[str, tuple[Scenario, int]] = {  # name -> (scenario, weight)
    "stream_chat": (stream_chat, 5),
    "multi_prompt": (multi_prompt, 3),
    "guided": (guided, 2),
    "dropped_stream": (dropped_stream, 2),
    "timed_out": (timed_out, 2),
    "bad_input": (bad_input, 3),
    "tokenize": (tokenize, 1),
}


async def client_loop(base: str, seed: int, until: float, counts: Counter[tuple[str, str]]) -> None:
    rng = random.Random(seed)
    names = list(SCENARIOS)
    weights = [SCENARIOS[n][1] for n in names]
    async with httpx.AsyncClient(base_url=base, timeout=DEADLINE_S) as client:
        while time.monotonic() < until:
            name = rng.choices(names, weights)[0]
            try:
                outcome = await asyncio.wait_for(SCENARIOS[name][0](client, rng), DEADLINE_S)
            except (TimeoutError, httpx.TimeoutException):
                outcome = "unanswered"
            except httpx.HTTPError as e:
                outcome = f"transport_{type(e).__name__}"
            counts[(name, outcome)] += 1


async def sampler(pid: int, start: float, until: float, every: float, samples: list[tuple[float, float]]) -> None:
    while time.monotonic() < until:
        samples.append((round(time.monotonic() - start, 1), round(rss_mib(pid), 1)))
        await asyncio.sleep(every)


def gauges(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    out = {}
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        m = re.search(rf"^tokenmill:{name}\{{[^}}]*\}} (\S+)$", text, re.M)
        out[name] = float(m.group(1)) if m else float("nan")
    return out


def wait_idle(base: str, timeout: float = 60.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        g = gauges(base)
        if all(v == 0 for v in g.values()) or time.monotonic() > deadline:
            return g
        time.sleep(0.5)


def window(samples: list[tuple[float, float]], lo: float, hi: float) -> dict[str, float]:
    values = [m for t, m in samples if lo <= t < hi]
    if not values:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "models" / "tokenmill-demo"))
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--rss-slack-mib", type=float, default=32.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "soak.json"))
    args = ap.parse_args()

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = Path(args.out).with_suffix(".log")
    proc = start_server(args.model, port, log)
    counts: Counter[tuple[str, str]] = Counter()
    samples: list[tuple[float, float]] = []
    start = time.monotonic()
    until = start + args.minutes * 60

    async def run() -> None:
        loops = [client_loop(base, args.seed * 1000 + i, until, counts) for i in range(args.clients)]
        await asyncio.gather(sampler(proc.pid, start, until, args.sample_s, samples), *loops)

    try:
        asyncio.run(run())
        idle = wait_idle(base)
        samples.append((round(time.monotonic() - start, 1), round(rss_mib(proc.pid), 1)))
        health = httpx.get(f"{base}/health", timeout=10).status_code
    finally:
        proc.terminate()
        proc.wait(60)

    total = args.minutes * 60
    after_warmup = window(samples, WARMUP_S, WARMUP_S + 300)
    last = window(samples, total - 300, total + 3600)
    by_outcome: Counter[str] = Counter()
    for (_, outcome), k in counts.items():
        by_outcome[outcome] += k
    failures = {o: k for o, k in by_outcome.items() if o not in ("ok", "refused", "dropped", "timed_out")}
    flat = last["median"] - after_warmup["median"] <= args.rss_slack_mib
    verdict = {
        "every_request_answered": not failures,
        "idle_at_end": all(v == 0 for v in idle.values()),
        "health_at_end": health,
        "rss_flat_after_warmup": flat,
    }
    report = {
        "benchmark": "soak",
        "model": args.model,
        "minutes": args.minutes,
        "clients": args.clients,
        "cpu": cpu_name(),
        "requests": sum(counts.values()),
        "by_outcome": dict(by_outcome),
        "by_scenario": {f"{s}:{o}": k for (s, o), k in sorted(counts.items())},
        "failures": failures,
        "gauges_at_end": idle,
        "rss_mib_after_warmup_5min": after_warmup,
        "rss_mib_last_5min": last,
        "rss_samples": samples,
        "verdict": verdict,
        "passed": all(v is True or v == 200 for v in verdict.values()),
    }
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k not in ("rss_samples", "by_scenario")}, indent=1))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
