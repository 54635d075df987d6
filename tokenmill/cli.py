"""The `tokenmill` command line: one subcommand per job (`make-model`, `convert`, `quantize`, `generate`,
`serve`, `tune`, `prefix-report`, `eval-quant`, `bench`, `doctor`).

The engine flags and `--config` come from engine_args.py (derived from `EngineConfig`); serve's own
flags from `ServeSettings` (server/settings.py), the same way. `bench` lives in bench/cli.py, which imports nothing
from here."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

from tokenmill.bench.cli import add_bench_parser
from tokenmill.config import EngineConfig
from tokenmill.doctor.cli import add_doctor_parser
from tokenmill.engine_args import (
    DEFAULT_MODEL,
    add_engine_args,
    add_flags,
    default_model,
    engine_config,
    given,
    read_config_file,
    settings_from,
)
from tokenmill.server.settings import JoinedAction, ServeSettings, run_server
from tokenmill.tools.make_model import ARCHS, SIZES

MODEL_HELP = (
    "Hugging Face model folder or .gguf file "
    f"(default: the --config file's model, else {DEFAULT_MODEL.name} or the bundled demo model)"
)


def _make_model(args: argparse.Namespace) -> int:
    from tokenmill.tools.make_model import describe, make_model

    folder = make_model(
        args.arch,
        args.size,
        Path(args.out),
        seed=args.seed,
        tie_embeddings=args.tie_embeddings,
        max_shard_size=args.max_shard_size,
        pooling=args.pooling,
    )
    print(describe(folder))
    return 0


def _convert(args: argparse.Namespace) -> int:
    from tokenmill.tools.gguf_convert import convert_gguf

    out = convert_gguf(args.gguf, args.out, dtype=args.dtype, overwrite=args.overwrite)
    print(f"wrote {out}")
    return 0


def _quantize(args: argparse.Namespace) -> int:
    from tokenmill.tools.quantize_checkpoint import quantize_folder

    out = quantize_folder(args.model, args.out, args.quantization, args.group_size, overwrite=args.overwrite)
    print(f"wrote {out}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from tokenmill.engine.engine import LLMEngine
    from tokenmill.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )
    # --seed is the request's sampling seed here; it seeds the engine too when given
    engine = LLMEngine(engine_config(args, **({} if args.seed is None else {"seed": args.seed})))
    prompt: str | list[int] = args.prompt
    if args.chat:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    engine.add_request("cli", prompt, params)
    finish = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.outputs[0].text_delta)
            sys.stdout.flush()
            finish = out.outputs[0].finish_reason
    sys.stdout.write("\n")
    print(f"[finish_reason: {finish}]", file=sys.stderr)
    return 0


def _serve(args: argparse.Namespace) -> int:
    file_values = read_config_file(args.config, EngineConfig, ServeSettings)  # checked before anything loads
    config = engine_config(args, file_values)
    settings = settings_from(ServeSettings, args, file_values)
    if args.model is not None and (settings.models is not None or settings.models_dir is not None):
        raise ValueError("model: give a MODEL or --models / --models-dir, not both")
    run_server(config, settings, key_on_command_line="api_key" in given(args, ServeSettings))
    return 0


def _tune(args: argparse.Namespace) -> int:
    from tokenmill.runner.tune import tune

    file_values = read_config_file(args.config, EngineConfig, ServeSettings)  # a serve --config file reads here too
    print(tune(engine_config(args, file_values)).render())
    return 0


def _prefix_report(args: argparse.Namespace) -> int:
    from tokenmill.doctor.prefix_report import analyse, read_trace
    from tokenmill.text.tokenizer import Tokenizer

    tokenizer = Tokenizer(args.tokenizer) if args.tokenizer else None
    prompts = read_trace(Path(args.trace), tokenizer)
    print(analyse(prompts, args.block_size, args.cache_blocks, tokenizer, max_tokens=args.max_tokens).render())
    return 0


def _eval_quant(args: argparse.Namespace) -> int:
    from tokenmill.eval.quant_eval import evaluate
    from tokenmill.quant.quantize import QuantSpec

    if args.windows < 1 or args.window_len < 2:
        raise ValueError("windows: at least one window of at least 2 tokens")
    spec = QuantSpec(args.quantization, args.group_size, args.group_fallback, args.head)
    text = Path(args.text) if args.text else None
    report = evaluate(args.model or default_model(), spec, args.dtype, text, args.windows, args.window_len)
    print(report.render())
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_json(), indent=2) + "\n", encoding="utf-8")
    return 0


def _sparsify(args: argparse.Namespace) -> int:
    from tokenmill.eval.quant_eval import compare_folders
    from tokenmill.tools.sparsify import sparsify_folder

    out = sparsify_folder(args.model, args.out, args.method, overwrite=args.overwrite, storage=args.format)
    print(f"wrote {out}")
    if args.windows > 0:
        report = compare_folders(str(args.model), str(out), f"2:4 sparse ({args.method})", windows=args.windows)
        print(report.render())
        if args.json:
            Path(args.json).write_text(json.dumps(report.to_json(), indent=2) + "\n", encoding="utf-8")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_model_writers(sub)
    _add_runners(sub)
    _add_prefix_report(sub)
    _add_quality_tools(sub)
    add_bench_parser(sub)
    add_doctor_parser(sub)
    return parser


def _add_model_writers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """make-model, convert and quantize: the commands that write a model folder."""
    mm = sub.add_parser(
        "make-model",
        help="write a Hugging Face model folder with random weights and an offline-trained tokenizer",
    )
    mm.add_argument("--arch", choices=ARCHS, default="llama")
    mm.add_argument("--size", choices=SIZES, default="tiny", help="tiny: unit tests; small: the peer model")
    mm.add_argument("--out", required=True, help="folder to write")
    mm.add_argument("--seed", type=int, default=0, help="seed for weights and tokenizer corpus")
    mm.add_argument("--tie-embeddings", action="store_true", help="share the embedding and LM head weights")
    mm.add_argument(
        "--max-shard-size", default=None, help="split the weights into shards of at most this size (e.g. 1MB)"
    )
    mm.add_argument(
        "--pooling",
        choices=("last", "mean", "cls"),
        default=None,
        help="an embedding model: write sentence-transformers' pooling config (modules.json, 1_Pooling) too",
    )
    mm.set_defaults(func=_make_model)

    conv = sub.add_parser("convert", help="write a GGUF file as a Hugging Face model folder (safetensors, tokenizer)")
    conv.add_argument("gguf", help="the .gguf file")
    conv.add_argument("--out", required=True, help="folder to write")
    conv.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        default="auto",
        help="dtype of the written weights (auto: the file's float type, float32 for quantized files)",
    )
    conv.add_argument("--overwrite", action="store_true", help="replace the folder if it exists")
    conv.set_defaults(func=_convert)

    qz = sub.add_parser(
        "quantize", help="write a model folder as a compressed-tensors checkpoint (int8 / int4), loadable as stored"
    )
    qz.add_argument("model", help="the Hugging Face model folder")
    qz.add_argument("--quantization", required=True, choices=("int8", "int4"), help="int8 or int4, symmetric")
    qz.add_argument(
        "--group-size",
        type=int,
        default=None,
        help="inputs sharing a scale (default: per channel for int8, 32 for int4)",
    )
    qz.add_argument("--out", required=True, help="folder to write")
    qz.add_argument("--overwrite", action="store_true", help="replace the folder if it exists")
    qz.set_defaults(func=_quantize)


def _add_runners(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """generate and serve: the commands that run a model."""
    gen = sub.add_parser("generate", help="generate from one prompt, streaming the text to the terminal")
    gen.add_argument("model", nargs="?", default=None, help=MODEL_HELP)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=1.0, help="0 for greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--repetition-penalty", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None, help="sampling seed")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    add_engine_args(gen, exclude=("seed",))
    gen.set_defaults(func=_generate)

    srv = sub.add_parser("serve", help="serve a model over the OpenAI API (completions, chat, models, metrics)")
    srv.add_argument("model", nargs="?", default=None, help=MODEL_HELP)
    server_flags = srv.add_argument_group("server settings (also from --config)")
    add_flags(server_flags, ServeSettings, exclude=("api_key",))
    server_flags.add_argument(
        "--api-key",
        dest="ServeSettings.api_key",
        action=JoinedAction,
        default=argparse.SUPPRESS,
        metavar="API_KEY",
        help=next(f for f in dataclasses.fields(ServeSettings) if f.name == "api_key").metadata["help"],
    )
    add_engine_args(srv)
    srv.set_defaults(func=_serve)

    tn = sub.add_parser(
        "tune",
        help="measure once the kernel choices `serve` with the same flags would take by default (into the cache)",
    )
    tn.add_argument("model", nargs="?", default=None, help=MODEL_HELP)
    add_engine_args(tn)
    tn.set_defaults(func=_tune)


def _add_prefix_report(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """prefix-report: a trace replayed through the prefix cache's hasher."""
    pr = sub.add_parser(
        "prefix-report", help="replay a trace of prompts through the prefix cache's hasher: why it hits"
    )
    pr.add_argument(
        "trace",
        help="JSONL, one request per line: prompt (text or ids), prompt_token_ids or messages; "
        "optional cache_salt and max_tokens",
    )
    pr.add_argument("--block-size", type=int, default=16)
    pr.add_argument(
        "--cache-blocks",
        type=int,
        default=None,
        help="also replay a KV cache of this many blocks (the engine's block count), one request at a time",
    )
    pr.add_argument(
        "--max-tokens",
        type=int,
        default=1,
        help="tokens each request generates in that replay when its line has no max_tokens (default 1)",
    )
    pr.add_argument("--tokenizer", default=None, help="model folder whose tokenizer (and chat template) to use")
    pr.set_defaults(func=_prefix_report)


def _add_quality_tools(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """eval-quant and sparsify: a quantized or pruned model against the original."""
    ev = sub.add_parser(
        "eval-quant",
        help="a quantization's quality against the unquantized model: perplexity, KL, top-1 agreement, memory",
    )
    ev.add_argument("model", nargs="?", default=None, help=MODEL_HELP)
    ev.add_argument("--quantization", required=True, choices=("int8", "int4", "w8a8"))
    ev.add_argument(
        "--group-size", type=int, default=None, help="inputs sharing one scale (as --quantization-group-size)"
    )
    ev.add_argument("--group-fallback", action="store_true", help="as --quantization-group-fallback")
    ev.add_argument("--head", default="same", choices=("same", "int8"), help="as --quantization-head")
    ev.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"), help="of both models")
    ev.add_argument("--text", default=None, help="a text file (default: the standard library's held-out files)")
    ev.add_argument("--windows", type=int, default=16, help="windows of text to read (at most)")
    ev.add_argument("--window-len", type=int, default=512, help="tokens a window")
    ev.add_argument("--json", default=None, help="also write the report as JSON to this file")
    ev.set_defaults(func=_eval_quant)

    sp = sub.add_parser(
        "sparsify", help="2:4-prune a model folder's decoder projections (magnitude or wanda) and report the quality"
    )
    sp.add_argument("model", help="Hugging Face model folder")
    sp.add_argument("--method", default="wanda", choices=("magnitude", "wanda"), help="what decides the 2 kept of 4")
    sp.add_argument("--out", required=True, help="folder to write (compressed-tensors, 2:4 sparsity_config)")
    sp.add_argument(
        "--format",
        default="sparse-24-bitmask",
        choices=("sparse-24-bitmask", "dense"),
        help="how the pruned weights are stored: half the values and a bitmask, or dense with zeros in place",
    )
    sp.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    sp.add_argument("--windows", type=int, default=8, help="text windows of the quality report (0: none)")
    sp.add_argument("--json", default=None, help="also write the quality report as JSON to this file")
    sp.set_defaults(func=_sparsify)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # what was asked, as given (bench records it in its result file)
    log = logging.getLogger("tokenmill")  # tokenmill's own log lines (KV cache size, ...) to stderr
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    try:
        return int(args.func(args))
    except ValueError as e:  # bad input: one clear line, no stack trace
        command = args.command + (f" {args.bench_command}" if args.command == "bench" else "")
        print(f"tokenmill {command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
