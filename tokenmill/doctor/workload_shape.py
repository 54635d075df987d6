"""Questions 3 and 4: the trace's length variance (continuous against static batching) and KV fragmentation.

Question 3 describes the input and output lengths (percentiles, coefficient of variation) and compares
continuous with static batching on the trace through the simulator (both schedulers, the same measured
step costs): static batching holds a batch until its longest member ends, so the more the output
lengths vary, the more it loses.

Question 4 compares what KV memory would be wasted on this trace by reserving each request's worst case
up front (max_model_len slots, as engines before paging did) with what paging wastes (the unfilled
slots of each request's last block): each request holds, over its decode, prompt + output / 2 tokens
on average, weighted by the steps it decodes; the unfilled share of blocks of size b is measured by the
simulator's replay (live tokens over allocated slots) for the current size, and estimated as b / 2
slots a request for the others.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenmill.doctor.findings import Finding, p50


@dataclass
class Lengths:
    p50: float
    p90: float
    p99: float
    max: int
    mean: float
    cv: float  # standard deviation / mean

    @classmethod
    def of(cls, values: Sequence[int]) -> Lengths:
        p50, p90, p99 = (float(x) for x in np.percentile(values, [50, 90, 99]))
        mean = statistics.fmean(values)
        cv = statistics.pstdev(values) / mean if mean else 0.0
        return cls(p50, p90, p99, max(values), mean, cv)

    def describe(self) -> str:
        return f"p50 {self.p50:.0f}, p90 {self.p90:.0f}, p99 {self.p99:.0f}, max {self.max}, CV {self.cv:.2f}"


def length_finding(
    prompts: Sequence[int],
    outputs: Sequence[int],
    scheduling: str,
    simulate: Callable[[dict[str, Any]], dict[str, Any]],
) -> Finding:
    """`simulate(settings)`: the simulator's summary of the trace with these settings changed."""
    inputs, outs = Lengths.of(prompts), Lengths.of(outputs)
    continuous = simulate({"scheduling": "continuous"})
    static = simulate({"scheduling": "static"})
    if not continuous["completed"] or not static["completed"]:
        lines = [f"input lengths: {inputs.describe()}", f"output lengths: {outs.describe()}"]
        return Finding("3. Length variance", "no request of the trace can run here (see question 1)", lines)
    gain = continuous["output_throughput"] / max(static["output_throughput"], 1e-9)
    evidence = [
        f"input lengths: {inputs.describe()}",
        f"output lengths: {outs.describe()}",
        "simulated on the measured step costs, continuous / static batching: output tokens/s "
        f"{continuous['output_throughput']:.1f} / {static['output_throughput']:.1f} ({gain:.2f}x), TTFT p50 "
        f"{p50(continuous, 'ttft'):.0f} / {p50(static, 'ttft'):.0f} ms, TPOT p50 "
        f"{p50(continuous, 'tpot'):.1f} / {p50(static, 'tpot'):.1f} ms",
    ]
    ttft_gain = p50(static, "ttft") / max(p50(continuous, "ttft"), 1e-9)
    predicted = f"{gain:.2f}x output tokens/s, TTFT p50 {ttft_gain:.2f}x lower than static batching"
    if scheduling == "static":
        if gain > 1.05 or ttft_gain > 1.1:
            return Finding(
                "3. Length variance",
                f"static batching is configured and the output lengths vary (CV {outs.cv:.2f}): a batch waits for its "
                f"longest member; continuous batching is predicted {gain:.2f}x the output tokens/s",
                evidence,
                {"scheduling": "continuous"},
                predicted,
            )
        verdict = "static batching loses little on this trace (the lengths barely vary)"
        return Finding("3. Length variance", verdict, evidence)
    return Finding(
        "3. Length variance",
        f"continuous batching (already on) is predicted {gain:.2f}x static batching's output tokens/s on this trace "
        f"(output length CV {outs.cv:.2f})",
        evidence,
    )


def fragmentation_finding(
    prompts: Sequence[int],
    outputs: Sequence[int],
    max_model_len: int,
    block_size: int,
    live_share: float | None,
) -> Finding:
    """`live_share`: the simulator's live tokens over allocated slots at the current block size."""
    weights = [max(1, o) for o in outputs]
    held = sum(w * (p + o / 2) for w, p, o in zip(weights, prompts, outputs, strict=True)) / sum(weights)
    worst_case = 1 - held / max_model_len
    evidence = [
        f"a request holds on average {held:.0f} KV tokens while it decodes (prompt + half its output, weighted by "
        f"its decode steps)",
        f"reserving max_model_len ({max_model_len}) slots for each request up front would leave "
        f"{worst_case:.0%} of the reserved KV memory unused",
    ]
    estimates = {b: (b / 2) / (held + b / 2) for b in (8, 16, 32, 64)}
    current = 1 - live_share if live_share is not None else estimates.get(block_size, (block_size / 2) / held)
    evidence.append(
        f"paging with blocks of {block_size}: {current:.1%} of allocated slots unfilled"
        + (" (measured in the replay)" if live_share is not None else " (estimated: half a block a request)")
    )
    evidence.append(
        "estimated unfilled share by block size: " + ", ".join(f"{b}: {s:.1%}" for b, s in estimates.items())
    )
    if current > 0.1 and block_size > 8:
        smaller = max((b for b in estimates if b < block_size and estimates[b] <= 0.05), default=8)
        return Finding(
            "4. KV fragmentation",
            f"the requests are short for blocks of {block_size}: {current:.0%} of allocated KV slots sit unfilled",
            evidence,
            {"block_size": smaller},
            f"about {current - estimates[smaller]:.0%} more of the KV cache holding live tokens",
        )
    return Finding(
        "4. KV fragmentation",
        f"paging keeps waste at {current:.1%} (worst-case reservation would waste {worst_case:.0%}); blocks of "
        f"{block_size} suit these lengths",
        evidence,
    )
