"""LLM: the offline API in the shape vLLM users know — `LLM(model=...).generate(prompts, params)`."""

from __future__ import annotations

from collections.abc import Sequence

from tqdm import tqdm

from tokenmill.config import EngineConfig
from tokenmill.engine.engine import LLMEngine
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(
        self,
        model: str,
        dtype: str = "auto",
        device: str = "cpu",
        block_size: int = 16,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        kv_cache_memory: int | None = None,
        max_model_len: int | None = None,
        scheduling: str = "continuous",
        seed: int = 0,
        enable_prefix_caching: bool = True,
    ) -> None:
        config = EngineConfig(
            model=str(model),
            dtype=dtype,
            device=device,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            kv_cache_memory=kv_cache_memory,
            max_model_len=max_model_len,
            scheduling=scheduling,
            seed=seed,
            enable_prefix_caching=enable_prefix_caching,
        )
        self.engine = LLMEngine(config)
        self._counter = 0

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (strings or token-id lists); outputs in the prompts' order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompt_list = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            params = [SamplingParams()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompt_list)
        else:
            params = list(sampling_params)
            if len(params) != len(prompt_list):
                raise ValueError(
                    f"sampling_params: {len(params)} given for {len(prompt_list)} prompts; give one, or one per prompt"
                )
        ids = []
        try:
            for prompt, p in zip(prompt_list, params, strict=True):
                request_id = f"offline-{self._counter}"
                self._counter += 1
                self.engine.add_request(request_id, prompt, p)
                ids.append(request_id)
            return self._run(ids, use_tqdm)
        except BaseException:
            for request_id in ids:  # nothing leaks if a prompt is refused or the run is interrupted
                self.engine.abort_request(request_id)
            raise

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while len(done) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        return [done[i] for i in ids]

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (the next request computes its whole prompt); False while busy."""
        return self.engine.reset_prefix_cache()

    def stats(self) -> dict[str, int | float]:
        """Engine gauges: KV blocks total and free, running, waiting, preemptions, tokens processed."""
        return self.engine.stats()
