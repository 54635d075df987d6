"""The model's tokenizer and chat template, behind a small typed interface.

Owns `Tokenizer` (a local-only `transformers.AutoTokenizer` of a model folder, or the one a GGUF
file describes, `text/gguf_tokenizer.py`: never downloads, never runs code from the folder) and
`TokenizerInfo`, the plain facts the engine needs about it: the ids that end generation (from
`generation_config.json` when it lists them, as Llama 3 and Qwen checkpoints do), BOS, the
vocabulary size, the special ids and whether a chat template exists. Every decode goes through
`Tokenizer.decode`, so text streamed by the detokenizer and text decoded at once agree.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenmill.errors import ParamError
from tokenmill.model_files import is_gguf
from tokenmill.text.gguf_tokenizer import cached_gguf_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# A folder needs one of these for transformers to build a tokenizer without network access.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
GENERATION_CONFIG = "generation_config.json"


@dataclass(frozen=True)
class TokenizerInfo:
    eos_token_ids: tuple[int, ...]  # generation ends on any of these; empty if the folder names none
    bos_token_id: int | None
    vocab_size: int  # ids the tokenizer knows, added tokens included (the model's embedding may be larger)
    all_special_ids: frozenset[int]
    has_chat_template: bool


def read_generation_eos(folder: Path) -> tuple[int, ...] | None:
    """`eos_token_id` of generation_config.json (an int or a list of ints); None if absent or null."""
    path = folder / GENERATION_CONFIG
    if not path.is_file():
        return None
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a JSON object")
    value = cfg.get("eos_token_id")
    if value is None:
        return None
    values = value if isinstance(value, list) else [value]
    if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ValueError(f"{path}: field 'eos_token_id' must be a token id or a non-empty list of them, got {value!r}")
    return tuple(values)


def check_messages(messages: Sequence[Any]) -> None:
    """Every message is a dict with string 'role' and 'content'; raises ValueError naming the first bad one."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise ParamError("messages", "messages: expected a non-empty list of {'role': ..., 'content': ...} dicts")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ParamError(
                f"messages[{i}]",
                f"messages[{i}]: expected a dict with 'role' and 'content', got {type(message).__name__}",
            )
        for key in ("role", "content"):
            if key not in message:
                raise ParamError(f"messages[{i}]", f"messages[{i}]: missing '{key}'")
            if not isinstance(message[key], str):
                raise ParamError(
                    f"messages[{i}]", f"messages[{i}]: '{key}' must be a string, got {type(message[key]).__name__}"
                )


class Tokenizer:
    """Wraps `transformers.AutoTokenizer.from_pretrained(folder)`, local files only, no remote code."""

    def __init__(self, folder: str | Path) -> None:
        path = Path(folder)
        if is_gguf(path):
            if not path.is_file():
                raise ValueError(f"{path}: GGUF file not found")
            hf, eos_ids = cached_gguf_tokenizer(path)
            eos: tuple[int, ...] | None = eos_ids
        else:
            hf = self._load_folder(path)
            eos = read_generation_eos(path)
        self.folder = path
        self.hf: PreTrainedTokenizerBase = hf
        self._fast = getattr(hf, "backend_tokenizer", None)
        if not eos:
            eos = () if hf.eos_token_id is None else (int(hf.eos_token_id),)
        self.info = TokenizerInfo(
            eos_token_ids=eos,
            bos_token_id=None if hf.bos_token_id is None else int(hf.bos_token_id),
            vocab_size=len(hf),
            all_special_ids=frozenset(int(i) for i in hf.all_special_ids),
            has_chat_template=bool(hf.chat_template),
        )

    @staticmethod
    def _load_folder(path: Path) -> PreTrainedTokenizerBase:
        from transformers import AutoTokenizer

        if not path.is_dir():
            raise ValueError(f"{path}: tokenizer folder not found")
        if not any((path / name).is_file() for name in TOKENIZER_FILES):
            raise ValueError(f"{path}: no tokenizer file in the folder (expected one of {', '.join(TOKENIZER_FILES)})")
        try:
            return AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
        except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: cannot load the tokenizer ({type(e).__name__}: {e})") from None

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, as the tokenizer's post-processor adds them (BOS)."""
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`. No clean-up of spaces before punctuation: that heuristic is not a local
        operation, and streamed text must equal text decoded at once."""
        if self._fast is not None:  # the Rust tokenizer directly: the detokenizer calls this per token
            return str(self._fast.decode(list(ids), skip_special_tokens=skip_special_tokens))
        text = self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)
        assert isinstance(text, str)
        return text

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        tools_message: str | None = None,
        variables: dict[str, Any] | None = None,
    ) -> list[int]:
        """The folder's chat template rendered to text, then encoded without adding special tokens
        (the template writes its own BOS). `tools` go to a template that has a tools section; one that
        has none gets `tools_message` as (the start of) the system message instead. `variables`: more
        names the template may read (a request's `chat_template_kwargs`, `enable_thinking` say); one
        that is a parameter of transformers' `apply_chat_template` is refused."""
        if not self.info.has_chat_template:
            raise ParamError(
                "messages", f"messages: {self.folder} has no chat template; send a plain-text prompt instead"
            )
        check_messages(messages)
        from jinja2 import TemplateError

        extra: dict[str, Any] = dict(variables or {})
        taken = set(inspect.signature(self.hf.apply_chat_template).parameters)
        for name in extra:
            if name in taken or not name.isidentifier():
                raise ParamError(
                    "chat_template_kwargs", f"chat_template_kwargs: {name!r} cannot be given to the chat template"
                )
        if tools and "tools" in str(self.hf.chat_template):
            extra["tools"] = tools
        elif tools and tools_message:
            if messages[0]["role"] == "system":
                messages = [{**messages[0], "content": f"{tools_message}\n\n{messages[0]['content']}"}, *messages[1:]]
            else:
                messages = [{"role": "system", "content": tools_message}, *messages]
        try:
            text = self.hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
            )
        except TemplateError as e:  # the template's own raise_exception(), or a field it needs and lacks
            raise ParamError(
                "messages", f"messages: the chat template rejected them ({type(e).__name__}: {e})"
            ) from None
        if not isinstance(text, str):
            raise ParamError("messages", f"messages: the chat template rendered {type(text).__name__}, expected text")
        return self.encode(text, add_special_tokens=False)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """The vocabulary strings of `ids` (byte-level pieces, not text)."""
        tokens = self.hf.convert_ids_to_tokens(list(ids))
        assert isinstance(tokens, list)
        return [str(t) for t in tokens]
