"""2:4 weights (quant/sparse24.py): sparse-24-bitmask storage round-trips and loads as the dense
folder does, broken checkpoints are refused by name, and on a GPU (`gpu`) the projections run on
torch's semi-structured sparse kernels with the dense product's results. Imports nothing of the
server (the device script runs the gpu tests here)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tokenmill.models.config import ModelLoadError
from tokenmill.models.loader import load_model
from tokenmill.quant.sparse24 import compress_2_4, decompress_2_4
from tokenmill.tools.sparsify import prune_2_4, sparsify_folder


def test_sparse_24_bitmask_storage_loads_as_the_dense_folder(tiny_model_dir, tmp_path):
    src = tiny_model_dir("llama")
    dense = sparsify_folder(src, tmp_path / "dense", "magnitude", storage="dense")
    packed = sparsify_folder(src, tmp_path / "packed", "magnitude")
    with safe_open(str(packed / "model.safetensors"), framework="pt") as f:
        w = f.get_tensor("model.layers.0.mlp.down_proj.compressed")
        n, k = f.get_tensor("model.layers.0.mlp.down_proj.shape").flatten().tolist()
        bits = f.get_tensor("model.layers.0.mlp.down_proj.bitmask")
        assert tuple(w.shape) == (n, k // 2) and tuple(bits.shape) == (n, k // 8)
        assert w.numel() * w.element_size() + bits.numel() < 0.55 * n * k * w.element_size()  # half + a bit each
        assert "model.layers.0.mlp.down_proj.weight" not in f.keys()  # noqa: SIM118
    a, b = load_model(dense), load_model(packed)
    assert a.config.sparsity.format == "dense" and b.config.sparsity.format == "sparse-24-bitmask"
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name


def test_compress_and_decompress_round_trip_and_name_what_does_not_fit():
    w = prune_2_4(torch.randn(6, 24), torch.rand(6, 24))
    w[0, :4] = torch.tensor([0.0, 0.0, 0.0, 3.0])  # a group with one nonzero: a zero is kept beside it
    w[1, 4:8] = 0.0
    parts = compress_2_4(w)
    assert parts[".compressed"].shape == (6, 12) and parts[".bitmask"].dtype == torch.uint8
    assert torch.equal(decompress_2_4(parts[".shape"], parts[".compressed"], parts[".bitmask"], "x"), w)
    bits = parts[".bitmask"][0, 0].item()  # entries 0..7 of row 0, the first in the lowest bit
    assert bits & 0b1000 and sum(bits >> i & 1 for i in range(4)) == 2
    with pytest.raises(ValueError, match=r"x.bitmask: expected uint8 \[6, 3\]"):
        decompress_2_4(parts[".shape"], parts[".compressed"], parts[".bitmask"][:, :2], "x")
    with pytest.raises(ValueError, match=r"x\.compressed: 70 values for 72 kept entries"):
        decompress_2_4(parts[".shape"], parts[".compressed"].flatten()[:70], parts[".bitmask"], "x")
    with pytest.raises(ValueError, match="does not follow the 2:4 pattern"):
        compress_2_4(torch.ones(2, 8))


def test_broken_sparse_checkpoints_are_refused_by_name(tiny_model_dir, tmp_path):
    packed = sparsify_folder(tiny_model_dir("llama"), tmp_path / "packed", "magnitude")
    tensors = load_file(str(packed / "model.safetensors"))
    del tensors["model.layers.1.self_attn.o_proj.bitmask"]
    save_file(tensors, str(packed / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"'model.layers.1.self_attn.o_proj.bitmask' missing"):
        load_model(packed)
    config = json.loads((packed / "config.json").read_text())
    config["quantization_config"]["sparsity_config"]["format"] = "marlin-24"
    (packed / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"sparsity_config.format' is 'marlin-24'"):
        load_model(packed)
    with pytest.raises(ValueError, match="quantized already"):
        sparsify_folder(packed, tmp_path / "again", "magnitude")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_2_4_layers_run_on_the_sparse_kernels(tiny_model_dir, tmp_path, caplog):
    packed = sparsify_folder(tiny_model_dir("llama"), tmp_path / "packed", "magnitude")
    with caplog.at_level(logging.INFO, logger="tokenmill"):
        model = load_model(packed, dtype="bfloat16", device="cuda")
    assert "decoder projections on the sparse tensor cores" in caplog.text
    layer = model.layers[0].mlp.down_proj
    assert type(layer.weight).__name__.startswith("SparseSemiStructured")
    x = torch.randn(64, layer.input_size, dtype=torch.bfloat16, device="cuda")
    reference = x.float() @ layer.weight.to_dense().float().T
    torch.testing.assert_close(layer(x).float(), reference, atol=0.05, rtol=0.02)
