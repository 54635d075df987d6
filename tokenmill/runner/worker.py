"""Worker: the model side of an engine, built from its EngineConfig, and its steps.

In order: sets up the device (threads, the freed-memory policy), builds the model
(`runner/model_builder.py`: every "auto" resolved there; a draft model too), runs a warm-up step at
the largest batch the scheduler may send (`max_num_batched_tokens` tokens of prompt, then
`max_num_seqs` decodes) on a scratch cache, and only then sizes the KV cache from the memory left
(`kv_cache_memory` when given; otherwise the CPU default, or on a GPU a fraction of its memory less
the warm-up's peak) and allocates it in the backend's own layout; then captures the CUDA graphs of
decode steps where they apply, and gives the runner its speculative decoding proposer (prompt
lookup, or the draft model with its own KV cache). The engine core sees `num_blocks`, `block_size`,
`max_model_len`, `execute(SchedulerOutput) -> StepOutput` and `after_update()`; nothing else of
torch crosses. A KV connector it is given (prefill/decode disaggregation) is bound to the cache and
runs around the forward: received KV written before it, finished prefills' KV copied out after the
step's update.
"""

from __future__ import annotations

import functools
import logging
import time

import torch

from tokenmill.config import DEFAULT_CPU_KV_CACHE_MEMORY, GPU_MEMORY_FRACTION, EngineConfig, SpeculativeConfig
from tokenmill.layers.attention import KVCache, allocate_kv_cache
from tokenmill.models.config import ModelConfig
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.outputs import SchedulerOutput, StepOutput
from tokenmill.runner.cpu_memory import HeapTrimmer, keep_freed_memory
from tokenmill.runner.cpu_threads import physical_cores
from tokenmill.runner.cuda_graphs import DecodeGraphs, PaddedMetadata, graph_batch_sizes
from tokenmill.runner.kv_cache import kv_bytes_per_block, kv_cache_budget
from tokenmill.runner.model_builder import BuiltModel, build_draft, build_model
from tokenmill.runner.model_runner import ModelRunner
from tokenmill.runner.startup_log import phase
from tokenmill.runner.warm_up import CPU_DECODES, CPU_PROMPT, GREEDY, WORST, WarmUpShape, warm_up
from tokenmill.sched.kv_connector import KVWorkerConnector, NoKVConnector
from tokenmill.spec_decode.draft_model import DraftRunner
from tokenmill.spec_decode.ngram import NgramProposer
from tokenmill.spec_decode.proposer import Proposer
from tokenmill.structured.grammar import GrammarCompiler

logger = logging.getLogger("tokenmill")


def set_up_device(config: EngineConfig) -> torch.device:
    """The engine's device, made current (graph capture, events and Triton's launches use it); on a
    CPU, freed memory kept for reuse and torch's threads set (`cpu_threads`, else the physical cores)."""
    device = torch.device(config.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if device.type == "cpu":
        keep_freed_memory()
        torch.set_num_threads(config.cpu_threads or physical_cores())
    return device


class Worker:
    def __init__(self, config: EngineConfig, kv_connector: KVWorkerConnector | None = None) -> None:
        self.device = set_up_device(config)
        self.heap = HeapTrimmer() if self.device.type == "cpu" else None  # (see runner/cpu_memory.py)
        built = build_model(config, self.device)
        model = built.model
        self.backend, self.dtype, self.model_config = built.backend, built.dtype, model.config
        self.weight_bytes = model.weight_bytes()
        self.kv_dtype = torch.int8 if config.kv_cache_dtype == "int8" else self.dtype
        limit = self.model_config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or limit, limit)
        self.block_size = config.block_size
        peak = self._warm_up(model, config)
        spec = SpeculativeConfig.parse(config.speculative_config) if config.speculative_config else None
        draft = None
        if spec is not None and spec.model is not None:
            draft = build_draft(config, self.device, spec.model, self.dtype, self.model_config.vocab_size)
        graphed = self.device.type == "cuda" and not config.enforce_eager and isinstance(self.backend, PaddedMetadata)
        self.num_blocks = self._size_kv_cache(config, built, peak, draft, graphed)
        grammar = functools.partial(
            GrammarCompiler.for_model, config.model, self.model_config.vocab_size, config.grammar_compile_timeout
        )
        with phase(f"allocating the KV cache ({self.num_blocks} blocks)"):  # (zeroed: every page touched)
            caches = self._caches(self.num_blocks + (1 if graphed else 0))
        self.runner = ModelRunner(model, caches, self.backend, self.block_size, grammar)
        if graphed:
            self.runner.graphs = self._capture(model, caches, config.max_num_seqs)
        if spec is not None:
            self.runner.proposer = self._proposer(spec, draft, config.max_num_seqs)
        self.runner.greedy_head = built.greedy_head
        self.kv_connector = kv_connector or NoKVConnector()
        self.kv_connector.bind(self.runner.kv_caches)

    def _proposer(self, spec: SpeculativeConfig, draft: LlamaForCausalLM | None, max_num_seqs: int) -> Proposer:
        """Speculative decoding's proposer, on the runner's side: prompt lookup, or the draft model with
        a KV cache of its own in the target's block layout (and scratch blocks for its guesses)."""
        k = spec.num_speculative_tokens
        if draft is None:
            return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max, k)
        scratch = DraftRunner.scratch_blocks(max_num_seqs, k, self.block_size)
        caches = self._caches(self.num_blocks + scratch, draft.config)
        return DraftRunner(draft, caches, self.backend, self.block_size, self.num_blocks, k)

    def _size_kv_cache(
        self, config: EngineConfig, built: BuiltModel, peak: int, draft: LlamaForCausalLM | None, graphed: bool
    ) -> int:
        """The KV cache's blocks: the budget over one block's bytes (a draft model's share included;
        less the graphs' padding rows' scratch block), checked against max_model_len, and logged."""
        # on CPU, the default budget grows by what quantized weights free (on a GPU the free memory measured
        # after loading already counts it)
        freed = max(0, built.model.dense_weight_bytes() - self.weight_bytes)
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
        if draft is not None:  # its KV sits in the same blocks: each block holds both models' share
            per_block += kv_bytes_per_block(self.backend, draft.config, self.block_size, self.kv_dtype)
        num_blocks = budget // per_block - (1 if graphed else 0)  # (the graphs' padding rows' scratch block)
        if num_blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"kv_cache_memory: {budget} bytes hold {num_blocks * self.block_size} tokens of KV, fewer "
                f"than max_model_len ({self.max_model_len}); give at least "
                f"{-(-self.max_model_len // self.block_size) * per_block} bytes or lower max_model_len"
            )
        self._log_kv_cache(num_blocks, budget, built)
        return num_blocks

    def _log_kv_cache(self, num_blocks: int, budget: int, built: BuiltModel) -> None:
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB, %s, %s attention, %s layer ops, %d threads)",
            num_blocks,
            self.block_size,
            num_blocks * self.block_size,
            budget / 2**20,
            self.kv_dtype,
            self.backend.name,
            built.ops.name,
            torch.get_num_threads(),
        )
        if self.kv_dtype != self.dtype:
            dense = budget // kv_bytes_per_block(self.backend, self.model_config, self.block_size, self.dtype)
            logger.info(
                "KV cache in int8 with per-token scales: %d tokens where %s would hold %d (%.2fx)",
                num_blocks * self.block_size,
                self.dtype,
                dense * self.block_size,
                num_blocks / max(1, dense),
            )

    def _capture(self, model: LlamaForCausalLM, caches: list[KVCache], max_num_seqs: int) -> DecodeGraphs | None:
        """CUDA graphs of decode steps at the batch sizes up to `max_num_seqs`; None (every step eager)
        when a kernel cannot be captured (the log names it)."""
        start = time.perf_counter()
        sizes = graph_batch_sizes(max_num_seqs)
        try:
            graphs = DecodeGraphs(
                model, caches, self.backend, self.block_size, self.max_model_len, self.num_blocks, sizes, True
            )
        except RuntimeError as e:
            logger.warning("CUDA graphs: capture failed, every step runs eagerly (%s)", str(e).splitlines()[0])
            return None
        logger.info("CUDA graphs: decode steps of up to %d rows, %d sizes captured in %.1f s", sizes[-1],
                    len(sizes), time.perf_counter() - start)  # fmt: skip
        return graphs

    def execute(self, scheduled: SchedulerOutput) -> StepOutput:
        """The step: received KV written into the blocks just allocated, then the runner's forward."""
        if self.heap is not None:
            self.heap.tick()
        self.kv_connector.before_forward()
        return self.runner.execute(scheduled)

    def after_update(self) -> None:
        """After the scheduler applied the step: finished prefills' KV copied out, before anything can
        write into their freed blocks (the next step's forward)."""
        self.kv_connector.after_update()

    def stats_fields(self) -> dict[str, float]:
        """The structured-output and KV-transfer counters, as `EngineStats` fields."""
        grammar = self.runner.batch.grammar
        return {**(grammar.stats_fields() if grammar is not None else {}), **self.kv_connector.stats_fields()}

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

    def _warm_up(self, model: LlamaForCausalLM, config: EngineConfig) -> int:
        """The largest prefill chunk, then the most decodes, on a scratch cache: kernels are chosen and
        memory peaks before the KV cache takes what is left. On a GPU the steps are the worst the
        settings allow (prompt logprobs over the chunk, top-p at every row), as the cache is sized
        against their peak; elsewhere the greedy pair, short (`CPU_PROMPT`, `CPU_DECODES`). Returns the peak
        bytes allocated on a GPU (0 elsewhere)."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        chunk = min(config.max_num_batched_tokens, self.max_model_len)
        rows = min(config.max_num_seqs, config.max_num_batched_tokens)
        if self.device.type != "cuda":  # (a fixed KV budget: no peak to meet; warm_up.py CPU_PROMPT)
            chunk, rows = min(chunk, CPU_PROMPT), min(rows, CPU_DECODES)
        shape = WarmUpShape(chunk, rows, self.block_size)
        runner = ModelRunner(model, self._caches(shape.num_blocks), self.backend, self.block_size)
        warm_up(runner, shape, WORST if self.device.type == "cuda" else GREEDY)
        return torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else 0
