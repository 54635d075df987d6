"""`tokenmill bench serve | offline | plot`: flags, orchestration (variants, sweeps, repeats,
interleaved), the terminal report and the result file."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from tokenmill.bench.records import BenchResult, Run
from tokenmill.bench.workloads import BUILT_IN, WorkloadSpec, parse_range
from tokenmill.engine_args import add_engine_args, engine_config

SWEEPABLE = ("max-concurrency", "request-rate")


def add_bench_parser(sub: Any) -> None:
    bench = sub.add_parser("bench", help="measure TTFT, TPOT, ITL and tokens/s: a server, or the engine in-process")
    kinds = bench.add_subparsers(dest="bench_command", required=True)

    srv = kinds.add_parser("serve", help="load an OpenAI-compatible server (tokenmill, vLLM, llama.cpp, ...)")
    srv.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (a trailing /v1 is fine)")
    srv.add_argument("--model", required=True, help="the model name the server expects")
    srv.add_argument("--api-key", default=None, help="bearer key (default: $OPENAI_API_KEY or $TOKENMILL_API_KEY)")
    srv.add_argument(
        "--tokenizer",
        default=None,
        help="model folder: builds the workload in tokens; counts output tokens where a server sends no usage",
    )
    srv.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take")
    srv.add_argument(
        "--no-stream",
        dest="stream",
        action="store_false",
        help="one JSON response per request (TTFT = E2E; no ITL) instead of a stream",
    )
    srv.add_argument("--sweep", default=None, help="one run per value: max-concurrency=1,2,4 or request-rate=1,2,4")
    srv.add_argument("--cost-per-hour", type=float, default=None, help="price of the server per hour, USD")
    _add_common(srv)
    srv.set_defaults(func=_serve)

    off = kinds.add_parser("offline", help="run a workload through the engine in-process, variants side by side")
    off.add_argument("model", help="Hugging Face model folder")
    off.add_argument(
        "--compare",
        nargs="+",
        default=None,
        metavar="KEY=VAL[,KEY=VAL]",
        help="variants of the engine flags, run interleaved (e.g. scheduling=static scheduling=continuous)",
    )
    off.add_argument("--baseline", choices=["hf"], default=None, help="also run transformers generate, padded batches")
    off.add_argument("--threads", type=int, default=None, help="torch CPU threads (the same as --cpu-threads)")
    off.add_argument("--warmup", type=int, default=4, help="warm-up requests per variant before timing")
    add_engine_args(off, exclude=("seed",))  # --seed (below) seeds the workload and the engine
    _add_common(off)
    off.set_defaults(func=_offline)

    plot = kinds.add_parser("plot", help="PNG plots from result files: latency CDFs, throughput against latency")
    plot.add_argument("results", nargs="+", help="result JSON files")
    plot.add_argument("--out", required=True, help="folder for the PNG files")
    plot.set_defaults(func=_plot)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", default="random", help=f"{', '.join(BUILT_IN)} or jsonl:PATH")
    p.add_argument("--num-requests", type=int, default=None, help="requests (default 100; a trace: all its lines)")
    p.add_argument("--seed", type=int, default=0, help="seeds the workload and the arrivals")
    p.add_argument("--input-len", default="32:512", help="prompt (or question) tokens, N or MIN:MAX")
    p.add_argument("--output-len", default="8:512", help="output tokens, N or MIN:MAX")
    p.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: tokens of each shared system prompt")
    p.add_argument("--num-groups", type=int, default=4, help="shared-prefix: how many shared prompts")
    p.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation")
    p.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second (default: at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--repeats", type=int, default=1, help="repeat every run this many times, interleaved")
    p.add_argument("--goodput", default=None, help="SLOs in ms for goodput, e.g. ttft:500,tpot:50")
    p.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="let requests stop at EOS (default: exactly max_tokens each)",
    )
    p.add_argument("--out", default=None, help="result JSON (default: bench_<kind>_<workload>_<time>.json)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def _spec(args: argparse.Namespace) -> WorkloadSpec:
    trace = args.workload.startswith("jsonl:")
    return WorkloadSpec(
        name=args.workload,
        num_requests=args.num_requests if args.num_requests is not None or trace else 100,
        seed=args.seed,
        input_len=parse_range(args.input_len, "--input-len"),
        output_len=parse_range(args.output_len, "--output-len"),
        prefix_len=args.prefix_len,
        num_groups=args.num_groups,
        turns=args.turns,
    )


def _check_common(args: argparse.Namespace) -> Path:
    """Flags every run needs checked before anything loads; returns the result path."""
    if args.request_rate is not None and not (args.request_rate > 0 and math.isfinite(args.request_rate)):
        raise ValueError(
            f"--request-rate: must be a finite rate above 0 (omit it to send all at once), got {args.request_rate}"
        )
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency: must be at least 1, got {args.max_concurrency}")
    if args.repeats < 1:
        raise ValueError(f"--repeats: must be at least 1, got {args.repeats}")
    cost = getattr(args, "cost_per_hour", None)
    if cost is not None and not (cost >= 0 and math.isfinite(cost)):
        raise ValueError(f"--cost-per-hour: must be a finite price >= 0, got {cost}")
    if getattr(args, "timeout", 1.0) <= 0 or not math.isfinite(getattr(args, "timeout", 1.0)):
        raise ValueError(f"--timeout: must be a finite number of seconds above 0, got {args.timeout}")
    if getattr(args, "threads", None) is not None and args.threads < 1:
        raise ValueError(f"--threads: must be at least 1, got {args.threads}")
    if getattr(args, "warmup", 0) < 0:
        raise ValueError(f"--warmup: must be at least 0, got {args.warmup}")
    out = Path(args.out or f"bench_{args.bench_command}_{_slug(args.workload)}_{time.strftime('%Y%m%d-%H%M%S')}.json")
    if out.is_dir():
        raise ValueError(f"--out: {out} is a folder; give a file name")
    return out


def _recorded_command(args: argparse.Namespace) -> list[str]:
    """The command as given, with an API key's value hidden."""
    words, hide = [], False
    for word in getattr(args, "argv", []):
        words.append("***" if hide else ("--api-key=***" if word.startswith("--api-key=") else word))
        hide = word == "--api-key"
    return ["tokenmill", *words]


def _sweep(text: str | None, args: argparse.Namespace) -> list[tuple[str, dict[str, Any], float | None, int | None]]:
    """(label, settings, request rate, max concurrency) per run of a sweep (one run without one)."""
    if text is None:
        return [("serve", {}, args.request_rate, args.max_concurrency)]
    key, sep, values = text.partition("=")
    if not sep or key not in SWEEPABLE or not values:
        raise ValueError(f"--sweep: {text!r} is not KEY=V1,V2,... with KEY one of {', '.join(SWEEPABLE)}")
    points = []
    for raw in values.split(","):
        try:
            value: float = int(raw) if key == "max-concurrency" else float(raw)
        except ValueError:
            raise ValueError(
                f"--sweep: {raw!r} is not {'an integer' if key == 'max-concurrency' else 'a number'}"
            ) from None
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"--sweep: {key} values must be finite and above 0, got {raw}")
        label = f"{key}={value:g}"
        if any(label == p[0] for p in points):
            raise ValueError(f"--sweep: {key}={raw} is given twice")
        rate = float(value) if key == "request-rate" else args.request_rate
        cap = int(value) if key == "max-concurrency" else args.max_concurrency
        points.append((label, {key: value}, rate, cap))
    return points


def _finish(result: BenchResult, out: Path, bases: list[str]) -> int:
    from tokenmill.bench.compare import aggregate
    from tokenmill.bench.report import render

    aggregate(result, bases)
    try:
        result.write(out)
    except OSError as e:
        raise ValueError(f"--out: cannot write {out} ({e.strerror or e})") from None
    print(render(result))
    print(f"wrote {out}")
    return 0


def _slug(workload: str) -> str:
    return Path(workload[len("jsonl:") :]).stem if workload.startswith("jsonl:") else workload


def _environment() -> dict[str, Any]:
    return {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count()}


def _serve(args: argparse.Namespace) -> int:
    from tokenmill.bench.metrics import parse_slos, summarize
    from tokenmill.bench.serve import ServeTarget, run_serve
    from tokenmill.bench.workloads import build_workload

    out = _check_common(args)
    slos = parse_slos(args.goodput)
    points = _sweep(args.sweep, args)
    tokenizer = _tokenizer(args.tokenizer)
    workload = build_workload(_spec(args), tokenizer)
    key = args.api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get("TOKENMILL_API_KEY")
    target = ServeTarget(args.base_url, args.model, key, args.timeout, args.ignore_eos, args.stream)
    runs = []
    for repeat in range(args.repeats):
        for label, settings, rate, cap in points:
            run = run_serve(
                target,
                workload,
                label,
                repeat=repeat,
                settings=settings,
                request_rate=rate,
                max_concurrency=cap,
                tokenizer=tokenizer,
                progress=args.progress,
            )
            run.summary = summarize(run.records, run.duration_s, slos, args.cost_per_hour)
            runs.append(run)
    config = {
        "base_url": args.base_url,
        "model": args.model,
        "request_rate": args.request_rate,
        "max_concurrency": args.max_concurrency,
        "sweep": args.sweep,
        "stream": args.stream,
        "ignore_eos": args.ignore_eos,
        "repeats": args.repeats,
        "environment": _environment(),
    }
    result = BenchResult("serve", _recorded_command(args), workload.describe(), config, runs)
    return _finish(result, out, [])


def _offline(args: argparse.Namespace) -> int:
    import torch

    from tokenmill.bench.compare import label_of, parse_variant
    from tokenmill.bench.hf_baseline import HFBaseline, check_baseline
    from tokenmill.bench.metrics import parse_slos, summarize
    from tokenmill.bench.offline import run_offline
    from tokenmill.bench.workloads import build_workload
    from tokenmill.engine.engine import LLMEngine

    out = _check_common(args)
    slos = parse_slos(args.goodput)
    base = engine_config(args, seed=args.seed)
    if args.threads is not None:  # the engine sets torch's threads from its config
        base = dataclasses.replace(base, cpu_threads=args.threads)
    variants = [parse_variant(v, base) for v in args.compare] if args.compare else [{}]
    labels = [label_of(v) for v in variants]
    if len(set(labels)) != len(labels):
        raise ValueError("--compare: two variants are the same")
    tokenizer = _tokenizer(base.model)
    spec = _spec(args)
    workload = build_workload(spec, tokenizer)
    warm = build_workload(dataclasses.replace(spec, seed=spec.seed + 1, num_requests=max(1, args.warmup)), tokenizer)
    if args.baseline == "hf":  # before anything loads
        check_baseline(workload, args.request_rate, args.max_concurrency, args.ignore_eos)
    engines = [(label, v, LLMEngine(dataclasses.replace(base, **v))) for label, v in zip(labels, variants, strict=True)]
    hf = HFBaseline(base.model, base.dtype, base.max_num_seqs) if args.baseline == "hf" else None
    arrivals = {"request_rate": args.request_rate, "max_concurrency": args.max_concurrency}
    if args.warmup:
        for _, _, engine in engines:
            run_offline(engine, warm, "warm-up", ignore_eos=args.ignore_eos, **arrivals)
        if hf is not None:
            hf.run(warm)
    runs: list[Run] = []
    for repeat in range(args.repeats):
        for k in range(len(engines)):  # interleaved, and rotated so no variant always runs first
            label, overrides, engine = engines[(k + repeat) % len(engines)]
            engine.reset_prefix_cache()  # every run starts cold: its own requests fill the cache
            run = run_offline(engine, workload, label, repeat, overrides, ignore_eos=args.ignore_eos, **arrivals)
            runs.append(run)
            _log(run, args.progress)
        if hf is not None:
            runs.append(hf.run(workload, "hf", repeat))
            _log(runs[-1], args.progress)
    for run in runs:
        run.summary = summarize(run.records, run.duration_s, slos)
    config = {
        "engine": dataclasses.asdict(base),
        "variants": variants,
        "baseline": args.baseline,
        **arrivals,
        "ignore_eos": args.ignore_eos,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "environment": _environment(),
    }
    result = BenchResult("offline", _recorded_command(args), workload.describe(), config, runs)
    return _finish(result, out, [labels[0], *(["hf"] if hf is not None else [])])


def _log(run: Run, progress: bool) -> None:
    if progress:
        done = sum(r.ok for r in run.records)
        tokens = sum(r.output_tokens for r in run.records if r.ok)
        print(
            f"repeat {run.repeat} {run.label}: {done} requests, {tokens / run.duration_s:.1f} output tokens/s "
            f"in {run.duration_s:.1f} s",
            file=sys.stderr,
            flush=True,
        )


def _tokenizer(folder: str | None) -> Any:
    if folder is None:
        return None
    from tokenmill.text.tokenizer import Tokenizer

    return Tokenizer(folder)


def _plot(args: argparse.Namespace) -> int:
    from tokenmill.bench.plot import plot_results
    from tokenmill.bench.records import read_result

    results = [(Path(p).stem, read_result(Path(p))) for p in args.results]
    for path in plot_results(results, Path(args.out)):
        print(f"wrote {path}")
    return 0
