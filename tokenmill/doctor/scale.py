"""Question 6, scale: prefills stalling decodes, what disaggregation would move, and the replicas a rate needs.

All from the simulator on the measured step costs:
- the stall: the trace's TPOT p99 as served (prompt chunks share steps with decodes) against the same
  replay where the steps cost only their decoding rows (the prompts computed elsewhere: what a
  decode-only instance of a prefill/decode split would see), and with a smaller token budget a step
  (`max_num_batched_tokens` halved, twice), the setting that bounds a stall without a second machine;
- what a split moves: each request's prompt KV (prompt tokens x KV bytes a token) over `link_gbps`;
- the stall measured (`stall.py`, unless turned off): the same comparison on the engine itself, the
  trace's decode batch decoding alone and then with the trace's prompts arriving;
- capacity: with SLOs, the highest Poisson request rate at which one replica meets them (TTFT and TPOT
  p90), by bisection; without, its ceiling (requests a second with the whole trace at once), of which
  a replica is planned at 80%; the replicas the trace's own rate needs, and the cost per million
  output tokens at `cost_per_hour`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tokenmill.doctor.findings import Finding, p50, p90, p99
from tokenmill.doctor.stall import StallMeasurement
from tokenmill.doctor.step_cost import StepCost

QUESTION = "6. Scale"


@dataclass
class DecodeOnlyCost:
    """A step's cost with its prompt chunks computed elsewhere: only its decoding rows, as a decode step."""

    cost: StepCost

    def predict(self, chunks: Sequence[tuple[int, int]], decoding: bool) -> float:
        rows = [c for c in chunks if c[0] == 1]
        return self.cost.predict(rows, decoding=True) if rows else 0.0


def meets(summary: dict[str, Any], slos: dict[str, float]) -> bool:
    if not summary["completed"] or summary["failed"]:
        return False
    return all(p90(summary, k) <= v for k, v in slos.items() if k in ("ttft", "tpot"))


def capacity(at_rate: Callable[[float], dict[str, Any]], slos: dict[str, float], start: float) -> float:
    """The highest Poisson rate (requests/s, within 10%) at which `at_rate(rate)`'s replay meets the SLOs;
    0 when even a thousandth of `start` does not."""
    lo, hi = 0.0, max(start, 1e-3)
    while meets(at_rate(hi), slos):
        lo, hi = hi, hi * 2
        if hi > 1e6:
            return hi
    floor = hi / 1000
    while hi - lo > 0.1 * hi and hi > floor:
        mid = (lo + hi) / 2
        if meets(at_rate(mid), slos):
            lo = mid
        else:
            hi = mid
    return lo


def scale_finding(
    current: dict[str, Any],
    decode_only: dict[str, Any],
    smaller_budgets: dict[int, dict[str, Any]],
    budget: int,
    prompts: Sequence[int],
    kv_token_bytes: float,
    link_gbps: float,
    replica_rate: float,
    trace_rate: float | None,
    slos: dict[str, float],
    cost_per_hour: float | None,
    tokens_per_request: float,
    measured: StallMeasurement | None = None,
) -> Finding:
    stall = p99(current, "tpot") / max(p99(decode_only, "tpot"), 1e-9)
    kv_mb = [p * kv_token_bytes / 1e6 for p in prompts]
    mean_mb = sum(kv_mb) / len(kv_mb)
    transfer_ms = mean_mb * 8 / link_gbps  # MB x 8 / (Gbit/s) = ms
    evidence = [
        f"TPOT p99 as served: {p99(current, 'tpot'):.1f} ms; with the prompts computed elsewhere (decode-only "
        f"steps): {p99(decode_only, 'tpot'):.1f} ms: prefills stretch the slowest tokens {stall:.2f}x",
    ]
    if measured is not None:
        m = measured
        evidence.append(
            f"measured on this engine ({m.batch} requests decoding at {m.context} tokens, {len(m.decode_only_ms)} "
            f"steps each way): inter-token time p50 / p99 {m.p('without', 50):.1f} / {m.p('without', 99):.1f} ms "
            f"decode-only, {m.p('with', 50):.1f} / {m.p('with', 99):.1f} ms with {m.prompts} prompts of the trace's "
            f"lengths arriving (before {m.prompt_share:.0%} of the steps, as in the replay): "
            f"{m.p('with', 99) / max(m.p('without', 99), 1e-9):.2f}x at p99"
        )
    evidence += [
        "TPOT p99 with a smaller step budget: "
        + ", ".join(f"max_num_batched_tokens {b}: {p99(s, 'tpot'):.1f} ms" for b, s in smaller_budgets.items()),
        f"a prefill/decode split would move {mean_mb:.2f} MB of KV a request on average (max {max(kv_mb):.2f}), "
        f"{transfer_ms:.2f} ms at {link_gbps:g} Gbit/s, against a TTFT p50 of {p50(current, 'ttft'):.0f} ms",
        f"one replica sustains {replica_rate:.2f} requests/s "
        + ("within the SLOs" if slos else "(80% of its ceiling: the trace's requests all at once)"),
    ]
    if cost_per_hour is not None and replica_rate > 0:
        per_million = cost_per_hour / (replica_rate * tokens_per_request * 3600) * 1e6
        evidence.append(f"cost at {cost_per_hour:g}/hour: {per_million:.2f} per million output tokens at capacity")
    replicas = math.ceil(trace_rate / replica_rate) if trace_rate and replica_rate > 0 else 1
    if trace_rate:
        evidence.append(f"the trace's rate {trace_rate:.2f} requests/s needs {replicas} replica(s)")
    settings: dict[str, Any] = {}
    verdict = f"one engine serves this trace; prefills stretch TPOT p99 {stall:.2f}x"
    if replicas > 1:
        verdict = f"{replicas} replicas needed for the trace's rate (one sustains {replica_rate:.2f} requests/s)"
    tpot_slo = slos.get("tpot")
    if tpot_slo is not None and p99(current, "tpot") > tpot_slo:
        fixed = [b for b, s in smaller_budgets.items() if p99(s, "tpot") <= tpot_slo]
        if fixed:
            settings = {"max_num_batched_tokens": max(fixed)}
            verdict = (
                f"long prefills push TPOT p99 past the SLO ({p99(current, 'tpot'):.0f} > {tpot_slo:.0f} ms): a step "
                f"budget of {max(fixed)} tokens (from {budget}) bounds them"
            )
        elif p99(decode_only, "tpot") <= tpot_slo and transfer_ms < p50(current, "ttft"):
            verdict = (
                "prefills push TPOT p99 past the SLO and no step budget fixes it: a prefill/decode split would "
                f"({p99(decode_only, 'tpot'):.0f} ms) at {transfer_ms:.1f} ms of KV transfer a request"
            )
    if replicas > 1 and not verdict.startswith(f"{replicas} replicas"):
        verdict = f"{replicas} replicas needed for the trace's rate; " + verdict
    return Finding(QUESTION, verdict, evidence, settings)
