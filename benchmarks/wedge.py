"""Issue 42's reproductions against a live `tokenmill serve`: each client that could wedge, kill,
stall or leak the server, and what the server does with it now, in one JSON.

Every item starts its own server process on the bundled demo model (loopback, a free port) with the
flags its reproduction needs, runs the client behaviour the issue describes, and records what came
back and what the server was left doing (/metrics: requests running and waiting, tokens generated
after the answer; RSS; log growth). Items (the issue's numbers):

1. a client that times out on an n=5 request with --max-waiting 4 --max-num-seqs 1, then 3 requests
2. bad_words naming a token past the embedding (a token added to tokenizer.json), a bystander beside it
3. a multi-prompt request refused for one prompt (400), and a 300-prompt request refused (429 or 400)
5. a 10,000-property guided_json, a 20 MB /tokenize, a 300 MB body: /health's latency meanwhile, RSS
6. 1,100 connections trickling a header byte every few seconds, under a 1,024 open-file soft limit
7. 20 requests with 20,000 unknown field names each: RSS and log growth
8. a body of 100,000 '[', 5,000-deep guided_json and tool parameters, lone surrogates
9. with --api-key: the endpoints answered without a key, a lowercase 'bearer'
10. two API keys: does the second see the first's prefix in cached_tokens
13. schema-valid requests: a tool message with content null, an empty guided_grammar

Item 4 (a bystander beside 50,000 bad_words) is benchmarks/bystander.py; 11 and 12 are tests.
Usage: python benchmarks/wedge.py [--out benchmarks/results/wedge.json] [--only 1,3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import shutil
import socket
import string
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "models" / "tokenmill-demo"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@dataclass
class Live:
    base: str
    proc: subprocess.Popen[bytes]
    log: Path
    headers: dict[str, str]

    def post(self, path: str, body: Any = None, timeout: float = 120, **kw: Any) -> httpx.Response:
        if body is not None and not isinstance(body, bytes | str):
            kw["json"] = body
        elif body is not None:
            kw["content"] = body
            kw.setdefault("headers", {"content-type": "application/json"})
        kw.setdefault("headers", {})
        kw["headers"] = {**self.headers, **kw["headers"]}
        return httpx.post(self.base + path, timeout=timeout, **kw)

    def metric(self, name: str) -> float:
        text = httpx.get(self.base + "/metrics", headers=self.headers, timeout=30).text
        values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(f"tokenmill:{name}")]
        return sum(values)

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def leftovers(self, since: float, settle: float = 3.0) -> dict[str, float]:
        """What the server does `settle` s after an answer: requests running / waiting, and the tokens
        generated since the counter read `since` (before the request was sent)."""
        time.sleep(settle)
        return {
            "running": self.metric("num_requests_running"),
            "waiting": self.metric("num_requests_waiting"),
            f"tokens_generated_by_{settle:g}s_after": self.metric("generation_tokens_total") - since,
        }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def server(*flags: str, model: Path = DEMO, key: str | None = None, nofile: int | None = None) -> Iterator[Live]:
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="wedge-", suffix=".log")[1])
    env = {**os.environ, **({"TOKENMILL_API_KEY": key} if key else {})}

    def limit() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    cmd = [sys.executable, "-m", "tokenmill.cli", "serve", str(model), "--port", str(port), *flags]
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=REPO, env=env, preexec_fn=limit)
    live = Live(f"http://127.0.0.1:{port}", proc, log, {"Authorization": f"Bearer {key}"} if key else {})
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited: {log.read_text()[-2000:]}")
            try:
                if httpx.get(live.base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not come up")
            time.sleep(0.3)
        yield live
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def health_during(live: Live, work: Callable[[], Any]) -> dict[str, Any]:
    """Run `work` on a thread while /health is polled: its result, its seconds, /health's slowest answer."""
    result: dict[str, Any] = {}

    def run() -> None:
        start = time.monotonic()
        try:
            r = work()
            result["status"] = r.status_code
            result["error"] = r.json().get("error", {}).get("message", "")[:160] if r.status_code != 200 else None
        except Exception as e:
            result["status"] = f"{type(e).__name__}"
        result["seconds"] = round(time.monotonic() - start, 2)

    thread = threading.Thread(target=run)
    thread.start()
    slowest = 0.0
    while thread.is_alive():
        start = time.monotonic()
        with suppress(httpx.HTTPError):
            httpx.get(live.base + "/health", timeout=60)
        slowest = max(slowest, time.monotonic() - start)
        time.sleep(0.1)
    thread.join()
    return {**result, "health_slowest_s": round(slowest, 3)}


def nested(depth: int, inner: str, wrap: Callable[[str], str]) -> str:
    text = inner
    for _ in range(depth):
        text = wrap(text)
    return text


def deep_schema(depth: int) -> str:
    return nested(depth, '{"type": "string"}', lambda s: '{"type": "object", "properties": {"a": ' + s + "}}")


# -- the items -----------------------------------------------------------------------------------


def item1() -> dict[str, Any]:
    with server("--max-waiting", "4", "--max-num-seqs", "1") as live:
        with suppress(httpx.TimeoutException):
            live.post(COMPLETIONS, {"prompt": "p", "n": 5, "max_tokens": 1000, "ignore_eos": True}, timeout=0.4)
        time.sleep(1)
        after = [live.post(COMPLETIONS, {"prompt": "hello", "max_tokens": 4}).status_code for _ in range(3)]
        return {"statuses_after_the_timeout": after, **live.leftovers(live.metric("generation_tokens_total"))}


def model_with_extra_token(folder: Path) -> Path:
    shutil.copytree(DEMO, folder)
    tok = json.loads((folder / "tokenizer.json").read_text())
    size = json.loads((folder / "config.json").read_text())["vocab_size"]
    tok["added_tokens"].append(
        {
            "id": size,
            "content": "<|extra|>",
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
    )
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    return folder


def item2() -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp, server(model=model_with_extra_token(Path(tmp) / "m")) as live:
        out: dict[str, Any] = {}
        bystander = threading.Thread(
            target=lambda: out.update(
                bystander=live.post(
                    COMPLETIONS, {"prompt": "a long one", "max_tokens": 200, "ignore_eos": True}
                ).status_code
            )
        )
        bystander.start()
        time.sleep(0.3)
        r = live.post(COMPLETIONS, {"prompt": "hi", "bad_words": ["<|extra|>"], "max_tokens": 8})
        bystander.join()
        later = [live.post(COMPLETIONS, {"prompt": "hello", "max_tokens": 4}).status_code for _ in range(3)]
        return {
            "status": r.status_code,
            "param": r.json().get("error", {}).get("param") if r.status_code != 200 else None,
            "bystander": out.get("bystander"),
            "later": later,
            "health": httpx.get(live.base + "/health", timeout=10).status_code,
        }


def item3() -> dict[str, Any]:
    with server() as live:
        since = live.metric("generation_tokens_total")
        body = {"prompt": [[7, 8, 9], [5] * 1000], "min_tokens": 100, "max_tokens": None, "ignore_eos": True}
        r = live.post(COMPLETIONS, body)
        one = {"status": r.status_code, **live.leftovers(since)}
        since = live.metric("generation_tokens_total")
        r = live.post(COMPLETIONS, {"prompt": ["p"] * 300, "max_tokens": 300, "ignore_eos": True})
        many = {"status": r.status_code, **live.leftovers(since)}
        return {"multi_prompt_one_refused": one, "three_hundred_prompts": many}


def item5() -> dict[str, Any]:
    with server() as live:
        props = ", ".join(f'"p{i}": {{"type": "integer"}}' for i in range(10_000))
        schema = '{"type": "object", "properties": {' + props + "}}"
        body = '{"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "guided_json": ' + schema + "}"
        guided = health_during(live, lambda: live.post(CHAT, body))
        words = " ".join(random.Random(1).choice(("mill", "grain", "stone", "wheel")) for _ in range(4_000_000))
        tokenize = health_during(live, lambda: live.post("/tokenize", {"prompt": words[: 20 * 2**20]}))
        rss = live.rss_mib()
        big = b'{"prompt": "' + b"a" * (300 * 2**20) + b'"}'
        body_300mb = health_during(live, lambda: live.post(COMPLETIONS, big))
        body_300mb["rss_growth_mib"] = round(live.rss_mib() - rss, 1)
        return {"guided_json_10k_properties": guided, "tokenize_20mb": tokenize, "body_300mb": body_300mb}


def item6(connections: int = 1100, seconds: float = 25.0) -> dict[str, Any]:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    with server(nofile=1024) as live:
        port = int(live.base.rsplit(":", 1)[1])
        socks = []
        for _ in range(connections):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            socks.append(s)
        time.sleep(1)
        health, start, closed = [], time.monotonic(), set()
        while time.monotonic() - start < seconds:
            for i, s in enumerate(socks):
                if i not in closed:
                    try:
                        s.send(b"P")
                    except OSError:
                        closed.add(i)
            t0 = time.monotonic()
            try:
                ok = httpx.get(live.base + "/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                ok = False
            health.append((ok, time.monotonic() - t0))
            time.sleep(2)
        for s in socks:
            s.close()
        return {
            "connections": connections,
            "server_nofile_soft": 1024,
            "health_ok": sum(ok for ok, _ in health),
            "health_checks": len(health),
            "health_slowest_s": round(max(t for _, t in health), 3),
            "closed_by_server": len(closed),
        }


def item7() -> dict[str, Any]:
    with server() as live:
        rng = random.Random(7)
        rss, log = live.rss_mib(), live.log.stat().st_size
        for _ in range(20):
            names = {"".join(rng.choices(string.ascii_lowercase, k=16)): 1 for _ in range(20_000)}
            live.post(COMPLETIONS, {"prompt": "hi", "max_tokens": 1, **names})
        return {
            "rss_growth_mib": round(live.rss_mib() - rss, 1),
            "log_growth_kib": round((live.log.stat().st_size - log) / 1024, 1),
        }


def item8() -> dict[str, Any]:
    with server() as live:
        deep_tool = (
            '{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": '
            '{"name": "f", "parameters": ' + deep_schema(5000) + "}}]}"
        )
        cases = {
            "100k_open_brackets": (COMPLETIONS, "[" * 100_000),
            "guided_json_5000_deep": (
                CHAT,
                '{"messages": [{"role": "user", "content": "x"}], "guided_json": ' + deep_schema(5000) + "}",
            ),
            "tool_parameters_5000_deep": (CHAT, deep_tool),
            "lone_surrogate_chat": (CHAT, '{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}'),
            "lone_surrogate_tokenize": ("/tokenize", '{"prompt": "\\ud800"}'),
        }
        out = {}
        for name, (path, body) in cases.items():
            r = live.post(path, body)
            out[name] = {"status": r.status_code, "param": _param(r)}
        return out


def _param(r: httpx.Response) -> Any:
    try:
        return r.json()["error"].get("param")
    except (ValueError, KeyError, AttributeError):
        return None


def item9() -> dict[str, Any]:
    with server(key="sekrit") as live:
        open_ = {}
        for method, path, body in (
            ("POST", "/tokenize", {"prompt": "hi"}),
            ("POST", "/detokenize", {"tokens": [5, 6]}),
            ("GET", "/metrics", None),
            ("GET", "/openapi.json", None),
            ("GET", "/docs", None),
            ("GET", "/v1/models", None),
            ("GET", "/health", None),
        ):
            open_[path] = httpx.request(method, live.base + path, json=body, timeout=30).status_code
        lower = httpx.get(live.base + "/v1/models", headers={"authorization": "bearer sekrit"}, timeout=30)
        cmdline = Path(f"/proc/{live.proc.pid}/cmdline").read_bytes()
        return {"without_key": open_, "lowercase_bearer": lower.status_code, "key_in_ps": b"sekrit" in cmdline}


def item10(keys: bool = True) -> dict[str, Any]:
    """Two clients with their own API keys (or, `keys` False, two clients of a server without keys: a
    server that knows no tenants cannot tell them apart)."""
    with server(key="alice,bob" if keys else None) as live:
        secret = "the launch code of tenant A is 0451, keep it safe " * 3
        usage = []
        for who in ("alice", "bob", "alice"):
            r = live.post(COMPLETIONS, {"prompt": secret, "max_tokens": 1}, headers={"Authorization": f"Bearer {who}"})
            details = r.json().get("usage", {}).get("prompt_tokens_details") or {} if r.status_code == 200 else {}
            usage.append({"key": who, "status": r.status_code, "cached_tokens": details.get("cached_tokens")})
        return {"requests": usage}


def item13() -> dict[str, Any]:
    with server() as live:
        tool_null = {
            "messages": [
                {"role": "user", "content": "x"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
                },
                {"role": "tool", "content": None, "tool_call_id": "c1"},
            ],
            "max_tokens": 2,
        }
        empty_grammar = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "guided_grammar": ""}
        return {
            "tool_content_null_chat": live.post(CHAT, tool_null).status_code,
            "tool_content_null_tokenize": live.post("/tokenize", {"messages": tool_null["messages"]}).status_code,
            "empty_guided_grammar": {"status": (r := live.post(CHAT, empty_grammar)).status_code, "param": _param(r)},
        }


ITEMS = {1: item1, 2: item2, 3: item3, 5: item5, 6: item6, 7: item7, 8: item8, 9: item9, 10: item10, 13: item13}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "wedge.json")
    parser.add_argument("--only", default="", help="comma-separated item numbers (default: all)")
    parser.add_argument(
        "--no-keys", action="store_true", help="item 10 without API keys (a server that takes one key at most)"
    )
    args = parser.parse_args()
    chosen = [int(x) for x in args.only.split(",") if x] or list(ITEMS)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.machine(),
    )
    results: dict[str, Any] = {"commit": commit.stdout.strip(), "cpu": cpu, "cores": os.cpu_count(), "items": {}}
    for n in chosen:
        start = time.monotonic()
        try:
            results["items"][str(n)] = item10(keys=False) if n == 10 and args.no_keys else ITEMS[n]()
        except Exception as e:
            results["items"][str(n)] = {"error": f"{type(e).__name__}: {e}"[:500]}
        print(f"item {n} ({time.monotonic() - start:.0f} s): {json.dumps(results['items'][str(n)])}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
