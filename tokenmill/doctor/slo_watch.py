"""A capacity search's replay stopped once its SLOs are missed whatever its remaining requests do.

The searches (`scale.capacity`: TTFT and TPOT p90; `targets.capacity_p99`: p99) ask one thing of a
replay at a rate: whether every request finished and its TTFT and TPOT percentile meet the SLOs. A
percentile interpolates linearly between order statistics (numpy's default, `bench.metrics`): of n
values sorted, the q-th lies between those of rank floor(q (n - 1) / 100) and the next, so once
n - that rank values are past a limit, the percentile is past it however the other values come out.
`SloWatch.watch` counts, request by request as each finishes (`run_offline`'s `until`), those past
an SLO, and says stop at that count, with n every request of the trace (a TPOT comes only from the
requests of two tokens or more: fewer values, and a count that larger n asks is never too small);
a request that fails settles it at once (the search's answer is then "no" too). The rank is taken one
lower and a value must pass its limit by a billionth, so no rounding of the percentile's arithmetic
can turn a stop into a "yes" the whole replay would have given: a stopped replay says "missed" exactly
where the whole one does. A replay that meets its SLOs runs to its end.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from tokenmill.bench.records import RequestRecord

KEYS = ("ttft", "tpot")  # what the searches judge (an e2e SLO is reported, not searched on)
MARGIN = 1e-9  # relative: a value past its limit by less is not counted


def needed(n: int, percentile: float) -> int:
    """Values past a limit that put the `percentile` of n values past it (one more than the exact count)."""
    rank = max(0, math.floor(percentile * (n - 1) / 100) - 1)
    return n - rank


@dataclass(frozen=True)
class SloWatch:
    """The SLOs (ms, by metric) a search judges its replays on, at `percentile` (90, 99)."""

    slos: tuple[tuple[str, float], ...]
    percentile: float

    @classmethod
    def of(cls, slos: dict[str, float], percentile: float) -> SloWatch:
        return cls(tuple(sorted((k, float(v)) for k, v in slos.items() if k in KEYS)), percentile)

    def watch(self, requests: int) -> Callable[[RequestRecord], bool]:
        """A fresh counter for one replay of `requests` requests: True once the SLOs are missed for sure."""
        limit = needed(requests, self.percentile)
        past = {key: 0 for key, _ in self.slos}

        def missed(record: RequestRecord) -> bool:
            if not record.ok:
                return True
            values = {"ttft": record.ttft_s, "tpot": record.tpot_s}
            for key, ms in self.slos:
                value = values[key]
                if value is not None and value * 1e3 > ms * (1 + MARGIN):
                    past[key] += 1
                    if past[key] >= limit:
                        return True
            return False

        return missed

    def describe(self) -> str:
        q = f"p{self.percentile:g}"
        return " and ".join(f"{k.upper()} {q} {ms:g} ms" for k, ms in self.slos) or "no SLO"
