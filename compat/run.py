"""`make compat`: the tools people already point at an OpenAI-compatible server, against `tokenmill serve`.

Starts `tokenmill serve` (the bundled demo model, float32, a free loopback port) and runs each tool,
offline (local tokenizer paths, a local lm-eval task whose data is in this folder, HF_HUB_OFFLINE=1),
from the separate venv `make compat` builds (compat/requirements.txt, pinned). Prints one line per
tool and exits non-zero on any failure:
- openai: the official client, completions and chat, whole and streamed;
- openai-responses: the official client's Responses API calls (stateless): text whole and streamed (its
  stream helper's final response too), a function call and its output sent back, text.format json_schema,
  `store: true` refused;
- anthropic: the official client's Messages API calls: a message whole and streamed (its stream helper),
  a stop sequence, a forced tool call and its tool_result sent back, an error in Anthropic's shape;
- openai-embeddings: the official client's embeddings calls against a second server, `tokenmill serve
  --task embed` on an embedding folder `tokenmill make-model --pooling last` writes (random weights: no
  embedder can be downloaded here): a list of texts as float and as base64 (which decodes to the float
  answer), the client's default (it asks for base64 and decodes it), one text alone;
- lm-eval: `local-completions` log-likelihoods (echo + logprobs) on compat/tasks/tokenmill_python,
  each equal to lm-eval's own transformers run of the same checkpoint (`--model hf`) within 1e-3;
- schemathesis: every check, all phases, against /openapi.json (compat/schemathesis.toml);
- guidellm, at concurrency 1 and 4, on completions and chat;
- aiperf, on completions.

Usage: python compat/run.py [--tools-venv .venv-compat] [--only openai,lm-eval,...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "tokenmill-demo"
NAME = "tokenmill-demo"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "DO_NOT_TRACK": "1"}
LL_TOLERANCE = 1e-3


TOKENMILL = ROOT / ".venv" / "bin" / "tokenmill"


class Server:
    """`tokenmill serve MODEL` on a free loopback port, float32, small KV; RuntimeError if it does not
    come up (its log's tail)."""

    def __init__(self, log: Path, model: Path = MODEL, extra: tuple[str, ...] = ()) -> None:
        cmd = [str(TOKENMILL), "serve", str(model), "--port", "0", "--dtype", "float32", *extra]
        cmd += ["--max-model-len", "256", "--kv-cache-memory", str(64 * 2**20), "--max-waiting", "256"]
        self.log = log
        self.proc = subprocess.Popen(cmd, stderr=log.open("w"), stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            found = re.search(r"on (http://127\.0\.0\.1:\d+)", log.read_text())
            if found and self._healthy(found.group(1)):
                self.url = found.group(1)
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"tokenmill serve exited:\n{log.read_text()[-2000:]}")
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("tokenmill serve did not start in 120 s")

    @staticmethod
    def _healthy(url: str) -> bool:
        try:
            return urllib.request.urlopen(f"{url}/health", timeout=2).status == 200
        except OSError:
            return False

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def run(cmd: list[str], timeout: float, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, env={**os.environ, **OFFLINE}, capture_output=True, text=True, timeout=timeout)


def tail(done: subprocess.CompletedProcess[str], lines: int = 15) -> str:
    return "\n".join((done.stdout + done.stderr).strip().splitlines()[-lines:])


OPENAI_CHECK = r"""
import sys
from openai import OpenAI
c = OpenAI(base_url=sys.argv[1] + "/v1", api_key="none", max_retries=0, timeout=60)
whole = c.completions.create(model=sys.argv[2], prompt="def fib(n):", max_tokens=16, temperature=0)
streamed = "".join(x.choices[0].text for x in c.completions.create(
    model=sys.argv[2], prompt="def fib(n):", max_tokens=16, temperature=0, stream=True) if x.choices)
assert streamed == whole.choices[0].text, (streamed, whole.choices[0].text)
chat = c.chat.completions.create(model=sys.argv[2], messages=[{"role": "user", "content": "hi"}], max_tokens=8)
assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
print(f"completion, streamed == whole ({whole.usage.completion_tokens} tokens); chat ok")
"""


def check_openai(tools: Path, url: str, scratch: Path) -> str:
    done = run([str(tools / "bin" / "python"), "-c", OPENAI_CHECK, url, NAME], 120)
    if done.returncode:
        raise RuntimeError(tail(done))
    return done.stdout.strip().splitlines()[-1]


RESPONSES_CHECK = r"""
import json, sys
from openai import OpenAI, BadRequestError
c = OpenAI(base_url=sys.argv[1] + "/v1", api_key="none", max_retries=0, timeout=60)
ask = dict(model=sys.argv[2], instructions="Be brief.", input="Say hi.", max_output_tokens=16, temperature=0)
whole = c.responses.create(**ask)
assert whole.object == "response" and whole.status in ("completed", "incomplete") and whole.output_text
events = list(c.responses.create(**ask, stream=True))
streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
assert streamed == whole.output_text and events[-1].type == "response.incomplete", [e.type for e in events][-3:]
weather = {"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}
asked = [{"role": "user", "content": "Weather in Paris?"}]
called = c.responses.create(model=sys.argv[2], input=asked, tools=[weather], max_output_tokens=48,
                            tool_choice={"type": "function", "name": "get_weather"})
(call,) = [o for o in called.output if o.type == "function_call"]
assert call.name == "get_weather" and "city" in json.loads(call.arguments)
back = asked + [{"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
                {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
after = c.responses.create(model=sys.argv[2], input=back, tools=[weather], max_output_tokens=8)
schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
          "additionalProperties": False}
shape = {"format": {"type": "json_schema", "name": "n", "schema": schema, "strict": True}}
shaped = c.responses.create(model=sys.argv[2], input="A number.", max_output_tokens=32, text=shape, temperature=0)
assert shaped.status == "completed" and json.loads(shaped.output_text)["n"] in range(10)
with c.responses.stream(model=sys.argv[2], input="A number.", max_output_tokens=32, text=shape, temperature=0) as s:
    final = s.get_final_response()  # (the stream helper's: it needs response.completed)
assert final.output_text == shaped.output_text, (final.output_text, shaped.output_text)
try:
    c.responses.create(model=sys.argv[2], input="hi", store=True)
    raise SystemExit("store: true was accepted")
except BadRequestError as e:
    assert e.body["param"] == "store", e.body
print(f"text streamed == whole ({whole.usage.output_tokens} tokens, {len(events)} events); a function call and "
      f"its output ({after.usage.input_tokens} input tokens); json_schema; store refused")
"""

ANTHROPIC_CHECK = r"""
import sys
import anthropic
c = anthropic.Anthropic(base_url=sys.argv[1], api_key="none", max_retries=0, timeout=60)
ask = dict(model=sys.argv[2], system="Be brief.", max_tokens=16, extra_body={"temperature": 0},
           messages=[{"role": "user", "content": "Say hi."}])  # (this client leaves temperature to extra_body)
whole = c.messages.create(**ask)
assert whole.type == "message" and whole.content[0].type == "text" and whole.stop_reason == "max_tokens"
with c.messages.stream(**ask) as s:
    streamed = "".join(s.text_stream)
    final = s.get_final_message()
assert streamed == whole.content[0].text and final.usage.output_tokens == whole.usage.output_tokens
stop = whole.content[0].text[3:6]
stopped = c.messages.create(**{**ask, "stop_sequences": [stop]}) if stop.strip() else whole
assert stopped.stop_reason in ("stop_sequence", "max_tokens"), stopped.stop_reason
weather = {"name": "get_weather", "description": "The weather in a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}
asked = [{"role": "user", "content": "Weather in Paris?"}]
called = c.messages.create(model=sys.argv[2], max_tokens=48, messages=asked, tools=[weather],
                           tool_choice={"type": "tool", "name": "get_weather"})
(use,) = [b for b in called.content if b.type == "tool_use"]
assert called.stop_reason == "tool_use" and use.name == "get_weather" and "city" in use.input
back = asked + [{"role": "assistant", "content": called.content},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}]
with c.messages.stream(model=sys.argv[2], max_tokens=8, messages=back, tools=[weather]) as s:
    after = s.get_final_message()
try:
    c.messages.create(model=sys.argv[2], max_tokens=0, messages=asked)
    raise SystemExit("max_tokens: 0 was accepted")
except anthropic.BadRequestError as e:
    assert e.body["type"] == "error" and e.body["error"]["type"] == "invalid_request_error", e.body
print(f"message streamed == whole ({whole.usage.output_tokens} tokens); stop sequence ({stopped.stop_reason}); a "
      f"tool_use and its tool_result ({after.usage.input_tokens} input tokens); error in Anthropic's shape")
"""


def _client_check(check: str, tools: Path, url: str) -> str:
    done = run([str(tools / "bin" / "python"), "-c", check, url, NAME], 180)
    if done.returncode:
        raise RuntimeError(tail(done))
    return done.stdout.strip().splitlines()[-1]


def check_openai_responses(tools: Path, url: str, scratch: Path) -> str:
    return _client_check(RESPONSES_CHECK, tools, url)


def check_anthropic(tools: Path, url: str, scratch: Path) -> str:
    return _client_check(ANTHROPIC_CHECK, tools, url)


EMBEDDINGS_CHECK = r"""
import base64, math, struct, sys
from openai import OpenAI
c = OpenAI(base_url=sys.argv[1] + "/v1", api_key="none", max_retries=0, timeout=60)
(model,) = [m.id for m in c.models.list().data]
width = int(sys.argv[2])  # the folder's hidden size
texts = ["def fib(n):", "the quick brown fox", "import numpy as np", "fibonacci numbers"]
floats = c.embeddings.create(model=model, input=texts, encoding_format="float")
assert floats.object == "list" and [d.index for d in floats.data] == list(range(len(texts))), floats.data
vectors = [d.embedding for d in floats.data]
assert all(len(v) == width and all(isinstance(x, float) for x in v) for v in vectors), [len(v) for v in vectors]
assert all(abs(math.sqrt(sum(x * x for x in v)) - 1) < 1e-5 for v in vectors)  # the folder's Normalize module
assert len({tuple(v) for v in vectors}) == len(texts)
assert 0 < floats.usage.prompt_tokens == floats.usage.total_tokens, floats.usage
coded = c.embeddings.create(model=model, input=texts, encoding_format="base64")
assert all(isinstance(d.embedding, str) for d in coded.data) and coded.usage == floats.usage
decoded = [struct.unpack(f"<{width}f", base64.b64decode(d.embedding)) for d in coded.data]
assert all(len(base64.b64decode(d.embedding)) == 4 * width for d in coded.data)
worst = max(abs(a - b) for v, w in zip(vectors, decoded, strict=True) for a, b in zip(v, w, strict=True))
assert worst < 1e-5, worst  # (a second request may read the first's prompts from the prefix cache)
default = c.embeddings.create(model=model, input=texts)  # (the client picks the format and decodes)
assert all(len(d.embedding) == width for d in default.data)
fmt = max(abs(a - b) for d, v in zip(default.data, vectors, strict=True) for a, b in zip(d.embedding, v, strict=True))
assert fmt < 1e-5, fmt
one = c.embeddings.create(model=model, input=texts[1], encoding_format="float").data[0].embedding
alone = max(abs(a - b) for a, b in zip(one, vectors[1], strict=True))
assert alone < 1e-5, alone
print(f"{len(texts)} texts x {width} floats, unit length; base64 decodes to the float answer within {worst:.0e}, "
      f"the client's default within {fmt:.0e}, one text alone within {alone:.0e} ({floats.usage.prompt_tokens} tokens)")
"""


def embed_server(scratch: Path) -> Server:
    """`tokenmill serve --task embed` on a random-weight embedding folder (last-token pooling, normalized)
    that `tokenmill make-model` writes into `scratch`."""
    folder = scratch / "embedder"
    done = run([str(TOKENMILL), "make-model", "--pooling", "last", "--out", str(folder)], 300)
    if done.returncode:
        raise RuntimeError(f"make-model:\n{tail(done)}")
    return Server(scratch / "serve-embed.log", folder, ("--task", "embed"))


def check_openai_embeddings(tools: Path, url: str, scratch: Path) -> str:
    width = json.loads((scratch / "embedder" / "config.json").read_text())["hidden_size"]
    done = run([str(tools / "bin" / "python"), "-c", EMBEDDINGS_CHECK, url, str(width)], 180)
    if done.returncode:
        raise RuntimeError(tail(done))
    return done.stdout.strip().splitlines()[-1]


def _lm_eval(tools: Path, model: str, args: str, out: Path) -> list[list[float]]:
    cmd = [str(tools / "bin" / "lm_eval"), "--model", model, "--model_args", args, "--tasks", "tokenmill_python"]
    cmd += ["--include_path", "compat/tasks", "--log_samples", "--output_path", str(out), "--device", "cpu"]
    done = run(cmd, 900)
    if done.returncode:
        raise RuntimeError(tail(done))
    (samples,) = out.rglob("samples_tokenmill_python_*.jsonl")
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    return [[float(r[0]) for r in row["filtered_resps"]] for row in sorted(rows, key=lambda r: r["doc_id"])]


def check_lm_eval(tools: Path, url: str, scratch: Path) -> str:
    served = _lm_eval(
        tools,
        "local-completions",
        f"model={NAME},base_url={url}/v1/completions,tokenizer={MODEL},tokenizer_backend=huggingface,"
        "num_concurrent=2,max_retries=1,add_bos_token=True",  # as lm-eval's hf model encodes (BOS first)
        scratch / "lm-eval-served",
    )
    reference = _lm_eval(tools, "hf", f"pretrained={MODEL},dtype=float32", scratch / "lm-eval-hf")
    diffs = [abs(a - b) for x, y in zip(served, reference, strict=True) for a, b in zip(x, y, strict=True)]
    worst = max(diffs)
    if worst > LL_TOLERANCE:
        raise RuntimeError(f"log-likelihoods differ from transformers by up to {worst:.2e} (> {LL_TOLERANCE})")
    return f"{len(diffs)} log-likelihoods equal transformers' within {worst:.1e} (tolerance {LL_TOLERANCE})"


def check_schemathesis(tools: Path, url: str, scratch: Path) -> str:
    cmd = [str(tools / "bin" / "schemathesis"), "run", f"{url}/openapi.json", "--checks", "all"]
    cmd += ["--phases", "examples,coverage,fuzzing,stateful", "--max-examples", "25", "--seed", "1"]
    # a request may generate up to the server's 256-token length: ~0.5 s on an idle 2-core machine, tens of
    # seconds when the machine is busy with other work (schemathesis's own default of 10 s then reads as
    # a network error though the server answers)
    cmd += ["--request-timeout", "120"]
    done = run(cmd, 900, cwd=ROOT / "compat")  # compat/schemathesis.toml
    (scratch / "schemathesis.log").write_text(done.stdout + done.stderr)  # (the whole report: failures lead it)
    found = re.search(r"(\d+) generated, (\d+) passed", done.stdout)
    if done.returncode or not found:
        raise RuntimeError(f"{tail(done, 40)}\n(the whole report: {scratch / 'schemathesis.log'})")
    return f"all checks, all phases: {found.group(1)} generated, {found.group(2)} passed"


def check_guidellm(tools: Path, url: str, scratch: Path) -> str:
    results = []
    for route in ("/v1/completions", "/v1/chat/completions"):
        for streams in (1, 4):
            label = f"{'chat' if 'chat' in route else 'completions'}@{streams}"
            out = scratch / f"guidellm-{label}.json"
            cmd = [str(tools / "bin" / "guidellm"), "run", "--disable-progress"]
            cmd += ["--backend", f"kind=openai_http,target={url},model={NAME},request_format={route}"]
            cmd += ["--profile", f"kind=concurrent,streams={streams}", "--constraint", "kind=max_requests,count=8"]
            cmd += ["--data", "kind=synthetic_text,prompt_tokens=48,output_tokens=16"]
            cmd += ["--tokenizer", f"kind=hf_auto,model={MODEL}", "--output", f"kind=json,path={out}"]
            done = run(cmd, 600)
            if done.returncode or not out.is_file():
                raise RuntimeError(f"{route} at concurrency {streams}:\n{tail(done)}")
            state = json.loads(out.read_text())["benchmarks"][0]["scheduler_state"]
            if state["successful_requests"] != 8 or state["errored_requests"] or state["cancelled_requests"]:
                raise RuntimeError(f"{route} at concurrency {streams}: {state}")
            results.append(label)
    return f"8 of 8 requests succeeded at each of {', '.join(results)}"


def check_aiperf(tools: Path, url: str, scratch: Path) -> str:
    out = scratch / "aiperf"
    cmd = [str(tools / "bin" / "aiperf"), "profile", "--model", NAME, "--url", url, "--endpoint-type", "completions"]
    cmd += ["--streaming", "--tokenizer", str(MODEL), "--concurrency", "2", "--request-count", "8", "--isl", "32"]
    cmd += ["--osl", "16", "--extra-inputs", "ignore_eos:true", "--artifact-dir", str(out), "--ui-type", "none"]
    cmd += ["--no-server-metrics", "--no-gpu-telemetry", "--use-server-token-count"]  # tokens from usage
    # aiperf reads a local tokenizer folder without the hub; its offline mode takes any name for a repo id
    env = {k: v for k, v in os.environ.items() if k not in OFFLINE}
    done = subprocess.run(cmd, cwd=scratch, env=env, capture_output=True, text=True, timeout=600)
    report = out / "profile_export_aiperf.json"
    if done.returncode or not report.is_file():
        raise RuntimeError(tail(done))
    data = json.loads(report.read_text())
    count, osl = data["request_count"]["avg"], data["output_sequence_length"]
    if count != 8 or data.get("error_summary") or osl["min"] != 16 or osl["max"] != 16:
        raise RuntimeError(f"requests {count}, errors {data.get('error_summary')}, output lengths {osl}")
    ttft = data["time_to_first_token"]["p50"]
    return f"8 streamed requests, 16 tokens each, TTFT p50 {ttft:.0f} ms"


CHECKS: dict[str, Callable[[Path, str, Path], str]] = {
    "openai": check_openai,
    "openai-responses": check_openai_responses,
    "anthropic": check_anthropic,
    "openai-embeddings": check_openai_embeddings,
    "lm-eval": check_lm_eval,
    "guidellm": check_guidellm,
    "aiperf": check_aiperf,
    "schemathesis": check_schemathesis,
}
# the checks run against the embedding server (started the first time one of them runs); the others
# against the demo model's
EMBED_CHECKS = frozenset({"openai-embeddings"})


def started(servers: dict[str, Server | RuntimeError], kind: str, scratch: Path) -> Server:
    """The server of `kind` ("chat": the demo model; "embed"), started on first use; a start that failed
    fails each check that needs it, once tried."""
    if kind not in servers:
        try:
            servers[kind] = embed_server(scratch) if kind == "embed" else Server(scratch / "serve.log")
        except RuntimeError as e:
            servers[kind] = e
    server = servers[kind]
    if isinstance(server, RuntimeError):
        raise server
    return server


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tools-venv", default=str(ROOT / ".venv-compat"))
    parser.add_argument("--only", default=",".join(CHECKS), help=f"comma-separated, of {', '.join(CHECKS)}")
    args = parser.parse_args()
    tools = Path(args.tools_venv).resolve()  # the tools run from other folders
    wanted = [name for name in args.only.split(",") if name]
    unknown = [n for n in wanted if n not in CHECKS]
    if unknown:
        parser.error(f"--only: unknown tool {unknown[0]!r}")
    scratch = Path(tempfile.mkdtemp(prefix="tokenmill-compat-"))
    servers: dict[str, Server | RuntimeError] = {}
    failed = 0
    try:
        for name in wanted:
            start = time.monotonic()
            try:
                server = started(servers, "embed" if name in EMBED_CHECKS else "chat", scratch)
                line = f"PASS {name}: {CHECKS[name](tools, server.url, scratch)}"
            except Exception as e:  # one tool's failure is reported, the others still run
                failed += 1
                line = f"FAIL {name}: {e}"
            print(f"{line} ({time.monotonic() - start:.0f} s)", flush=True)
    finally:
        for server in servers.values():
            if isinstance(server, Server):
                server.stop()
    for log in sorted(scratch.glob("serve*.log")):
        if "Traceback" in log.read_text():
            failed += 1
            print(f"FAIL server log: a traceback (see {log})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
