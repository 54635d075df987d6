"""EngineConfig: every engine setting in one validated, frozen dataclass, and the one source of them.

Each field carries its help text, and where they apply its choices or integer minimum, in
`dataclasses.field(metadata=...)` (made by `setting`). Everything else is derived from the fields:
`LLM(model, **kwargs)` (`EngineConfig.from_kwargs`), the engine flags of `tokenmill generate | serve |
bench offline` and their `--config` YAML file (engine_args.py), `bench offline --compare` variants.
The helpers here (`setting`, `setting_type`, `check_setting(s)`, `check_known`) serve any settings
dataclass built the same way (the CLI's `ServeSettings` is one).

`SpeculativeConfig` (the parsed `speculative_config` setting) lives here too: plain data that the
scheduler's draft policy and the runner's proposers both read.

Bad values raise a ValueError naming the field. Derived sizes (the KV cache's blocks, the effective
maximum model length) are computed once by the engine from this and the model.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import types
import typing
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

GREEDY_HEAD = ("auto", "head", "logits")
QUANTIZATIONS = ("auto", "none", "int8", "int4", "w8a8")
KV_CACHE_DTYPES = ("auto", "int8")
QUANTIZATION_HEADS = ("same", "int8")
GGUF_LAYOUTS = ("auto", "blocks", "q8_0", "int")
GGUF_REPACKS = ("auto", "x16", "file")
SCHEDULING = ("continuous", "static")
DTYPES = ("auto", "float32", "bfloat16", "float16", "fastest")
TASKS = ("auto", "generate", "embed", "rerank")
POOLING = ("last", "mean", "cls")
DEFAULT_CPU_KV_CACHE_MEMORY = 2 * 1024**3  # bytes
GPU_MEMORY_FRACTION = 0.9  # of free memory after loading the model
SETTING_KINDS = (bool, int, float, str)


def setting(default: Any, help: str, *, choices: tuple[str, ...] = (), minimum: int | None = None) -> Any:
    """A settings field: its default, and in its metadata the help text, the allowed values of a str
    field (`choices`) and the least value of an int field (`minimum`; None for any)."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices, "minimum": minimum})


@dataclass(frozen=True)
class SettingType:
    """A settings field's type: one of bool, int, float, str, and whether None is allowed."""

    kind: type
    optional: bool


@functools.cache
def _types(cls: type) -> dict[str, SettingType]:
    out = {}
    for name, hint in typing.get_type_hints(cls).items():
        args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        kinds = [a for a in args if a is not type(None)]
        if len(kinds) != 1 or kinds[0] not in SETTING_KINDS:
            raise TypeError(f"{cls.__name__}.{name}: a setting is bool, int, float or str, optionally | None")
        out[name] = SettingType(kinds[0], optional=len(args) == 2)
    return out


def setting_type(cls: type, name: str) -> SettingType:
    """The type of field `name` of the settings dataclass `cls`."""
    return _types(cls)[name]


def check_setting(cls: type, name: str, value: Any) -> None:
    """Raise a ValueError naming `name` unless `value` fits the field: its type, choices, minimum."""
    kind = setting_type(cls, name)
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    choices: tuple[str, ...] = field.metadata.get("choices", ())
    minimum: int | None = field.metadata.get("minimum")
    if value is None and kind.optional:
        return
    if kind.kind is bool:
        ok, expected = isinstance(value, bool), "a boolean (true or false)"
    elif kind.kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        if minimum is None:
            expected = "an integer"
        else:
            expected = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            ok = ok and value >= minimum
    elif kind.kind is float:
        ok, expected = isinstance(value, int | float) and not isinstance(value, bool), "a number"
    else:
        ok, expected = isinstance(value, str), "a string"
        if choices:
            ok, expected = ok and value in choices, f"one of {', '.join(choices)}"
    if not ok:
        raise ValueError(f"{name}: expected {expected}, got {value!r}")


def check_settings(settings: Any) -> None:
    """Check every field of a settings dataclass instance (`check_setting`): call from `__post_init__`."""
    for field in dataclasses.fields(settings):
        check_setting(type(settings), field.name, getattr(settings, field.name))


def check_known(names: Iterable[str], known: Sequence[str], what: str) -> None:
    """Raise a ValueError naming the first of `names` not in `known` (`what` says what a name is in the
    message: "engine setting", "key", ...), with the closest known name as a suggestion."""
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(str(name).replace("-", "_"), known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ValueError(f"{name}: unknown {what}{hint}; expected one of {', '.join(known)}")


@dataclass(frozen=True)
class EngineConfig:
    model: str = dataclasses.field(metadata={"help": "Hugging Face model folder"})
    dtype: str = setting(
        "auto",
        "dtype of weights and activations; auto: the checkpoint's (a float32 one in bfloat16 on a GPU); "
        "fastest: the fastest here (timed at start) "
        "whose next-token distribution stays within KL 0.01 nats of float32's",
        choices=DTYPES,
    )
    device: str = setting("cpu", "torch device to run on: cpu, cuda, cuda:1, ...")
    enforce_eager: bool = setting(
        False,
        "on a CUDA device, run every step eagerly; by default decode-only steps replay CUDA graphs captured at "
        "start at padded batch sizes (1, 2, 4, 8, then every 8 up to max_num_seqs)",
    )
    block_size: int = setting(16, "tokens per KV cache block", minimum=1)
    max_num_seqs: int = setting(64, "most requests running at once", minimum=1)
    max_num_batched_tokens: int = setting(512, "tokens one engine step may run (prompt chunks + decodes)", minimum=1)
    kv_cache_memory: int | None = setting(
        None, "bytes for the KV cache (default: 2 GiB on CPU, 90% of free memory on GPU)", minimum=1
    )
    max_model_len: int | None = setting(
        None, "longest prompt + output, in tokens (default: the model's max_position_embeddings)", minimum=1
    )
    scheduling: str = setting(
        "continuous", "continuous batching, or static (the measured baseline)", choices=SCHEDULING
    )
    seed: int = setting(0, "seeds the requests that bring no seed")
    enable_prefix_caching: bool = setting(True, "share the KV of common prompt prefixes across requests")
    attention_backend: str = setting(
        "auto",
        "attention backend by name: `cpu` (a native paged kernel built for this CPU on first use), `torch` "
        "(the pure-torch reference), `triton` (a CUDA device; pip install 'tokenmill[gpu]'), or `auto` (`cpu` "
        "where its kernels build, `triton` on a CUDA device where triton is installed, else `torch`)",
    )
    cpu_threads: int | None = setting(
        None, "torch threads on a CPU device (default: one per physical core this process may use)", minimum=1
    )
    greedy_head: str = setting(
        "auto",
        "steps whose rows are all greedy: argmax inside the output projection, chunk by chunk (`head`), "
        "over full logits (`logits`), or whichever measures faster at start (`auto`)",
        choices=GREEDY_HEAD,
    )
    linear_backend: str = setting(
        "auto",
        "dense linear layers: `cpu` (a native few-row kernel, built on first use, for inputs of up to 64 rows; "
        "torch's GEMM above), `torch` (torch's GEMM), or `auto` (per weight shape and row count, whichever "
        "measures faster at start; torch where the kernels do not build)",
    )
    grammar_compile_timeout: float = setting(
        5.0,
        "seconds a structured-output spec (JSON schema, regex, grammar) may take to compile before it is "
        "refused (400) and remembered as refused; compiles run on two threads of their own",
    )
    cpu_huge_pages: bool = setting(
        True,
        "on a CPU device, weights on 2 MB pages where Linux's transparent huge pages allow (madvise or "
        "always mode): fewer TLB misses as a step streams them",
    )
    decode_steps: int = setting(
        4,
        "most decode steps in a row one engine step may run for greedy requests (each feeding the token it "
        "sampled to the next), while no request waits and while such a run stays under 20 ms: the scheduler "
        "and the outputs' bookkeeping once a run, not once a token (small models at few requests: "
        "docs/offline-api.md); tokens then stream a run at a time (a model whose forward takes 20 ms runs a "
        "forward a step anyway); 1: a step a token",
        minimum=1,
    )
    fused_decode: bool = setting(
        True,
        "run each decoder layer of a step (decodes, and prompt chunks the paged kernel attends) as one native "
        "call where the native attention, layer ops and dense weights run (the same kernels, no Python between them)",
    )
    kv_cache_dtype: str = setting(
        "auto",
        "KV cache values: auto (the model's dtype) or int8 (one float32 scale per token and KV head: about "
        "twice the tokens of a bfloat16 cache in the same memory, four times float32's)",
        choices=KV_CACHE_DTYPES,
    )
    quantization: str = setting(
        "auto",
        "the linear layers' weights: auto (as the checkpoint holds them: a GGUF file's Q8_0, Q4_0 and Q4_1 "
        "matrices stay quantized, everything else in --dtype), none (everything in --dtype), or quantized at "
        "load, the output projection included: int8 (weight-only, per output channel, or per group with "
        "--quantization-group-size), int4 (weight-only, asymmetric groups of 32 by default), w8a8 (int8 "
        "weights per channel, int8 activations per row at run time)",
        choices=QUANTIZATIONS,
    )
    quantization_group_size: int | None = setting(
        None, "inputs sharing one scale (a power of two from 32; default: per channel for int8, 32 for int4)", minimum=1
    )
    quantization_head: str = setting(
        "same",
        "the output projection's quantization: the same as the layers', or int8 per channel (as llama.cpp keeps "
        "its output tensor wider under 4-bit types)",
        choices=QUANTIZATION_HEADS,
    )
    quantization_group_fallback: bool = setting(
        False, "a layer whose input width the group size does not divide takes the largest power of two that does"
    )
    gguf_layout: str = setting(
        "auto",
        "a GGUF file's Q8_0, Q4_0 and Q4_1 matrices under quantization auto: blocks (the file's own blocks, "
        "products on int8 activations, prompts through an integer GEMM), q8_0 (Q8_0 so, Q4_0 / Q4_1 as int), int "
        "(read into tokenmill's int8 / int4 formats and their kernels), or auto (the CPU kind's default: blocks on "
        "AVX2 and with AVX-512 BF16 but no AMX, int with AMX or AVX-512 without BF16, q8_0 without AVX2); with "
        "AVX-512 VNNI it also says how quantization int8 / int4 keep their weights (int8 in Q8_0 blocks under "
        "blocks or q8_0, int4 in Q4_1 blocks under blocks, else tokenmill's formats)",
        choices=GGUF_LAYOUTS,
    )
    gguf_repack: str = setting(
        "auto",
        "GGUF blocks kept as stored (Q4_K, Q5_K, Q6_K, Q4_0, Q4_1, Q8_0): x16 (repacked at load into groups of 16 "
        "rows, products without horizontal sums), file (as the file stores them, as llama.cpp's --no-repack), or "
        "auto (the CPU kind's rule: every type with AVX-512 VNNI, all but Q8_0 on AVX2)",
        choices=GGUF_REPACKS,
    )
    speculative_config: str | None = setting(
        None,
        "speculative decoding, as vLLM's JSON: method (ngram: prompt lookup), num_speculative_tokens (k, up to "
        "15), prompt_lookup_min / prompt_lookup_max (the n-gram lengths tried, default 1 / 4); "
        'e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\'; outputs equal those without it',
    )
    layer_ops: str = setting(
        "auto",
        "norms, SwiGLU and rotary embeddings: `cpu` (fused native kernels, built on first use), `torch` "
        "(the reference), or `auto` (`cpu` where the kernels build, else `torch`)",
    )
    # pooling (embeddings, rerank and score: engine/pooling_config.py)
    task: str = setting(
        "auto",
        "what the model serves besides generation: embed (/v1/embeddings, and /v1/score and /v1/rerank by cosine), "
        "rerank (/v1/rerank and /v1/score by a yes/no answer's probability), generate; auto: embed where the "
        "folder has a sentence-transformers pooling config (modules.json), rerank where it has a "
        "rerank_template.jinja, else generate",
        choices=TASKS,
    )
    pooling: str | None = setting(
        None,
        "how an embedding pools the final hidden states over the prompt: last (token), mean, cls (the first "
        "token); default: the folder's sentence-transformers config, else last",
        choices=POOLING,
    )
    normalize: bool | None = setting(
        None, "L2-normalize embeddings (default: as the sentence-transformers Normalize module says, else true)"
    )
    matryoshka: bool = setting(
        False,
        "accept a request's `dimensions` (truncate, then renormalize) for any model; by default only where "
        "config.json lists matryoshka_dimensions or sets is_matryoshka",
    )
    rerank_template: str | None = setting(
        None,
        "a Jinja file rendering one (query, document) pair as the reranker's prompt (variables query, document, "
        "instruction); default: the folder's rerank_template.jinja, else Qwen3-Reranker's",
    )
    rerank_tokens: str = setting(
        "yes,no", "a rerank score is the first token's probability among these, at the prompt's last position"
    )

    def __post_init__(self) -> None:
        check_settings(self)
        if self.speculative_config is not None:
            SpeculativeConfig.parse(self.speculative_config)  # a bad one fails here, naming its key

    @classmethod
    def from_kwargs(cls, model: str, **settings: Any) -> EngineConfig:
        """`EngineConfig(model, **settings)`, where an unknown keyword is a ValueError naming it."""
        check_known(settings, [f.name for f in dataclasses.fields(cls)], "engine setting")
        spec = settings.get("speculative_config")
        if isinstance(spec, dict):  # vLLM's LLM(..., speculative_config={...})
            settings["speculative_config"] = json.dumps(spec)
        return cls(model=model, **settings)


# -- speculative decoding ----------------------------------------------------------------------

SPECULATIVE_METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 15  # 1 + k query rows a sequence: the native attention kernel takes up to 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """Which proposer guesses tokens ahead, and how many, in vLLM's shape: `--speculative-config
    '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'` (`LLM(...,
    speculative_config={...})`, a dict or its JSON). `method`: `ngram` (prompt lookup: the longest
    suffix n-gram of prompt + output found earlier in them proposes the tokens that followed it) or
    `draft_model` (`model`: a smaller model's folder, with the target's vocabulary, guesses). Bad keys
    and values are a ValueError naming `speculative_config.<key>`."""

    method: str
    num_speculative_tokens: int  # k: the most drafts a request gets a step
    prompt_lookup_min: int = 1  # ngram: the shortest suffix matched
    prompt_lookup_max: int = 4  # ngram: the longest suffix matched (tried first)
    model: str | None = None  # draft_model: the draft's folder (the target's vocabulary)
    # verify only the drafts the measured rule expects to pay this step (sched/spec_policy.py); False:
    # every draft, up to k (what tests of losslessness pin)
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config.method: expected one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}"
            )
        for name, low, high in (
            ("num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS),
            ("prompt_lookup_min", 1, None),
            ("prompt_lookup_max", 1, None),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low or (high and value > high):
                span = f"from {low} to {high}" if high else f">= {low}"
                raise ValueError(f"speculative_config.{name}: expected an integer {span}, got {value!r}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError(
                "speculative_config.model: the draft's folder, required with method draft_model and only then"
            )
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"speculative_config.model: expected a folder path, got {self.model!r}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config.adaptive: expected true or false, got {self.adaptive!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config.prompt_lookup_min: {self.prompt_lookup_min} is more than prompt_lookup_max "
                f"({self.prompt_lookup_max})"
            )

    @classmethod
    def parse(cls, value: str | dict[str, Any]) -> SpeculativeConfig:
        """From the flag's JSON or a dict."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not valid JSON ({e.msg})") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config: expected a JSON object, got {type(value).__name__}")
        known = [f.name for f in dataclasses.fields(cls)]
        for key in value:
            if key not in known:
                raise ValueError(f"speculative_config.{key}: unknown key; expected one of {', '.join(known)}")
        for required in ("method", "num_speculative_tokens"):
            if required not in value:
                raise ValueError(f"speculative_config.{required}: required")
        return cls(**value)

    def to_json(self) -> str:
        return json.dumps({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
