"""The models file and folder of `serve --models` / `--models-dir`: read, layered over the command
line's settings, checked before anything loads (each mistake one clear line naming file, model and
key), and each model's memory estimated from its files."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from tests.server_harness import KV_BLOCK_BYTES
from tokenmill.cli import main
from tokenmill.config import DEFAULT_CPU_KV_CACHE_MEMORY, EngineConfig
from tokenmill.server.model_catalog import (
    estimate_weight_bytes,
    model_spec,
    parse_bytes,
    read_models_file,
    scan_models_dir,
)

BASE = EngineConfig(model=".", max_model_len=128, kv_cache_memory=64 * KV_BLOCK_BYTES)


def write(tmp_path: Path, text: str, name: str = "models.yaml") -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_a_models_file_layers_each_models_settings_over_the_command_lines(tiny_model_dir, tmp_path: Path) -> None:
    llama, qwen = tiny_model_dir("llama"), tiny_model_dir("qwen3")
    shutil.copytree(qwen, tmp_path / "qwen")
    text = f"""
chat:
  model: {llama}
  max-model-len: 64
  kv_cache_memory: 2MiB
  reasoning_parser: qwen3
  max_n: 2
embedder: qwen
"""
    chat, embedder = read_models_file(write(tmp_path, text), BASE)
    assert (chat.name, chat.config.model, chat.config.max_model_len) == ("chat", str(llama), 64)
    assert chat.kv_bytes == chat.config.kv_cache_memory == 2 * 2**20
    assert chat.served == {"reasoning_parser": "qwen3", "max_n": 2}
    assert (embedder.name, embedder.config.model) == ("embedder", str(tmp_path / "qwen"))  # relative to the file
    assert embedder.config.max_model_len == 128 and embedder.served == {}  # the command line's
    assert embedder.kv_bytes == 64 * KV_BLOCK_BYTES
    as_json = json.dumps({"chat": {"path": str(llama)}})
    (only,) = read_models_file(write(tmp_path, as_json, "models.json"), BASE)
    assert only.config.model == str(llama)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("chat: [1, 2]", "chat: expected a path or a mapping of settings, got list"),
        ("chat:\n  max_model_len: 64", "chat: model: required"),
        ("chat:\n  model: MODEL\n  max_model_lenn: 64", "unknown model setting (did you mean max_model_len?)"),
        ("chat:\n  model: MODEL\n  port: 9000", "chat: port: a setting of the whole server, not of one model"),
        ("chat:\n  model: MODEL\n  dtype: float64", "chat: dtype: expected one of auto, float32"),
        ("chat:\n  model: MODEL\n  kv_cache_memory: lots", "chat: kv_cache_memory: expected a byte size"),
        ("chat:\n  model: /nowhere", "chat: model: /nowhere: not a model folder (no config.json) nor a .gguf file"),
        ("chat: {model: MODEL\n", "not valid YAML or JSON at line"),
        ("- a\n- b", "expected a mapping of model names"),
        ("' chat': MODEL", "a model name is a non-empty string without surrounding spaces"),
    ],
)
def test_a_bad_models_file_is_one_clear_error(tiny_model_dir, tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text.replace("MODEL", str(tiny_model_dir("llama"))))
    with pytest.raises(ValueError, match="^--models .*" + re.escape(message)):
        read_models_file(path, BASE)


def test_a_models_dir_serves_each_folder_and_gguf_file_in_it(tiny_model_dir, tmp_path: Path) -> None:
    shutil.copytree(tiny_model_dir("llama"), tmp_path / "llama-chat")
    (tmp_path / "notes").mkdir()  # no config.json: not a model
    (tmp_path / "small.gguf").write_bytes(b"GGUF" + bytes(1020))
    specs = scan_models_dir(str(tmp_path), BASE)
    assert [(s.name, Path(s.config.model).name) for s in specs] == [
        ("llama-chat", "llama-chat"),
        ("small", "small.gguf"),
    ]
    assert specs[1].weight_bytes == 1024
    with pytest.raises(ValueError, match="holds no model folder"):
        scan_models_dir(str(tmp_path / "notes"), BASE)


def test_the_weights_estimate_follows_the_dtype_and_quantization(tiny_model_dir) -> None:
    folder = tiny_model_dir("llama")  # float32 weights
    stored = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    cfg = EngineConfig(model=str(folder))
    assert estimate_weight_bytes(cfg) == stored
    assert estimate_weight_bytes(EngineConfig(model=str(folder), dtype="bfloat16")) == stored // 2
    assert estimate_weight_bytes(EngineConfig(model=str(folder), quantization="int4")) == stored // 8
    spec = model_spec("m", cfg, {})
    assert spec.kv_bytes == DEFAULT_CPU_KV_CACHE_MEMORY  # the CPU default without kv_cache_memory


def test_byte_sizes() -> None:
    assert [parse_bytes(v, "memory") for v in ("24GiB", "512MiB", "1.5GB", "2G", "1000", 7)] == [
        24 * 2**30, 512 * 2**20, 1_500_000_000, 2 * 2**30, 1000, 7,
    ]  # fmt: skip
    for bad in ("0", "-1", "lots", "3 parsecs", True):
        with pytest.raises(ValueError, match="memory: expected a byte size"):
            parse_bytes(bad, "memory")


def test_serve_refuses_a_model_and_models_together(tiny_model_dir, tmp_path: Path, capsys) -> None:
    folder = str(tiny_model_dir("llama"))
    path = write(tmp_path, f"a: {folder}")
    assert main(["serve", folder, "--models", path]) == 2
    assert "give a MODEL or --models / --models-dir, not both" in capsys.readouterr().err
    assert main(["serve", "--models", path, "--models-dir", str(tmp_path)]) == 2
    assert "give --models or --models-dir, not both" in capsys.readouterr().err
    assert main(["serve", "--models", path, "--memory", "1KiB"]) == 2
    assert "memory: a alone needs about" in capsys.readouterr().err


def test_serve_refuses_two_models_that_would_record_to_one_trace_file(tiny_model_dir, tmp_path: Path, capsys) -> None:
    # each model records to FILE with its name in it (a/b and a_b would share one): refused before anything serves
    folder = tiny_model_dir("llama")
    path = write(tmp_path, f"a/b: {folder}\na_b: {folder}")
    assert main(["serve", "--models", path, "--record-trace", str(tmp_path / "t.jsonl")]) == 2
    assert "record_trace: two model names give the same trace file" in capsys.readouterr().err
    assert not list(tmp_path.glob("t.*"))
