"""The prompt product on GGUF blocks (`gguf_gemm`, kernels/csrc/gguf_gemm.cpp): x' @ W^T for many x rows,
x' the activations rounded to int8 as the decode product rounds them, equal to `gguf_linear`'s values
row for row (the same integer sums in the same order), and to the dequantized weights times x' within
float32 summation; the layer method sends prompt chunks to it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.quant.test_gguf_blocks import random_blocks, reference, rounded_x, x_run
from tokenmill.kernels.cpu_build import load_cpu_kernels
from tokenmill.quant.gguf_method import BLOCK_TYPES, BLOCKS


@pytest.fixture(scope="module")
def ops():
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("the native CPU kernels do not build here")
    return kernels.ops


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
