"""Every bad model folder gives a ModelLoadError naming the file and the field or tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tokenmill.models.config import ModelLoadError, load_config
from tokenmill.models.loader import load_model


@pytest.fixture
def folder(tiny_model_dir, tmp_path) -> Path:
    """A private copy of the tiny untied qwen2 checkpoint (single safetensors file) to break."""
    dst = tmp_path / "model"
    shutil.copytree(tiny_model_dir("qwen2"), dst)
    return dst


def edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    for key, value in changes.items():
        if value is ...:
            cfg.pop(key)
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg))


def edit_weights(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_missing_folder(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_missing_config(folder):
    (folder / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"config\.json is missing"):
        load_model(folder)


def test_malformed_json(folder):
    (folder / "config.json").write_text('{"architectures": [')
    with pytest.raises(ModelLoadError, match=r"config\.json: malformed JSON"):
        load_model(folder)


def test_config_not_an_object(folder):
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelLoadError, match="expected a JSON object"):
        load_model(folder)


def test_unsupported_architecture(folder):
    edit_config(folder, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelLoadError, match=r"config\.json: field 'architectures' is \['GPT2LMHeadModel'\]"):
        load_model(folder)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("hidden_size", ..., "field 'hidden_size' is missing"),
        ("hidden_size", "128", "field 'hidden_size' must be int"),
        ("num_hidden_layers", 0, "field 'num_hidden_layers' must be a positive integer"),
        ("num_key_value_heads", 3, r"field 'num_key_value_heads' \(3\) must divide"),
        ("hidden_act", "gelu", "field 'hidden_act' is 'gelu'"),
        ("tie_word_embeddings", "yes", "field 'tie_word_embeddings' must be bool"),
        ("eos_token_id", "x", "field 'eos_token_id' must be int or list"),
        ("rms_norm_eps", -1.0, "field 'rms_norm_eps' must be positive"),
        ("head_dim", 7, "field 'head_dim' must be a positive even integer"),
    ],
)
def test_malformed_field(folder, field, value, message):
    edit_config(folder, **{field: value})
    with pytest.raises(ModelLoadError, match=message) as err:
        load_model(folder)
    assert str(folder / "config.json") in str(err.value)


def test_unsupported_rope_type_is_named(folder):
    edit_config(folder, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    with pytest.raises(ModelLoadError, match=r"field 'rope_parameters.rope_type' is 'dynamic'"):
        load_model(folder)


def test_transformers4_rope_layout(folder):
    """Real checkpoints saved by transformers 4 put rope_theta and rope_scaling at the top level."""
    edit_config(folder, rope_parameters=..., rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2})
    cfg = load_config(folder)
    assert (cfg.rope.rope_type, cfg.rope.theta, cfg.rope.factor) == ("linear", 5e5, 2.0)
    edit_config(folder, rope_scaling={"rope_type": "longrope", "factor": 2})
    with pytest.raises(ModelLoadError, match=r"field 'rope_scaling.rope_type' is 'longrope'"):
        load_model(folder)


def test_sliding_window_fields(folder):
    edit_config(folder, layer_types=["full_attention", "sliding_attention", "full_attention"], sliding_window=None)
    with pytest.raises(ModelLoadError, match=r"field 'layer_types\[1\]' is 'sliding_attention' but"):
        load_model(folder)
    # transformers 4 Qwen layout: a window that only applies when use_sliding_window is true
    edit_config(folder, layer_types=..., sliding_window=32, use_sliding_window=False, max_window_layers=1)
    assert load_config(folder).sliding_windows == (None, None, None)
    edit_config(folder, use_sliding_window=True)
    assert load_config(folder).sliding_windows == (None, 32, 32)


def test_no_weights(folder):
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no model\.safetensors"):
        load_model(folder)


def test_pickle_checkpoint_is_refused(folder):
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ModelLoadError, match=r"pickle checkpoints \(pytorch_model\.bin\).*never unpickles"):
        load_model(folder)


def test_shape_mismatch(folder):
    edit_weights(folder, lambda t: t.update({"model.layers.1.self_attn.k_proj.weight": torch.zeros(32, 128)}))
    with pytest.raises(
        ModelLoadError, match=r"model\.safetensors: tensor 'model\.layers\.1\.self_attn\.k_proj\.weight' has shape"
    ):
        load_model(folder)


def test_missing_tensor(folder):
    edit_weights(folder, lambda t: t.pop("model.layers.2.mlp.up_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"tensor 'model\.layers\.2\.mlp\.up_proj\.weight' missing"):
        load_model(folder)


def test_unexpected_tensor(folder):
    edit_weights(folder, lambda t: t.update({"model.layers.0.self_attn.q_norm.weight": torch.ones(32)}))
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: unexpected tensor 'model\.layers\.0\.self_attn"):
        load_model(folder)


def test_corrupt_safetensors(folder):
    (folder / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: not a readable safetensors file"):
        load_model(folder)


def test_shard_listed_in_index_but_missing(tiny_model_dir, tmp_path):
    dst = tmp_path / "sharded"
    shutil.copytree(tiny_model_dir("llama"), dst)  # llama untied is sharded
    shard = sorted(dst.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=rf"{shard.name}: listed in model\.safetensors\.index\.json but missing"):
        load_model(dst)


def test_bad_dtype_names_the_field(folder):
    with pytest.raises(ValueError, match="dtype: expected one of float32, bfloat16, float16 or 'auto'"):
        load_model(folder, dtype="float8")


def test_fused_parameters_hold_the_checkpoint_tensors(folder):
    """q/k/v and gate/up land in their rows of the fused parameters, converted once to the dtype."""
    model = load_model(folder, dtype="bfloat16")
    tensors = load_file(folder / "model.safetensors")
    qkv = model.layers[1].self_attn.qkv_proj
    expected = torch.cat([tensors[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"]).bfloat16()
    assert torch.equal(qkv.weight, expected)
    bias = torch.cat([tensors[f"model.layers.1.self_attn.{p}_proj.bias"] for p in "qkv"]).bfloat16()
    assert torch.equal(qkv.bias, bias)
    gate_up = torch.cat([tensors[f"model.layers.1.mlp.{p}_proj.weight"] for p in ("gate", "up")]).bfloat16()
    assert torch.equal(model.layers[1].mlp.gate_up_proj.weight, gate_up)
    assert all(not p.requires_grad for p in model.parameters())
