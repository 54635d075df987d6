"""Question 2, prompt redundancy: how much of the trace's prompts the prefix cache can serve, and why not more.

The trace goes through `prefix_report.analyse` (the block hasher and the engine's KV manager): the hit
rate an unbounded cache reaches (achievable) and the one a cache of the current size reaches (LRU,
one request at a time), and where prompts first part from the closest earlier one, with the text
there. Causes of a low rate are told apart: prompts that share less than a block (whole blocks only
are cached: a smaller block size recovers it); something per request early in the prompt (a
timestamp, a session id: quoted where prompts part); a cache too small for the working set
(achievable well above LRU); cache salts that split tenants (the rate without salts). The TTFT saving
comes from the simulator, with the cache on and off.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tokenmill.doctor.findings import Finding, p50
from tokenmill.doctor.prefix_report import PrefixReport, TextTokenizer, TraceRequest, analyse, common_prefix

QUESTION = "2. Prompt redundancy"


def redundancy_finding(
    requests: Sequence[TraceRequest],
    block_size: int,
    cache_blocks: int,
    caching_on: bool,
    max_num_batched_tokens: int,
    simulate: Callable[[dict[str, Any]], dict[str, Any]],
    tokenizer: TextTokenizer | None = None,
    chains: list[list[bytes]] | None = None,
) -> Finding:
    """`chains`: the requests' `prefix_report.block_chains`, if hashed already."""
    report = analyse(
        requests, block_size, cache_blocks, tokenizer, max_num_batched_tokens=max_num_batched_tokens, chains=chains
    )
    evidence = [
        f"{report.prompts} prompts, {report.prompt_tokens:,} tokens, blocks of {block_size} (the prompts through the "
        "block hasher and the engine's KV manager)",
        f"achievable prefix-hit rate (unbounded cache): {report.achievable_hit_rate:.1%}; with the current cache "
        f"({cache_blocks} blocks, LRU): {report.lru_hit_rate:.1%}",
    ]
    for d in report.divergences[:3]:
        evidence.append(
            f"{d.count} prompts part from the closest earlier one at token {d.position}: "
            f"...{d.before!r} | {d.after!r}..."
        )
    pitfalls = _salt_pitfalls(requests, block_size, report)
    shared, realigned = _sharing(requests, block_size)
    early = bool(report.divergences) and report.divergences[0].position < 4 * block_size
    if early and realigned * 2 >= report.prompts - 1 > 0 and report.achievable_hit_rate < 0.5:
        return _broken_prefix(report, evidence, pitfalls)
    if report.achievable_hit_rate < 0.02:
        return _nothing_shared(report, shared, block_size, evidence, pitfalls)
    return _cache_gain(report, simulate, caching_on, evidence, pitfalls)


def _salt_pitfalls(requests: Sequence[TraceRequest], block_size: int, report: PrefixReport) -> list[str]:
    """A pitfall where cache salts keep tenants from sharing much of what they would."""
    if not any(r.cache_salt for r in requests):
        return []
    unsalted = analyse([TraceRequest(r.token_ids, None, r.max_tokens) for r in requests], block_size)
    if unsalted.achievable_hit_rate <= report.achievable_hit_rate + 0.05:
        return []
    return [
        f"cache salts split the tenants: {unsalted.achievable_hit_rate:.0%} of prompt tokens would hit without "
        f"them, {report.achievable_hit_rate:.0%} with (keep salts only where tenants must not share)"
    ]


def _broken_prefix(report: PrefixReport, evidence: list[str], pitfalls: list[str]) -> Finding:
    """Prompts that part early and agree again: a per-request value breaks the cache for what follows."""
    d = report.divergences[0]
    pitfalls.append(
        f"{'zero' if report.achievable_hit_rate < 0.02 else 'few'} prefix hits: prompts part at token "
        f"{d.position}, where something changes per request (...{d.before!r} | {d.after!r}...), and agree "
        "again after it: a timestamp, id or name early in the prompt breaks the cache for everything after it"
    )
    verdict = (
        f"a per-request value at token {d.position} ({d.after!r}...) breaks prefix caching "
        f"({report.achievable_hit_rate:.0%} of prompt tokens can hit): move it after the shared part of the prompt"
    )
    return Finding(QUESTION, verdict, evidence, pitfalls=pitfalls)


def _nothing_shared(
    report: PrefixReport, shared: int, block_size: int, evidence: list[str], pitfalls: list[str]
) -> Finding:
    """No prefix hits: a shared prefix shorter than a block (smaller blocks let it hit), or nothing shared."""
    settings: dict[str, Any] = {}
    if 8 <= shared < block_size and report.prompts > 1:
        smaller = 1 << (shared.bit_length() - 1)  # the largest power of two within the shared prefix
        pitfalls.append(
            f"zero prefix hits: prompts share at most {shared} tokens, less than one block of {block_size}: "
            "only whole blocks are cached"
        )
        settings = {"block_size": smaller, "enable_prefix_caching": True}
        verdict = f"the shared prefix ({shared} tokens) is shorter than a block: blocks of {smaller} let it hit"
    else:
        verdict = "the prompts share nothing worth caching"
    return Finding(QUESTION, verdict, evidence, settings, pitfalls=pitfalls)


def _cache_gain(
    report: PrefixReport,
    simulate: Callable[[dict[str, Any]], dict[str, Any]],
    caching_on: bool,
    evidence: list[str],
    pitfalls: list[str],
) -> Finding:
    """What the prefix cache saves on this trace (simulated on and off), and whether it is big enough."""
    on = simulate({"enable_prefix_caching": True})
    off = simulate({"enable_prefix_caching": False})
    saving = 1 - p50(on, "ttft") / max(p50(off, "ttft"), 1e-9)
    evidence.append(
        f"simulated TTFT p50 with the cache on / off: {p50(on, 'ttft'):.0f} / {p50(off, 'ttft'):.0f} ms; "
        f"output tokens/s {on['output_throughput']:.1f} / {off['output_throughput']:.1f}"
    )
    if report.lru_hit_rate < 0.5 * report.achievable_hit_rate:
        pitfalls.append(
            f"the cache is too small for the working set: {report.lru_hit_rate:.0%} hits of "
            f"{report.achievable_hit_rate:.0%} possible (more KV memory, or a smaller model footprint: see question 1)"
        )
    if not caching_on:
        return Finding(
            QUESTION,
            f"{report.achievable_hit_rate:.0%} of prompt tokens could come from the prefix cache, which is off",
            evidence,
            {"enable_prefix_caching": True},
            f"TTFT p50 {saving:.0%} lower",
            pitfalls,
        )
    return Finding(
        QUESTION,
        f"prefix caching (on) serves {report.lru_hit_rate:.0%} of prompt tokens; TTFT p50 {saving:.0%} lower "
        "than without",
        evidence,
        pitfalls=pitfalls,
    )


def _sharing(requests: Sequence[TraceRequest], block_size: int) -> tuple[int, int]:
    """(the longest prefix a prompt shares with an earlier one of the same salt, how many prompts part from
    their closest earlier one and then agree again: a run of a block's length found in both after the
    point where they part, within the next 512 tokens). Earlier prompts are looked at over a window."""
    best = realigned = 0
    for i, r in enumerate(requests):
        closest, at = None, -1
        first = r.token_ids[0] if r.token_ids else None
        for other in requests[max(0, i - 64) : i]:
            if other.cache_salt != r.cache_salt:
                continue
            ids = other.token_ids
            n = common_prefix(r.token_ids, ids) if ids and ids[0] == first else 0  # (no call for a first token apart)
            if n > at:
                closest, at = other, n
        if closest is None:
            continue
        best = max(best, at)
        a, b = r.token_ids[at : at + 512], closest.token_ids[at : at + 512]
        runs = {tuple(b[k : k + block_size]) for k in range(len(b) - block_size + 1)}
        if any(tuple(a[k : k + block_size]) in runs for k in range(len(a) - block_size + 1)):
            realigned += 1
    return best, realigned
