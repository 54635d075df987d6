"""Which linear method each layer gets (quant/config.py), decided without loading a model: by the
settings, the device, what the checkpoint stores (AWQ / GPTQ / compressed-tensors, GGUF tensor types)
and the layer's prefix."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tokenmill import config as engine_config
from tokenmill.kernels.defaults import CpuKind
from tokenmill.quant.awq_gptq import CheckpointInt4Method, CheckpointInt8Method
from tokenmill.quant.checkpoint import CheckpointQuantization
from tokenmill.quant.compressed import CompressedInt4Method
from tokenmill.quant.config import (
    GGUF_EMBEDDING,
    GGUF_LAYOUTS,
    GGUF_REPACKS,
    GGUF_TABLE,
    QuantConfig,
    QuantSettings,
    build_quant_config,
    gguf_layout,
    gguf_repack,
)
from tokenmill.quant.gguf_method import REPACKED_TYPES, GGUFBlocksMethod, GGUFMatrix
from tokenmill.quant.int_methods import Int4LinearMethod, Int8LinearMethod, W8A8LinearMethod
from tokenmill.quant.method import UnquantizedLinearMethod

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
QKV, DOWN, HEAD = "layers.0.self_attn.qkv_proj", "layers.1.mlp.down_proj", "lm_head"
SHAPE = (96, 64)


def build(
    quantization="auto", *, device=CPU, stored=None, gguf=None, group=None, head="same", backend="torch", layout="int"
):
    settings = QuantSettings(quantization, group, False, head, backend, layout)
    return build_quant_config(
        settings, device=device, dtype=torch.float32, dense_backend=lambda: "torch", stored=stored, gguf_types=gguf
    )


def test_auto_and_none_on_a_plain_checkpoint_are_dense_everywhere():
    for quantization in ("auto", "none"):
        quant = build(quantization)
        for prefix in (QKV, DOWN, HEAD):
            assert type(quant.method_for(prefix, SHAPE)) is UnquantizedLinearMethod
        assert quant.dense is quant.layers  # a dense layers' method serves the dense products too


@pytest.mark.parametrize(
    ("name", "method"), [("int8", Int8LinearMethod), ("int4", Int4LinearMethod), ("w8a8", W8A8LinearMethod)]
)
def test_int8_int4_w8a8_quantize_every_projection_and_the_head_alike(name, method):
    quant = build(name)
    assert all(isinstance(quant.method_for(p, SHAPE), method) for p in (QKV, DOWN, HEAD))
    assert quant.method_for(QKV, SHAPE) is quant.method_for(DOWN, SHAPE)  # one instance serves every layer
    assert type(quant.dense) is UnquantizedLinearMethod


def test_quantization_head_int8_gives_the_head_its_own_method():
    quant = build("int4", head="int8")
    assert isinstance(quant.method_for(QKV, SHAPE), Int4LinearMethod)
    head = quant.method_for(HEAD, SHAPE)
    assert isinstance(head, Int8LinearMethod) and head.spec.group_size is None  # per channel
    same = build("int8", head="int8")  # int8 layers: the head is theirs
    assert same.method_for(HEAD, SHAPE) is same.layers


def test_group_size_reaches_the_method_and_is_refused_without_quantization():
    assert build("int8", group=64).method_for(QKV, SHAPE).spec.group_size == 64
    with pytest.raises(ValueError, match="quantization_group_size, quantization_head: apply to int8, int4 or w8a8"):
        build("auto", group=64)


def test_quantizing_at_load_runs_on_a_cpu_only():
    with pytest.raises(ValueError, match="quantization: int8 runs on a CPU device, not cuda"):
        build("int8", device=CUDA)


@pytest.mark.parametrize(
    ("stored", "method"),
    [
        (CheckpointQuantization("awq", 4, 128), CheckpointInt4Method),
        (CheckpointQuantization("gptq", 4, 128), CheckpointInt4Method),
        (CheckpointQuantization("gptq", 8, 128), CheckpointInt8Method),
        (CheckpointQuantization("compressed-tensors", 4, 32, symmetric=True), CompressedInt4Method),
    ],
)
def test_a_stored_checkpoint_loads_as_stored_with_a_dense_head(stored, method):
    quant = build(stored=stored)
    assert isinstance(quant.method_for(QKV, SHAPE), method) and isinstance(quant.method_for(DOWN, SHAPE), method)
    assert type(quant.method_for(HEAD, SHAPE)) is UnquantizedLinearMethod


def test_a_stored_checkpoint_refuses_other_settings():
    stored = CheckpointQuantization("awq", 4, 128)
    with pytest.raises(ValueError, match=r"AWQ-quantized; it loads as stored .* not with quantization none on cpu"):
        build("none", stored=stored)
    with pytest.raises(ValueError, match=r"AWQ-quantized; it loads as stored .* not with quantization auto on cuda"):
        build("auto", stored=stored, device=CUDA)
    with pytest.raises(ValueError, match="AWQ-quantized already; leave quantization auto, not int8"):
        build("int8", stored=stored)


GGUF = {
    QKV: "Q8_0",
    DOWN: "Q4_1",
    "layers.0.self_attn.o_proj": "Q4_K",
    "layers.0.mlp.gate_up_proj": "Q4_K+Q6_K",
    "layers.1.mlp.gate_up_proj": "F16+Q4_K",
}


def test_gguf_layers_keep_q8_0_and_q4_x_in_int_formats_the_other_block_types_in_their_blocks():
    quant = build(gguf=GGUF)
    q8, q4 = quant.method_for(QKV, SHAPE), quant.method_for(DOWN, SHAPE)
    assert isinstance(q8, Int8LinearMethod) and q8.prequantized and q8.spec.group_size == 32
    assert isinstance(q4, Int4LinearMethod) and q4.prequantized and q4.spec.group_size == 32
    blocks = quant.method_for("layers.0.self_attn.o_proj", SHAPE)
    assert isinstance(blocks, GGUFBlocksMethod)  # a K-quant
    assert quant.method_for("layers.0.mlp.gate_up_proj", SHAPE) is blocks  # block types mixed
    for prefix in ("layers.1.mlp.gate_up_proj", "layers.9.mlp.down_proj"):
        assert type(quant.method_for(prefix, SHAPE)) is UnquantizedLinearMethod  # a float type mixed in, unknown
    assert type(quant.method_for(HEAD, SHAPE)) is UnquantizedLinearMethod  # untied, no lm_head type given


def test_a_gguf_untied_q8_0_head_is_kept_and_a_tied_q8_0_table_gives_an_int8_head_of_its_own():
    untied = build(gguf={HEAD: "Q8_0"}).method_for(HEAD, SHAPE)
    assert isinstance(untied, Int8LinearMethod) and untied.prequantized
    tied = build(gguf={GGUF_TABLE: "Q8_0"}).method_for(HEAD, SHAPE)
    assert isinstance(tied, Int8LinearMethod) and not tied.prequantized and tied.spec.group_size == 32
    assert type(build(gguf={GGUF_TABLE: "F16"}).method_for(HEAD, SHAPE)) is UnquantizedLinearMethod


def test_a_gguf_table_of_a_block_type_stays_in_its_blocks_and_a_tied_head_reads_them():
    tied = build(gguf={GGUF_TABLE: "Q6_K", GGUF_EMBEDDING: "Q6_K"})
    assert isinstance(tied.method_for(HEAD, SHAPE), GGUFBlocksMethod)
    assert tied.embedding_blocks(tied=True) is tied.method_for(HEAD, SHAPE)
    q8 = build(gguf={GGUF_TABLE: "Q8_0", GGUF_EMBEDDING: "Q8_0"})  # tied: an int8 head, the table dense
    assert q8.embedding_blocks(tied=True) is None
    untied = build(gguf={HEAD: "Q6_K", GGUF_EMBEDDING: "Q8_0"})
    assert isinstance(untied.embedding_blocks(tied=False), GGUFBlocksMethod)
    assert build(gguf={GGUF_EMBEDDING: "F16"}).embedding_blocks(tied=False) is None


def test_gguf_layout_blocks_keeps_q8_0_and_q4_x_in_their_blocks_a_tied_q8_0_head_reading_the_table():
    quant = build(gguf=GGUF, layout="blocks")
    blocks = quant.method_for("layers.0.self_attn.o_proj", SHAPE)
    assert isinstance(blocks, GGUFBlocksMethod)
    assert quant.method_for(QKV, SHAPE) is blocks and quant.method_for(DOWN, SHAPE) is blocks
    tied = build(gguf={GGUF_TABLE: "Q8_0", GGUF_EMBEDDING: "Q8_0"}, layout="blocks")
    head = tied.method_for(HEAD, SHAPE)
    assert isinstance(head, GGUFBlocksMethod) and tied.embedding_blocks(tied=True) is head  # one copy


def test_gguf_layout_auto_is_the_cpu_kinds_rule():
    avx2 = CpuKind(avx512=False, vnni=False, bf16=False, amx=False)
    zen4 = CpuKind(avx512=True, vnni=True, bf16=True, amx=False)
    amx = CpuKind(avx512=True, vnni=True, bf16=True, amx=True)
    assert gguf_layout("auto", avx2) == "q8_0"  # (no AVX2 flag: no vector form of the blocks)
    assert gguf_layout("auto", CpuKind(avx512=False, vnni=False, bf16=False, amx=False, avx2=True)) == "blocks"
    icx = CpuKind(avx512=True, vnni=True, bf16=False, amx=False)  # (AVX-512 VNNI alone: not measured, int)
    assert gguf_layout("auto", zen4) == "blocks" and gguf_layout("auto", amx) == gguf_layout("auto", icx) == "int"
    assert gguf_layout("int", avx2) == "int" and gguf_layout("blocks", amx) == "blocks"
    assert gguf_layout("auto") in ("blocks", "q8_0", "int")  # this machine's
    q8 = build(gguf=GGUF, layout="q8_0")  # Q8_0 in its blocks, Q4_1 in int4
    assert isinstance(q8.method_for(QKV, SHAPE), GGUFBlocksMethod)
    assert isinstance(q8.method_for(DOWN, SHAPE), Int4LinearMethod)
    assert GGUF_LAYOUTS == engine_config.GGUF_LAYOUTS  # (the setting's choices, which quant/config.py checks)
    with pytest.raises(ValueError, match="gguf_layout: expected one of auto, blocks, q8_0, int, got 'q8'"):
        gguf_layout("q8")


def test_gguf_types_are_kept_on_a_cpu_under_auto_only():
    for quant in (build("none", gguf=GGUF), build("auto", gguf=GGUF, device=CUDA)):
        assert not quant.gguf and type(quant.method_for(QKV, SHAPE)) is UnquantizedLinearMethod


def test_uniform_and_the_checkpoint_default():
    method = Int8LinearMethod(build("int8").layers.spec, None)
    quant = QuantConfig.uniform(method)
    assert quant.method_for(QKV, SHAPE) is method and quant.method_for(HEAD, SHAPE) is method
    stored = QuantConfig.for_checkpoint(CheckpointQuantization("gptq", 8, 64))
    assert isinstance(stored.layers, CheckpointInt8Method) and type(stored.head) is UnquantizedLinearMethod
    assert type(QuantConfig.for_checkpoint(None).layers) is UnquantizedLinearMethod


def test_each_cpu_kind_repacks_the_block_types_its_rule_chose():
    """`gguf_repack`: AVX-512 VNNI puts every type with a 16-row form into it; AVX2 all but Q8_0 (whose
    16-row form lost to its file blocks at one request there); a CPU without AVX2 none (no vector form
    there). `repack` given (the setting's x16 / file): all or none, whatever the CPU."""
    kernels = SimpleNamespace(ops=object(), build_dir=None)
    avx2 = CpuKind(avx512=False, vnni=False, bf16=False, amx=False, avx2=True)
    zen4 = CpuKind(avx512=True, vnni=True, bf16=True, amx=False, avx2=True)
    older = CpuKind(avx512=False, vnni=False, bf16=False, amx=False)
    assert GGUFBlocksMethod(kernels, cpu=zen4).repack_types == set(REPACKED_TYPES)  # type: ignore[arg-type]
    assert GGUFBlocksMethod(kernels, cpu=avx2).repack_types == set(REPACKED_TYPES) - {"Q8_0"}  # type: ignore[arg-type]
    assert not GGUFBlocksMethod(kernels, cpu=older).repack_types  # type: ignore[arg-type]
    assert GGUFBlocksMethod(kernels, cpu=older, repack=True).repack_types == set(REPACKED_TYPES)  # type: ignore[arg-type]
    assert not GGUFBlocksMethod(kernels, cpu=zen4, repack=False).repack_types  # type: ignore[arg-type]
    assert (gguf_repack("auto"), gguf_repack("x16"), gguf_repack("file")) == (None, True, False)  # the setting
    assert GGUF_REPACKS == engine_config.GGUF_REPACKS
    with pytest.raises(ValueError, match="gguf_repack: expected one of auto, x16, file, got 'yes'"):
        gguf_repack("yes")
    on_avx2 = GGUFBlocksMethod(kernels, cpu=avx2)  # type: ignore[arg-type]
    assert on_avx2.repacks(GGUFMatrix("Q4_K", torch.zeros(32, 144, dtype=torch.uint8), 256))
    assert not on_avx2.repacks(GGUFMatrix("Q8_0", torch.zeros(32, 272, dtype=torch.uint8), 256))
    assert not on_avx2.repacks(GGUFMatrix("Q4_K", torch.zeros(24, 144, dtype=torch.uint8), 256))  # (24 rows)


def test_each_block_type_takes_its_cpu_kinds_prompt_product():
    """`auto`: on AVX2 the 32-weight types measured (Q8_0, Q4_0) take the widened float32 tiles, the
    K-quants the integer GEMM; AVX-512 keeps the integer GEMM for all. Few rows: the decode product."""
    avx2 = CpuKind(avx512=False, vnni=False, bf16=False, amx=False)
    zen4 = CpuKind(avx512=True, vnni=True, bf16=True, amx=False)
    kernels = SimpleNamespace(ops=object(), build_dir=None)
    ours = GGUFBlocksMethod(kernels, cpu=avx2)  # type: ignore[arg-type]
    prompt, decode = torch.zeros(65, 32), torch.zeros(8, 32)
    assert ours.product("Q8_0", prompt) == ours.product("Q4_0", prompt) == "gguf_gemm_widened"
    assert ours.product("Q4_K", prompt) == ours.product("Q6_K", prompt) == "gguf_gemm"
    assert ours.product("Q8_0", decode) == "gguf_linear"
    assert ours.product("Q8_0", prompt.half()) is None  # float16: dequantized chunks and torch's GEMM
    theirs = GGUFBlocksMethod(kernels, cpu=zen4)  # type: ignore[arg-type]
    assert {theirs.product(t, prompt) for t in ("Q8_0", "Q4_0", "Q4_K")} == {"gguf_gemm"}
    pinned = GGUFBlocksMethod(kernels, prompt_kernel="gemm", cpu=avx2)  # type: ignore[arg-type]
    assert pinned.product("Q8_0", prompt) == "gguf_gemm"
    assert GGUFBlocksMethod(None, cpu=avx2).product("Q8_0", prompt) is None
    with pytest.raises(ValueError, match="prompt_kernel: expected one of auto, gemm, widened, dequant"):
        GGUFBlocksMethod(kernels, prompt_kernel="fast")  # type: ignore[arg-type]
