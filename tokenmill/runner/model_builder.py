"""The engine's model, built from its EngineConfig: every "auto" resolved in one place, logged as one line.

`build_model(config, device)` opens the checkpoint (a GGUF file is parsed once, then built from as
often as needed), resolves the settings (`resolve`: the dtype, the attention backend, the layer
ops, the dense linear method and the quantization, as a `QuantConfig`), loads the model (a float
checkpoint quantized at load reads its quantized weights from runner/quantized_cache.py after the
first start), plans the native kernels per weight shape and row class and fuses the decode layers
where they apply (`prepare_native`), picks the greedy head where it is `auto`, and hands back a
`BuiltModel`. A server's start measures nothing: every kernel choice is the autotune cache's, or,
where it has none, kernels/defaults.py's rule for the CPU kind (the resolution line counts them);
`tokenmill tune` (runner/tune.py) measures those once and fills the cache. `--dtype fastest` is a
request to measure: each candidate dtype is built and `runner/dtype_choice.py` keeps the fastest
faithful one, with a progress bar. The draft model of speculative decoding is built the same way
(`build_draft`). Each long phase logs a start-up line before and after (runner/startup_log.py).
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from tokenmill.config import EngineConfig
from tokenmill.kernels.autotune import Autotuner, default_cache_path
from tokenmill.kernels.cpu_build import NATIVE_DTYPES, load_cpu_kernels
from tokenmill.kernels.defaults import DECODE, default_choice
from tokenmill.layers.attention import AttentionBackend
from tokenmill.layers.backends import get_attention_backend
from tokenmill.layers.backends.cpu_paged import CpuPagedBackend, prompt_candidates
from tokenmill.layers.fused_decode import FusedDecode
from tokenmill.layers.ops import LayerOps, get_layer_ops
from tokenmill.model_files import is_gguf
from tokenmill.models.config import ModelConfig
from tokenmill.models.gguf_checkpoint import GGUFCheckpoint
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.models.loader import gguf_layer_types, load_model, read_model_config, resolve_dtype
from tokenmill.quant.config import QuantConfig, QuantSettings, build_quant_config
from tokenmill.quant.cpu_dense import CpuLinearMethod, dense_weight_shapes, tune_linear
from tokenmill.quant.int_methods import QuantizedLinearMethod
from tokenmill.quant.tuning import tune_quantized, weights_by_shape
from tokenmill.runner import huge_pages
from tokenmill.runner.cpu_memory import trim_heap
from tokenmill.runner.cpu_threads import torch_threads
from tokenmill.runner.dtype_choice import CANDIDATES, fastest_dtype, log_report
from tokenmill.runner.quantized_cache import CacheMismatch, cache_for
from tokenmill.runner.startup_log import phase

logger = logging.getLogger("tokenmill")

Source = str | GGUFCheckpoint  # a model folder, or a GGUF file opened once


@dataclass
class BuiltModel:
    """A loaded model and what it was built with; `greedy_head`: greedy rows take the argmax inside
    the output projection (`LlamaForCausalLM.greedy_tokens`) rather than logits + argmax."""

    model: LlamaForCausalLM
    backend: AttentionBackend
    ops: LayerOps
    dtype: torch.dtype
    quant: QuantConfig
    greedy_head: bool = False


@dataclass(frozen=True)
class Resolved:
    """The settings of one build with every "auto" resolved (`greedy_head` is timed once built)."""

    dtype: torch.dtype
    attention: str
    layer_ops: str
    quant: QuantConfig


def native_or_reference(name: str, field: str, device: torch.device, dtype: torch.dtype) -> str:
    """The backend (or layer ops) name to build: `auto` means the native CPU kernels only where they
    run (a CPU device, float32 or bfloat16), the torch reference elsewhere; `cpu` elsewhere is an error."""
    native = device.type == "cpu" and dtype in NATIVE_DTYPES
    if name == "cpu" and not native:
        raise ValueError(f"{field}: 'cpu' runs float32 and bfloat16 on a CPU device, not {dtype} on {device}")
    return name if native or name != "auto" else "torch"


def attention_backend_name(name: str, device: torch.device, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> str:
    """`auto` on a CUDA device: triton where it is installed (and the cache is not int8, which it does
    not read); elsewhere as `native_or_reference`."""
    triton = importlib.util.find_spec("triton") is not None
    if name == "auto" and device.type == "cuda" and triton and kv_cache_dtype != "int8":
        return "triton"
    return native_or_reference(name, "attention_backend", device, dtype)


def default_dtype(config_dtype: str, checkpoint: ModelConfig, device: torch.device) -> torch.dtype:
    """`--dtype` resolved: auto is the checkpoint's dtype, except a float32 checkpoint on a GPU runs in
    bfloat16 there (as vLLM does: the tensor cores' dtype, half the bytes a step streams)."""
    dtype = resolve_dtype(config_dtype, checkpoint)
    if config_dtype == "auto" and device.type == "cuda" and dtype == torch.float32:
        logger.info("dtype auto: the float32 checkpoint runs in bfloat16 on %s (--dtype float32 keeps it)", device)
        return torch.bfloat16
    return dtype


def open_checkpoint(model: str) -> Source:
    """A GGUF file opened (its metadata parse takes seconds, so once), or the folder's path."""
    if not is_gguf(model):
        return model
    with phase(f"reading the GGUF file {Path(model).name}'s metadata"):
        return GGUFCheckpoint(model)


def resolve(config: EngineConfig, device: torch.device, source: Source, dtype: torch.dtype) -> Resolved:
    """Every "auto" of one build in `dtype`: the attention backend, the layer ops, the linear methods."""

    def dense_backend() -> str:  # (resolved only where a dense method is asked for)
        return native_or_reference(config.linear_backend, "linear_backend", device, dtype)

    checkpoint = read_model_config(source)
    settings = QuantSettings(
        config.quantization,
        config.quantization_group_size,
        config.quantization_group_fallback,
        config.quantization_head,
        config.linear_backend,
        config.gguf_layout,
        config.gguf_repack,
    )
    gguf = gguf_layer_types(source) if isinstance(source, GGUFCheckpoint) else None
    quant = build_quant_config(
        settings, device=device, dtype=dtype, dense_backend=dense_backend, stored=checkpoint.quantization,
        gguf_types=gguf,
    )  # fmt: skip
    attention = attention_backend_name(config.attention_backend, device, dtype, config.kv_cache_dtype)
    ops = native_or_reference(config.layer_ops, "layer_ops", device, dtype)
    return Resolved(dtype, attention, ops, quant)


def build_in(
    config: EngineConfig, device: torch.device, source: Source, dtype: torch.dtype, tuner: Autotuner
) -> BuiltModel:
    """The model in `dtype` with its attention backend, layer ops and linear methods; with
    `linear_backend` auto, the methods' kernel per weight shape and row class planned here."""
    resolved = resolve(config, device, source, dtype)
    backend = get_attention_backend(resolved.attention)
    ops = get_layer_ops(resolved.layer_ops)
    huge = device.type == "cpu" and config.cpu_huge_pages and huge_pages.available()
    placed: list[int] = []  # the bytes given huge pages before the load (none where it quantizes)
    model = _load(config, device, source, resolved, backend, ops, placed.append if huge else None)
    if huge:
        moved = huge_pages.move_to_huge_pages(model)
        trim_heap()  # the 4 KB copies moved from go back to the system (glibc keeps them: cpu_memory.py)
        logger.info("weights on 2 MB pages: %.1f MiB", (sum(placed) + moved) / 2**20)
    tune = config.linear_backend == "auto"
    prepare_native(
        model, tuner, config.max_num_seqs, config.max_num_batched_tokens, tune=tune, fused=config.fused_decode
    )
    return BuiltModel(model, backend, ops, resolved.dtype, resolved.quant)


def _load(
    config: EngineConfig,
    device: torch.device,
    source: Source,
    resolved: Resolved,
    backend: AttentionBackend,
    ops: LayerOps,
    placed: Callable[[int], object] | None = None,
) -> LlamaForCausalLM:
    """The checkpoint loaded (and quantized where asked); a float checkpoint quantized at load reads
    its quantized weights from the cache after the first start, and writes them there on that one.
    With `placed`, a load that quantizes nothing writes its weights straight onto huge pages (the
    bytes so placed passed to `placed`); a quantizing one leaves them to `move_to_huge_pages`, as its
    dense weights are dropped once quantized. On a CPU, torch runs one thread meanwhile, and the
    layers are quantized on as many threads as torch had, one layer each (runner/cpu_threads.py)."""
    threads = torch_threads(1) if device.type == "cpu" else nullcontext(1)
    with threads as workers:
        name = Path(source.path if isinstance(source, GGUFCheckpoint) else source).name
        dtype, quant = resolved.dtype, resolved.quant
        cache = cache_for(source, quant, dtype, device)
        if cache is not None and cache.exists():
            try:
                with phase(f"reading {name}'s {config.quantization} weights from the cache {cache.folder}"):
                    return cache.load(str(source), dtype, backend, ops, quant)
            except (CacheMismatch, OSError) as exc:
                logger.warning("quantized weights cache %s unusable (%s): quantizing again", cache.folder, exc)
        what = f"reading the weights of {name} in {str(dtype).removeprefix('torch.')}"
        if cache is not None:
            what += f" and quantizing them to {config.quantization} (once: then cached)"
        place = None
        if placed is not None and not quantizes_at_load(quant):
            place = lambda m: placed(huge_pages.place_on_huge_pages(m))  # noqa: E731
        with phase(what):
            model = load_model(
                source, dtype=dtype, device=device, backend=backend, ops=ops, quant=quant, place=place, workers=workers
            )
        if cache is not None:
            with phase(f"writing the {config.quantization} weights to the cache {cache.folder}"):
                cache.save(model)
        return model


def quantizes_at_load(quant: QuantConfig) -> bool:
    """Whether a method of `quant` quantizes dense weights after loading them (not a checkpoint's own)."""
    return any(isinstance(m, QuantizedLinearMethod) and not m.prequantized for m in (quant.layers, quant.head))


def build_model(config: EngineConfig, device: torch.device, tuner: Autotuner | None = None) -> BuiltModel:
    """The engine's model (module docstring), its resolution logged as one line. `tuner` (default: the
    machine's autotune cache, not measuring) makes the kernel choices."""
    source = open_checkpoint(config.model)
    tuner = tuner or Autotuner(device, default_cache_path(), measure=False)
    if config.dtype == "fastest":
        built = _fastest(config, device, source, tuner)
    else:
        dtype = default_dtype(config.dtype, read_model_config(source), device)
        built = build_in(config, device, source, dtype, tuner)
    if config.greedy_head == "auto":
        built.greedy_head = greedy_head_is_faster(built, config.max_num_seqs, tuner)
    else:
        built.greedy_head = config.greedy_head == "head"
    choose_prompt_attention(built, config.max_num_batched_tokens, tuner)
    _log(config, built, tuner)
    return built


def _fastest(config: EngineConfig, device: torch.device, source: Source, tuner: Autotuner) -> BuiltModel:
    """`--dtype fastest`: every candidate built, the fastest faithful one kept. An explicit request to
    measure: the tuner measures what its cache lacks, a progress bar counting the choices."""
    built: dict[torch.dtype, BuiltModel] = {}

    def build(dtype: torch.dtype) -> tuple[LlamaForCausalLM, AttentionBackend]:
        built[dtype] = build_in(config, device, source, dtype, tuner)
        return built[dtype].model, built[dtype].backend

    measure, progress = tuner.measure, tuner.progress
    logger.info("dtype fastest: building %d candidate dtypes and timing what the cache lacks", len(CANDIDATES))
    with tqdm(desc="dtype fastest: kernel choices measured", unit=" choice", mininterval=1.0) as bar:
        tuner.measure, tuner.progress = True, progress or bar
        try:
            report = fastest_dtype(build, CANDIDATES, config.max_num_seqs, tuner)
        finally:
            tuner.measure, tuner.progress = measure, progress
    log_report(report)
    return built[report.dtype]


def _log(config: EngineConfig, built: BuiltModel, tuner: Autotuner) -> None:
    """The one line that says what every setting resolved to, the weights' size, and where the kernel
    choices came from (cache, measured, defaults)."""
    model = built.model
    defaults = tuner.counts["default"]
    hint = f" (`tokenmill tune {config.model}` measures the defaults once)" if defaults else ""
    logger.info(
        "model: dtype %s (%s), %s attention, %s layer ops, %s linear layers, quantization %s (%s), greedy %s; "
        "weights %.1f MiB (%.1f MiB unquantized); kernel choices %s%s",
        str(built.dtype).removeprefix("torch."),
        config.dtype,
        built.backend.name,
        built.ops.name,
        getattr(model.dense, "name", "torch"),
        built.quant.describe(),
        config.quantization,
        "argmax in the head" if built.greedy_head else "logits",
        model.weight_bytes() / 2**20,
        model.dense_weight_bytes() / 2**20,
        tuner.summary(),
        hint,
    )


def build_draft(
    config: EngineConfig, device: torch.device, draft: str, dtype: torch.dtype, vocab_size: int
) -> LlamaForCausalLM:
    """The draft model of speculative decoding, built as the target is (dtype, kernels, quantization),
    with the target's vocabulary (`vocab_size`)."""
    try:
        tuner = Autotuner(device, default_cache_path(), measure=False)
        model = build_in(config, device, open_checkpoint(draft), dtype, tuner).model
    except (OSError, ValueError) as e:
        raise ValueError(f"speculative_config.model: {e}") from None
    if model.config.vocab_size != vocab_size:
        raise ValueError(
            f"speculative_config.model: its vocabulary has {model.config.vocab_size} tokens, the target's "
            f"{vocab_size}: a draft must share the target's tokenizer"
        )
    logger.info("draft model: %s, %.1f MiB of weights", draft, model.weight_bytes() / 2**20)
    return model


def prepare_native(
    model: LlamaForCausalLM, tuner: Autotuner, max_seqs: int, max_tokens: int, *, tune: bool, fused: bool
) -> None:
    """What the engine does to a loaded model beyond loading it: with `tune`, the kernel plans
    (`plan_kernels`); with `fused`, the decoder layers as one native call a step where that applies."""
    if tune:
        plan_kernels(model, tuner, max_seqs, max_tokens)
    kernels = load_cpu_kernels() if fused and FusedDecode.supports(model) else None  # built already then
    if kernels is not None:
        model.fused_decode = FusedDecode(kernels, model)


def plan_kernels(model: LlamaForCausalLM, tuner: Autotuner, max_seqs: int, max_tokens: int) -> None:
    """The native linear method's kernel per weight shape and row class, and each quantized method's
    (through `tuner`: cached, measured, or by default; up to `max_tokens` rows, prompt chunks
    included; up to `max_seqs` for the output projection, which sees one row a sequence)."""
    method = model.dense
    head = (model.config.vocab_size, model.config.hidden_size)
    if isinstance(method, CpuLinearMethod):
        shapes = dense_weight_shapes(model, model.tied_head())
        rows = {shape: max_tokens for shape in shapes}
        rows[head] = min(max_seqs, max_tokens)
        plan = tune_linear(method, shapes, rows, tuner)
        native = sorted(k for k, v in plan.items() if v == "cpu")
        logger.info(
            "linear layers (%s): native kernel for %s; torch's GEMM otherwise",
            model.dtype,
            ", ".join(native) or "none",
        )
    for quantized in model.quantized_methods():
        shapes = weights_by_shape(layer for _, layer in model.quantized_layers() if layer.linear_method is quantized)
        rows = {shape: max_tokens for shape in shapes}
        if head in rows:
            rows[head] = min(max_seqs, max_tokens)
        plan = tune_quantized(quantized, shapes, rows, model.dtype, tuner)
        logger.info(
            "%s linear layers (%s): %s", quantized.name, model.dtype, ", ".join(f"{k} {v}" for k, v in plan.items())
        )


def greedy_head_is_faster(built: BuiltModel, rows: int, tuner: Autotuner) -> bool:
    """Whether `greedy_tokens` (the output projection in cache-sized chunks, argmax as it goes)
    beats logits + argmax for `rows` greedy rows here: it depends on the CPU and the dtype. Timed on
    random hidden states through the autotune cache (not measuring: its cached choice, else the
    default, logits); within a machine's noise either may win, and both pick the argmax."""
    model, dtype = built.model, built.dtype
    cfg = model.config
    hidden = torch.randn(rows, cfg.hidden_size, device=model.norm.weight.device).to(dtype)
    with torch.inference_mode():
        if model.greedy_head_weight() is None:  # (asked, not run: a 1B model's head is a 0.1 GB read)
            return False
        shape = f"{rows} rows {dtype} hidden {cfg.hidden_size} vocab {cfg.vocab_size}"
        candidates = {
            "head": lambda: model.greedy_tokens(hidden),
            "logits": lambda: model.ops.argmax(model.compute_logits(hidden)),
        }
        default = default_choice("greedy_head", DECODE, str(dtype).removeprefix("torch."), tuner.cpu, candidates)
        choice = tuner.choose("greedy_head", shape, candidates, repeats=7, default=default)
    timings = ", ".join(f"{n} {t:.2f} ms" for n, t in choice.timings_ms.items()) or "by default"
    logger.info(
        "greedy steps: %s (at %d rows: %s)", "argmax in the head" if choice.name == "head" else "logits", rows, timings
    )
    return choice.name == "head"


def choose_prompt_attention(built: BuiltModel, chunk: int, tuner: Autotuner) -> None:
    """Which path the `cpu` backend's prompt chunks take (`prompt_attention`: its paged kernel or
    torch's SDPA), for this model's heads in its dtype at `chunk` tokens a chunk: through the autotune
    cache (not measuring: its cached choice, else the CPU kind's rule, kernels/defaults.py)."""
    backend = built.backend
    if not isinstance(backend, CpuPagedBackend):
        return
    cfg = built.model.config
    dtype = str(built.dtype).removeprefix("torch.")
    shape = f"{chunk} tokens after {chunk} in {dtype}, {cfg.num_heads} heads on {cfg.num_kv_heads} x {cfg.head_dim}"
    candidates = prompt_candidates(backend.kernels, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, built.dtype, chunk)
    choice = tuner.choose("prompt_attention", shape, candidates, repeats=3, default=backend.prompt_attention)
    backend.use_for_prompts(choice.name)
    timings = ", ".join(f"{n} {t:.1f} ms" for n, t in choice.timings_ms.items()) or "by default"
    logger.info("prompt attention: %s (%s)", "the paged kernel" if choice.name == "native" else "SDPA", timings)


def refine(built: BuiltModel, config: EngineConfig, tuner: Autotuner) -> None:
    """The kernel choices of a built model made again through `tuner` (measuring, for `tokenmill
    tune`): the kernel plans, the greedy head and the prompt attention, as `build_model` made them."""
    if config.linear_backend == "auto":
        plan_kernels(built.model, tuner, config.max_num_seqs, config.max_num_batched_tokens)
    if config.greedy_head == "auto":
        built.greedy_head = greedy_head_is_faster(built, config.max_num_seqs, tuner)
    choose_prompt_attention(built, config.max_num_batched_tokens, tuner)
