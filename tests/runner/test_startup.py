"""A start-up measures nothing: every kernel choice is the autotune cache's or kernels/defaults.py's
rule for the CPU kind (and the resolution line counts the defaults); `tokenmill tune` measures the
defaults once into the cache, and a later start reads them back."""

from __future__ import annotations

import logging

import pytest
import torch

from tokenmill.config import EngineConfig
from tokenmill.kernels.autotune import Autotuner
from tokenmill.kernels.cpu_build import load_cpu_kernels
from tokenmill.kernels.defaults import BATCH, DECODE, PROMPT, CpuKind, default_choice
from tokenmill.quant import config as quant_config
from tokenmill.quant.cpu_dense import CpuLinearMethod
from tokenmill.quant.int_methods import QuantizedLinearMethod
from tokenmill.runner.model_builder import build_model
from tokenmill.runner.tune import tune

CPU = torch.device("cpu")
AVX2 = CpuKind.from_flags("fpu sse4_2 avx avx2 fma f16c")
ZEN4 = CpuKind.from_flags("avx2 fma avx512f avx512bw avx512_vnni avx512_bf16")  # AVX-512 with VNNI and BF16
ICELAKE = CpuKind.from_flags("avx2 fma avx512f avx512bw avx512_vnni")  # AVX-512 VNNI, no BF16
AMX = CpuKind.from_flags("avx2 fma avx512f avx512_vnni avx512_bf16 amx_tile amx_bf16 amx_int8")
needs_kernels = pytest.mark.skipif(load_cpu_kernels() is None, reason="the native CPU kernels do not build here")


def never(candidates, repeats, sync):
    raise AssertionError(f"measured {sorted(candidates)} on the start-up path")


def config_for(folder, **settings) -> EngineConfig:
    # the thread count pinned: `tune` sets it as serve does, and the cache's machine key includes it
    return EngineConfig(model=str(folder), cpu_threads=torch.get_num_threads(), max_num_seqs=16, **settings)


def test_cpu_kinds_from_their_flags():
    assert (AVX2.avx512, AVX2.vnni, AVX2.bf16, AVX2.amx) == (False, False, False, False)
    assert (ZEN4.avx512, ZEN4.vnni, ZEN4.bf16, ZEN4.amx) == (True, True, True, False)
    assert (ICELAKE.vnni, ICELAKE.bf16) == (True, False)
    assert AMX.amx and AMX.bf16
    assert not CpuKind.from_flags("avx512f amx_tile").amx  # tiles without a tile dtype: not usable
    assert AVX2.avx2 and ZEN4.avx2 and not CpuKind.from_flags("sse4_2 avx avx2").avx2  # (AVX2 with FMA)


@pytest.mark.parametrize(
    ("cpu", "op", "rows", "dtype", "candidates", "expected"),
    [
        # dense: the native kernel for decode and batches everywhere; prompt chunks to torch's GEMM
        # where it runs the dtype in hardware
        (AVX2, "linear", DECODE, "bfloat16", ("cpu", "torch"), "cpu"),
        (AVX2, "linear", PROMPT, "float32", ("cpu", "torch"), "torch"),
        (AVX2, "linear", PROMPT, "bfloat16", ("cpu", "torch"), "cpu"),  # torch's bf16 GEMM emulated
        (ZEN4, "linear", PROMPT, "bfloat16", ("cpu", "torch"), "torch"),
        (ICELAKE, "linear", PROMPT, "bfloat16", ("cpu", "torch"), "cpu"),
        (AMX, "linear", BATCH, "bfloat16", ("cpu", "torch"), "cpu"),
        # int8 weight-only
        (AVX2, "int8", DECODE, "bfloat16", ("dequant", "native", "tiled"), "native"),
        (AVX2, "int8", BATCH, "float32", ("dequant", "native", "tiled"), "tiled"),
        (AVX2, "int8", BATCH, "float32", ("dequant", "native"), "native"),  # per group: no tiled loop
        # prompts on AVX2: the tiles' weight rows widened in cache (`broadcast`), in either dtype
        (AVX2, "int8", PROMPT, "float32", ("dequant", "native", "tiled", "broadcast"), "broadcast"),
        (AVX2, "int8", PROMPT, "bfloat16", ("dequant", "native", "tiled", "broadcast"), "broadcast"),
        (AVX2, "int8", PROMPT, "bfloat16", ("dequant", "native", "tiled"), "tiled"),
        (ZEN4, "int8", PROMPT, "float32", ("dequant", "native", "tiled", "broadcast"), "dequant"),
        (ZEN4, "int8", PROMPT, "bfloat16", ("dequant", "native", "tiled", "broadcast"), "dequant"),
        # Zen 4: dequantized for the bfloat16 GEMM (measured ahead of int8 activations on VNNI in the
        # engine's prompt chunks), `gemm` where that is not offered
        (ZEN4, "int8", PROMPT, "bfloat16", ("dequant", "native", "tiled", "gemm"), "dequant"),
        (ZEN4, "int8", PROMPT, "float32", ("native", "tiled", "gemm"), "gemm"),
        (AMX, "int8", PROMPT, "bfloat16", ("dequant", "native", "tiled", "gemm", "amx"), "dequant"),
        (ICELAKE, "int8", PROMPT, "bfloat16", ("dequant", "native", "tiled", "gemm"), "tiled"),
        (ICELAKE, "int8", PROMPT, "bfloat16", ("dequant", "native", "tiled", "broadcast"), "tiled"),
        (AMX, "int8", BATCH, "bfloat16", ("dequant", "native", "tiled", "amx"), "amx"),
        (AMX, "int8", BATCH, "bfloat16", ("dequant", "native", "tiled"), "tiled"),  # tiles not granted
        # W8A8
        (AVX2, "w8a8", DECODE, "float32", ("int_mm", "native", "tiled"), "native"),
        (AVX2, "w8a8", PROMPT, "float32", ("int_mm", "native", "tiled"), "tiled"),
        (ZEN4, "w8a8", PROMPT, "float32", ("int_mm", "native", "tiled"), "int_mm"),
        (ICELAKE, "w8a8", BATCH, "float32", ("int_mm", "native", "tiled"), "tiled"),
        (AMX, "w8a8", BATCH, "bfloat16", ("int_mm", "native", "tiled", "amx"), "amx"),
        (AMX, "w8a8", PROMPT, "bfloat16", ("int_mm", "native", "tiled", "amx"), "amx"),
        # int4 (native kept to decode rows by the method; int4pack only without tokenmill's kernels)
        (AVX2, "int4", DECODE, "bfloat16", ("native", "dequant"), "native"),
        (ZEN4, "int4", BATCH, "bfloat16", ("dequant",), "dequant"),
        (AMX, "int4", BATCH, "bfloat16", ("dequant", "amx"), "amx"),
        (AMX, "int4", PROMPT, "bfloat16", ("dequant", "amx"), "dequant"),
        (AVX2, "int4", BATCH, "bfloat16", ("int4pack", "dequant"), "int4pack"),
        # int4's many rows without bfloat16 arithmetic: float32 weights and GEMM (`dequant32`)
        (AVX2, "int4", BATCH, "bfloat16", ("native", "dequant", "dequant32"), "dequant32"),
        (AVX2, "int4", PROMPT, "bfloat16", ("native", "dequant", "dequant32"), "dequant32"),
        (AVX2, "int4", PROMPT, "float32", ("native", "dequant"), "dequant"),  # (offered for bfloat16 only)
        # without bfloat16 arithmetic: the integer kernel's many-row loops (`gemm`), then (AVX2 builds)
        # the outer-product tiles over weight rows dequantized in cache (`widened`)
        (AVX2, "int4", BATCH, "bfloat16", ("native", "dequant", "dequant32", "widened", "gemm"), "gemm"),
        (AVX2, "int4", PROMPT, "float32", ("native", "dequant", "widened", "gemm"), "gemm"),
        (AVX2, "int4", PROMPT, "bfloat16", ("native", "dequant", "dequant32", "widened"), "widened"),
        # AVX-512 BF16 without AMX: the integer kernel on VNNI, else the bfloat16 GEMM (not dequant32)
        (ZEN4, "int4", PROMPT, "bfloat16", ("dequant", "widened", "gemm"), "gemm"),
        (ZEN4, "int4", BATCH, "bfloat16", ("native", "dequant", "dequant32", "gemm"), "gemm"),
        (ICELAKE, "int4", PROMPT, "bfloat16", ("native", "dequant", "dequant32"), "dequant32"),
        (ZEN4, "int4", BATCH, "bfloat16", ("native", "dequant", "dequant32"), "dequant"),
        (ZEN4, "int4", PROMPT, "bfloat16", ("native", "dequant", "dequant32"), "dequant"),
        (AMX, "int4", PROMPT, "bfloat16", ("dequant", "gemm", "amx"), "dequant"),  # AMX: unmeasured, kept
        # a GGUF type's prompt product: Q3_K dequantized for the bfloat16 GEMM where the CPU has it;
        # the other K-quants and AVX2 their integer GEMM (the first candidate)
        (ZEN4, "gguf_prompt", PROMPT, "Q3_K", ("gemm", "widened", "dequant"), "dequant"),
        (AMX, "gguf_prompt", PROMPT, "Q3_K", ("gemm", "widened", "dequant"), "dequant"),
        (AVX2, "gguf_prompt", PROMPT, "Q3_K", ("gemm", "widened", "dequant"), "gemm"),
        (ZEN4, "gguf_prompt", PROMPT, "Q4_K", ("gemm", "widened", "dequant"), "gemm"),
        (AVX2, "greedy_head", DECODE, "float32", ("head", "logits"), "logits"),
        # a prompt chunk's attention: the paged kernel, but on AMX (unmeasured there) torch's SDPA
        (AVX2, "prompt_attention", PROMPT, "bfloat16", ("native", "sdpa"), "native"),
        (ZEN4, "prompt_attention", PROMPT, "bfloat16", ("native", "sdpa"), "native"),
        (AMX, "prompt_attention", PROMPT, "bfloat16", ("native", "sdpa"), "sdpa"),
        (AVX2, "an op with no rule", DECODE, "float32", ("b", "a"), "b"),  # the first candidate
    ],
)
def test_the_defaults_per_cpu_kind(cpu, op, rows, dtype, candidates, expected):
    assert default_choice(op, rows, dtype, cpu, candidates) == expected


def test_a_tuner_not_measuring_gives_the_default_and_writes_nothing(tmp_path):
    path = tmp_path / "autotune.json"
    tuner = Autotuner(CPU, path, measure=False, timer=never)
    choice = tuner.choose("op", "shape", {"a": lambda: None, "b": lambda: None}, default="b")
    assert (choice.name, choice.source, choice.timings_ms) == ("b", "default", {})
    assert not path.exists() and tuner.missed == ["op|shape"] and tuner.summary() == "1 (1 defaults)"
    with pytest.raises(ValueError, match="no default"):
        tuner.choose("op", "shape", {"a": lambda: None})


@needs_kernels
@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_a_start_measures_nothing_and_follows_the_table(tiny_model_dir, tmp_path, monkeypatch, caplog, quantization):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    tuner = Autotuner(CPU, tmp_path / "autotune.json", measure=False, timer=never)
    tuner.cpu = AVX2
    monkeypatch.setattr(quant_config, "in_blocks", lambda settings, cpu=None: False)  # (AVX2: the int formats)
    with caplog.at_level(logging.INFO, logger="tokenmill"):
        built = build_model(config_for(tiny_model_dir("llama"), quantization=quantization), CPU, tuner)
    assert tuner.counts["default"] > 0 and tuner.counts["measured"] == 0
    assert f"kernel choices {tuner.counts['default']} ({tuner.counts['default']} defaults)" in caplog.text
    assert "start-up: reading the weights of" in caplog.text
    assert not built.greedy_head  # the default: logits
    model = built.model
    if quantization == "none":
        method = model.dense
        assert isinstance(method, CpuLinearMethod)
        for table in method.native.values():  # float32 on AVX2: native to 64 rows, torch's GEMM past
            assert all(table[1:65]) and not any(table[65:])
        return
    (method,) = model.quantized_methods()
    assert isinstance(method, QuantizedLinearMethod)
    expected = {"int8": ("native", "tiled", "broadcast"), "int4": ("native", "gemm", "gemm")}[quantization]
    for shape, table in method.plan.items():
        most = len(table) - 1  # (the head sees max_num_seqs rows at most)
        picks = [method.kernel_for(shape, rows) for rows in (1, 8, 9, 64, 65)]
        want = [expected[0]] * 2 + [expected[1]] * 2 + [expected[2] if most > 64 else expected[1]]
        assert picks == want, shape


@needs_kernels
def test_tune_measures_the_defaults_once_and_a_start_reads_them(tiny_model_dir, tmp_path, monkeypatch):
    """`tokenmill tune` measures exactly the choices a start took by default; the next start reads
    every one from the cache (the timer's verdict, here torch's GEMM everywhere, not the table's)."""
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    path = tmp_path / "autotune.json"
    measured: list[list[str]] = []

    def torch_wins(candidates, repeats, sync):
        measured.append(sorted(candidates))
        return {name: 1.0 if name in ("torch", "logits", "sdpa") else 2.0 for name in candidates}

    config = config_for(tiny_model_dir("llama"), dtype="float32")
    start = Autotuner(CPU, path, measure=False, timer=never)
    build_model(config, CPU, start)
    defaults = start.counts["default"]
    report = tune(config, Autotuner(CPU, path, measure=False, timer=torch_wins))
    assert report.measured == len(measured) == defaults and report.cached == 0
    again = tune(config, Autotuner(CPU, path, measure=False, timer=never))
    assert again.measured == 0 and again.cached == defaults and "nothing to measure" in again.render()
    later = Autotuner(CPU, path, measure=False, timer=never)
    built = build_model(config, CPU, later)
    assert later.counts == {"cache": defaults}
    assert not any(any(table) for table in built.model.dense.native.values())  # the measured choice: torch
    assert built.backend.prompt_attention == "sdpa"  # (the measured one, on every CPU kind)
