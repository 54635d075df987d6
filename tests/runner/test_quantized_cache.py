"""Quantized weights cached on disk: a float checkpoint quantized at load is written once and read
back exactly on the next start (no quantizing); other settings are another key, and a cache that
does not read back is a warning and a fresh quantization."""

from __future__ import annotations

import dataclasses
import gc
import logging

import pytest
import torch

from tokenmill.config import EngineConfig
from tokenmill.kernels.autotune import Autotuner
from tokenmill.quant import config as quant_config
from tokenmill.runner import model_builder
from tokenmill.runner.dtype_choice import probe_logits
from tokenmill.runner.model_builder import build_model
from tokenmill.runner.quantized_cache import cache_root

CPU = torch.device("cpu")


def build(folder, tmp_path, **settings):
    config = EngineConfig(model=str(folder), max_num_seqs=8, **settings)
    return build_model(config, CPU, Autotuner(CPU, tmp_path / "autotune.json", measure=False))


def no_load(*args, **kwargs):
    raise AssertionError("the checkpoint was loaded and quantized again")


def state(model) -> dict[str, torch.Tensor]:
    """Every tensor the model holds: parameters, and each quantized layer's fields."""
    out = {name: p.data for name, p in model.named_parameters()}
    for name, layer in model.quantized_layers():
        for field in dataclasses.fields(layer.quantized):
            value = getattr(layer.quantized, field.name)
            plain = torch.tensor(list(repr(value).encode()))  # (a type name, a group, a flag)
            out[f"{name}::{field.name}"] = value if isinstance(value, torch.Tensor) else plain
    return out


@pytest.mark.parametrize(
    ("quantization", "tied", "dtype", "blocks"),
    [
        ("int8", False, "float32", False),
        ("int4", True, "bfloat16", False),
        ("w8a8", False, "float32", False),
        ("int8", True, "float32", False),
        ("int8", True, "float32", True),  # int8 in Q8_0 blocks (quant/int_blocks.py), whatever this CPU's kind
        ("int8", False, "bfloat16", True),
        ("int4", True, "bfloat16", True),  # int4 in Q4_1 blocks
    ],
)
def test_the_cache_round_trips_exactly(
    tiny_model_dir, tmp_path, monkeypatch, caplog, quantization, tied, dtype, blocks
):
    monkeypatch.setenv("TOKENMILL_QUANTIZED_CACHE_DIR", str(tmp_path / "quantized"))
    monkeypatch.setattr(quant_config, "in_blocks", lambda settings, cpu=None: blocks)
    folder = tiny_model_dir("llama", tied=tied)
    built = build(folder, tmp_path, quantization=quantization, dtype=dtype)
    first = built.model
    (written,) = cache_root().iterdir()
    assert (written / "model.safetensors").is_file()
    monkeypatch.setattr(model_builder, "load_model", no_load)
    with caplog.at_level(logging.INFO, logger="tokenmill"):
        again = build(folder, tmp_path, quantization=quantization, dtype=dtype).model
    assert "from the cache" in caplog.text
    assert type(first.layers[0].mlp.down_proj.linear_method).__name__ == (
        "BlocksQuantMethod"
        if blocks
        else {"int8": "Int8LinearMethod", "int4": "Int4LinearMethod", "w8a8": "W8A8LinearMethod"}[quantization]
    )
    expected, got = state(first), state(again)
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    assert type(again.embed_tokens) is type(first.embed_tokens)  # a tied quantized head: rows read from it
    backend = built.backend
    ids = torch.arange(1, 17)
    assert torch.equal(probe_logits(again, backend, ids), probe_logits(first, backend, ids))


def test_other_settings_are_another_key_and_a_bad_cache_quantizes_again(tiny_model_dir, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TOKENMILL_QUANTIZED_CACHE_DIR", str(tmp_path / "quantized"))
    folder = tiny_model_dir("llama")
    loads = []
    real = model_builder.load_model
    monkeypatch.setattr(model_builder, "load_model", lambda *a, **k: loads.append(1) or real(*a, **k))
    build(folder, tmp_path, quantization="int4")
    (entry,) = cache_root().iterdir()
    other_groups = {"quantization_group_size": 64, "quantization_group_fallback": True}
    build(folder, tmp_path, quantization="int4", **other_groups)  # other settings: another key
    assert len(loads) == 2 and len(list(cache_root().iterdir())) == 2
    build(folder, tmp_path, quantization="int4")
    assert len(loads) == 2  # read back
    # a file cut short: a warning, quantized again, and the cache rewritten whole
    file = entry / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with caplog.at_level(logging.WARNING, logger="tokenmill"):
        build(folder, tmp_path, quantization="int4")
    assert len(loads) == 3 and "unusable" in caplog.text and "quantizing again" in caplog.text
    build(folder, tmp_path, quantization="int4")
    assert len(loads) == 3
    # another key's file in this key's place (a mismatched key): refused, quantized again
    other = next(p for p in cache_root().iterdir() if p != entry) / "model.safetensors"
    file.write_bytes(other.read_bytes())
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tokenmill"):
        build(folder, tmp_path, quantization="int4")
    assert len(loads) == 4 and "another checkpoint or settings" in caplog.text


def test_no_cache_for_a_dense_model(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_QUANTIZED_CACHE_DIR", str(tmp_path / "quantized"))
    build(tiny_model_dir("llama"), tmp_path)
    assert not cache_root().exists()


def mapped(path) -> bool:
    """Whether this process maps `path` (/proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        return any(line.rstrip().endswith(str(path)) for line in maps)


def test_a_cached_build_keeps_no_view_of_the_file(tiny_model_dir, tmp_path, monkeypatch):
    """The tensors a cached build reads under a huge page are copied out of the file's mapping, so none
    keeps the whole file (every page the build read) resident beside the copies: the tiny model's all are
    that small, and the file is unmapped once the build is done."""
    monkeypatch.setenv("TOKENMILL_QUANTIZED_CACHE_DIR", str(tmp_path / "quantized"))
    folder = tiny_model_dir("llama")
    build(folder, tmp_path, quantization="int8", dtype="float32")
    (written,) = cache_root().iterdir()
    monkeypatch.setattr(model_builder, "load_model", no_load)
    again = build(folder, tmp_path, quantization="int8", dtype="float32").model
    gc.collect()
    assert not mapped(written / "model.safetensors")
    assert next(again.parameters()).abs().sum() > 0  # (the model holds its weights still)
