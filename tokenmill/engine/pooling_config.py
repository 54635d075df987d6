"""What a model folder and the settings say about pooling: the task the model serves, how an embedding
is pooled, whether it may be truncated, and a reranker's prompt template and answer tokens.

Reads the files sentence-transformers writes beside the weights: `modules.json` (the module list: a
`Pooling` module means an embedding model, a `Normalize` module after it means unit vectors; a `Dense`
projection after pooling is refused, tokenmill has none) and the pooling module's `config.json`
(`pooling_mode_lasttoken`, `pooling_mode_mean_tokens`, `pooling_mode_cls_token`; the other modes are
refused by name). `config.json`'s `matryoshka_dimensions` or `is_matryoshka` (as vLLM reads them)
allow a request's `dimensions`; `--matryoshka` allows it for any model. A reranker's template comes
from `--rerank-template FILE` or the folder's `rerank_template.jinja`; without either, Qwen3-Reranker's.

The settings win over the folder: `--task`, `--pooling`, `--normalize`. With `--task auto` a folder
with a sentence-transformers pooling module serves embeddings, one with a rerank template reranks,
and any other generates. Plain JSON and text: no torch, no tokenizer (the front end, `engine/pooling.py`,
turns this into prompts and `PoolingParams`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.model_files import ModelLoadError, is_gguf

MODULES_FILE = "modules.json"
RERANK_TEMPLATE_FILE = "rerank_template.jinja"
POOLING_MODULE = "sentence_transformers.models.Pooling"
NORMALIZE_MODULE = "sentence_transformers.models.Normalize"
TRANSFORMER_MODULE = "sentence_transformers.models.Transformer"
# sentence-transformers' pooling modes -> tokenmill's pooling types (the others are refused by name)
POOLING_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
UNSUPPORTED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")

# Qwen3-Reranker's prompt, from its model card: the Jinja variables are `query`, `document` and `instruction`
QWEN3_RERANK_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
    "<Instruct>: {{ instruction or 'Given a web search query, retrieve relevant passages that answer the query' }}\n"
    "<Query>: {{ query }}\n<Document>: {{ document }}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
)


@dataclass(frozen=True)
class PoolingConfig:
    task: str  # generate | embed | rerank
    pooling: str = "last"  # last | mean | cls (embed)
    normalize: bool = True  # embed: unit vectors
    matryoshka: bool = False  # embed: a request may ask for fewer `dimensions`
    matryoshka_dimensions: tuple[int, ...] = ()  # those it may ask for (empty: any up to the hidden size)
    rerank_template: str = QWEN3_RERANK_TEMPLATE  # rerank: Jinja over query, document, instruction
    rerank_tokens: tuple[str, ...] = ("yes", "no")  # rerank: the score is p(first) among these
    source: str = "settings"  # where the pooling came from: sentence-transformers or settings
    hidden_size: int | None = None  # an embedding's width, from config.json (None: a GGUF file)


def read_pooling_config(config: EngineConfig) -> PoolingConfig:
    """The model's pooling as `config` and its folder say (see the module docstring); a ModelLoadError
    naming the file and field for a configuration tokenmill cannot honour."""
    folder = Path(config.model)
    if config.task == "generate":
        return PoolingConfig(task="generate")
    st = None if is_gguf(folder) else read_sentence_transformers(folder)
    template_file = Path(config.rerank_template) if config.rerank_template else folder / RERANK_TEMPLATE_FILE
    has_template = not is_gguf(folder) and template_file.is_file()
    if config.rerank_template and not template_file.is_file():
        raise ModelLoadError(f"{template_file}: rerank_template: no such file")
    task = config.task
    if task == "auto":
        task = "embed" if st is not None else "rerank" if has_template else "generate"
    pooling, normalize = st if st is not None else ("last", True)
    dims, flagged, hidden = _model_config(folder)
    tokens = tuple(t for t in config.rerank_tokens.split(",") if t)
    if len(tokens) < 2:
        raise ValueError(f"rerank_tokens: expected two or more comma-separated tokens, got {config.rerank_tokens!r}")
    return PoolingConfig(
        task=task,
        pooling=config.pooling or pooling,
        normalize=normalize if config.normalize is None else config.normalize,
        matryoshka=config.matryoshka or flagged or bool(dims),
        matryoshka_dimensions=() if config.matryoshka else dims,
        rerank_template=template_file.read_text(encoding="utf-8") if has_template else QWEN3_RERANK_TEMPLATE,
        rerank_tokens=tokens,
        source="sentence-transformers" if st is not None and not config.pooling else "settings",
        hidden_size=hidden,
    )


def read_sentence_transformers(folder: Path) -> tuple[str, bool] | None:
    """(pooling type, normalize) from sentence-transformers' `modules.json` and its pooling module's
    config; None when the folder has no such pooling module."""
    modules = _json(folder / MODULES_FILE)
    if modules is None:
        return None
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ModelLoadError(f"{folder / MODULES_FILE}: expected a list of modules")
    kinds = [str(m.get("type", "")) for m in modules]
    if POOLING_MODULE not in kinds:
        return None
    at = kinds.index(POOLING_MODULE)
    for kind in kinds[at + 1 :]:
        if kind != NORMALIZE_MODULE:
            raise ModelLoadError(f"{folder / MODULES_FILE}: module {kind!r} after pooling is not supported")
    for kind in kinds[:at]:
        if kind != TRANSFORMER_MODULE:
            raise ModelLoadError(f"{folder / MODULES_FILE}: module {kind!r} before pooling is not supported")
    path = folder / str(modules[at].get("path", "1_Pooling")) / "config.json"
    pooling = _json(path)
    if not isinstance(pooling, dict):
        raise ModelLoadError(f"{path}: the pooling module's config is missing or not a JSON object")
    on = [key for key in (*POOLING_MODES, *UNSUPPORTED_MODES) if pooling.get(key) is True]
    if len(on) != 1:
        raise ModelLoadError(f"{path}: expected exactly one pooling mode set, got {on or 'none'}")
    if on[0] in UNSUPPORTED_MODES:
        supported = ", ".join(POOLING_MODES)
        raise ModelLoadError(f"{path}: {on[0]} is not supported; tokenmill pools with {supported}")
    if pooling.get("include_prompt", True) is not True:
        raise ModelLoadError(f"{path}: include_prompt false is not supported (every prompt token is pooled)")
    return POOLING_MODES[on[0]], NORMALIZE_MODULE in kinds


def _model_config(folder: Path) -> tuple[tuple[int, ...], bool, int | None]:
    """(matryoshka_dimensions, is_matryoshka, hidden_size) of a folder's config.json (none for a GGUF file)."""
    cfg = None if is_gguf(folder) else _json(folder / "config.json")
    if not isinstance(cfg, dict):
        return (), False, None
    dims = cfg.get("matryoshka_dimensions") or []
    if not isinstance(dims, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims):
        raise ModelLoadError(f"{folder / 'config.json'}: matryoshka_dimensions: expected a list of positive integers")
    hidden = cfg.get("hidden_size")
    return tuple(dims), cfg.get("is_matryoshka") is True, hidden if isinstance(hidden, int) else None


def _json(path: Path) -> Any:
    """A JSON file's value; None when it does not exist."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from None
