"""How many drafts to verify this step, from measurements: speculation only where it pays.

Verifying d drafts adds d tokens to the step; it pays when the tokens they are expected to add
outrun what the longer step costs. Both sides are measured as the engine runs:

- `StepCurve`: the step's time by the tokens it runs (an average per power-of-two bucket of token
  counts, each bucket's mean count and mean time; linear between buckets), from steps without prompt
  chunks only (a prompt chunk's attention and the engine's work around it are another curve). A token count beyond the
  measured ones costs, until measured, what the largest measured one did: optimistic, so the rule
  tries a longer step once, measures it, and keeps to it only if it paid.
- acceptance by draft position: a request's draft j counts only if every draft before it was kept,
  so its expected tokens are the product of the conditional rates c_0 .. c_j, where c_i is how often
  draft i was kept when it was reached (the request's own counts, pulled toward the engine-wide ones
  while it has few; the engine-wide ones start at 3/4, optimistic, so that drafts get tried and
  measured: a rule that starts pessimistic never verifies any and never learns otherwise). Per
  position, not one rate: drafts copied from the context come in runs (once a run starts, the next
  draft is likely kept too), which one geometric rate undercounts.
- the proposer's own time a step (an average).

`choose` takes the drafts in order of expected tokens (each request's first, then its second, ...:
the products fall with j) and keeps the count that maximizes (decoding requests + expected extra tokens) /
(step time at that many tokens + what proposing still costs); none, when no count beats plain
decoding. Asked first as if every request were offered its k drafts, with the proposer's time: when
that does not pay, the runner proposes nothing for the next step (acceptance starts optimistic, so
proposing gets tried before it is judged). Pure Python: the scheduler's draft policy
(`sched/draft_policy.py`) asks it.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

SMOOTHING = 0.2  # weight of a new measurement in a running average
PRIOR = 4.0  # drafts' worth of the engine-wide rate in a request's own (a few requests' outcomes decide)


@dataclass
class StepCurve:
    """Step seconds by tokens run: per bucket (bit length of the count) a running mean count and time."""

    buckets: dict[int, tuple[float, float]] = field(default_factory=dict)  # bucket -> (tokens, seconds)
    _points: list[tuple[float, float]] = field(default_factory=list)  # the buckets' points by count

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0:
            return
        b = tokens.bit_length()
        old = self.buckets.get(b)
        if old is None:
            self.buckets[b] = (float(tokens), seconds)
        else:
            n, t = old
            self.buckets[b] = (n + SMOOTHING * (tokens - n), t + SMOOTHING * (seconds - t))
        self._points = sorted(self.buckets.values())

    def seconds(self, tokens: int) -> float | None:
        """The expected time of a step of `tokens` tokens; None before any step was measured."""
        points = self._points
        if not points:
            return None
        if tokens <= points[0][0]:
            return points[0][1]
        for (n0, t0), (n1, t1) in itertools.pairwise(points):
            if tokens <= n1:
                return t0 + (t1 - t0) * (tokens - n0) / (n1 - n0) if n1 > n0 else t1
        return points[-1][1]  # past the longest measured step: as long as that one, until measured


@dataclass
class Candidate:
    """A request that could verify drafts this step."""

    request_id: str
    num_drafts: int  # what its proposer offered (at most k)
    reached: list[int] = field(default_factory=list)  # [j]: its drafts at j verified with all before kept
    kept: list[int] = field(default_factory=list)  # [j]: of those, kept


@dataclass
class SpeculationPolicy:
    curve: StepCurve = field(default_factory=StepCurve)
    proposer_seconds: float = 0.0  # a step's proposing, averaged
    # engine-wide counts by draft position (the scheduler's), the prior of every request's own
    reached: list[int] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)

    def gains(self, c: Candidate) -> list[float]:
        """The expected tokens each of its drafts adds: [j] = P(drafts 0..j all kept)."""
        out, p = [], 1.0
        for j in range(c.num_drafts):
            overall = (_at(self.kept, j) + 3) / (_at(self.reached, j) + 4)  # optimistic until measured
            p *= (_at(c.kept, j) + PRIOR * overall) / (_at(c.reached, j) + PRIOR)
            out.append(p)
        return out

    def observe_proposer(self, seconds: float) -> None:
        self.proposer_seconds += SMOOTHING * (seconds - self.proposer_seconds)

    def choose(
        self,
        decoding: int,
        other_tokens: int,
        candidates: list[Candidate],
        proposer_seconds: float = 0.0,
    ) -> dict[str, int]:
        """Drafts to verify per candidate (0 or absent: none). `decoding`: requests decoding this step
        (one token each, candidates included); `other_tokens`: prompt tokens the step also runs;
        `proposer_seconds`: what proposing still costs (0 once the drafts are there)."""
        base = decoding + other_tokens
        plain = self.curve.seconds(base)
        if plain is None or decoding == 0:
            return {}
        gains = {c.request_id: self.gains(c) for c in candidates}
        # (minus the expected tokens of a request's next draft, the request, that draft's position)
        heap = [(-g[0], request_id, 0) for request_id, g in gains.items() if g]
        heapq.heapify(heap)
        best_rate, best_count, extra, count = decoding / plain, 0, 0.0, 0
        taken: list[str] = []
        while heap:
            neg_gain, request_id, j = heapq.heappop(heap)
            extra += -neg_gain
            count += 1
            taken.append(request_id)
            if j + 1 < len(gains[request_id]):  # its next draft counts only if this one is kept too
                heapq.heappush(heap, (-gains[request_id][j + 1], request_id, j + 1))
            seconds = self.curve.seconds(base + count)
            assert seconds is not None
            rate = (decoding + extra) / (seconds + proposer_seconds)
            if rate > best_rate:
                best_rate, best_count = rate, count
        chosen: dict[str, int] = {}
        for request_id in taken[:best_count]:
            chosen[request_id] = chosen.get(request_id, 0) + 1
        return chosen


def _at(counts: list[int], j: int) -> int:
    return counts[j] if j < len(counts) else 0
