"""The native few-row linear kernel against float64 (float32) and torch's GEMM (bfloat16); the CPU
linear method's per-shape plan; tuning through the autotune cache (choices pinned by a seeded cache)."""

from __future__ import annotations

import json
import types

import pytest
import torch
import torch.nn.functional as F

from tokenmill.kernels.autotune import Autotuner
from tokenmill.kernels.cpu_build import load_cpu_kernels
from tokenmill.kernels.defaults import CpuKind
from tokenmill.layers.backends import get_attention_backend
from tokenmill.layers.ops import get_layer_ops
from tokenmill.models.loader import load_model
from tokenmill.quant.cpu_dense import (
    CpuLinearMethod,
    dense_weight_shapes,
    get_dense_linear_method,
    tune_linear,
)
from tokenmill.runner.dtype_choice import probe_logits

KERNELS = load_cpu_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="native CPU kernels did not build here")

TORCH = get_attention_backend("torch")
SHAPES = [
    (1, 64, 32),
    (3, 37, 100),
    (4, 64, 48),
    (5, 5, 33),
    (8, 130, 96),
    (11, 7, 33),
    (13, 16, 64),
    (16, 11, 20),  # AVX-512 float32 outer-product tiles from 16 rows: here no whole tile of 12 weight rows
    (17, 36, 64),  # a panel of 32 with 17 real rows (both vectors), 3 whole tiles
    (20, 13, 33),
    (24, 70, 64),  # AMX (bfloat16, 8-32 rows, K a multiple of 32): two blocks of 32 and 6 rows short of one
    (32, 96, 96),
    (33, 25, 17),  # a second panel with one real row
    (37, 50, 130),
    (64, 24, 40),
]


@pytest.mark.parametrize(("rows", "out_f", "in_f"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_float32_matches_float64(rows, out_f, in_f, bias):
    g = torch.Generator().manual_seed(rows * 1000 + out_f)
    x = torch.randn(rows, 2 * in_f, generator=g)[:, 1 : in_f + 1]  # rows with a stride, not contiguous
    w = torch.randn(out_f, in_f, generator=g)
    b = torch.randn(out_f, generator=g) if bias else None
    out = torch.empty(rows, out_f)
    KERNELS.ops.linear(out, x, w, b)
    expected = x.double() @ w.double().T + (b.double() if bias else 0)
    # float32 sums of in_f products: relative error a few ulp of the row's magnitude
    scale = (x.double().abs() @ w.double().abs().T).max()
    assert (out.double() - expected).abs().max() <= 1e-6 * scale


@pytest.mark.parametrize(("rows", "out_f", "in_f"), SHAPES)
def test_bfloat16_matches_torch(rows, out_f, in_f):
    g = torch.Generator().manual_seed(rows + out_f)
    x = torch.randn(rows, in_f, generator=g).bfloat16()
    w = torch.randn(out_f, in_f, generator=g).bfloat16()
    b = torch.randn(out_f, generator=g).bfloat16()
    out = torch.empty(rows, out_f, dtype=torch.bfloat16)
    KERNELS.ops.linear(out, x, w, b)
    exact = x.double() @ w.double().T + b.double()  # the inputs are exact in float64
    # both sum in float32 and round once: each within one bfloat16 rounding (2^-8 relative) of the exact value
    tol = 2**-8 * exact.abs() + 1e-4 * (x.double().abs() @ w.double().abs().T)
    assert ((out.double() - exact).abs() <= tol).all()
    assert ((F.linear(x, w, b).double() - exact).abs() <= tol).all()


# 5-8 rows on AVX2 (bfloat16: 5-10) take the K-sliced walk (linear_kblock.h: slices of 256 columns,
# blocks of 64 weight rows a thread, prefetch 4 slices ahead): several slices with a tail past the last
# whole vector, a thread's rows in whole and partial blocks, fewer rows than the prefetch distance, one
# short slice; 13 bfloat16 rows: AVX2's outer-product tiles on a panel with 13 real rows.
KBLOCK_SHAPES = [
    (5, 150, 1100),
    (6, 3, 1030),
    (7, 129, 517),
    (8, 300, 2048),
    (8, 2, 20),
    (9, 150, 1100),
    (10, 67, 260),
    (13, 50, 300),
]


@pytest.mark.parametrize(("rows", "out_f", "in_f"), KBLOCK_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_in_k_slices_match_float64(rows, out_f, in_f, dtype):
    g = torch.Generator().manual_seed(rows * 7 + in_f)
    x = torch.randn(rows, in_f + 3, generator=g)[:, 3:].to(dtype)  # rows with a stride
    w = torch.randn(out_f, in_f, generator=g).to(dtype)
    b = torch.randn(out_f, generator=g).to(dtype)
    out = torch.empty(rows, out_f, dtype=dtype)
    KERNELS.ops.linear(out, x, w, b)
    exact = x.double() @ w.double().T + b.double()  # the inputs are exact in float64
    # float32 sums (a few ulp of the products' magnitude), then one rounding to the dtype
    rounding = 2**-8 if dtype == torch.bfloat16 else 0.0
    tol = rounding * exact.abs() + 1e-5 * (x.double().abs() @ w.double().abs().T)
    assert ((out.double() - exact).abs() <= tol).all()


def test_bad_inputs_name_what_is_wrong():
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="weight must be contiguous"):
        KERNELS.ops.linear(torch.empty(2, 4), x, torch.randn(8, 4).T, None)
    with pytest.raises(RuntimeError, match="one dtype"):
        KERNELS.ops.linear(torch.empty(2, 4), x, w.bfloat16(), None)
    with pytest.raises(RuntimeError, match="bias must be"):
        KERNELS.ops.linear(torch.empty(2, 4), x, w, torch.randn(3))


class Counting:
    """Wraps the native linear op, counting its calls."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args):
        self.calls += 1
        return self.fn(*args)


def test_the_plan_routes_rows():
    method = CpuLinearMethod(KERNELS)
    method._linear = counting = Counting(method._linear)
    w = torch.randn(32, 16)
    for rows in (1, 64, 300):  # a shape outside the plan: native at every row count, prompt chunks too
        before = counting.calls
        x = torch.randn(rows, 16)
        torch.testing.assert_close(method.product(x, w), F.linear(x, w))
        assert counting.calls == before + 1
    method.native[(32, 16)] = (False, True, False, False, True)  # 1 row native, 2-3 torch, 4 and more native
    before = counting.calls
    method.product(torch.randn(1, 16), w)
    assert counting.calls == before + 1
    method.product(torch.randn(2, 16), w)
    method.product(torch.randn(1, 16), w[:8], shape=(32, 16))  # a slice follows its whole weight's plan
    assert counting.calls == before + 2
    method.product(torch.randn(3, 16), w)
    method.product(torch.randn(100, 16), w)  # past the table: its last entry
    assert counting.calls == before + 3


def tiny(tiny_model_dir, method, dtype="float32", tied=False):
    folder = tiny_model_dir("llama", tied=tied)
    return load_model(folder, dtype=dtype, backend=TORCH, ops=get_layer_ops("torch"), linear_method=method)


def test_a_model_on_the_native_kernel_matches_torch(tiny_model_dir, hf_logits):
    ids = torch.arange(1, 13)  # 12 rows: every projection (and the head) takes the native kernel
    for tied in (False, True):
        reference = tiny(tiny_model_dir, None, tied=tied)
        native = tiny(tiny_model_dir, get_dense_linear_method("cpu"), tied=tied)
        logits = probe_logits(native, TORCH, ids)
        torch.testing.assert_close(logits, probe_logits(reference, TORCH, ids), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits, hf_logits(tiny_model_dir("llama", tied=tied), ids), rtol=1e-4, atol=1e-4)
        hidden = torch.randn(3, reference.config.hidden_size)
        assert torch.equal(native.greedy_tokens(hidden), reference.compute_logits(hidden).argmax(-1))


def test_tuning_fills_the_plan_and_a_seeded_cache_pins_it(tiny_model_dir, tmp_path):
    path = tmp_path / "autotune.json"
    method = get_dense_linear_method("cpu")
    model = tiny(tiny_model_dir, method, tied=True)
    shapes = dense_weight_shapes(model, model.tied_head())
    assert (model.config.vocab_size, model.config.hidden_size) in shapes  # the tied head is tuned too
    head = (model.config.vocab_size, model.config.hidden_size)
    rows = {shape: 80 for shape in shapes} | {head: 16}  # prompt chunks of 80 rows; the head up to 16
    summary = tune_linear(method, shapes, rows, Autotuner(torch.device("cpu"), path))
    assert set(method.native) == set(shapes)
    assert all(len(t) == rows[shape] + 1 for shape, t in method.native.items())
    assert len(summary) == 5 * len(shapes) - 2  # every class up to 80 rows; the head: 1, 2-8 and 9-24
    assert f"{head[0]}x{head[1]} rows 65-512" not in summary
    # a second tuner on the same machine reads every choice back; one seeded to torch pins torch
    data = json.loads(path.read_text())
    (key,) = data
    for entry in data[key].values():
        entry["choice"] = "torch"
    path.write_text(json.dumps(data))
    pinned = get_dense_linear_method("cpu")
    tuner = Autotuner(torch.device("cpu"), path)
    tuner.choose = types.MethodType(
        lambda self, op, shape, c, repeats=5, default=None: _cached(self, op, shape, c, default), tuner
    )
    tune_linear(pinned, shapes, rows, tuner)
    assert not any(any(t) for t in pinned.native.values())


def test_decode_classes_are_timed_inside_a_step(tiny_model_dir, monkeypatch):
    """A decode class times each shape on both kernels within a pass over every weight of the step, in
    layer order, the other shapes on the kernels chosen so far; prompt chunks are timed shape by shape."""
    method = get_dense_linear_method("cpu")
    model = tiny(tiny_model_dir, method)
    shapes = dense_weight_shapes(model, None)
    order = list(shapes)
    first = order[0]
    depth = max(len(ws) for ws in shapes.values())
    step_order = [(s, i) for i in range(depth) for s in order if i < len(shapes[s])]
    where = {w.data_ptr(): (shape, i) for shape, ws in shapes.items() for i, w in enumerate(ws)}
    calls: list[tuple[str, tuple[int, int], int, int]] = []  # (kernel, shape, layer, rows)

    def record(kernel, fn):
        def run(x, w, bias=None):
            calls.append((kernel, *where[w.data_ptr()], x.shape[0]))
            return fn(x, w, bias)

        return run

    monkeypatch.setattr(method, "native_product", record("cpu", method.native_product))
    monkeypatch.setattr(F, "linear", record("torch", F.linear))
    asked: list[tuple[str, str]] = []

    class Tuner:  # picks torch for the first shape at one row, the native kernel otherwise
        cpu = CpuKind.from_flags("avx2 fma")

        def choose(self, op, what, candidates, repeats=5, default=None):
            asked.append((op, what))
            shape = tuple(int(n) for n in what.split(" ")[0].split("x"))
            one_row = " rows 1-1 " in what
            if op == "linear_step":
                calls.clear()
                candidates["torch"]()
                rows = calls[0][3]
                assert [(s, i) for _, s, i, m in calls if m == rows] == step_order
                chosen = {
                    s: "torch" if s == shape or (one_row and s == first and shape != first) else "cpu" for s in order
                }
                assert {s: k for k, s, _, _ in calls} == chosen
            return types.SimpleNamespace(name="torch" if one_row and shape == first else "cpu")

    tune_linear(method, shapes, {shape: 80 for shape in shapes}, Tuner())
    assert [op for op, _ in asked] == ["linear_step"] * 4 * len(shapes) + ["linear"] * len(shapes)
    assert all(" rows 65-512 " in what for op, what in asked if op == "linear")
    assert not method.native[first][1] and all(method.native[s][1] for s in order[1:])
    assert all(all(method.native[s][2:65]) for s in order)


def _cached(tuner, op, shape, candidates, default):
    choice = Autotuner.choose(tuner, op, shape, candidates, default=default)
    assert choice.cached, f"{op} {shape} was measured again"
    return choice


def test_the_autotuner_measures_once_and_reads_back(tmp_path, caplog):
    path = tmp_path / "cache" / "autotune.json"
    calls = {"fast": 0, "slow": 0}

    def fast():
        calls["fast"] += 1

    def slow():
        calls["slow"] += 1
        torch.randn(200, 200) @ torch.randn(200, 200)

    first = Autotuner(torch.device("cpu"), path).choose("op", "shape", {"slow": slow, "fast": fast}, repeats=3)
    assert first.name == "fast" and not first.cached and calls == {"fast": 4, "slow": 4}
    again = Autotuner(torch.device("cpu"), path).choose("op", "shape", {"slow": slow, "fast": fast})
    assert again.name == "fast" and again.cached and calls["fast"] == 4
    assert again.timings_ms.keys() == {"fast", "slow"}
    # a cached choice that is no longer a candidate is measured again
    other = Autotuner(torch.device("cpu"), path).choose("op", "shape", {"slow": slow}, repeats=1)
    assert other.name == "slow" and not other.cached
    # and so is one made without a candidate there is now (a kernel added, or AMX granted since)
    more = Autotuner(torch.device("cpu"), path).choose("op", "shape", {"slow": slow, "fast": fast}, repeats=1)
    assert more.name == "fast" and not more.cached
    path.write_text("{not json")
    assert not Autotuner(torch.device("cpu"), path).choose("op", "shape", {"fast": fast}, repeats=1).cached
    assert "unreadable" in caplog.text
