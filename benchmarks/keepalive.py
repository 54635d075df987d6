"""What a kept-alive connection costs a request: the same requests over one connection (httpx, as
the OpenAI client sends them) and over a new connection each (`Connection: close`), interleaved.

Against a `tokenmill serve` of the `small` model in bfloat16 (prefix caching off): `GET /v1/models`,
and `POST /v1/completions` of a 4-token prompt for one token. Each repeat sends `--requests` of each
kind both ways, alternating; the figure is the median latency per way and the kept-alive / new ratio
per repeat. Before the listening socket named its protocol (server/launch.py `bind`), Nagle's
algorithm held a kept-alive response's second write for the client's delayed ACK (~40 ms). The server
runs the tokenmill of the current directory (`python -m tokenmill.cli`), so the script can measure
another checkout from there.

Usage: python benchmarks/keepalive.py [--repeats 3] [--requests 10] [--out results/keepalive.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import signal
import statistics
import time
from collections.abc import Callable

import httpx
from common import RESULTS, ensure_model
from serve import free_port, start_server


def timed(
    send: Callable[[httpx.Client, dict[str, str]], object], client: httpx.Client, headers: dict[str, str]
) -> float:
    """Milliseconds one request takes."""
    start = time.perf_counter()
    send(client, headers)
    return 1000 * (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--out", default=str(RESULTS / "keepalive.json"))
    args = parser.parse_args()
    model = ensure_model()
    port = free_port()
    server = start_server(model, port, "--dtype", "bfloat16", "--no-enable-prefix-caching", "--log-interval", "600")
    url = f"http://127.0.0.1:{port}"
    body = {"model": model.name, "prompt": [5, 6, 7, 8], "max_tokens": 1, "temperature": 0}
    kinds = {
        "models": lambda c, h: c.get(f"{url}/v1/models", headers=h),
        "completion": lambda c, h: c.post(f"{url}/v1/completions", json=body, headers=h),
    }
    ms: dict[str, dict[str, list[float]]] = {k: {"kept_alive": [], "new": []} for k in kinds}
    ratios: dict[str, list[float]] = {k: [] for k in kinds}
    try:
        with httpx.Client(timeout=60) as kept, httpx.Client(timeout=60) as fresh:
            for send in kinds.values():  # (warm: the first request of each kind)
                send(kept, {}), send(fresh, {"Connection": "close"})
            for _ in range(args.repeats):
                for kind, send in kinds.items():
                    rep = {"kept_alive": [], "new": []}
                    for _ in range(args.requests):
                        rep["kept_alive"].append(timed(send, kept, {}))
                        rep["new"].append(timed(send, fresh, {"Connection": "close"}))
                    for way, xs in rep.items():
                        ms[kind][way].append(statistics.median(xs))
                    ratios[kind].append(ms[kind]["kept_alive"][-1] / ms[kind]["new"][-1])
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
    out = {
        "benchmark": "keepalive",
        "model": f"{model.name} (make-model small, 54.9M parameters), bfloat16, prefix caching off",
        "machine": platform.processor() or platform.machine(),
        "repeats": args.repeats,
        "requests": args.requests,
        "median_ms": ms,
        "kept_alive_over_new": ratios,
    }
    for kind in kinds:
        a, n = ms[kind]["kept_alive"], ms[kind]["new"]
        print(
            f"{kind:11s} kept alive {statistics.median(a):6.1f} ms  new connection {statistics.median(n):6.1f} ms  "
            f"ratio {statistics.median(ratios[kind]):.2f} [{min(ratios[kind]):.2f}-{max(ratios[kind]):.2f}]"
        )
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
