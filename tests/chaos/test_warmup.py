"""Issue 42 item 12: the warm-up a GPU sizes its KV cache against is the worst step the settings allow.

On a GPU the cache takes what the warm-up's peak leaves; a step whose memory goes past that peak runs
out of memory mid-serving. The greedy warm-up (one row sampled, no logprobs) peaks far below a full
chunk with prompt logprobs or top-p at every decode row. The peak is measured here on the CPU with a
live-tensor-bytes counter (every tensor an op makes counted until it is freed), the accounting that
`torch.cuda.max_memory_allocated` does on a GPU.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tokenmill.config import EngineConfig
from tokenmill.outputs import NewRequestData, ScheduledChunk, SchedulerOutput
from tokenmill.runner.model_runner import ModelRunner
from tokenmill.runner.warm_up import GREEDY, WORST, WarmUpShape, warm_up
from tokenmill.runner.worker import Worker
from tokenmill.sampling_params import SamplingParams

CHUNK, ROWS = 256, 16


class LiveBytes(TorchDispatchMode):
    """The peak of the bytes held by tensors the ops inside it made (a storage counted once, until freed)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.storages: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                storage = t.untyped_storage()
                key, size = storage.data_ptr(), storage.nbytes()
                if size and key not in self.storages:
                    self.storages.add(key)
                    self.live += size
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(t, self._free, key, size)
        return out

    def _free(self, key: int, size: int) -> None:
        if key in self.storages:
            self.storages.discard(key)
            self.live -= size


def worker(model_dir: str) -> Worker:
    config = EngineConfig.from_kwargs(
        model_dir, dtype="float32", max_num_seqs=ROWS, max_num_batched_tokens=CHUNK, max_model_len=512
    )
    return Worker(config)


def peak_of(run: Any) -> int:
    with LiveBytes() as counter:
        run()
    return counter.peak


def test_the_worst_warm_up_peaks_at_least_as_high_as_the_costliest_steps(tiny_model_dir):
    w = worker(str(tiny_model_dir("llama")))
    model = w.runner.model
    shape = WarmUpShape(CHUNK, ROWS, w.block_size)

    def scratch() -> ModelRunner:
        return ModelRunner(model, w._caches(shape.num_blocks), w.backend, w.block_size)

    greedy = peak_of(lambda: warm_up(scratch(), shape, GREEDY))
    worst = peak_of(lambda: warm_up(scratch(), shape, WORST))

    # the costliest steps a client can ask for: a full chunk with prompt logprobs, top-p at every row
    def prompt_logprobs_chunk() -> None:
        params = SamplingParams(max_tokens=1, prompt_logprobs=5)
        prompt = list(range(1, CHUNK + 1))
        scratch().execute(
            SchedulerOutput(
                [NewRequestData("p", prompt, params, 0)],
                [ScheduledChunk("p", prompt, 0, list(range(shape.prompt_blocks)), True, True)],
                [],
            )
        )

    def top_p_rows() -> None:
        params = SamplingParams(max_tokens=1, top_p=0.5, seed=1, logprobs=2)
        ids = [f"r{i}" for i in range(ROWS)]
        scratch().execute(
            SchedulerOutput(
                [NewRequestData(i, [5, 6], params, 0) for i in ids],
                [ScheduledChunk(i, [5, 6], 0, [b], True, True) for b, i in enumerate(ids)],
                [],
            )
        )

    costliest = max(peak_of(prompt_logprobs_chunk), peak_of(top_p_rows))
    print(f"peak MiB: greedy {greedy / 2**20:.1f}, worst {worst / 2**20:.1f}, costliest step {costliest / 2**20:.1f}")
    assert worst >= costliest, (worst, costliest)
    # (what the greedy warm-up measured: well short of those steps, the cache sized past what they need)
    assert greedy < 0.8 * costliest, (greedy, costliest)
