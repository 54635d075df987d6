"""LLM: the offline API in the shape vLLM users know — `LLM(model=...).generate(prompts, params)`,
`.chat(messages, params)`, and for embedding models and rerankers `.embed(prompts)`, `.score(text_1, text_2)`."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from tqdm import tqdm

from tokenmill.config import EngineConfig
from tokenmill.engine.engine import LLMEngine
from tokenmill.engine.pooling import (
    EmbeddingRequestOutput,
    ScoringRequestOutput,
    cosine_output,
    embedding_output,
    score_output,
)
from tokenmill.errors import ParamError
from tokenmill.outputs import EngineStats, OutputKind, RequestOutput
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams

# a string, token ids, or vLLM's TextPrompt / TokensPrompt dicts: {"prompt": str}, {"prompt_token_ids": [...]}
Prompt = str | list[int] | dict[str, Any]
PROMPT_KEYS = ("prompt", "prompt_token_ids")


class LLM:
    def __init__(self, model: str, **engine_kwargs: Any) -> None:
        """`model`: a Hugging Face model folder or a GGUF file; `engine_kwargs`: any other `EngineConfig` field by name
        (dtype, max_num_seqs, kv_cache_memory, ...). An unknown keyword is a ValueError naming it."""
        self.engine = LLMEngine(EngineConfig.from_kwargs(str(model), **engine_kwargs))
        self._counter = 0

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (strings or token-id lists); outputs in the prompts' order."""
        prompt_list = _prompt_list(prompts)
        if sampling_params is None:
            params = [SamplingParams()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompt_list)
        else:
            params = list(sampling_params)
            if len(params) != len(prompt_list):
                raise ParamError(
                    "sampling_params",
                    f"sampling_params: {len(params)} given for {len(prompt_list)} prompts; give one, or one per prompt",
                )
        adds = [
            functools.partial(self.engine.add_request, prompt=prompt, params=p, output_kind=OutputKind.FINAL_ONLY)
            for prompt, p in zip(prompt_list, params, strict=True)
        ]
        return self._run_all(adds, use_tqdm, "generate")

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        *,
        dimensions: int | None = None,
        normalize: bool | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """The embedding of every prompt, as vLLM's `LLM.embed` (`.outputs.embedding`): the final norm's
        hidden states pooled as the model folder's sentence-transformers config (or `pooling=`) says,
        truncated to `dimensions` where the model allows it, normalized where it says (or `normalize`)."""
        params = self.engine.pooling.embed_params(dimensions, normalize)
        outs = self._pool([(p, params) for p in _prompt_list(prompts)], use_tqdm, "embed")
        return [embedding_output(o) for o in outs]

    def score(
        self, text_1: str | Sequence[str], text_2: str | Sequence[str], use_tqdm: bool = True
    ) -> list[ScoringRequestOutput]:
        """Scores of text pairs, as vLLM's `LLM.score` (`.outputs.score`): text_1 against each text_2 (or
        two lists pairwise). A reranker (task rerank): p(yes) of its template's prompt; an embedding
        model: the cosine of the two embeddings."""
        pooling = self.engine.pooling
        pooling.check_scoring()
        pairs = pooling.pairs(text_1, text_2)
        if pooling.task == "rerank":
            params = pooling.score_params()
            jobs = [(pooling.rerank_prompt(q, d), params) for q, d in pairs]
            return [score_output(o) for o in self._pool(jobs, use_tqdm, "score")]
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))  # each text embedded once
        embed = pooling.embed_params()
        vectors = dict(zip(texts, self._pool([(t, embed) for t in texts], use_tqdm, "score"), strict=True))
        return [cosine_output(vectors[a], vectors[b], pooling.cosine) for a, b in pairs]

    def _pool(
        self, jobs: Sequence[tuple[str | list[int], PoolingParams]], use_tqdm: bool, desc: str
    ) -> list[RequestOutput]:
        """Run pooling requests (prompt, params) to their end; outputs in order (`.pooled` set)."""
        adds = [functools.partial(self.engine.add_pooling_request, prompt=p, pooling=params) for p, params in jobs]
        return self._run_all(adds, use_tqdm, desc)

    def _run_all(self, adds: Sequence[Callable[..., None]], use_tqdm: bool, desc: str) -> list[RequestOutput]:
        """Add each request (`add(request_id)`), run them all, outputs in order; nothing leaks if one
        is refused or the run is interrupted."""
        ids = []
        try:
            for add in adds:
                request_id = f"offline-{self._counter}"
                self._counter += 1
                add(request_id)
                ids.append(request_id)
            return self._run(ids, use_tqdm, desc)
        except BaseException:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise

    def chat(
        self,
        messages: list[dict[str, str]] | Sequence[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {'role', 'content'} dicts) or to several (a
        list of such lists), each rendered by the model's chat template, as vLLM's `LLM.chat`."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.engine.tokenizer
        prompts: list[Prompt] = [
            tokenizer.apply_chat_template(list(c), add_generation_prompt)  # type: ignore[arg-type]
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool, desc: str = "generate") -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc=desc, unit="req", disable=not use_tqdm) as bar:
            while len(done) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        return [done[i] for i in ids]

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (the next request computes its whole prompt); False while busy."""
        return self.engine.reset_prefix_cache()

    def stats(self) -> EngineStats:
        """Engine gauges: KV blocks total and free, running, waiting, preemptions, tokens processed."""
        return self.engine.stats()


def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[str | list[int]]:
    """One prompt or several, each as the engine takes it (see `_prompt`)."""
    if isinstance(prompts, str | dict) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]  # type: ignore[list-item]
    return [_prompt(p, i) for i, p in enumerate(prompts)]  # type: ignore[arg-type]


def _prompt(p: object, index: int) -> str | list[int]:
    """One prompt as the engine takes it; ValueError naming it when it is none of the shapes above."""
    if isinstance(p, dict):
        keys = set(p)
        if len(keys) != 1 or not keys <= set(PROMPT_KEYS):
            raise ValueError(
                f"prompts[{index}]: a prompt dict holds exactly one of {', '.join(PROMPT_KEYS)}; "
                f"got keys {sorted(keys)}"
            )
        if "prompt" in p:
            if isinstance(p["prompt"], str):
                return p["prompt"]
            raise ValueError(f"prompts[{index}]: 'prompt' must be a string, got {type(p['prompt']).__name__}")
        p = p["prompt_token_ids"]
        if not isinstance(p, list | tuple):
            kind = type(p).__name__
            raise ValueError(f"prompts[{index}]: 'prompt_token_ids' must be a list of token ids, got {kind}")
    if isinstance(p, str):
        return p
    if isinstance(p, list | tuple) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return list(p)
    kind = type(p).__name__
    raise ValueError(f"prompts[{index}]: must be a string, a list of token ids or a prompt dict, got {kind}")
