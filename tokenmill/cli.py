"""The `tokenmill` command line: one subcommand per job (`make-model`, `generate`, `serve`,
`prefix-report`, `bench`; `doctor` arrives with its issue)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from tokenmill.models.make_model import ARCHS, SIZES

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig

# The bundled demo model (models/tokenmill-demo in the repository): the default of serve and generate.
DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "models" / "tokenmill-demo"


def default_model() -> str:
    if not (DEFAULT_MODEL / "config.json").is_file():
        raise ValueError(f"model: no model folder given, and the bundled default ({DEFAULT_MODEL}) is missing")
    return str(DEFAULT_MODEL)


def _make_model(args: argparse.Namespace) -> int:
    from tokenmill.models.make_model import describe, make_model

    folder = make_model(
        args.arch,
        args.size,
        Path(args.out),
        seed=args.seed,
        tie_embeddings=args.tie_embeddings,
        max_shard_size=args.max_shard_size,
    )
    print(describe(folder))
    return 0


def engine_config(args: argparse.Namespace, seed: int) -> EngineConfig:
    from tokenmill.config import EngineConfig

    return EngineConfig(
        model=args.model or default_model(),
        dtype=args.dtype,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory,
        max_model_len=args.max_model_len,
        scheduling=args.scheduling,
        seed=seed,
        enable_prefix_caching=args.enable_prefix_caching,
    )


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
    engine = LLMEngine(engine_config(args, seed=0 if args.seed is None else args.seed))
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
    import os

    from tokenmill.server.launch import build_server, serve
    from tokenmill.server.protocol import Limits

    config = engine_config(args, seed=args.seed)
    limits = Limits(max_n=args.max_n, max_tokens=args.max_tokens_limit, max_prompt_tokens=args.max_prompt_tokens)
    server = build_server(config, args.served_model_name, args.max_waiting, limits, args.log_interval)
    serve(server, args.host, args.port, args.api_key or os.environ.get("TOKENMILL_API_KEY"), args.drain_timeout)
    return 0


def _prefix_report(args: argparse.Namespace) -> int:
    from tokenmill.doctor.prefix_report import analyse, read_trace
    from tokenmill.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer(args.tokenizer) if args.tokenizer else None
    prompts = read_trace(Path(args.trace), tokenizer)
    print(analyse(prompts, args.block_size, args.cache_blocks, tokenizer, max_tokens=args.max_tokens).render())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
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
    mm.set_defaults(func=_make_model)

    gen = sub.add_parser("generate", help="generate from one prompt, streaming the text to the terminal")
    gen.add_argument("model", nargs="?", default=None, help="Hugging Face model folder (default: the bundled demo)")
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
    add_engine_flags(gen, with_seed=False)
    gen.set_defaults(func=_generate)

    srv = sub.add_parser("serve", help="serve a model over the OpenAI API (completions, chat, models, metrics)")
    srv.add_argument(
        "model", nargs="?", default=None, help="Hugging Face model folder (default: the bundled tokenmill-demo)"
    )
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    srv.add_argument("--port", type=int, default=8000, help="port (0: any free port, logged at start)")
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or TOKENMILL_API_KEY)")
    srv.add_argument("--served-model-name", default=None, help="the model name clients send (default: folder name)")
    srv.add_argument("--max-waiting", type=int, default=64, help="refuse new requests (429) past this many waiting")
    srv.add_argument("--max-n", type=int, default=16, help="largest n a request may ask for")
    srv.add_argument("--max-tokens-limit", type=int, default=None, help="largest max_tokens a request may ask for")
    srv.add_argument("--max-prompt-tokens", type=int, default=None, help="longest prompt accepted, in tokens")
    srv.add_argument("--drain-timeout", type=float, default=30.0, help="seconds in-flight requests get on SIGTERM")
    srv.add_argument("--log-interval", type=float, default=10.0, help="seconds between throughput log lines")
    add_engine_flags(srv)
    srv.set_defaults(func=_serve)

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

    from tokenmill.bench.cli import add_bench_parser

    add_bench_parser(sub)
    return parser


def add_engine_flags(p: argparse.ArgumentParser, with_seed: bool = True) -> None:
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the KV cache (CPU default 2 GiB)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--scheduling", default="continuous", choices=["continuous", "static"])
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="share the KV of common prompt prefixes (on by default)",
    )
    if with_seed:
        p.add_argument("--seed", type=int, default=0, help="seeds the requests that bring no seed")


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
