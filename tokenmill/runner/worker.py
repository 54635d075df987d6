"""Worker: builds the model side of an engine from its EngineConfig, and runs its steps.

In order: resolves the device and dtype, picks the attention backend by name, loads the model,
runs a warm-up step at the largest batch the scheduler may send (`max_num_batched_tokens` tokens
of prompt, then `max_num_seqs` decodes) on a scratch cache, and only then sizes the KV cache from
the memory left (`kv_cache_memory` when given; otherwise the CPU default, or on a GPU a fraction of
its memory less the warm-up's peak) and allocates it in the backend's own layout. The engine core
sees `num_blocks`, `block_size`, `max_model_len` and `execute(SchedulerOutput) -> StepOutput`;
nothing else of torch crosses.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import time

import torch

from tokenmill.config import DEFAULT_CPU_KV_CACHE_MEMORY, GPU_MEMORY_FRACTION, EngineConfig
from tokenmill.engine.tokenizer import Tokenizer
from tokenmill.kernels.autotune import Autotuner, default_cache_path
from tokenmill.kernels.cpu_build import NATIVE_DTYPES, CpuKernels, load_cpu_kernels
from tokenmill.layers.attention import AttentionBackend, KVCache, allocate_kv_cache
from tokenmill.layers.awq_gptq import checkpoint_method
from tokenmill.layers.backends import get_attention_backend
from tokenmill.layers.cpu_linear import CpuLinearMethod, dense_weight_shapes, get_dense_linear_method, tune_linear
from tokenmill.layers.fused_decode import FusedDecode
from tokenmill.layers.linear import LinearMethod
from tokenmill.layers.ops import get_layer_ops
from tokenmill.layers.quant_linear import (
    Int4LinearMethod,
    Int8LinearMethod,
    get_head_method,
    get_quant_method,
    tune_quantized,
    weights_by_shape,
)
from tokenmill.layers.quantize import QuantSpec
from tokenmill.models.config import ModelConfig
from tokenmill.models.gguf_blocks import BLOCK
from tokenmill.models.gguf_checkpoint import GGUFCheckpoint, is_gguf
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.models.loader import load_model, read_model_config, resolve_dtype
from tokenmill.outputs import SchedulerOutput, StepOutput
from tokenmill.runner import huge_pages
from tokenmill.runner.cpu_memory import keep_freed_memory
from tokenmill.runner.cpu_threads import physical_cores
from tokenmill.runner.cuda_graphs import DecodeGraphs, PaddedMetadata, graph_batch_sizes
from tokenmill.runner.dtype_choice import CANDIDATES, fastest_dtype, log_report
from tokenmill.runner.kv_cache import kv_bytes_per_block, kv_cache_budget
from tokenmill.runner.model_runner import ModelRunner
from tokenmill.runner.warm_up import GREEDY, WORST, WarmUpShape, warm_up
from tokenmill.spec_decode.config import SpeculativeConfig
from tokenmill.spec_decode.draft_model import DraftRunner
from tokenmill.structured.grammar import GrammarCompiler

logger = logging.getLogger("tokenmill")


def grammar_compiler(model: str, vocab_size: int, compile_timeout: float) -> GrammarCompiler:
    """The GrammarCompiler of structured-output requests, over the model's own tokenizer."""
    return GrammarCompiler(Tokenizer(model), vocab_size, compile_timeout)


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


def prepare_native(
    model: LlamaForCausalLM, tuner: Autotuner, max_seqs: int, max_tokens: int, *, tune: bool, fused: bool
) -> None:
    """What the engine does to a loaded model beyond loading it: with `tune`, the native linear
    method's kernel per weight shape and row class (through `tuner`: up to `max_tokens` rows, prompt
    chunks included; up to `max_seqs` for the output projection, which sees one row a sequence); with
    `fused`, the decoder layers as one native call a step where that applies."""
    method = model.dense
    if tune and isinstance(method, CpuLinearMethod):
        shapes = dense_weight_shapes(model, model.tied_head())
        rows = {shape: max_tokens for shape in shapes}
        rows[(model.config.vocab_size, model.config.hidden_size)] = min(max_seqs, max_tokens)
        start = time.perf_counter()  # (timed once per machine, then read from the autotune cache)
        plan = tune_linear(method, shapes, rows, tuner)
        native = sorted(k for k, v in plan.items() if v == "cpu")
        logger.info(
            "linear layers (%s, tuned in %.1f s): native kernel for %s; torch's GEMM otherwise",
            model.dtype,
            time.perf_counter() - start,
            ", ".join(native) or "none",
        )
    for quantized in model.quantized_methods() if tune else []:
        shapes = weights_by_shape(layer for _, layer in model.quantized_layers() if layer.linear_method is quantized)
        rows = {shape: max_tokens for shape in shapes}
        head = (model.config.vocab_size, model.config.hidden_size)
        if head in rows:
            rows[head] = min(max_seqs, max_tokens)
        dtype = model.dtype
        plan = tune_quantized(quantized, shapes, rows, dtype, tuner)
        logger.info("%s linear layers (%s): %s", quantized.name, dtype, ", ".join(f"{k} {v}" for k, v in plan.items()))
    kernels = load_cpu_kernels() if fused and FusedDecode.supports(model) else None  # built already then
    if kernels is not None:
        model.fused_decode = FusedDecode(kernels, model)


class Worker:
    def __init__(self, config: EngineConfig) -> None:
        self.device = torch.device(config.device)
        if self.device.type == "cuda":  # (graph capture, events and Triton's launches use the current device)
            torch.cuda.set_device(self.device)
        if self.device.type == "cpu":
            keep_freed_memory()
            torch.set_num_threads(config.cpu_threads or physical_cores())
        self.huge_pages = self.device.type == "cpu" and config.cpu_huge_pages and huge_pages.available()
        self.tuner = Autotuner(self.device, default_cache_path())
        # a GGUF file is read once (its metadata parse takes seconds), then built from as often as needed
        source: str | GGUFCheckpoint = GGUFCheckpoint(config.model) if is_gguf(config.model) else config.model
        checkpoint_config = read_model_config(source)
        # AWQ / GPTQ / compressed-tensors layers as stored (config.json), or None
        self.checkpoint_quantization = checkpoint_config.quantization
        if config.dtype == "fastest":
            model, self.backend = self._fastest(config, source)
        else:
            dtype = default_dtype(config.dtype, checkpoint_config, self.device)
            model, self.backend = self._build(config, source, dtype)
        dtype = model.dtype
        ops = model.ops
        self.weight_bytes = model.weight_bytes()
        dense_bytes = model.dense_weight_bytes()
        logger.info(
            "weights: %.1f MiB (%s, quantization %s; %.1f MiB unquantized)",
            self.weight_bytes / 2**20,
            dtype,
            config.quantization,
            dense_bytes / 2**20,
        )
        self.model_config: ModelConfig = model.config
        self.dtype = dtype
        self.kv_dtype = torch.int8 if config.kv_cache_dtype == "int8" else dtype
        limit = self.model_config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or limit, limit)
        self.block_size = config.block_size
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._warm_up(model, config)
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else 0
        # on CPU, the default budget grows by what quantized weights free (on a GPU the free memory measured
        # after loading already counts it)
        freed = max(0, dense_bytes - self.weight_bytes)
        budget = kv_cache_budget(
            self.device, config.kv_cache_memory, DEFAULT_CPU_KV_CACHE_MEMORY + freed, GPU_MEMORY_FRACTION, peak
        )
        if freed and config.kv_cache_memory is None and self.device.type == "cpu":
            logger.info(
                "KV cache budget: the default %.1f MiB + the %.1f MiB %s weights free",
                DEFAULT_CPU_KV_CACHE_MEMORY / 2**20,
                freed / 2**20,
                config.quantization,
            )
        per_block = kv_bytes_per_block(self.backend, self.model_config, self.block_size, self.kv_dtype)
        spec = SpeculativeConfig.parse(config.speculative_config) if config.speculative_config else None
        draft = self._draft_model(config, spec, dtype) if spec is not None and spec.model is not None else None
        if draft is not None:  # its KV sits in the same blocks: each block holds both models' share
            per_block += kv_bytes_per_block(self.backend, draft.config, self.block_size, self.kv_dtype)
        graphed = self.device.type == "cuda" and not config.enforce_eager and isinstance(self.backend, PaddedMetadata)
        self.num_blocks = budget // per_block - (1 if graphed else 0)  # (the graphs' padding rows' scratch block)
        if self.num_blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"kv_cache_memory: {budget} bytes hold {self.num_blocks * self.block_size} tokens of KV, fewer "
                f"than max_model_len ({self.max_model_len}); give at least "
                f"{-(-self.max_model_len // self.block_size) * per_block} bytes or lower max_model_len"
            )
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB, %s, %s attention, %s layer ops, %d threads)",
            self.num_blocks,
            self.block_size,
            self.num_blocks * self.block_size,
            budget / 2**20,
            self.kv_dtype,
            self.backend.name,
            ops.name,
            torch.get_num_threads(),
        )
        if self.kv_dtype != self.dtype:
            dense = budget // kv_bytes_per_block(self.backend, self.model_config, self.block_size, self.dtype)
            logger.info(
                "KV cache in int8 with per-token scales: %d tokens where %s would hold %d (%.2fx)",
                self.num_blocks * self.block_size,
                self.dtype,
                dense * self.block_size,
                self.num_blocks / max(1, dense),
            )
        grammar = functools.partial(
            grammar_compiler, config.model, self.model_config.vocab_size, config.grammar_compile_timeout
        )
        caches = self._caches(self.num_blocks + (1 if graphed else 0))
        self.runner = ModelRunner(model, caches, self.backend, self.block_size, grammar)
        if graphed:
            start = time.perf_counter()
            sizes = graph_batch_sizes(config.max_num_seqs)
            try:
                self.runner.graphs = DecodeGraphs(
                    model, caches, self.backend, self.block_size, self.max_model_len, self.num_blocks, sizes, True
                )
                logger.info("CUDA graphs: decode steps of up to %d rows, %d sizes captured in %.1f s", sizes[-1],
                            len(sizes), time.perf_counter() - start)  # fmt: skip
            except RuntimeError as e:  # a kernel that cannot be captured (the log names it): eager steps
                logger.warning("CUDA graphs: capture failed, every step runs eagerly (%s)", str(e).splitlines()[0])
        if draft is not None and spec is not None:
            k = spec.num_speculative_tokens
            scratch = DraftRunner.scratch_blocks(config.max_num_seqs, k, self.block_size)
            caches = self._caches(self.num_blocks + scratch, draft.config)
            self.runner.draft = DraftRunner(draft, caches, self.backend, self.block_size, self.num_blocks, k)
        if config.greedy_head == "auto":
            self.runner.greedy_head = self._greedy_head_is_faster(model, config.max_num_seqs)
        else:
            self.runner.greedy_head = config.greedy_head == "head"

    def _build(
        self, config: EngineConfig, source: str | GGUFCheckpoint, dtype: torch.dtype
    ) -> tuple[LlamaForCausalLM, AttentionBackend]:
        """The model in `dtype` with its attention backend, layer ops and linear method; with
        `linear_backend` auto, the method's kernel per weight shape and row class tuned here."""
        name = attention_backend_name(config.attention_backend, self.device, dtype, config.kv_cache_dtype)
        backend = get_attention_backend(name)
        ops = get_layer_ops(native_or_reference(config.layer_ops, "layer_ops", self.device, dtype))
        method, head = self._linear_methods(config, dtype)
        checkpoint_methods = self._checkpoint_methods(config, source, dtype)
        if checkpoint_methods and isinstance(source, GGUFCheckpoint):
            head = head or self._tied_gguf_head(source, self._quant_kernels(config, dtype))
        model = load_model(
            source,
            dtype=dtype,
            device=self.device,
            backend=backend,
            ops=ops,
            linear_method=method,
            head_method=head,
            checkpoint_methods=checkpoint_methods,
        )
        if self.huge_pages:
            logger.info("weights on 2 MB pages: %.1f MiB", huge_pages.move_to_huge_pages(model) / 2**20)
        prepare_native(
            model,
            self.tuner,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            tune=config.linear_backend == "auto",
            fused=config.fused_decode,
        )
        return model, backend

    def _linear_methods(self, config: EngineConfig, dtype: torch.dtype) -> tuple[LinearMethod, LinearMethod | None]:
        """The dense method (`linear_backend`), or the quantized one `quantization` names; and the
        output projection's own (`quantization_head`; None: the layers')."""
        stored = self.checkpoint_quantization
        if config.quantization in ("auto", "none"):
            if config.quantization_group_size is not None or config.quantization_head != "same":
                raise ValueError(
                    "quantization_group_size, quantization_head: apply to int8, int4 or w8a8; "
                    f"quantization is {config.quantization}"
                )
            method = get_dense_linear_method(
                native_or_reference(config.linear_backend, "linear_backend", self.device, dtype)
            )
            if stored is None:
                return method, None
            if config.quantization == "none" or self.device.type != "cpu":
                raise ValueError(
                    f"quantization: this checkpoint is {stored.method.upper()}-quantized; it loads as stored "
                    f"(quantization auto) on a CPU device, not with quantization {config.quantization} on {self.device}"
                )
            return checkpoint_method(stored, self._quant_kernels(config, dtype)), method  # (the head: dense)
        if stored is not None:
            raise ValueError(
                f"quantization: this checkpoint is {stored.method.upper()}-quantized already; "
                f"leave quantization auto, not {config.quantization}"
            )
        if self.device.type != "cpu":
            raise ValueError(f"quantization: {config.quantization} runs on a CPU device, not {self.device}")
        spec = QuantSpec(
            config.quantization,
            config.quantization_group_size,
            config.quantization_group_fallback,
            config.quantization_head,
        )
        kernels = self._quant_kernels(config, dtype)
        return get_quant_method(spec, kernels), get_head_method(spec, kernels)

    def _checkpoint_methods(
        self, config: EngineConfig, source: str | GGUFCheckpoint, dtype: torch.dtype
    ) -> dict[str, LinearMethod] | None:
        """With `quantization` auto on a CPU, a GGUF file's Q8_0 matrices load into int8 and its Q4_0 /
        Q4_1 ones into int4 (groups of 32: the same grids), as stored; None: everything dense."""
        if config.quantization != "auto" or not isinstance(source, GGUFCheckpoint) or self.device.type != "cpu":
            return None
        kernels = self._quant_kernels(config, dtype)
        int8 = Int8LinearMethod(QuantSpec("int8", BLOCK), kernels, prequantized=True)
        int4 = Int4LinearMethod(QuantSpec("int4", BLOCK), kernels, prequantized=True)
        return {"Q8_0": int8, "Q4_0": int4, "Q4_1": int4}

    @staticmethod
    def _quant_kernels(config: EngineConfig, dtype: torch.dtype) -> CpuKernels | None:
        """The native kernels the quantized methods run, where they build and are asked for."""
        return load_cpu_kernels() if config.linear_backend != "torch" and dtype in NATIVE_DTYPES else None

    @staticmethod
    def _tied_gguf_head(source: GGUFCheckpoint, kernels: CpuKernels | None) -> LinearMethod | None:
        """A tied output projection over a Q8_0 embedding table: an int8 layer of its own, quantized from
        the table in groups of 32 (Q8_0's grid again, exactly: each block's largest value is its scale
        times 127), the dense table then dropped; None (the table itself) for other types."""
        table = next(i for i in source.infos if i.hf_name == "model.embed_tokens.weight")
        if not source.config.tie_word_embeddings or table.type_name != "Q8_0":
            return None
        return Int8LinearMethod(QuantSpec("int8", BLOCK), kernels)

    def _fastest(self, config: EngineConfig, source: str | GGUFCheckpoint) -> tuple[LlamaForCausalLM, AttentionBackend]:
        built: dict[torch.dtype, tuple[LlamaForCausalLM, AttentionBackend]] = {}

        def build(dtype: torch.dtype) -> tuple[LlamaForCausalLM, AttentionBackend]:
            built[dtype] = self._build(config, source, dtype)
            return built[dtype]

        report = fastest_dtype(build, CANDIDATES, config.max_num_seqs, self.tuner)
        log_report(report)
        return built[report.dtype]

    def execute(self, scheduled: SchedulerOutput) -> StepOutput:
        return self.runner.execute(scheduled)

    def _draft_model(self, config: EngineConfig, spec: SpeculativeConfig, dtype: torch.dtype) -> LlamaForCausalLM:
        """The draft model of speculative decoding, built as the target is (dtype, kernels, quantization),
        with the target's vocabulary."""
        assert spec.model is not None
        source: str | GGUFCheckpoint = GGUFCheckpoint(spec.model) if is_gguf(spec.model) else spec.model
        try:
            draft, _ = self._build(config, source, dtype)
        except (OSError, ValueError) as e:
            raise ValueError(f"speculative_config.model: {e}") from None
        if draft.config.vocab_size != self.model_config.vocab_size:
            raise ValueError(
                f"speculative_config.model: its vocabulary has {draft.config.vocab_size} tokens, the target's "
                f"{self.model_config.vocab_size}: a draft must share the target's tokenizer"
            )
        logger.info("draft model: %s, %.1f MiB of weights", spec.model, draft.weight_bytes() / 2**20)
        return draft

    def _caches(self, num_blocks: int, cfg: ModelConfig | None = None) -> list[KVCache]:
        cfg = cfg or self.model_config
        return allocate_kv_cache(
            self.backend,
            cfg.num_layers,
            num_blocks,
            self.block_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            self.kv_dtype,
            self.device,
        )

    def _greedy_head_is_faster(self, model: LlamaForCausalLM, rows: int) -> bool:
        """Whether `greedy_tokens` (the output projection in cache-sized chunks, argmax as it goes)
        beats logits + argmax for `rows` greedy rows here: it depends on the CPU and the dtype (on
        one AVX-512 machine 11% faster at 32 rows in float32, 14% slower in bfloat16). Timed on random
        hidden states through the autotune cache. Within this machine's noise either may win; both
        pick the argmax."""
        cfg = self.model_config
        hidden = torch.randn(rows, cfg.hidden_size, device=self.device).to(self.dtype)
        with torch.inference_mode():
            if model.greedy_tokens(hidden) is None:
                return False
            shape = f"{rows} rows {self.dtype} hidden {cfg.hidden_size} vocab {cfg.vocab_size}"
            choice = self.tuner.choose(
                "greedy_head",
                shape,
                {
                    "head": lambda: model.greedy_tokens(hidden),
                    "logits": lambda: model.ops.argmax(model.compute_logits(hidden)),
                },
                repeats=7,
            )
        logger.info(
            "greedy steps: %s (at %d rows: %s)",
            "argmax in the head" if choice.name == "head" else "logits",
            rows,
            ", ".join(f"{n} {t:.2f} ms" for n, t in choice.timings_ms.items()),
        )
        return choice.name == "head"

    def _warm_up(self, model: LlamaForCausalLM, config: EngineConfig) -> None:
        """The largest prefill chunk, then the most decodes, on a scratch cache: kernels are chosen and
        memory peaks before the KV cache takes what is left. On a GPU the steps are the worst the
        settings allow (prompt logprobs over the chunk, top-p at every row), as the cache is sized
        against their peak; elsewhere the greedy pair."""
        shape = WarmUpShape(
            min(config.max_num_batched_tokens, self.max_model_len),
            min(config.max_num_seqs, config.max_num_batched_tokens),
            self.block_size,
        )
        runner = ModelRunner(model, self._caches(shape.num_blocks), self.backend, self.block_size)
        warm_up(runner, shape, WORST if self.device.type == "cuda" else GREEDY)
