"""The baseline people use without tokenmill: Hugging Face transformers `generate` in padded batches.

Requests are taken in workload order in batches of `batch_size`, left-padded to the batch's longest
prompt, greedy, each batch generating until its longest request is done (`min_new_tokens` =
`max_new_tokens`, EOS ignored as in the tokenmill runs); only the tokens a request asked for count.
All requests are submitted at the start, so a request's TTFT includes the batches before its own. A
logits processor stamps the time of every generation step: token k of a batch is ready at stamp k,
and a request's TTFT, ITL and end-to-end latency are taken from its own tokens' stamps, as if
`generate` streamed. That favours the baseline: `generate` returns a batch only when its longest
request is done, so a shorter request's caller waits longer than its E2E here.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

import torch

from tokenmill.bench.records import RequestRecord, Run
from tokenmill.bench.workloads import Workload


class _StepClock:
    """A LogitsProcessor that changes nothing and notes when each step's logits are ready."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.stamps.append(time.perf_counter())
        return scores


def check_baseline(
    workload: Workload, request_rate: float | None, max_concurrency: int | None, ignore_eos: bool
) -> None:
    """The baseline submits everything at once and generates exactly max_tokens; a ValueError for
    settings it has no equivalent of."""
    timed = any(r.after is not None or r.arrival_s is not None for r in workload.requests)
    if request_rate is not None or max_concurrency is not None or timed:
        raise ValueError(
            "--baseline hf: transformers runs padded batches of requests submitted at once; it cannot "
            "follow --request-rate, --max-concurrency, trace arrival times or multi-turn dependencies"
        )
    if not ignore_eos:
        raise ValueError("--baseline hf: the baseline generates exactly max_tokens; drop --no-ignore-eos")


class HFBaseline:
    def __init__(self, model_dir: str | Path, dtype: str, batch_size: int) -> None:
        import transformers

        from tokenmill.models.config import load_config
        from tokenmill.models.loader import resolve_dtype
        from tokenmill.text.tokenizer import Tokenizer

        config = load_config(Path(model_dir))
        self.dtype = resolve_dtype(dtype, config)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=self.dtype, local_files_only=True, trust_remote_code=False
        ).eval()
        self.tokenizer = Tokenizer(model_dir)
        self.batch_size = batch_size
        pad = self.tokenizer.hf.pad_token_id
        self.pad_id = int(pad) if pad is not None else (self.tokenizer.info.eos_token_ids or (0,))[0]

    def run(self, workload: Workload, label: str = "hf", repeat: int = 0) -> Run:
        from transformers import LogitsProcessorList

        prompts = [r.token_ids(self.tokenizer) for r in workload.requests]
        reqs = workload.requests
        records: list[RequestRecord] = []
        t0 = time.perf_counter()
        with torch.inference_mode():
            for b in range(0, len(reqs), self.batch_size):
                batch = list(range(b, min(b + self.batch_size, len(reqs))))
                width = max(len(prompts[i]) for i in batch)
                ids = torch.full((len(batch), width), self.pad_id, dtype=torch.int64)
                mask = torch.zeros(len(batch), width, dtype=torch.int64)
                for row, i in enumerate(batch):  # left padding, as generate expects
                    ids[row, width - len(prompts[i]) :] = torch.tensor(prompts[i])
                    mask[row, width - len(prompts[i]) :] = 1
                new = max(reqs[i].max_tokens for i in batch)
                clock = _StepClock()
                self.model.generate(
                    ids,
                    attention_mask=mask,
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=False,
                    pad_token_id=self.pad_id,
                    logits_processor=LogitsProcessorList([clock]),
                )
                stamps = [s - t0 for s in clock.stamps]
                for i in batch:
                    n = reqs[i].max_tokens
                    mine = stamps[:n]
                    records.append(
                        RequestRecord(
                            index=i,
                            ok=True,
                            start_s=0.0,
                            prompt_tokens=len(prompts[i]),
                            output_tokens=n,
                            ttft_s=mine[0],
                            e2e_s=mine[-1],
                            itl_s=[y - x for x, y in itertools.pairwise(mine)],
                        )
                    )
        duration = time.perf_counter() - t0
        settings: dict[str, Any] = {"baseline": "transformers generate", "batch_size": self.batch_size}
        return Run(label, repeat, settings, duration, records)
