"""The GGUF block kernels (kernels/csrc/gguf_blocks.cpp) against the `gguf` package: dequantized rows equal
`gguf.quants.dequantize` bit for bit on random blocks of every kept type, and the decode product equals
x' @ W^T, x' the activations rounded to int8 as the kernel rounds them (one scale per 256 for the
K-quants, per 32 for the 32-weight types), within float32 summation (and x @ W^T within that rounding's
bound)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tokenmill.quant.gguf_method import BLOCK_TYPES, BLOCKS, GGUFMatrix, dequantize, row_bytes

# byte offsets of each type's float16 fields within a block (the rest: any bits are a valid block)
HALVES = {"Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q3_K": (108,)}


def random_blocks(type_name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """[rows, row bytes] of random blocks: random bits, the float16 scales finite (negative ones and
    zeros among them)."""
    rng = np.random.default_rng(seed)
    _, weights, size = BLOCKS[type_name]
    blocks = rng.integers(0, 256, size=(rows, cols // weights, size), dtype=np.uint8)
    for offset in HALVES.get(type_name, (0,)):
        halves = (rng.standard_normal((rows, cols // weights)) * 0.02).astype(np.float16)
        halves[rng.random(halves.shape) < 0.02] = 0
        blocks[:, :, offset : offset + 2] = halves.view(np.uint8).reshape(rows, cols // weights, 2)
    return blocks.reshape(rows, -1)


def reference(raw: np.ndarray, type_name: str, cols: int) -> np.ndarray:
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).reshape(raw.shape[0], cols)


def x_run(type_name: str) -> int:
    """The run of x values the kernel rounds with one scale for `type_name`: a block of weights."""
    return BLOCKS[type_name][1]


def rounded_x(x: np.ndarray, run: int) -> np.ndarray:
    """x [M, K] float32 as the kernel rounds it: int8 in runs of `run`, one float32 scale a run (float64)."""
    runs = x.reshape(x.shape[0], -1, run)
    amax = np.abs(runs).max(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(runs * inv)
    return (q.astype(np.float64) * (amax / np.float32(127)).astype(np.float64)).reshape(x.shape)


def shapes(type_name: str) -> list[tuple[int, int]]:
    weights = BLOCKS[type_name][1]
    return [(37, weights * 3), (5, 2 * 2048)] if weights == 256 else [(37, 96), (9, 576)]


@pytest.mark.parametrize("type_name", BLOCK_TYPES)
def test_dequantized_rows_equal_the_gguf_package_bit_for_bit(ops, type_name):
    for i, (n, k) in enumerate(shapes(type_name)):
        raw = random_blocks(type_name, n, k, seed=i)
        ref = reference(raw, type_name, k)
        m = GGUFMatrix(type_name, torch.from_numpy(raw), k)
        assert raw.shape[1] == row_bytes(type_name, k)
        ours = dequantize(m, ops, torch.float32).numpy()
        assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32))  # signed zeros included
        ids = torch.tensor([n - 1, 0, 3, 3], dtype=torch.int64)
        picked = dequantize(m, ops, torch.bfloat16, ids=ids)
        assert torch.equal(picked.view(torch.int16), torch.from_numpy(ref[ids.numpy()]).bfloat16().view(torch.int16))
        part = dequantize(m, ops, torch.float32, rows=(2, 5)).numpy()
        assert np.array_equal(part, ref[2:5])
        fallback = dequantize(m, None, torch.float32, ids=ids).numpy()  # the gguf package's own path
        assert np.array_equal(fallback, ref[ids.numpy()])


@pytest.mark.parametrize("type_name", BLOCK_TYPES)
@pytest.mark.parametrize("rows", [1, 3, 8, 11])
def test_the_decode_product_is_the_int8_rounded_x_times_the_weights(ops, type_name, rows):
    for i, (n, k) in enumerate(shapes(type_name)):
        raw = random_blocks(type_name, n, k, seed=10 + i)
        w = reference(raw, type_name, k).astype(np.float64)
        rng = np.random.default_rng(rows + i)
        x = (rng.standard_normal((rows, k)) * rng.uniform(0.1, 3, size=(rows, 1))).astype(np.float32)
        x[:, 5] = 40.0  # an outlier in one run
        if rows > 2:
            x[2, :] = 0.0  # a row of zeros
        out = torch.empty(rows, n)
        ops.gguf_linear(out, torch.from_numpy(x), torch.from_numpy(raw), BLOCKS[type_name][0])
        xr = rounded_x(x, x_run(type_name))
        expected = xr @ w.T
        # float32 sums of products: within a few ulps of the sum of magnitudes
        slack = 1e-5 * (np.abs(xr) @ np.abs(w).T) + 1e-30
        assert np.all(np.abs(out.numpy() - expected) <= slack)
        # and x @ W^T within the int8 rounding of x: |x - x'| summed against |W|
        bound = np.abs(x - xr) @ np.abs(w).T + slack
        assert np.all(np.abs(out.numpy() - x.astype(np.float64) @ w.T) <= bound)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q5_0"])
def test_the_decode_product_in_bfloat16_writes_a_column_slice(ops, type_name):
    n, k = shapes(type_name)[0]
    raw = random_blocks(type_name, n, k, seed=3)
    w = reference(raw, type_name, k).astype(np.float64)
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(0)).bfloat16()
    wide = torch.full((4, n + 10), 7.0, dtype=torch.bfloat16)
    ops.gguf_linear(wide[:, 5 : 5 + n], x, torch.from_numpy(raw), BLOCKS[type_name][0])
    expected = rounded_x(x.float().numpy(), x_run(type_name)) @ w.T
    got = wide[:, 5 : 5 + n].double().numpy()
    assert np.all(np.abs(got - expected) <= 2**-8 * np.abs(expected) + 1e-5 * np.abs(expected).max())
    assert torch.all(wide[:, :5] == 7.0) and torch.all(wide[:, 5 + n :] == 7.0)  # nothing written outside


def test_blocks_that_do_not_hold_the_shape_are_refused(ops):
    raw = torch.zeros(4, 144, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="144 bytes a row do not hold 512 weights"):
        ops.gguf_linear(torch.empty(1, 4), torch.zeros(1, 512), raw, BLOCKS["Q4_K"][0])
    with pytest.raises(ValueError, match="a row of 96 is not a whole number"):
        row_bytes("Q6_K", 96)
