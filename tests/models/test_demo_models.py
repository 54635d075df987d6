"""The bundled demo pair (models/tokenmill-demo, models/tokenmill-demo-draft): committed Hugging Face
folders that load in transformers and in tokenmill with equal logits, sized as promised, the
default of `serve` and `generate`, and the target writes what its model card says."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import safe_open

from tests.helpers import PagedRunner, assert_logits_close
from tokenmill import LLM, SamplingParams
from tokenmill.cli import build_parser, engine_config, main
from tokenmill.engine_args import DEMO_MODEL
from tokenmill.models.loader import load_model
from tokenmill.text.tokenizer import Tokenizer

TARGET, DRAFT = DEMO_MODEL, DEMO_MODEL.parent / "tokenmill-demo-draft"
PYTHON = re.compile(r"\b(return|if|for|while|else|def|in|is|not|None|self)\b|[=(:]")


@pytest.mark.parametrize(("folder", "low", "high"), [(TARGET, 5e6, 10e6), (DRAFT, 0.5e6, 1.5e6)])
def test_folders_are_small_bfloat16_safetensors_of_the_promised_size(folder, low, high):
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == 8192
    params = 0
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            t = f.get_tensor(name)
            assert t.dtype == torch.bfloat16, name
            params += t.numel()
    assert low <= params <= high
    assert (folder / "README.md").is_file() and (folder / "training_log.json").is_file()
    total = sum(p.stat().st_size for d in (TARGET, DRAFT) for p in d.iterdir())
    assert total <= 60 * 2**20
    assert not list(folder.glob("*.bin")) and not list(folder.glob("*.py"))  # no pickle, no code


@pytest.mark.parametrize("folder", [TARGET, DRAFT], ids=["target", "draft"])
def test_loads_in_transformers_and_tokenmill_with_equal_logits(folder):
    import transformers

    tok = Tokenizer(folder)
    ids = torch.tensor(tok.encode("import os\n\n\ndef main(argv):\n    for name in argv:\n        print(name)\n"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(ids[None]).logits[0].float()
    runner = PagedRunner(
        load_model(folder, dtype="float32"), num_blocks=8, block_size=16, block_order=[3, 1, 6, 0, 7, 2, 5, 4]
    )
    ours = runner.step({0: ids})[0]
    assert_logits_close(ours, expected)


def test_both_share_one_tokenizer_with_a_chat_template():
    a, b = Tokenizer(TARGET), Tokenizer(DRAFT)
    text = "def fibonacci(n):\n    return n"
    assert a.encode(text) == b.encode(text) and a.info.vocab_size == 8192
    assert a.info.has_chat_template
    chat = a.apply_chat_template([{"role": "user", "content": "hi"}])
    assert a.decode(chat, skip_special_tokens=False).endswith("<|im_start|>assistant\n")


def test_serve_and_generate_default_to_smollm2_else_the_bundled_target(capsys, monkeypatch, tmp_path):
    """Without a model: SmolLM2 where `make serve` set it up (its GGUF file first, else a converted
    folder); here it is absent, so the demo target."""
    smollm2, gguf = tmp_path / "smollm2-135m-instruct", tmp_path / "smollm2-135m-instruct.gguf"
    monkeypatch.setattr("tokenmill.engine_args.DEFAULT_MODEL", smollm2)
    monkeypatch.setattr("tokenmill.engine_args.DEFAULT_GGUF", gguf)
    args = build_parser().parse_args(["serve"])
    assert engine_config(args, seed=0).model == str(TARGET)
    smollm2.mkdir()
    (smollm2 / "config.json").write_text("{}")
    assert engine_config(args, seed=0).model == str(smollm2)
    gguf.write_bytes(b"GGUF")
    assert engine_config(args, seed=0).model == str(gguf)  # the file kept quantized, before the folder
    gguf.unlink()
    (smollm2 / "config.json").unlink()
    assert main(["generate", "--prompt", "def fibonacci(n):", "--max-tokens", "24", "--temperature", "0"]) == 0
    printed = capsys.readouterr().out
    greedy = (TARGET / "README.md").read_text().split("```python\n")[1]  # the card's greedy completion
    assert len(printed) > 30 and greedy.startswith("def fibonacci(n):" + printed[:30])


def test_completions_match_the_model_card_and_look_like_python():
    card = (TARGET / "README.md").read_text()
    recorded = [block.split("\n```", 1)[0] for block in card.split("```python\n")[1:]]  # greedy, seed 0, seed 1
    llm = LLM(str(TARGET))
    greedy = llm.generate(["def fibonacci(n):"], SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)
    text = "def fibonacci(n):" + greedy[0].outputs[0].text
    # the card was written by the same code with the same defaults; allow a near-tie late in the text
    assert text[:40] == recorded[0][:40] and text.startswith("def fibonacci(n):\n    ")
    sampled = llm.generate(
        ["def fibonacci(n):"], SamplingParams(temperature=0.7, max_tokens=64, seed=1), use_tqdm=False
    )
    text = "def fibonacci(n):" + sampled[0].outputs[0].text
    assert text[:40] == recorded[2][:40]
    assert len(PYTHON.findall(text)) >= 5 and "\n" in text
