"""The prompt product on GGUF blocks (`gguf_gemm`, kernels/csrc/gguf_gemm.cpp): x' @ W^T for many x rows,
x' the activations rounded to int8 as the decode product rounds them, equal to `gguf_linear`'s values
row for row (the same integer sums in the same order), and to the dequantized weights times x' within
float32 summation; the layer method sends prompt chunks to it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.quant.test_gguf_blocks import random_blocks, reference, rounded_x, x_run
from tokenmill.kernels.cpu_build import cpu_flags
from tokenmill.quant.gguf_method import BLOCK_TYPES, BLOCKS


def case(type_name: str, rows: int, seed: int) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Random blocks [n, row bytes] (n spanning several weight tiles) and x [rows, k] with an outlier and
    a row of zeros."""
    k = 512 if BLOCKS[type_name][1] == 256 else 96
    n = 300
    raw = random_blocks(type_name, n, k, seed=seed)
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, k)) * rng.uniform(0.1, 3, size=(rows, 1))).astype(np.float32)
    x[:, 5] = 40.0
    x[min(2, rows - 1), :] = 0.0
    return raw, x, n, k


@pytest.mark.parametrize("type_name", BLOCK_TYPES)
@pytest.mark.parametrize("rows", [9, 70])
def test_the_prompt_product_is_the_int8_rounded_x_times_the_weights(ops, type_name, rows):
    raw, x, n, k = case(type_name, rows, seed=rows)
    code = BLOCKS[type_name][0]
    out = torch.empty(rows, n)
    ops.gguf_gemm(out, torch.from_numpy(x), torch.from_numpy(raw), code)
    w = reference(raw, type_name, k).astype(np.float64)
    xr = rounded_x(x, x_run(type_name))
    slack = 1e-5 * (np.abs(xr) @ np.abs(w).T) + 1e-30
    assert np.all(np.abs(out.numpy() - xr @ w.T) <= slack)
    # the decode product's values, a few rows at a time (its own row classes), bit for bit
    few = torch.empty(rows, n)
    for m0 in range(0, rows, 4):
        ops.gguf_linear(few[m0 : m0 + 4], torch.from_numpy(x[m0 : m0 + 4]), torch.from_numpy(raw), code)
    assert torch.equal(out, few)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q8_0", "Q5_1"])
def test_the_prompt_product_in_bfloat16_writes_a_column_slice(ops, type_name):
    raw, x, n, k = case(type_name, 13, seed=1)
    xb = torch.from_numpy(x).bfloat16()
    wide = torch.full((13, n + 10), 7.0, dtype=torch.bfloat16)
    ops.gguf_gemm(wide[:, 5 : 5 + n], xb, torch.from_numpy(raw), BLOCKS[type_name][0])
    expected = rounded_x(xb.float().numpy(), x_run(type_name)) @ reference(raw, type_name, k).astype(np.float64).T
    got = wide[:, 5 : 5 + n].double().numpy()
    assert np.all(np.abs(got - expected) <= 2**-8 * np.abs(expected) + 1e-5 * np.abs(expected).max())
    assert torch.all(wide[:, :5] == 7.0) and torch.all(wide[:, 5 + n :] == 7.0)


@pytest.mark.parametrize("type_name", BLOCK_TYPES)
@pytest.mark.parametrize("rows", [9, 16, 70])
def test_the_widened_prompt_product_is_x_times_the_dequantized_weights(ops, type_name, rows):
    """`gguf_gemm_widened`: float32 arithmetic on the dequantized weights, x not rounded (AVX2's
    outer-product tiles from 16 rows; n = 300 is whole tiles of 6, so 302 leaves 2 rows to gguf_gemm).
    Elsewhere, and under 16 rows, it is gguf_gemm's int8-rounded product."""
    raw, x, n, k = case(type_name, rows, seed=rows + 1)
    raw = np.concatenate([raw, random_blocks(type_name, 2, k, seed=7)])
    n += 2
    code = BLOCKS[type_name][0]
    wide = torch.full((rows, n + 3), 7.0)
    ops.gguf_gemm_widened(wide[:, :n], torch.from_numpy(x), torch.from_numpy(raw), code)
    out = wide[:, :n].double().numpy()
    w = reference(raw, type_name, k).astype(np.float64)
    exact = x.astype(np.float64) @ w.T
    slack = 1e-5 * (np.abs(x) @ np.abs(w).T) + 1e-30
    gemm = torch.empty(rows, n)
    ops.gguf_gemm(gemm, torch.from_numpy(x), torch.from_numpy(raw), code)
    widened = np.abs(out - exact) <= slack  # [rows, n]: the columns the widened tiles computed
    flags = cpu_flags().split()
    if rows >= 16 and "avx2" in flags and "fma" in flags and "avx512f" not in flags:  # the tiles are built
        assert widened[:, : n - 2].all()
    if rows >= 16 and widened[:, : n - 2].all():
        assert torch.equal(wide[:, n - 2 : n], gemm[:, n - 2 :])  # the rows short of a tile: gguf_gemm's
    else:  # no outer-product tiles in this build (or too few rows): gguf_gemm's values throughout
        assert torch.equal(wide[:, :n], gemm)
    assert torch.all(wide[:, n:] == 7.0)
    bf = torch.empty(rows, n, dtype=torch.bfloat16)
    ops.gguf_gemm_widened(bf, torch.from_numpy(x).bfloat16(), torch.from_numpy(raw), code)
    assert torch.allclose(bf.float(), wide[:, :n].bfloat16().float(), rtol=2e-2, atol=1e-2 * float(np.abs(exact).max()))
