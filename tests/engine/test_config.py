"""EngineConfig is the one source of engine settings: LLM's keywords, the engine flags of generate,
serve and bench offline, and `--config` files are derived from its fields (and agree with them);
the CLI modules import without a cycle; layers import no models."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill.cli import build_parser, main
from tokenmill.config import EngineConfig, setting_type
from tokenmill.engine_args import engine_config, flags_of, read_config_file, settings_from
from tokenmill.llm import LLM
from tokenmill.server.settings import ServeSettings

ENGINE_FIELDS = [f for f in dataclasses.fields(EngineConfig) if f.name != "model"]
COMMANDS = {"generate": ["generate", "--prompt", "x"], "serve": ["serve"], "bench offline": ["bench", "offline"]}


def _subparser(parser: argparse.ArgumentParser, *path: str) -> argparse.ArgumentParser:
    for name in path:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return parser


def _parse(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "engine.yaml"
    path.write_text(text, encoding="utf-8")
    return str(path)


# ----------------------------------------------------------------------------- LLM keywords


def test_llm_takes_the_engine_fields_as_keywords_and_names_an_unknown_one():
    # no second list of settings in llm.py: the model, then any EngineConfig field by name
    params = inspect.signature(LLM.__init__).parameters
    assert list(params) == ["self", "model", "engine_kwargs"]
    assert params["engine_kwargs"].kind is inspect.Parameter.VAR_KEYWORD
    config = EngineConfig.from_kwargs("m", max_num_seqs=8, enable_prefix_caching=False, attention_backend="x")
    assert config == EngineConfig(model="m", max_num_seqs=8, enable_prefix_caching=False, attention_backend="x")
    with pytest.raises(ValueError, match=r"^max_num_seq: unknown engine setting \(did you mean max_num_seqs\?\)"):
        EngineConfig.from_kwargs("m", max_num_seq=8)
    with pytest.raises(ValueError, match=r"^bogus: unknown engine setting"):  # before any model loads
        LLM("no/such/folder", bogus=1)
    with pytest.raises(ValueError, match=r"^block_size: expected a positive integer, got 0"):
        LLM("no/such/folder", block_size=0)


def test_engine_config_checks_every_field_by_its_type():
    assert EngineConfig(model="m").attention_backend == "auto"
    for name, bad in [
        ("max_num_seqs", "8"),
        ("max_model_len", 0),
        ("dtype", "float64"),
        ("scheduling", "eager"),
        ("enable_prefix_caching", 1),
        ("seed", True),
        ("attention_backend", 3),
        ("device", None),
    ]:
        with pytest.raises(ValueError, match=f"^{name}: expected"):
            EngineConfig(model="m", **{name: bad})
    assert EngineConfig(model="m", kv_cache_memory=None, seed=-3).seed == -3


# ----------------------------------------------------------------------------- CLI flags


@pytest.mark.parametrize("command", COMMANDS)
def test_every_engine_field_has_exactly_one_flag_with_its_default_and_help(command):
    parser = _subparser(build_parser(), *command.split())
    options = [o for a in parser._actions for o in a.option_strings]
    engine_dests = {a.dest for a in parser._actions if a.dest.startswith("EngineConfig.")}
    own_seed = command != "serve"  # generate's --seed samples; bench's seeds the workload (and the engine)
    expected = {f"EngineConfig.{f.name}" for f in ENGINE_FIELDS if not (own_seed and f.name == "seed")}
    assert engine_dests == expected
    for f in ENGINE_FIELDS:
        option = "--" + f.name.replace("_", "-")
        assert options.count(option) == 1, option
        if setting_type(EngineConfig, f.name).kind is bool:
            assert options.count("--no-" + f.name.replace("_", "-")) == 1
    assert options.count("--config") == 1
    # the flags' defaults and help are the fields'
    for flag, f in zip(flags_of(EngineConfig, exclude={"model"}), ENGINE_FIELDS, strict=True):
        assert (flag.name, flag.default, flag.choices) == (f.name, f.default, f.metadata.get("choices", ()))
        assert flag.help.startswith(f.metadata["help"]) and f.metadata["help"]
        assert f.default is None or "(default: " in flag.help
    action = next(a for a in parser._actions if a.dest == "EngineConfig.dtype")
    assert tuple(action.choices) == ("auto", "float32", "bfloat16", "float16", "fastest")


@pytest.mark.parametrize("command", COMMANDS)
def test_no_flags_give_the_dataclass_defaults(command):
    args = _parse([*COMMANDS[command], "some/model"])
    expected = EngineConfig(model="some/model")
    assert engine_config(args, **({"seed": args.seed} if command == "bench offline" else {})) == expected


def test_each_flag_sets_its_field():
    values = {
        "dtype": "bfloat16",
        "device": "cuda:1",
        "enforce_eager": True,
        "block_size": 32,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 1024,
        "kv_cache_memory": 123456,
        "max_model_len": 256,
        "scheduling": "static",
        "seed": 7,
        "enable_prefix_caching": False,
        "attention_backend": "sdpa",
        "layer_ops": "torch",
        "cpu_threads": 3,
        "greedy_head": "logits",
        "linear_backend": "torch",
        "cpu_huge_pages": False,
        "decode_steps": 2,
        "fused_decode": False,
        "kv_cache_dtype": "int8",
        "grammar_compile_timeout": 2.5,
        "quantization": "int4",
        "quantization_group_size": 64,
        "quantization_group_fallback": True,
        "quantization_head": "int8",
        "gguf_layout": "int",
        "gguf_repack": "file",
        "speculative_config": '{"method": "ngram", "num_speculative_tokens": 3}',
        "task": "embed",
        "pooling": "mean",
        "normalize": False,
        "matryoshka": True,
        "rerank_template": "template.jinja",
        "rerank_tokens": "ja,nein",
    }
    assert set(values) == {f.name for f in ENGINE_FIELDS}  # a new field gets a line here
    argv = ["serve", "m"]
    for name, value in values.items():
        option = "--" + name.replace("_", "-")
        argv += (
            [("--no-" + option[2:]) if value is False else option] if isinstance(value, bool) else [option, str(value)]
        )
    assert engine_config(_parse(argv)) == EngineConfig(model="m", **values)


def test_generate_seed_samples_and_seeds_the_engine_when_given():
    assert engine_config(_parse(["generate", "m", "--prompt", "x"])).seed == 0
    args = _parse(["generate", "m", "--prompt", "x", "--seed", "5"])
    assert args.seed == 5 and engine_config(args, seed=args.seed).seed == 5


def test_serve_flags_come_from_serve_settings():
    args = _parse(["serve", "--port", "0", "--api-key", "k", "--max-tokens-limit", "64", "--drain-timeout", "2.5"])
    s = settings_from(ServeSettings, args, {})
    assert s == ServeSettings(port=0, api_key="k", max_tokens_limit=64, drain_timeout=2.5)
    assert settings_from(ServeSettings, _parse(["serve"]), {}) == ServeSettings()
    with pytest.raises(ValueError, match=r"^max_n: expected a positive integer, got 0"):
        settings_from(ServeSettings, _parse(["serve", "--max-n", "0"]), {})


# ----------------------------------------------------------------------------- --config


def test_serve_config_file_gives_values_and_flags_override_them(tmp_path):
    path = _write(
        tmp_path,
        "model: from/file\nmax-num-seqs: 4\nblock_size: 32\ndtype: float32\nenable-prefix-caching: false\n"
        "kv_cache_memory: 1000000\nport: 9001\napi-key: secret\ndrain_timeout: 5\n",
    )
    args = _parse(["serve", "--config", path, "--max-num-seqs", "8"])
    file_values = read_config_file(args.config, EngineConfig, ServeSettings)
    config = engine_config(args, file_values)
    assert config == EngineConfig(
        model="from/file",
        max_num_seqs=8,  # the flag beats the file
        block_size=32,
        dtype="float32",
        enable_prefix_caching=False,
        kv_cache_memory=1_000_000,
    )
    assert settings_from(ServeSettings, args, file_values) == ServeSettings(
        port=9001, api_key="secret", drain_timeout=5
    )
    # a positional model and a --flag beat the file's
    args = _parse(["serve", "given/model", "--config", path, "--enable-prefix-caching", "--port", "0"])
    file_values = read_config_file(args.config, EngineConfig, ServeSettings)
    config = engine_config(args, file_values)
    assert (config.model, config.max_num_seqs, config.enable_prefix_caching) == ("given/model", 4, True)
    assert settings_from(ServeSettings, args, file_values).port == 0


def test_generate_and_bench_offline_read_engine_keys_from_config(tmp_path):
    path = _write(tmp_path, "scheduling: static\nmax_model_len: 128\nseed: 3\n")
    args = _parse(["generate", "m", "--prompt", "x", "--config", path])
    assert engine_config(args) == EngineConfig(model="m", scheduling="static", max_model_len=128, seed=3)
    args = _parse(["bench", "offline", "m", "--config", path, "--max-model-len", "64"])
    config = engine_config(args, seed=args.seed)  # bench's --seed seeds the workload and the engine
    assert config == EngineConfig(model="m", scheduling="static", max_model_len=64, seed=0)
    assert read_config_file(_write(tmp_path, "# nothing set\n"), EngineConfig) == {}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("max_num_seq: 8\n", "max_num_seq: unknown key (did you mean max_num_seqs?)"),
        ("bogus-key: 1\n", "bogus-key: unknown key"),
        ("max_num_seqs: 0\n", "max_num_seqs: expected a positive integer, got 0"),
        ("max-num-seqs: many\n", "max_num_seqs: expected a positive integer, got 'many'"),
        ("dtype: float64\n", "dtype: expected one of auto, float32, bfloat16, float16, fastest, got 'float64'"),
        ("enable_prefix_caching: maybe\n", "enable_prefix_caching: expected a boolean"),
        ("port: http\n", "port: expected an integer >= 0, got 'http'"),
        ("max_num_seqs: 4\nmax-num-seqs: 8\n", "max-num-seqs: given twice"),
        ("- max_num_seqs\n", "expected a mapping of settings"),
        ("max_num_seqs: [1\n", "not valid YAML at line"),
    ],
)
def test_bad_serve_config_is_one_clear_line(tmp_path, capsys, text, message):
    path = _write(tmp_path, text)
    assert main(["serve", "--config", path, "--port", "0"]) == 2  # refused before anything loads
    err = capsys.readouterr().err
    assert err.startswith(f"tokenmill serve: error: --config {path}: ") and message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_config_keys_are_the_commands(tmp_path, capsys):
    path = _write(tmp_path, "port: 8001\n")  # a server setting: serve's file only
    assert main(["generate", "m", "--prompt", "x", "--config", path]) == 2
    assert capsys.readouterr().err.startswith(f"tokenmill generate: error: --config {path}: port: unknown key")
    argv = ["bench", "offline", "m", "--config", path, "--out", str(tmp_path / "r.json")]
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith(f"tokenmill bench offline: error: --config {path}: port: unknown key")
    assert main(["serve", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read it" in capsys.readouterr().err


# ----------------------------------------------------------------------------- layering


def _imports(module: str) -> set[str]:
    code = (
        f"import sys, {module}; print(' '.join(sorted(m for m in sys.modules if m.startswith(('tokenmill', 'torch')))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_bench_cli_and_engine_args_do_not_import_the_top_level_cli():
    assert "tokenmill.cli" not in _imports("tokenmill.bench.cli")
    loaded = _imports("tokenmill.engine_args")
    assert not {"tokenmill.cli", "tokenmill.bench.cli", "torch"} & loaded


def test_layers_import_no_models_and_moved_names_are_one_object():
    assert not {m for m in _imports("tokenmill.layers.rotary") if m.startswith("tokenmill.models")}
    import tokenmill.layers.sampler as sampler
    import tokenmill.models.config as model_config
    import tokenmill.sampling_params as sampling_params
    from tokenmill.layers.rotary import RopeConfig

    assert model_config.RopeConfig is RopeConfig  # models/config.py imports it from the layer
    assert sampler.generator_seed is sampling_params.generator_seed  # the sampler imports it from there
