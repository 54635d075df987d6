"""Offline byte-level BPE tokenizer for random-weight test checkpoints.

Owns one job: train a deterministic byte-level BPE on the Python standard library's own sources
(present on every machine that runs tokenmill) and save it as a Hugging Face tokenizer
(`tokenizer.json` + `tokenizer_config.json` with a chat template) beside a model.
"""

from __future__ import annotations

import json
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

# ChatML, the format Qwen models use; the BOS token opens the conversation as in Llama's templates.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class SpecialTokens:
    bos: str = "<s>"
    eos: str = "</s>"
    pad: str = "<pad>"
    im_start: str = "<|im_start|>"
    im_end: str = "<|im_end|>"

    def all(self) -> list[str]:
        return [self.bos, self.eos, self.pad, self.im_start, self.im_end]


def corpus(seed: int, max_bytes: int) -> list[str]:
    """Standard-library module sources in a seed-determined order, up to about `max_bytes`."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))
    if not files:
        raise RuntimeError(f"no Python sources found under {stdlib} to train a tokenizer on")
    random.Random(seed).shuffle(files)
    texts: list[str] = []
    total = 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return texts


def train_bpe(
    vocab_size: int, seed: int, max_bytes: int, specials: SpecialTokens, texts: list[str] | None = None
) -> Tokenizer:
    """A byte-level BPE with at most `vocab_size` tokens (specials first, ids 0..4), trained on
    `texts`, or by default on `corpus(seed, max_bytes)`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials.all(),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts if texts is not None else corpus(seed, max_bytes), trainer=trainer)
    bos_id = tok.token_to_id(specials.bos)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{specials.bos} $A",
        pair=f"{specials.bos} $A {specials.bos} $B",
        special_tokens=[(specials.bos, bos_id)],
    )
    return tok


def save_tokenizer(tok: Tokenizer, out: Path, specials: SpecialTokens, model_max_length: int) -> None:
    """Write tokenizer.json and tokenizer_config.json (with the chat template) into `out`."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=specials.bos,
        eos_token=specials.eos,
        pad_token=specials.pad,
        additional_special_tokens=[specials.im_start, specials.im_end],
        model_max_length=model_max_length,
        chat_template=CHAT_TEMPLATE,
    )
    hf.save_pretrained(str(out))
    # transformers 5 writes the template to chat_template.jinja; older loaders (and vLLM) read it
    # from tokenizer_config.json, and know the tokenizer class by its long-standing name.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
