"""Command-line flags and `--config FILE.yaml` derived from settings dataclasses; the default model.

Owns what `tokenmill generate | serve | bench offline` share: one `--kebab-case` flag per field of
`EngineConfig` (but `model`, which each command takes as a positional), typed from the field (int,
float, str with choices, optional ints, bool as `--x/--no-x`), its help from the field's metadata;
`--config` (a YAML mapping of the same settings, keys in snake_case or kebab-case); and
`engine_config(args)`, which layers them. The same machinery builds serve's own flags from its
`ServeSettings` (cli.py). tokenmill/cli.py and tokenmill/bench/cli.py import from here; this module
imports neither.

Precedence, lowest first: the dataclass's defaults, the `--config` file, the flags given on the
command line, what the command overrides itself (generate's sampling `--seed`, bench's `--seed`).
So that a flag left out lets the file's value through, a generated flag has no argparse default
(argparse.SUPPRESS: no attribute at all when not given) and stores under `Class.field`; its help
states the dataclass's default.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml

from tokenmill.config import EngineConfig, check_known, check_setting, setting_type

MODELS = Path(__file__).resolve().parent.parent / "models"
# The default of serve and generate: SmolLM2-135M-Instruct where `make serve` has set it up
# (scripts/fetch_smollm2.py): its Q4_1 GGUF file, served kept quantized (the fastest of its paths
# measured, benchmarks/serve_paths.py), else the float32 folder an older set-up (or the script's
# --folder) converted it to, else the bundled demo model (models/tokenmill-demo in the repository).
DEFAULT_GGUF = MODELS / "smollm2-135m-instruct.gguf"
DEFAULT_MODEL = MODELS / "smollm2-135m-instruct"
DEMO_MODEL = MODELS / "tokenmill-demo"
TRUE, FALSE = ("true", "on", "yes", "1"), ("false", "off", "no", "0")


def default_model() -> str:
    if DEFAULT_GGUF.is_file():
        return str(DEFAULT_GGUF)
    for folder in (DEFAULT_MODEL, DEMO_MODEL):
        if (folder / "config.json").is_file():
            return str(folder)
    raise ValueError(f"model: no model given, and neither {DEFAULT_MODEL} nor the bundled {DEMO_MODEL} is there")


T = TypeVar("T")


@dataclass(frozen=True)
class Flag:
    """The command-line flag of one settings field."""

    name: str  # the field, snake_case
    option: str  # --kebab-case
    dest: str  # where argparse stores it: "Class.field"
    kind: type  # bool, int, float or str
    optional: bool  # the field takes None (only as its default: no flag value means None)
    default: Any  # the dataclass's default
    help: str  # the field's help, with the default stated
    choices: tuple[str, ...]


def flags_of(cls: type, exclude: Collection[str] = ()) -> list[Flag]:
    """One flag per field of the settings dataclass `cls` that has a default, but those in `exclude`."""
    flags = []
    for field in dataclasses.fields(cls):
        if field.name in exclude or field.default is dataclasses.MISSING:
            continue
        kind = setting_type(cls, field.name)
        help_text = field.metadata["help"]
        if kind.kind is bool:
            help_text += f" (default: {'on' if field.default else 'off'})"
        elif field.default is not None:
            help_text += f" (default: {field.default})"
        flags.append(
            Flag(
                name=field.name,
                option="--" + field.name.replace("_", "-"),
                dest=f"{cls.__name__}.{field.name}",
                kind=kind.kind,
                optional=kind.optional,
                default=field.default,
                help=help_text,
                choices=field.metadata.get("choices", ()),
            )
        )
    return flags


def add_flags(parser: argparse._ActionsContainer, cls: type, exclude: Collection[str] = ()) -> None:
    """Add the flags of `cls`'s fields (see `flags_of`) to `parser`; `given` reads them back."""
    for flag in flags_of(cls, exclude):
        help_text = flag.help.replace("%", "%%")  # argparse %-formats help
        if flag.kind is bool:
            parser.add_argument(
                flag.option,
                dest=flag.dest,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=help_text,
            )
        else:
            parser.add_argument(
                flag.option,
                dest=flag.dest,
                type=flag.kind,
                choices=flag.choices or None,
                default=argparse.SUPPRESS,
                metavar=None if flag.choices else flag.name.upper(),
                help=help_text,
            )


def given(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The fields of `cls` whose flags were given on the command line, by field name."""
    prefix = f"{cls.__name__}."
    return {dest[len(prefix) :]: value for dest, value in vars(args).items() if dest.startswith(prefix)}


def add_engine_args(parser: argparse.ArgumentParser, exclude: Collection[str] = ()) -> None:
    """`--config FILE.yaml` and the engine flags (every `EngineConfig` field but `model` and `exclude`)."""
    parser.add_argument(
        "--config",
        default=None,
        metavar="FILE.yaml",
        help="a YAML mapping of this command's settings (keys in snake_case or kebab-case, as the flags "
        "name them); flags given on the command line override it",
    )
    group = parser.add_argument_group("engine settings (also from --config)")
    add_flags(group, EngineConfig, exclude={"model", *exclude})


def read_config_file(path: str | None, *classes: type) -> dict[str, Any]:
    """The settings in the YAML file `path` (none without a file), by field name: each key a field of
    one of `classes` (snake_case or kebab-case), each value checked against its field. A ValueError
    names the file and the key."""
    if path is None:
        return {}
    where = f"--config {path}"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{where}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise ValueError(f"{where}: not valid YAML{at} ({getattr(e, 'problem', None) or e})") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a mapping of settings (key: value), got {type(raw).__name__}")
    owner = {f.name: cls for cls in classes for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.replace("-", "_") if isinstance(key, str) else key
        if name not in owner:
            try:
                check_known([key], list(owner), "key")
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
        if name in values:
            raise ValueError(f"{where}: {key}: given twice (in snake_case and in kebab-case)")
        try:
            check_setting(owner[name], name, value)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        values[name] = value
    return values


def settings_from(cls: type[T], args: argparse.Namespace, file_values: Mapping[str, Any], **overrides: Any) -> T:
    """`cls` from its defaults, then the file's values for its fields, then its flags given, then `overrides`."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    values = {k: v for k, v in file_values.items() if k in names}
    values.update(given(args, cls))
    values.update(overrides)
    return cls(**values)


def engine_config(
    args: argparse.Namespace, file_values: Mapping[str, Any] | None = None, **overrides: Any
) -> EngineConfig:
    """The EngineConfig of a command: its defaults < the `--config` file < engine flags given < `overrides`.

    `file_values`: the file as `read_config_file` read it (a command whose file holds more than
    engine settings reads it first); left out, `args.config` is read here for engine settings only.
    The model: `overrides`, else the positional `args.model`, else the file's, else `default_model()`.
    """
    if file_values is None:
        file_values = read_config_file(getattr(args, "config", None), EngineConfig)
    model = overrides.pop("model", None) or args.model or file_values.get("model") or default_model()
    return settings_from(EngineConfig, args, file_values, model=model, **overrides)


def parse_value(cls: type, name: str, raw: str) -> Any:
    """A field's value from text (`--compare KEY=VAL`): typed as the field; "none" for an optional one."""
    kind = setting_type(cls, name)
    if kind.optional and raw.lower() in ("none", "null"):
        return None
    if kind.kind is bool:
        if raw.lower() not in (*TRUE, *FALSE):
            raise ValueError(f"{name}={raw!r} is not true or false")
        return raw.lower() in TRUE
    if kind.kind is int:
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{name}={raw!r} is not an integer") from None
    if kind.kind is float:
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"{name}={raw!r} is not a number") from None
    return raw
