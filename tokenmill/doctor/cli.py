"""`tokenmill doctor --models FILE|--models-dir DIR [--memory SIZE]`, or
`tokenmill doctor MODEL --workload W|jsonl:TRACE|KIND:FILE [--window S:E] [--time-scale X] [--length-scale F|fit]
[--memory BYTES] [--slo ttft:MS,tpot:MS] [--config FILE]
[--request-rate R] [--draft DIR] [--verify [--budget-s S] [--repeats N] [--apply]] [--out DIR]`: the parser
and the command (the work is in diagnose.py and, for --verify, verify.py).

The current settings are the engine flags and `--config` file, as `tokenmill serve` takes them. A
trace states each request's prompt and, as max_tokens, the tokens it generated; its arrival times
(or `--request-rate`, Poisson) set the load. `recommended.yaml` holds the settings to change (with
--verify, those it kept); with `--apply`, the whole configuration to serve instead: the model, the
current `--config` file's settings and the engine flags given, changed by the verified recommendations
(`tokenmill serve --config recommended.yaml`), read back as serve reads it before it is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import time
from pathlib import Path
from typing import Any

import yaml

from tokenmill.config import EngineConfig
from tokenmill.doctor.findings import recommended_settings
from tokenmill.engine_args import add_engine_args, engine_config, given, read_config_file

UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30, "b": 1}


def parse_bytes(text: str) -> int:
    """ "8GiB", "512MiB", "2e9", "1500000000" -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in UNITS:
        raise ValueError(f"--memory: {text!r} is not a size in bytes (e.g. 8GiB, 512MiB, 2000000000)")
    value = int(float(m.group(1)) * UNITS[unit])
    if value < 1:
        raise ValueError(f"--memory: must be above 0, got {text!r}")
    return value


def add_doctor_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from tokenmill.bench.workloads import BUILT_IN

    doc = sub.add_parser(
        "doctor", help="which optimizations a workload needs: measured on this machine, replayed on the scheduler"
    )
    doc.add_argument("model", nargs="?", default=None, help="Hugging Face model folder (default: the demo model)")
    doc.add_argument(
        "--workload",
        default="mixed",
        help=f"{', '.join(BUILT_IN)}, jsonl:PATH (a trace), trace:FILE (serve --record-trace), azure:FILE.csv, "
        "burstgpt:FILE.csv or mooncake:FILE.jsonl",
    )
    doc.add_argument(
        "--window", default=None, help="trace:, azure:, burstgpt:, mooncake:: START:END seconds of the trace"
    )
    doc.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="trace:, azure:, burstgpt:, mooncake:: arrival times multiplied by this (0.5: twice the rate)",
    )
    doc.add_argument(
        "--length-scale",
        default="1",
        help="azure:, burstgpt:, mooncake:, trace: (hashes): prompt and output lengths multiplied by this, or fit "
        "(the 99th-percentile request fits the model's context); longer ones are clipped to it",
    )
    doc.add_argument("--num-requests", type=int, default=None, help="requests (default 64; a trace: all its lines)")
    doc.add_argument("--input-len", default="32:512", help="built-in workloads: prompt tokens, N or MIN:MAX")
    doc.add_argument("--output-len", default="8:256", help="built-in workloads: output tokens, N or MIN:MAX")
    doc.add_argument(
        "--request-rate", type=float, default=None, help="Poisson arrivals a second (default: the trace's, or at once)"
    )
    doc.add_argument(
        "--memory",
        default=None,
        help="bytes for weights + KV cache (default: what the settings take; with --models: the available memory)",
    )
    doc.add_argument(
        "--models",
        default=None,
        help="a serve --models file: which of its models fit in --memory together, which take turns (nothing else)",
    )
    doc.add_argument("--models-dir", default=None, help="as --models, for the models a serve --models-dir DIR serves")
    doc.add_argument("--slo", default=None, help="latency goals in ms, e.g. ttft:500,tpot:50")
    doc.add_argument(
        "--link-gbps", type=float, default=10.0, help="network between machines, for a prefill/decode split"
    )
    doc.add_argument("--cost-per-hour", type=float, default=None, help="price of the machine an hour: cost per token")
    doc.add_argument(
        "--draft", default=None, help="a draft model's folder: its agreement with MODEL on the trace, for question 5"
    )
    doc.add_argument(
        "--verify",
        action="store_true",
        help="run each recommendation against the current settings on a sample of the trace; withdraw what "
        "moves none of TTFT, TPOT and tokens/s beyond the runs' noise (recommended.yaml keeps what stays)",
    )
    doc.add_argument(
        "--budget-s", type=float, default=120.0, help="--verify: seconds its runs should take (8 requests at least)"
    )
    doc.add_argument("--repeats", type=int, default=3, help="--verify: interleaved runs of each setting")
    doc.add_argument(
        "--apply",
        action="store_true",
        help="with --verify: recommended.yaml becomes the whole configuration to serve (the current settings "
        "changed by the verified recommendations), for tokenmill serve --config",
    )
    doc.add_argument("--out", default="doctor-report", help="folder for report.md, report.json, recommended.yaml")
    doc.add_argument("--workload-seed", type=int, default=0, help="seeds a built-in workload and its arrivals")
    add_target_args(doc)
    add_engine_args(doc)
    doc.set_defaults(func=_doctor)


def _doctor(args: argparse.Namespace) -> int:
    from tokenmill.bench.metrics import parse_slos
    from tokenmill.bench.workloads import WorkloadSpec, is_trace, parse_range
    from tokenmill.doctor.calibrate import calibrate
    from tokenmill.doctor.diagnose import diagnose, verify_findings, write_report
    from tokenmill.doctor.step_cost import probe
    from tokenmill.doctor.traces.load import TraceFlags, load_workload
    from tokenmill.engine.engine import LLMEngine

    memory = parse_bytes(args.memory) if args.memory is not None else None
    if args.models is not None or args.models_dir is not None:
        return _several(args, memory)
    if not args.link_gbps > 0:
        raise ValueError(f"--link-gbps: must be above 0, got {args.link_gbps}")
    if args.verify and (args.repeats < 2 or not args.budget_s > 0):
        raise ValueError("--repeats: at least 2, --budget-s: above 0, for --verify")
    if args.apply and not args.verify:
        raise ValueError("--apply: needs --verify (only measured recommendations are applied)")
    try:
        slos = parse_slos(args.slo)
    except ValueError as e:  # (its messages name bench's flag)
        raise ValueError(str(e).replace("--goodput", "--slo")) from None
    slos.update(target_slos(args))
    trace = is_trace(args.workload)
    spec = WorkloadSpec(
        name=args.workload,
        num_requests=args.num_requests if args.num_requests is not None or trace else 64,
        seed=args.workload_seed,
        input_len=parse_range(args.input_len, "--input-len"),
        output_len=parse_range(args.output_len, "--output-len"),
    )
    # the engine as configured: the probe times a forward a step (the simulator's unit) with decode runs off,
    # and calibration on the trace sees what the runs save
    config = engine_config(args)
    engine = LLMEngine(config)
    start = time.perf_counter()
    vocab = min(engine.model_config.vocab_size, engine.tokenizer.vocab_size)
    flags = TraceFlags(args.window, args.time_scale, args.length_scale)
    workload, info = load_workload(spec, engine.tokenizer, engine.max_model_len, vocab, flags)
    say(f"read {len(workload.requests)} requests of {args.workload} in {time.perf_counter() - start:.1f} s")
    say(f"measuring step costs of {config.model} on this machine ...")
    cost = calibrate(engine, workload, probe(engine, progress=say), args.request_rate, progress=say)
    draft = None
    if args.draft is not None:
        draft = LLMEngine(
            EngineConfig.from_kwargs(
                args.draft,
                dtype=config.dtype,
                device=config.device,
                max_num_seqs=config.max_num_seqs,
                enable_prefix_caching=False,
            )
        )
    diagnosis = diagnose(
        engine,
        workload,
        cost,
        memory,
        slos,
        args.request_rate,
        args.link_gbps,
        args.cost_per_hour,
        draft=draft,
        trace_info=info,
        progress=say,
    )
    if args.verify:
        print("tokenmill doctor: verifying the recommendations ...", flush=True)
        verify_findings(engine, diagnosis, workload, args.request_rate, args.budget_s, args.repeats)
    text = write_report(diagnosis, Path(args.out))
    if args.target:
        text += targets_section(args, engine, workload, cost, diagnosis, slos, memory)
    print(text)
    if args.apply:
        write_applied(args, config, recommended_settings(diagnosis.findings), Path(args.out) / "recommended.yaml")
    print(f"tokenmill doctor: wrote {args.out}/report.md, report.json and recommended.yaml")
    return 0


def _several(args: argparse.Namespace, memory: int | None) -> int:
    """`--models FILE` / `--models-dir DIR`: question 1 for the models a several-model server serves."""
    from tokenmill.doctor.several_fit import read_specs, several_fit, write_several_report

    if args.model is not None:
        raise ValueError("model: give a MODEL or --models / --models-dir, not both")
    specs = read_specs(args.models, args.models_dir, engine_config(args, model="."))
    text = write_several_report(several_fit(specs, memory), args.models or args.models_dir, Path(args.out))
    print(text)
    print(f"tokenmill doctor: wrote {args.out}/report.md and report.json")
    return 0


def add_target_args(doc: argparse.ArgumentParser) -> None:
    """--target and its flags: the answers for hardware that is not this machine (target_report.py)."""
    from tokenmill.doctor.hardware import BUILT_IN

    doc.add_argument(
        "--target",
        action="append",
        default=[],
        help=f"answer for here, {', '.join(BUILT_IN)} or a spec-sheet YAML (repeatable): a roofline prediction",
    )
    doc.add_argument("--model-config", default=None, help="--target: a config.json or folder (weights not needed)")
    doc.add_argument(
        "--target-dtype", default="bfloat16", choices=("bfloat16", "fp8", "int8"), help="--target: weights' dtype"
    )
    doc.add_argument("--target-steps", default=None, help="--target: a JSON file of steps measured on a target")
    doc.add_argument("--price-per-hour", type=float, default=None, help="--target: a replica's price an hour")
    doc.add_argument("--slo-ttft", type=float, default=None, help="TTFT goal in ms (as --slo ttft:MS)")
    doc.add_argument("--slo-tpot", type=float, default=None, help="TPOT goal in ms (as --slo tpot:MS)")
    doc.epilog = "--target answers are predictions (a roofline model), labelled with the calibration behind them"


def target_slos(args: argparse.Namespace) -> dict[str, float]:
    slos = {k: getattr(args, f"slo_{k}") for k in ("ttft", "tpot") if getattr(args, f"slo_{k}") is not None}
    for k, v in slos.items():
        if not v > 0:
            raise ValueError(f"--slo-{k}: must be above 0 ms, got {v:g}")
    if (args.model_config or args.target_steps) and not args.target:
        raise ValueError("--model-config and --target-steps: need --target")
    if args.price_per_hour is not None and not args.price_per_hour > 0:
        raise ValueError(f"--price-per-hour: must be above 0, got {args.price_per_hour:g}")
    from tokenmill.doctor.hardware import load_target
    from tokenmill.doctor.targets import read_model_config

    for name in args.target:  # (read before the probe: a bad file fails at once)
        if name != "here" and name != args.target_steps:
            load_target(name)
    if args.model_config:
        read_model_config(args.model_config)
    return slos


def targets_section(
    args: argparse.Namespace, engine: Any, workload: Any, cost: Any, diagnosis: Any, slos: dict[str, float], memory: Any
) -> str:
    """The Targets section, appended to the report folder's report.md and report.json."""
    from tokenmill.doctor.target_report import TargetOptions, append_targets, run_targets

    opts = TargetOptions(
        args.target, args.model_config, args.target_dtype, args.price_per_hour, args.target_steps, slos,
        args.request_rate, memory,
    )  # fmt: skip
    out = Path(args.out)
    return append_targets(out, run_targets(engine, workload, cost, diagnosis, opts, out))


def say(text: str) -> None:
    """A progress line."""
    print(f"tokenmill doctor: {text}", flush=True)


def write_applied(args: argparse.Namespace, current: EngineConfig, settings: dict[str, Any], path: Path) -> None:
    """`path`: the current configuration (the model, the --config file's settings, the engine flags
    given) changed by `settings`; read back as `serve --config` reads it, it must give exactly the
    current EngineConfig changed by `settings`."""
    values = {
        "model": current.model,
        **read_config_file(args.config, EngineConfig),
        **given(args, EngineConfig),
        **settings,
    }
    lines = "# tokenmill doctor --verify --apply: the current settings, changed by the verified recommendations\n"
    path.write_text(lines + yaml.safe_dump(values, sort_keys=False))
    back = engine_config(argparse.Namespace(model=None), read_config_file(str(path), EngineConfig))
    if back != dataclasses.replace(current, **settings):
        raise ValueError(f"--apply: {path} does not read back as the recommended configuration")
