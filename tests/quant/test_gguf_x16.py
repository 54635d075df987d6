"""Q4_K, Q5_K, Q6_K, Q4_0, Q4_1 and Q8_0 matrices repacked into groups of 16 rows (kernels/csrc/gguf_x16.cpp): the
same values as the file's blocks (dequantized rows bit for bit); the K-quants' products equal to the file
blocks' own bit for bit at every row count (the same integer sums and float steps), the 32-weight types' the
per-32 int8-rounded x times the weights within float32 summation, the same at every row count; and a
model served either way gives the same logits, holding the table of a tied head once. Forced on here,
so that every type is tested in the form the build has: AVX-512 VNNI's, AVX2's (gguf_x16_avx2.h; a
TOKENMILL_MAX_ISA=avx2 build runs this file in tests/layers/test_isa_cap.py) or the scalar one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.gguf_files import q4_k_m_types, write_gguf
from tests.helpers import PagedRunner
from tests.quant.test_gguf_blocks import random_blocks
from tokenmill.engine_args import DEMO_MODEL
from tokenmill.kernels.cpu_build import load_cpu_kernels
from tokenmill.models.loader import load_model
from tokenmill.quant.config import QuantConfig, gguf_methods
from tokenmill.quant.gguf_method import (
    BLOCKS,
    GGUFBlocksMethod,
    GGUFEmbedding,
    GGUFMatrix,
    dequantize,
    held_matrices,
    repack,
    repackable,
)
from tokenmill.quant.method import UnquantizedLinearMethod

TYPES = ["Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q4_1", "Q8_0"]


def matrices(ops, type_name: str, n: int = 48, k: int = 512) -> tuple[GGUFMatrix, GGUFMatrix]:
    raw = torch.from_numpy(random_blocks(type_name, n, k, seed=n + k))
    m = GGUFMatrix(type_name, raw, k)
    return m, repack(m, ops)


@pytest.mark.parametrize("type_name", TYPES)
def test_the_repacked_rows_are_the_files_rows(ops, type_name):
    m, x16 = matrices(ops, type_name)
    assert x16.repacked and x16.shape == m.shape
    assert x16.nbytes <= 1.03 * m.nbytes  # (Q4_K / Q5_K: scales a byte each, 148 / 180 bytes for 144 / 176)
    for dtype in (torch.float32, torch.bfloat16):
        whole = dequantize(m, ops, dtype)
        assert torch.equal(dequantize(x16, ops, dtype), whole)
        ids = torch.tensor([47, 0, 16, 15, 31, 5])
        assert torch.equal(dequantize(x16, ops, dtype, ids=ids), whole[ids])
        assert torch.equal(dequantize(x16, ops, dtype, rows=(13, 35)), whole[13:35])


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_repacked_products_equal_the_file_blocks_at_every_row_count(ops, type_name, dtype):
    m, x16 = matrices(ops, type_name, n=64, k=768)
    code = BLOCKS[type_name][0]
    rng = np.random.default_rng(3)
    x = torch.from_numpy((rng.standard_normal((21, 768)) * rng.uniform(0.1, 3, (21, 1))).astype(np.float32)).to(dtype)
    x[:, 7] = 30.0
    x[4] = 0.0
    file = torch.empty(21, 64, dtype=dtype)
    ops.gguf_linear(file, x, m.data, code)
    for op in (ops.gguf_linear, ops.gguf_gemm, ops.gguf_gemm_widened):  # (one product serves every row count)
        out = torch.empty(21, 64, dtype=dtype)
        op(out, x, x16.data, code + 100)
        assert torch.equal(out, file), op
    for rows in (1, 3, 8, 9):
        few = torch.empty(rows, 64, dtype=dtype)
        ops.gguf_linear(few, x[:rows], x16.data, code + 100)
        assert torch.equal(few, file[:rows])
    wide = torch.full((21, 80), 5.0, dtype=dtype)  # a column slice of a wider output
    ops.gguf_gemm(wide[:, 8:72], x, x16.data, code + 100)
    assert torch.equal(wide[:, 8:72], file) and torch.all(wide[:, :8] == 5) and torch.all(wide[:, 72:] == 5)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_the_32_weight_types_products_are_the_per_32_rounded_x_times_the_weights(ops, type_name):
    m, x16 = matrices(ops, type_name, n=32, k=256)
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((19, 256)) * rng.uniform(0.1, 3, (19, 1))).astype(np.float32)
    x[:, 3] = 25.0
    x[2] = 0.0
    blocks = x.reshape(19, 8, 32)
    amax = np.abs(blocks).max(axis=2, keepdims=True)  # (float32 arithmetic throughout, as the kernel's)
    scale = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, np.float32(1)), np.float32(0))
    xr = (np.rint(blocks * scale) * (amax / np.float32(127))).astype(np.float64).reshape(19, 256)
    w = dequantize(m, ops, torch.float32).double().numpy()
    out = torch.empty(19, 32)
    ops.gguf_gemm(out, torch.from_numpy(x), x16.data, BLOCKS[type_name][0] + 100)
    slack = 1e-5 * (np.abs(xr) @ np.abs(w).T) + 1e-30
    assert np.all(np.abs(out.numpy() - xr @ w.T) <= slack)
    for rows in (1, 5, 8):
        few = torch.empty(rows, 32)
        ops.gguf_linear(few, torch.from_numpy(x[:rows]), x16.data, BLOCKS[type_name][0] + 100)
        assert torch.equal(few, out[:rows])


def test_what_cannot_be_repacked_is_refused(ops):
    raw = torch.from_numpy(random_blocks("Q4_K", 24, 256, seed=1))
    assert not repackable(GGUFMatrix("Q4_K", raw, 256))  # 24 rows: not groups of 16
    assert not repackable(GGUFMatrix("Q5_1", torch.from_numpy(random_blocks("Q5_1", 32, 64, seed=1)), 64))
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ops.gguf_repack16(raw, 12)
    with pytest.raises(RuntimeError, match="Q4_K"):
        ops.gguf_repack16(torch.from_numpy(random_blocks("Q5_1", 32, 64, seed=1)), 7)
    _, x16 = matrices(ops, "Q4_K")
    with pytest.raises(RuntimeError, match="16-row repacked"):
        ops.gguf_linear(torch.empty(1, 48), torch.randn(1, 256), x16.data, 112)  # k 256, not 512
    with pytest.raises(ValueError, match="interleaved"):
        x16.permute_rows(torch.arange(48))
    with pytest.raises(ValueError, match="native kernels"):
        dequantize(x16, None, torch.float32)


@pytest.fixture(scope="module")
def tied_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf-x16")
    return write_gguf(DEMO_MODEL, folder / "demo-q4_k_m.gguf", q4_k_m_types("Q4_K", tied=True))


def served(path, repacked: bool, dtype: str):
    methods = gguf_methods(load_cpu_kernels(), "int", repack=repacked)
    for m in methods.values():
        if isinstance(m, GGUFBlocksMethod):
            m.prompt_kernel = "gemm"
    return load_model(path, dtype=dtype, quant=QuantConfig(UnquantizedLinearMethod(), gguf=methods))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_model_repacked_at_load_gives_the_files_logits(ops, tied_file, dtype):
    file_model, x16_model = served(tied_file, False, dtype), served(tied_file, True, dtype)
    parts = [m for layer in x16_model.layers for _, m in layer.mlp.gate_up_proj.gguf_parts]
    assert parts and all(m.repacked for m in parts)
    # the tied head's table is the head's own repacked matrix: held once
    assert isinstance(x16_model.embed_tokens, GGUFEmbedding)
    assert x16_model.embed_tokens.matrix is x16_model.lm_head.gguf_parts[0][1]
    held = sum(m.nbytes for m in held_matrices(x16_model.modules()))
    assert held <= 1.03 * sum(m.nbytes for m in held_matrices(file_model.modules()))
    ids = torch.randint(0, 4096, (40,), generator=torch.Generator().manual_seed(5))
    for rows in (ids, ids[:1]):  # a prompt chunk, and a decode-sized step
        runs = [
            PagedRunner(m, num_blocks=8, block_size=16, block_order=[2, 5, 0, 7, 1, 4, 6, 3]).step({0: rows})[0]
            for m in (file_model, x16_model)
        ]
        assert torch.equal(runs[0], runs[1])
