"""`--dtype fastest`: the fastest dtype on this machine whose next-token distribution stays close
to float32's.

Which dtype is fast is a property of the machine, not of the model: with AVX-512 BF16 a bfloat16
matrix product runs 2-3x faster than float32's at any batch; on AVX2 alone bfloat16 arithmetic is
emulated, twice as fast as float32 at one row (half the bytes) and slower at sixteen. So at start
each candidate dtype's model is built (kernels tuned for it), the model's own linear layers are
timed at one row and at `max_num_seqs` rows through the autotune cache (the geometric mean of the
two times decides: each batch size counts alike), and the fastest candidate whose
next-token distribution on a probe prompt stays within `KL_BOUND` of float32's (mean over the
probe's positions of KL(p_float32 || p_candidate), in nats) is kept. Float32 always qualifies.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenmill.kernels.autotune import Autotuner
from tokenmill.layers.attention import AttentionBackend, allocate_kv_cache
from tokenmill.layers.linear import LinearBase
from tokenmill.models.llama import LlamaForCausalLM

logger = logging.getLogger("tokenmill")

CANDIDATES = (torch.float32, torch.bfloat16, torch.float16)
KL_BOUND = 0.01  # nats: mean KL(p_float32 || p_dtype) of the next token over the probe's positions
PROBE_TOKENS = 32
PROBE_BLOCK = 16


@dataclass(frozen=True)
class DtypeReport:
    """The dtype kept, each candidate's linear-stack time (ms, geometric mean of 1 and max rows), its
    mean and largest next-token KL from float32 on the probe, and whether the timings were cached."""

    dtype: torch.dtype
    timings_ms: dict[str, float]
    mean_kl: dict[str, float]
    max_kl: dict[str, float]
    cached: bool


def probe_logits(model: LlamaForCausalLM, backend: AttentionBackend, ids: torch.Tensor) -> torch.Tensor:
    """float32 logits [n, vocab] at every position of one prompt `ids` [n], run in one chunk."""
    cfg, n = model.config, ids.shape[0]
    blocks = -(-n // PROBE_BLOCK)
    device = ids.device
    dtype = model.dtype
    caches = allocate_kv_cache(
        backend, cfg.num_layers, blocks, PROBE_BLOCK, cfg.num_kv_heads, cfg.head_dim, dtype, device
    )
    metadata = backend.build_metadata([n], [n], [list(range(blocks))], PROBE_BLOCK, device)
    with torch.inference_mode():
        hidden = model(ids, torch.arange(n, device=device), caches, metadata)
        return model.compute_logits(hidden)


def next_token_kl(reference: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:  # [n, vocab] x2 -> [n]
    """KL(p_reference || p_logits) in nats at each row."""
    log_p = torch.log_softmax(reference.double(), dim=-1)
    log_q = torch.log_softmax(logits.double(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1)


def linear_stack(model: LlamaForCausalLM, rows: int) -> Callable[[], None]:
    """Runs every linear layer of the model (dense or quantized, through its method) and a tied head
    once on `rows` input rows."""
    layers = [m for m in model.modules() if isinstance(m, LinearBase)]
    tied = model.tied_head()
    device = model.norm.weight.device
    widths = {layer.input_size for layer in layers} | ({tied.shape[1]} if tied is not None else set())
    inputs = {k: torch.randn(rows, k, device=device).to(model.dtype) for k in widths}

    def run() -> None:
        with torch.inference_mode():
            for layer in layers:
                layer(inputs[layer.input_size])
            if tied is not None:
                model.dense.product(inputs[tied.shape[1]], tied)

    return run


def fastest_dtype(
    build: Callable[[torch.dtype], tuple[LlamaForCausalLM, AttentionBackend]],
    candidates: tuple[torch.dtype, ...],
    max_rows: int,
    tuner: Autotuner,
) -> DtypeReport:
    """Build each candidate (float32 first: the reference), time its linear layers at 1 and `max_rows`
    rows, probe its next-token distribution, and return the fastest within KL_BOUND of float32."""
    models = {dtype: build(dtype) for dtype in candidates}
    reference_model, reference_backend = models[torch.float32]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(reference_model.config.vocab_size, (PROBE_TOKENS,), generator=generator)
    ids = ids.to(reference_model.norm.weight.device)
    reference = probe_logits(reference_model, reference_backend, ids)
    mean_kl: dict[str, float] = {}
    max_kl: dict[str, float] = {}
    for dtype, (model, backend) in models.items():
        logits = reference if dtype == torch.float32 else probe_logits(model, backend, ids)
        kl = next_token_kl(reference, logits)
        mean_kl[_name(dtype)], max_kl[_name(dtype)] = float(kl.mean()), float(kl.max())
    # the linear layers timed: each shape, its count and method (a quantized model times its own kernels)
    layers = Counter(
        (m.output_size, m.input_size, type(m.linear_method).__name__)
        for m in reference_model.modules()
        if isinstance(m, LinearBase)
    )
    tied = reference_model.tied_head()
    signature = " ".join(f"{o}x{i}*{n} {method}" for (o, i, method), n in sorted(layers.items()))
    signature += f" tied {tied.shape[0]}x{tied.shape[1]}" if tied is not None else ""
    step_ms: dict[str, list[float]] = {_name(d): [] for d in models}
    cached = True
    for m in sorted({1, max_rows}):
        stacks = {_name(d): linear_stack(model, m) for d, (model, _) in models.items()}
        choice = tuner.choose("dtype", f"{signature} rows {m}", stacks)
        cached &= choice.cached
        for name, ms in choice.timings_ms.items():
            step_ms[name].append(ms)
    timings = {name: math.prod(ms) ** (1 / len(ms)) for name, ms in step_ms.items()}
    ranked = sorted(timings, key=lambda n: timings[n])
    keep = next(n for n in ranked if n == "float32" or mean_kl[n] <= KL_BOUND)
    return DtypeReport(getattr(torch, keep), timings, mean_kl, max_kl, cached)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def log_report(report: DtypeReport) -> None:
    figures = ", ".join(
        f"{n} {report.timings_ms[n]:.2f} ms (KL mean {report.mean_kl[n]:.2e}, max {report.max_kl[n]:.2e})"
        for n in report.timings_ms
    )
    source = "cached timings" if report.cached else "measured now"
    logger.info(
        "dtype fastest: %s (linear layers at 1 and max_num_seqs rows, %s: %s; KL bound %.0e nats)",
        _name(report.dtype),
        source,
        figures,
        KL_BOUND,
    )
