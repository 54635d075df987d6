"""LLMEngine: the synchronous engine — the front end's OutputProcessor and the EngineCore in one thread.

`add_request` tokenizes and checks a request and hands its core requests (one per child of an
n > 1 request) to the core; `step` runs one core step and turns its plain outputs into
RequestOutputs, finishing in the core whatever matched a stop string. `LLM.generate`, `tokenmill
generate` and `tokenmill bench offline` drive it; the server drives the same two halves through
`AsyncEngine`, the core on its own thread.
"""

from __future__ import annotations

from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.engine.core import EngineCore
from tokenmill.engine.output_processor import CheckedRequest, EngineLimits, OutputProcessor
from tokenmill.engine.pooling import PoolingFrontEnd
from tokenmill.engine.pooling_config import read_pooling_config
from tokenmill.outputs import EngineStats, OutputKind, RequestOutput, StepStats
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams
from tokenmill.text.tokenizer import Tokenizer


def engine_limits(core: EngineCore) -> EngineLimits:
    return EngineLimits(
        max_model_len=core.max_model_len,
        vocab_size=core.model_config.vocab_size,
        block_size=core.block_size,
        num_blocks=core.num_blocks,
        prefix_caching=core.config.enable_prefix_caching,
    )


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.core = EngineCore(config)
        self.tokenizer = Tokenizer(config.model)
        self.pooling = PoolingFrontEnd(read_pooling_config(config), self.tokenizer)
        self.processor = OutputProcessor(
            self.tokenizer, engine_limits(self.core), config.seed, config.grammar_compile_timeout, self.pooling
        )
        grammar = self.core.worker.runner.batch.grammar
        if grammar is not None:  # one compiler for the front end and the core: each spec compiles once
            grammar.use_compiler(self.processor.grammar)

    @property
    def model_config(self) -> Any:
        """The model's description as the runner loaded it (a `tokenmill.models.config.ModelConfig`:
        the engine reads only its vocabulary size and holds it for its callers)."""
        return self.core.model_config

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def last_step(self) -> StepStats:
        return self.core.last_step

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | CheckedRequest,
        params: SamplingParams,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        output_kind: OutputKind = OutputKind.CUMULATIVE,
    ) -> None:
        requests = self.processor.add_request(request_id, prompt, params, arrival_time, cache_salt, output_kind)
        try:
            for request in requests:
                self.core.add_request(request)
        except ValueError:
            self.core.abort_requests(self.processor.abort_request(request_id))
            raise

    def add_pooling_request(
        self, request_id: str, prompt: str | list[int], pooling: PoolingParams, arrival_time: float | None = None
    ) -> None:
        """A prompt-only request whose output is one vector (`RequestOutput.pooled`), once it finishes."""
        checked = self.processor.checker.check_pooling(prompt, pooling)
        self.add_request(request_id, checked, checked.params, arrival_time, output_kind=OutputKind.FINAL_ONLY)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its blocks now; False when no such request is open."""
        core_ids = self.processor.abort_request(request_id)
        self.core.abort_requests(core_ids)
        return bool(core_ids)

    def has_unfinished_requests(self) -> bool:
        return self.processor.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One core step's RequestOutputs. A request the engine failed alone raises its RequestFailed
        (the engine's state is clean: the caller may abort the rest, or step on)."""
        processed = self.processor.process(self.core.step())
        self.core.stop_requests(processed.stop_ids)
        if processed.errors:
            raise next(iter(processed.errors.values()))
        return processed.request_outputs

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (as vLLM's reset_prefix_cache); False while requests are in flight."""
        return self.core.reset_prefix_cache()

    def stats(self) -> EngineStats:
        return self.core.stats()
