"""The warm-up steps a worker runs on a scratch cache before it sizes its KV cache.

Two steps: the largest prompt chunk the scheduler may send (`max_num_batched_tokens` tokens, or
the model's length), then the most decodes (`max_num_seqs` rows). They choose and build kernels, and
on a GPU their peak memory is what the KV cache leaves free, so they must be the worst steps the
settings allow, not the cheapest: `WORST` asks for prompt logprobs over the whole chunk (the
`[chunk, V]` float32 log-softmax and its top-k), and top-p / top-k / min-p with penalties and
logprobs at every decode row (a `[rows, V]` sort with its indices). A step past that peak would
run out of memory mid-serving. `GREEDY` is the cheap pair, for devices whose cache is not sized from
the peak (the CPU: a fixed budget), where the start-up time matters more.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.outputs import NewRequestData, ScheduledChunk, SchedulerOutput
from tokenmill.runner.model_runner import ModelRunner
from tokenmill.runner.startup_log import phase
from tokenmill.sampling_params import MAX_LOGPROBS, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=1)
# The CPU's warm-up: a prompt chunk of `CPU_PROMPT` tokens, then `CPU_DECODES` decode rows. A CPU's KV
# cache is a fixed budget, not what a peak leaves, and its kernels are chosen without timing
# (kernels/defaults.py) and built ahead of time, so nothing there needs the largest steps: the pair
# only runs each layer once (first-call set-up, the step's buffers) before the server says it is
# ready. Both fit the decode row class (quant/cpu_dense.py ROW_CLASSES: 1-8 rows), the cheapest
# product of every method; a larger class's first product (oneDNN's per-shape set-up: milliseconds)
# falls on the first request that needs it. On a 1B-class model a 64-row decode step or a 512-token
# prefill costs seconds of start-up, a quantized model's dequantizing classes far more.
CPU_PROMPT = 8
CPU_DECODES = 1
WORST = SamplingParams(
    temperature=1.0,
    top_p=0.9,
    top_k=50,
    min_p=0.01,
    repetition_penalty=1.1,
    presence_penalty=0.5,
    frequency_penalty=0.5,
    seed=0,
    max_tokens=1,
    logprobs=MAX_LOGPROBS,
    prompt_logprobs=MAX_LOGPROBS,
)


@dataclass(frozen=True)
class WarmUpShape:
    """The largest steps the settings allow: a `prompt_len`-token chunk, then `decodes` decode rows."""

    prompt_len: int  # min(max_num_batched_tokens, max_model_len)
    decodes: int  # min(max_num_seqs, max_num_batched_tokens)
    block_size: int

    @property
    def prompt_blocks(self) -> int:
        return -(-self.prompt_len // self.block_size)

    @property
    def num_blocks(self) -> int:
        """Blocks the scratch cache needs: the chunk's, and one for each decode row."""
        return self.prompt_blocks + self.decodes


def warm_up(runner: ModelRunner, shape: WarmUpShape, params: SamplingParams) -> None:
    """Run the prefill step, then the decode step, on `runner` (whose cache holds
    `shape.num_blocks` blocks), every request sampled with `params`."""
    with phase(f"warm-up: a {shape.prompt_len}-token prompt chunk, then {shape.decodes} decodes"):
        _steps(runner, shape, params)


def _steps(runner: ModelRunner, shape: WarmUpShape, params: SamplingParams) -> None:
    prompt = [0] * shape.prompt_len
    runner.execute(
        SchedulerOutput(
            new_requests=[NewRequestData("warm-up", prompt, params, 0)],
            chunks=[ScheduledChunk("warm-up", prompt, 0, list(range(shape.prompt_blocks)), True, True)],
            finished_request_ids=[],
        )
    )
    ids = [f"warm-up-{i}" for i in range(shape.decodes)]
    runner.execute(
        SchedulerOutput(
            new_requests=[NewRequestData(i, [0], params, 0) for i in ids],
            chunks=[ScheduledChunk(i, [0], 0, [shape.prompt_blocks + b], True, True) for b, i in enumerate(ids)],
            finished_request_ids=["warm-up"],
        )
    )
