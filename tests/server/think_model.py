"""A tiny make-model folder for the reasoning tests: its tokenizer has `<think>` and `</think>` as
single tokens (the last two ids of the vocabulary, renamed, as Qwen3's and DeepSeek-R1's have them),
and its chat template opens the reasoning (`open_think`), closes it empty (`enable_thinking: false`,
as Qwen3's does) and writes `reasoning_effort` into the prompt when given."""

from __future__ import annotations

import json
from pathlib import Path

TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if reasoning_effort is defined %}{{ 'effort: ' + reasoning_effort + '\\n' }}{% endif %}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% elif open_think is defined and open_think %}{{ '<think>\\n' }}{% endif %}{% endif %}"
)


def think_model(folder: Path) -> dict[str, int]:
    """Turn the make-model folder `folder` into the reasoning model (in place); the tags' ids."""
    tj = json.loads((folder / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    names = {v: k for k, v in vocab.items()}
    ids = {"<think>": len(vocab) - 2, "</think>": len(vocab) - 1}
    gone = {names[i] for i in ids.values()}  # (and the merges that make or use the renamed tokens)
    tj["model"]["merges"] = [m for m in tj["model"]["merges"] if "".join(m) not in gone and not set(m) & gone]
    for tag, i in ids.items():
        del vocab[names[i]]
        vocab[tag] = i
        tj["added_tokens"].append(
            {"id": i, "content": tag, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False}
            | {"special": False}
        )
    (folder / "tokenizer.json").write_text(json.dumps(tj))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if (folder / "chat_template.jinja").exists():
        (folder / "chat_template.jinja").write_text(TEMPLATE)
    return ids
