"""`tokenmill tune MODEL [engine flags]`: the kernel choices a server's start takes by default,
measured once on this machine and written to the autotune cache, so every later start reads them.

The model is built as `serve` builds it (the same flags: dtype, quantization, max_num_seqs,
max_num_batched_tokens, cpu_threads, ...; the same thread count, which the cache's machine key
includes), not measuring: that pass counts the choices the cache lacks (`Autotuner.missed`). Then
the built model's choices are made again measuring (`model_builder.refine`), a progress bar over
the count, each one written to the cache as it is measured (an interrupted run keeps what it
measured). A choice the cache holds already is not measured again. There is no refinement in the
background of a running server: timing kernels on the cores that serve would slow the steps it
runs beside (and disturb its own timings), so measuring is this command's, run once when the
machine is otherwise idle.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from tqdm import tqdm

from tokenmill.config import EngineConfig
from tokenmill.kernels.autotune import Autotuner, default_cache_path
from tokenmill.runner.model_builder import build_model, refine
from tokenmill.runner.worker import set_up_device


@dataclass(frozen=True)
class TuneReport:
    """What a run did: choices found in the cache, measured now, the seconds measuring took, and
    the cache file."""

    cached: int
    measured: int
    seconds: float
    path: str

    def render(self) -> str:
        if not self.measured:
            return f"nothing to measure: all {self.cached} kernel choices are in {self.path} already"
        return (
            f"measured {self.measured} kernel choices in {self.seconds:.1f} s ({self.cached} cached already); "
            f"written to {self.path}: `tokenmill serve` with the same flags reads them"
        )


def tune(config: EngineConfig, tuner: Autotuner | None = None) -> TuneReport:
    """Measure the kernel choices `config`'s model lacks in the cache (`tuner`: default, the machine's)."""
    device = set_up_device(config)
    tuner = tuner or Autotuner(device, default_cache_path(), measure=False)
    built = build_model(config, device, tuner)
    missing = len(tuner.missed)
    cached = tuner.counts["cache"]
    start = time.perf_counter()
    if missing:
        tuner.measure = True
        with tqdm(total=missing, desc="tokenmill tune", unit=" choice", mininterval=0.5) as bar:
            tuner.progress = bar
            try:
                refine(built, config, tuner)
            finally:
                tuner.progress, tuner.measure = None, False
    return TuneReport(cached, tuner.counts["measured"], time.perf_counter() - start, str(tuner.path))
