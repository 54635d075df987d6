"""The tokenizer and chat template a GGUF file describes, built as a transformers fast tokenizer.

Owns the one step transformers leaves open: a GGUF stores the vocabulary and merges but names its
pre-tokenizer only by a llama.cpp tag (`tokenizer.ggml.pre`). transformers (`gguf_file=`) builds the
tokenizer and knows the split rules of some tags; for others it keeps GPT-2's byte-level split. Tags
whose rule differs from that are mapped here explicitly (SmolLM's `smollm` splits every digit on its
own before the GPT-2 rules, as llama.cpp does); the BOS and EOS ids of the built tokenizer are checked
against the file's metadata, and the ids that end generation (EOS, and EOT/EOM where the file names
them, as llama.cpp stops on) are read from it.

Building it parses the file's metadata and converts its vocabulary (seconds for a 32,000-token one),
so `cached_gguf_tokenizer` builds it once per file and saves it (transformers' `save_pretrained`: the
tokenizer.json of the built tokenizer, split rule included, with its settings and chat template), with
the ids that end generation, in `$TOKENMILL_CACHE_DIR/gguf/<key>-tokenizer/`, the key a hash of the
file's path, size, modification time and first 16 MiB (where its metadata is) and of the transformers
version; later starts load that folder. One that does not load is a warning, and the tokenizer is
built from the file again.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenmill.model_files import ModelLoadError, cache_dir, file_key

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
CACHE_FORMAT = "tokenmill gguf tokenizer 1"  # the cached folder's layout; a change makes every key new
CACHE_HEAD = 16 << 20  # the key hashes the file's first bytes: its metadata, unless that is larger
SAVED = "tokenmill.json"  # the cached folder's own file: the key's text and the ids that end generation


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


def cached_gguf_tokenizer(path: Path) -> tuple[PreTrainedTokenizerBase, tuple[int, ...]]:
    """`load_gguf_tokenizer(path)`, built once per file and loaded from the cache after (module docstring)."""
    import transformers
    from transformers import AutoTokenizer

    key, text = file_key(path, CACHE_FORMAT, f"transformers {transformers.__version__}", head=CACHE_HEAD)
    folder = cache_dir("gguf") / f"{key}-tokenizer"
    if (folder / SAVED).is_file():
        try:
            saved = json.loads((folder / SAVED).read_text(encoding="utf-8"))
            if saved["key"] != text:
                raise ValueError("written for another file")
            hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
            return hf, tuple(int(i) for i in saved["ends"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            logger.warning("GGUF tokenizer cache %s unusable (%s): building it from the file again", folder, e)
    hf, ends = load_gguf_tokenizer(path)
    _save(folder, hf, ends, text)
    return hf, ends


def _save(folder: Path, hf: PreTrainedTokenizerBase, ends: tuple[int, ...], text: str) -> None:
    """The tokenizer saved beside `folder` and renamed in (its own file last: a folder without it is
    never read)."""
    staging = folder.with_name(f"{folder.name}.{os.getpid()}.tmp")
    try:
        staging.mkdir(parents=True, exist_ok=True)
        hf.save_pretrained(str(staging))
        (staging / SAVED).write_text(json.dumps({"key": text, "ends": list(ends)}), encoding="utf-8")
        if folder.exists():  # one that did not load: replaced
            shutil.rmtree(folder)
        os.replace(staging, folder)
    except (OSError, ValueError, TypeError) as e:  # a full or read-only disk, a setting it cannot save
        logger.warning("GGUF tokenizer not cached in %s (%s)", folder, e)
        shutil.rmtree(staging, ignore_errors=True)
