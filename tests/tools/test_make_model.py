"""`tokenmill make-model`: complete, deterministic Hugging Face folders covering each family's features."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tokenmill.cli import main
from tokenmill.models.config import load_config
from tokenmill.tools.make_model import build_config, make_model


def tensors_of(folder) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        out.update(load_file(path))
    return out


def test_folder_is_complete_and_loads_with_transformers(tiny_model_dir):
    import transformers

    folder = tiny_model_dir("llama", True)
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= names
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    assert "{{ bos_token }}" in tok_cfg["chat_template"]
    gen = json.loads((folder / "generation_config.json").read_text())
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    assert gen["eos_token_id"] == [tok.convert_tokens_to_ids("</s>"), tok.convert_tokens_to_ids("<|im_end|>")]
    text = "def naïve(x): return '€ → 日本' * x"
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<s><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_deterministic_for_a_seed(tmp_path):
    a = make_model("qwen3", "tiny", tmp_path / "a", seed=3)
    b = make_model("qwen3", "tiny", tmp_path / "b", seed=3)
    c = make_model("qwen3", "tiny", tmp_path / "c", seed=4)
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    ta, tb, tc = tensors_of(a), tensors_of(b), tensors_of(c)
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    assert not torch.equal(ta["model.layers.0.mlp.up_proj.weight"], tc["model.layers.0.mlp.up_proj.weight"])
    assert (a / "tokenizer.json").read_bytes() != (c / "tokenizer.json").read_bytes()


def test_tiny_configs_cover_each_familys_features(tiny_model_dir):
    llama = load_config(tiny_model_dir("llama"))
    assert llama.rope.rope_type == "llama3" and llama.num_kv_heads < llama.num_heads
    mistral = load_config(tiny_model_dir("mistral"))
    assert mistral.num_kv_heads == 1 and mistral.sliding_windows == (24, 24, 24)
    qwen2 = load_config(tiny_model_dir("qwen2"))
    assert qwen2.qkv_bias and not qwen2.o_bias and qwen2.rope.rope_type == "yarn"
    assert "model.layers.0.self_attn.q_proj.bias" in tensors_of(tiny_model_dir("qwen2"))
    qwen3 = load_config(tiny_model_dir("qwen3"))
    assert qwen3.qk_norm and qwen3.head_dim * qwen3.num_heads != qwen3.hidden_size
    assert "model.layers.0.self_attn.k_norm.weight" in tensors_of(tiny_model_dir("qwen3"))
    # tied checkpoints carry no lm_head; the sharded one has an index naming several files
    assert "lm_head.weight" not in tensors_of(tiny_model_dir("qwen3", True))
    assert "lm_head.weight" in tensors_of(tiny_model_dir("qwen3", False))
    index = json.loads((tiny_model_dir("llama") / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_small_is_the_peer_model(arch):
    """vocab 32,000, hidden 512, intermediate 1376, 8 layers, 8 q / 2 kv heads: 54.9M untied."""
    import transformers

    cfg = build_config(arch, "small", tie_embeddings=False, bos=0, eos=1, pad=2)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    params = sum(p.numel() for p in model.parameters())
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (32000, 512, 1376)
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (8, 8, 2)
    biases = 8 * (512 + 2 * 128) if arch == "qwen2" else 0
    norms = 8 * 2 * 64 if arch == "qwen3" else 0
    assert params == 54_927_872 + biases + norms


def test_cli(tmp_path, capsys):
    assert main(["make-model", "--arch", "mistral", "--size", "tiny", "--out", str(tmp_path / "m"), "--seed", "2"]) == 0
    assert "mistral: vocab 4096" in capsys.readouterr().out
    assert load_config(tmp_path / "m").architecture == "MistralForCausalLM"
    with pytest.raises(SystemExit) as exit_info:
        main(["make-model", "--arch", "gpt2", "--out", str(tmp_path / "x")])
    assert exit_info.value.code == 2
    assert "invalid choice: 'gpt2'" in capsys.readouterr().err
