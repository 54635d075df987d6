"""The linear-layer seam: the unquantized method is F.linear, fused layers' shard loaders place each
checkpoint tensor once in its rows, and a custom LinearMethod carries through construction, loading
and the forward of a whole model."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn
from torch.overrides import TorchFunctionMode

from tests.helpers import PagedRunner, assert_logits_close
from tokenmill.layers.linear import Linear, LinearBase, MergedLinear, weight_loader_of
from tokenmill.models import loader
from tokenmill.models.llama import STACKED_PROJECTIONS, WeightTarget
from tokenmill.models.loader import load_model, load_weights
from tokenmill.quant.method import (
    LinearMethod,
    ShardId,
    ShardLoader,
    UnquantizedLinearMethod,
    WeightLoadError,
    WeightShapeError,
    register_bias,
    set_weight_loader,
)

# Torch calls that make a new copy of a tensor's data; a load must call none of them besides copy_.
COPYING = {"clone", "contiguous", "to", "cat", "stack", "float", "half", "bfloat16", "type", "__mul__", "mul"}


@contextmanager
def record_torch_calls() -> Iterator[Counter[str]]:
    """Counts every torch function and Tensor method called inside the block, by name."""
    calls: Counter[str] = Counter()

    class Recorder(TorchFunctionMode):
        def __torch_function__(
            self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
        ) -> Any:
            calls[getattr(func, "__name__", str(func))] += 1
            return func(*args, **(kwargs or {}))

    with Recorder():
        yield calls


def load(layer: LinearBase, name: str, tensor: torch.Tensor, shard_id: ShardId) -> None:
    param = getattr(layer, name)
    with torch.no_grad():
        weight_loader_of(param)(param, tensor, shard_id)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unquantized_is_f_linear(bias, dtype):
    gen = torch.Generator().manual_seed(0)
    layer = Linear(48, 40, bias=bias, dtype=dtype)
    assert isinstance(layer.linear_method, UnquantizedLinearMethod)
    assert layer.weight.shape == (40, 48) and layer.weight.dtype == dtype
    w = torch.randn(40, 48, generator=gen)
    b = torch.randn(40, generator=gen)
    load(layer, "weight", w, None)
    if bias:
        load(layer, "bias", b, None)
    else:
        assert layer.bias is None
    for shape in [(1, 48), (7, 48), (3, 5, 48)]:
        x = torch.randn(shape, generator=gen).to(dtype)
        expected = F.linear(x, w.to(dtype), b.to(dtype) if bias else None)
        assert torch.equal(layer(x), expected)


def test_merged_shards_land_in_their_rows_copied_once():
    """q/k/v (and their biases) go to their rows, converted to the layer's dtype in the one copy_."""
    gen = torch.Generator().manual_seed(1)
    layer = MergedLinear(16, {"q": 12, "k": 4, "v": 4}, bias=True, dtype=torch.bfloat16)
    assert {sid: (s.start, s.size) for sid, s in layer.shards.items()} == {"q": (0, 12), "k": (12, 4), "v": (16, 4)}
    ptrs = (layer.weight.data_ptr(), layer.bias.data_ptr())
    parts = {
        sid: (torch.randn(rows, 16, generator=gen), torch.randn(rows, generator=gen))
        for sid, rows in (("q", 12), ("k", 4), ("v", 4))
    }
    for sid in ("v", "q", "k"):  # any order
        for name, tensor in zip(("weight", "bias"), parts[sid], strict=True):
            with record_torch_calls() as calls:
                load(layer, name, tensor, sid)
            assert calls["copy_"] == 1, calls
            assert not COPYING & set(calls), calls
    assert (layer.weight.data_ptr(), layer.bias.data_ptr()) == ptrs
    assert torch.equal(layer.weight, torch.cat([parts[s][0] for s in "qkv"]).bfloat16())
    assert torch.equal(layer.bias, torch.cat([parts[s][1] for s in "qkv"]).bfloat16())


def test_gate_up_rows_and_forward():
    gen = torch.Generator().manual_seed(2)
    layer = MergedLinear(8, {"gate": 6, "up": 6})
    gate, up = torch.randn(6, 8, generator=gen), torch.randn(6, 8, generator=gen)
    load(layer, "weight", up, "up")
    load(layer, "weight", gate, "gate")
    x = torch.randn(3, 8, generator=gen)
    assert torch.equal(layer(x), F.linear(x, torch.cat([gate, up])))


def test_shard_loader_refuses_what_does_not_fit():
    layer = MergedLinear(16, {"q": 12, "k": 4, "v": 4}, bias=True)
    layer.weight.data.zero_()
    with pytest.raises(WeightShapeError, match=r"shape \[8, 16\] does not fit shard 'k', of shape \[4, 16\]") as err:
        load(layer, "weight", torch.ones(8, 16), "k")
    assert (err.value.got, err.value.expected) == ((8, 16), (4, 16))
    assert not layer.weight.any(), "a refused tensor is never copied"
    with pytest.raises(WeightShapeError, match=r"shard 'q', of shape \[12\]"):
        load(layer, "bias", torch.ones(12, 1), "q")
    with pytest.raises(WeightLoadError, match=r"no shard 'o' in this layer \(its shards: 'q', 'k', 'v'\)"):
        load(layer, "weight", torch.ones(4, 16), "o")
    with pytest.raises(WeightLoadError, match=r"no shard None"):
        load(layer, "weight", torch.ones(20, 16), None)
    plain = Linear(16, 4)
    with pytest.raises(WeightLoadError, match=r"no shard 'q' in this layer \(its shards: None\)"):
        load(plain, "weight", torch.ones(4, 16), "q")
    with pytest.raises(WeightShapeError, match=r"does not fit the parameter, of shape \[4, 16\]"):
        load(plain, "weight", torch.ones(16, 4), None)


def test_checkpoint_map_covers_the_checkpoint(tiny_model_dir):
    """Each Hugging Face tensor name maps to its tokenmill parameter and shard id, and the map holds
    exactly the checkpoint's tensors; fused layers' shard ids are the ones the map sends."""
    folder = tiny_model_dir("qwen3")
    model = load_model(folder, dtype="float32")
    targets = model.checkpoint_map()
    assert targets["model.layers.1.self_attn.k_proj.weight"] == WeightTarget("layers.1.self_attn.qkv_proj.weight", "k")
    assert targets["model.layers.2.mlp.up_proj.weight"] == WeightTarget("layers.2.mlp.gate_up_proj.weight", "up")
    assert targets["model.layers.0.self_attn.o_proj.weight"] == WeightTarget("layers.0.self_attn.o_proj.weight", None)
    assert targets["model.layers.0.self_attn.q_norm.weight"] == WeightTarget("layers.0.self_attn.q_norm.weight", None)
    assert targets["lm_head.weight"] == WeightTarget("lm_head.weight", None)
    names: set[str] = set()
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            names.update(f.keys())
    assert set(targets) == names
    for name, module in model.named_modules():
        if isinstance(module, MergedLinear):
            assert list(module.shards) == [sid for _, sid in STACKED_PROJECTIONS[name.rpartition(".")[2]]]


class TransposedScaled(LinearMethod):
    """A test double for a quantized method: keeps W^T (named `weight`, as the checkpoint's suffix),
    scaled by 4 after loading, and undoes both in apply. Counts its after-loading calls per layer."""

    def __init__(self) -> None:
        self.processed: Counter[int] = Counter()
        self.applied = 0

    def create_weights(
        self, layer: LinearBase, input_size: int, output_sizes: list[int], bias: bool, dtype: torch.dtype
    ) -> None:
        weight_t = nn.Parameter(torch.empty(input_size, sum(output_sizes), dtype=dtype), requires_grad=False)
        columns = ShardLoader(layer.shards, dim=1)

        def load_transposed(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId) -> None:
            columns(param, loaded.t(), shard_id)  # a view: still one copy

        layer.register_parameter("weight", set_weight_loader(weight_t, load_transposed))
        if bias:
            register_bias(layer, dtype)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        self.processed[id(layer)] += 1
        layer.weight.mul_(4)

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        self.applied += 1
        return F.linear(x, (layer.weight * 0.25).t(), bias)


@pytest.mark.parametrize(("arch", "tied"), [("qwen2", False), ("llama", True)], ids=["qwen2-untied", "llama-tied"])
def test_custom_method_runs_the_whole_model(tiny_model_dir, arch, tied):
    folder = tiny_model_dir(arch, tied)
    method = TransposedScaled()
    custom = load_model(folder, dtype="float32", linear_method=method)
    default = load_model(folder, dtype="float32")
    cfg = custom.config
    linears = [m for m in custom.modules() if isinstance(m, LinearBase)]
    # qkv, o, gate_up, down, lm_head: a tied head under a non-dense method is a layer of its own,
    # filled from the embedding table through its own weight loader
    assert len(linears) == 4 * cfg.num_layers + 1
    assert all(m.linear_method is method for m in linears)
    assert method.processed == Counter({id(m): 1 for m in linears})
    qkv = custom.layers[0].self_attn.qkv_proj
    assert qkv.weight.shape == (cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size)
    assert torch.equal(qkv.weight.t() * 0.25, default.layers[0].self_attn.qkv_proj.weight)
    ids = torch.randint(0, cfg.vocab_size, (29,), generator=torch.Generator().manual_seed(3))
    ours = PagedRunner(custom, 4, 16, [0, 1, 2, 3]).step({0: ids})[0]
    ref = PagedRunner(default, 4, 16, [0, 1, 2, 3]).step({0: ids})[0]
    assert method.applied == len(linears)  # one forward: every layer went through the method
    assert ours.dtype == torch.float32
    assert_logits_close(ours, ref, rel=1e-5)


@pytest.mark.parametrize(("arch", "tied"), [("qwen3", False), ("qwen2", True)], ids=["qwen3-sharded", "qwen2-tied"])
def test_load_model_copies_each_tensor_once(tiny_model_dir, monkeypatch, arch, tied):
    """While the weights load, every checkpoint tensor is copied exactly once, straight into its
    parameter (converted in that copy), and nothing else copies data."""
    folder = tiny_model_dir(arch, tied)
    tensors = 0
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            tensors += len(list(f.keys()))
    recorded: list[Counter[str]] = []

    def recording_load_weights(model: nn.Module, folder: Path) -> None:
        with record_torch_calls() as calls:
            load_weights(model, folder)
        recorded.append(calls)

    monkeypatch.setattr(loader, "load_weights", recording_load_weights)
    model = load_model(folder, dtype="bfloat16")
    [calls] = recorded
    assert calls["copy_"] == tensors
    assert not COPYING & set(calls), calls
    assert tied or isinstance(model.lm_head, Linear)
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in model.parameters())
