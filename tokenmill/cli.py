"""The `tokenmill` command line: one subcommand per job (`make-model` for now; `serve`,
`generate`, `bench` and `doctor` arrive with their issues)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tokenmill.models.make_model import ARCHS, SIZES


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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ValueError as e:  # bad input: one clear line, no stack trace
        print(f"tokenmill {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
