"""compressed-tensors pack-quantized checkpoints loaded as stored (quant/compressed.py).

The checkpoints are written by the `compressed-tensors` library itself (its quantization parameters,
its compressor), not by tokenmill's code; the reference is the library's own decompression written
as a dense folder, and transformers, which loads these folders on a CPU through the same library."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import PagedRunner, assert_logits_close, write_quantized_copies
from tokenmill.layers.linear import LinearBase
from tokenmill.models.config import ModelLoadError
from tokenmill.models.loader import load_model
from tokenmill.quant.quantize import Int4Weight, Int8Weight

IDS = torch.randint(0, 4096, (29,), generator=torch.Generator().manual_seed(4))
SCHEMES = {  # name -> (bits, symmetric, strategy, group size)
    "int4-asym-g32": (4, False, "group", 32),
    "int4-sym-g32": (4, True, "group", 32),
    "int8-channel": (8, True, "channel", None),
}


def write_compressed(source: Path, out: Path, scheme_name: str) -> tuple[Path, Path]:
    """(compressed folder, the library's decompression as a dense folder) of the model in `source`."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    bits, symmetric, strategy, group = SCHEMES[scheme_name]
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy, group_size=group)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)

    def pack(prefix: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        rows = w.float().reshape(w.shape[0], -1, group or w.shape[1])
        scale, zero = calculate_qparams(rows.amin(-1), rows.amax(-1), args)
        state = {"weight": w.float(), "weight_scale": scale, "weight_zero_point": zero}
        compressed = PackedQuantizationCompressor.compress(state, scheme)
        return compressed, PackedQuantizationCompressor.decompress(dict(compressed), scheme)["weight"]

    quant = QuantizationConfig(
        config_groups={"group_0": scheme}, format="pack-quantized", quantization_status="compressed", ignore=["lm_head"]
    )
    ref = out.with_name(out.name + "-dense")
    write_quantized_copies(source, out, ref, pack, quant.model_dump(exclude_none=True))
    return out, ref


def logits(model) -> torch.Tensor:
    return PagedRunner(model, num_blocks=8, block_size=16, block_order=[1, 3, 5, 7, 0, 2, 4, 6]).step({0: IDS})[0]


@pytest.mark.parametrize("scheme_name", sorted(SCHEMES))
def test_a_compressed_checkpoint_computes_what_the_library_decompresses(tiny_model_dir, tmp_path, scheme_name):
    folder, ref = write_compressed(tiny_model_dir("qwen2"), tmp_path / scheme_name, scheme_name)
    model = load_model(folder, dtype="float32")
    expected = Int4Weight if SCHEMES[scheme_name][0] == 4 else Int8Weight
    layers = [m for n, m in model.named_modules() if isinstance(m, LinearBase) and n != "lm_head"]
    assert layers and all(isinstance(m.quantized, expected) for m in layers)
    assert not any("weight_packed" in n for n, _ in model.named_parameters())
    assert_logits_close(logits(model), logits(load_model(ref, dtype="float32")), rel=1e-5)


@pytest.mark.parametrize("scheme_name", ["int4-sym-g32", "int8-channel"])
def test_transformers_loads_the_same_folder(tiny_model_dir, tmp_path, scheme_name):
    """(Symmetric schemes, llm-compressor's W4A16 / W8A16: transformers 5.24 expects asymmetric zero points
    unpacked, [N, K / g], where compressed-tensors 0.20.1 writes them packed, and refuses such folders.)"""
    from transformers import AutoModelForCausalLM

    folder, _ = write_compressed(tiny_model_dir("llama"), tmp_path / scheme_name, scheme_name)
    theirs = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():
        ref = theirs.eval()(IDS[None]).logits[0]
    assert_logits_close(logits(load_model(folder, dtype="float32")), ref, rel=1e-4)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"format": "int-quantized"}, r"quantization_config\.format' is 'int-quantized'"),
        ({"weights": {"num_bits": 3}}, r"config_groups\.group_0\.weights' are 3-bit int"),
        ({"weights": {"group_size": 48}}, r"weights\.group_size' is 48"),
        ({"input_activations": {"num_bits": 8}}, r"input_activations' is set: quantized activations are not supported"),
    ],
)
def test_an_unsupported_compressed_config_names_the_field(tiny_model_dir, tmp_path, change, message):
    folder, _ = write_compressed(tiny_model_dir("llama"), tmp_path / "int4", "int4-asym-g32")
    cfg = json.loads((folder / "config.json").read_text())
    qc = cfg["quantization_config"]
    group = qc["config_groups"]["group_0"]
    if "format" in change:
        qc["format"] = change["format"]
    elif "weights" in change:
        group["weights"] |= change["weights"]
    else:
        group |= change
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=message):
        load_model(folder)


# ----------------------------------------------------------------------------- tokenmill quantize


def test_quantize_int8_writes_the_in_memory_int8_model(tiny_model_dir, tmp_path, capsys):
    """`tokenmill quantize --quantization int8`: the folder loads (as stored) into the very weights
    `--quantization int8` makes at load, and transformers loads it to the same logits."""
    from transformers import AutoModelForCausalLM

    from tokenmill.cli import main
    from tokenmill.quant.int_methods import Int8LinearMethod
    from tokenmill.quant.method import UnquantizedLinearMethod
    from tokenmill.quant.quantize import QuantSpec

    folder = tiny_model_dir("llama")
    out = tmp_path / "int8"
    assert main(["quantize", str(folder), "--quantization", "int8", "--out", str(out)]) == 0
    written = load_model(out, dtype="float32")
    # (the output projection stays dense in the written folder, as compressed-tensors' `ignore: [lm_head]`)
    method = Int8LinearMethod(QuantSpec("int8"), None)
    in_memory = load_model(folder, dtype="float32", linear_method=method, head_method=UnquantizedLinearMethod())
    for (name, a), (_, b) in zip(written.named_modules(), in_memory.named_modules(), strict=True):
        if isinstance(a, LinearBase) and name != "lm_head":
            assert torch.equal(a.quantized.q, b.quantized.q) and torch.equal(a.quantized.scales, b.quantized.scales)
    ours = logits(written)
    assert_logits_close(ours, logits(in_memory), rel=1e-6)
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()(IDS[None]).logits[0]
    assert_logits_close(ours, ref, rel=1e-4)
    assert (out / "tokenizer.json").is_file()
    assert main(["quantize", str(folder), "--quantization", "int8", "--out", str(out)]) == 2
    assert "tokenmill quantize: error: out: " in capsys.readouterr().err


def test_quantize_int4_writes_symmetric_groups(tiny_model_dir, tmp_path, capsys):
    """int4: symmetric groups of 32 (scale max |w| / 7), the scheme transformers loads without zero points."""
    from tokenmill.cli import main

    folder = tiny_model_dir("qwen2")
    out = tmp_path / "int4"
    assert main(["quantize", str(folder), "--quantization", "int4", "--out", str(out)]) == 0
    written = load_model(out, dtype="float32")
    dense = load_model(folder, dtype="float32")
    for name, layer in dense.named_modules():  # the reference: each group rounded here
        if isinstance(layer, LinearBase) and name != "lm_head":
            w = layer.weight.data.reshape(layer.output_size, -1, 32)
            scale = w.abs().amax(-1, keepdim=True) / 7
            layer.weight.data.copy_((torch.round(w / scale).clamp(-7, 7) * scale).reshape(layer.weight.shape))
    assert all(
        isinstance(m.quantized, Int4Weight)
        for n, m in written.named_modules()
        if isinstance(m, LinearBase) and n != "lm_head"
    )
    assert_logits_close(logits(written), logits(dense), rel=1e-5)
    assert (
        main(["quantize", str(folder), "--quantization", "int4", "--group-size", "64", "--out", str(tmp_path / "g")])
        == 2
    )
    assert "group_size: 64 does not divide the input width 352" in capsys.readouterr().err
    assert not (tmp_path / "g").exists()
