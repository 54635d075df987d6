"""The tokenizer and chat template a GGUF file describes, built as a transformers fast tokenizer.

Owns the one step transformers leaves open: a GGUF stores the vocabulary and merges but names its
pre-tokenizer only by a llama.cpp tag (`tokenizer.ggml.pre`). transformers (`gguf_file=`) builds the
tokenizer and knows the split rules of some tags; for others it keeps GPT-2's byte-level split. Tags
whose rule differs from that are mapped here explicitly (SmolLM's `smollm` splits every digit on its
own before the GPT-2 rules, as llama.cpp does); the BOS and EOS ids of the built tokenizer are checked
against the file's metadata, and the ids that end generation (EOS, and EOT/EOM where the file names
them, as llama.cpp stops on) are read from it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenmill.model_files import ModelLoadError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# llama.cpp's tags whose split is GPT-2's byte-level regex, which transformers applies by default.
GPT2_SPLIT_TAGS = ("default", "gpt-2")
# Metadata keys of the tokens that end generation, as llama.cpp's end-of-generation set has them.
END_OF_GENERATION_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
# Control tokens that end a turn whatever the metadata says (llama.cpp adds these to its set by their
# text: a GGUF of a chat model often names only the base model's EOS).
END_OF_TURN_TEXTS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")
CONTROL = 3  # tokenizer.ggml.token_type of a control token


def _smollm_pre_tokenizer() -> Any:
    """Each digit alone, then GPT-2's byte-level split (llama.cpp's `smollm`; SmolLM's own tokenizer.json)."""
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )


# tokenizer.ggml.pre -> the pre-tokenizer it means, where transformers does not build it.
PRE_TOKENIZERS = {"smollm": _smollm_pre_tokenizer}


def _metadata(path: Path) -> dict[str, Any]:
    import gguf

    reader = gguf.GGUFReader(str(path))
    wanted = (
        "tokenizer.ggml.model",
        "tokenizer.ggml.pre",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.token_type",
        *END_OF_GENERATION_KEYS,
    )
    return {key: reader.fields[key].contents() for key in wanted if key in reader.fields}


def load_gguf_tokenizer(
    path: Path, metadata: Mapping[str, Any] | None = None
) -> tuple[PreTrainedTokenizerBase, tuple[int, ...]]:
    """(the tokenizer, the ids that end generation) of a GGUF file; `metadata`: its fields as a
    `GGUFCheckpoint` read them already (else they are read here)."""
    from transformers import AutoTokenizer

    try:
        meta = metadata if metadata is not None else _metadata(path)
        hf = AutoTokenizer.from_pretrained(
            str(path.parent), gguf_file=path.name, local_files_only=True, trust_remote_code=False
        )
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        raise ModelLoadError(f"{path}: cannot build the tokenizer from the GGUF ({type(e).__name__}: {e})") from None
    model = meta.get("tokenizer.ggml.model")
    pre = meta.get("tokenizer.ggml.pre")
    if model == "gpt2" and pre in PRE_TOKENIZERS:
        hf.backend_tokenizer.pre_tokenizer = PRE_TOKENIZERS[pre]()
    elif model == "gpt2" and pre not in (None, *GPT2_SPLIT_TAGS):
        logger.info("%s: tokenizer.ggml.pre is %r: using the split transformers builds for it", path, pre)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if bos is not None and hf.bos_token_id != bos:
        raise ModelLoadError(
            f"{path}: the built tokenizer's BOS id is {hf.bos_token_id}, "
            f"GGUF key 'tokenizer.ggml.bos_token_id' says {bos}"
        )
    eos = meta.get("tokenizer.ggml.eos_token_id")
    if eos is not None and hf.eos_token_id != eos:
        raise ModelLoadError(
            f"{path}: the built tokenizer's EOS id is {hf.eos_token_id}, "
            f"GGUF key 'tokenizer.ggml.eos_token_id' says {eos}"
        )
    tokens = meta.get("tokenizer.ggml.tokens") or []
    if len(hf) > len(tokens):
        logger.warning(
            "%s: the tokenizer transformers builds has %d tokens, the file %d (ids past the model's vocabulary "
            "are refused in prompts)",
            path,
            len(hf),
            len(tokens),
        )
    ends = [int(meta[key]) for key in END_OF_GENERATION_KEYS if key in meta]
    types = meta.get("tokenizer.ggml.token_type") or []
    ends += [
        i
        for i, (text, kind) in enumerate(zip(tokens, types, strict=False))
        if kind == CONTROL and text in END_OF_TURN_TEXTS
    ]
    return hf, tuple(dict.fromkeys(ends))
