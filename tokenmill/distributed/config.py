"""ParallelConfig: how many engine replicas a server runs (data-parallel, or prefill and decode ones),
how requests are routed, which Ray cluster."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.engine.router import ROUTING


@dataclass(frozen=True)
class ParallelConfig:
    data_parallel_size: int = 1  # engine cores, each a Ray actor with its own model copy and KV cache
    routing: str = "least_loaded"  # or "prefix": to the replica holding the longest cached prefix
    ray_address: str | None = None  # an existing cluster ("auto", "ray://host:10001", ...); None: a local one
    prefill_size: int = 0  # with decode_size: a disaggregated server's prefill and decode replicas
    decode_size: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.data_parallel_size, bool) or not isinstance(self.data_parallel_size, int):
            raise ValueError(f"data_parallel_size: expected a positive integer, got {self.data_parallel_size!r}")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size: expected a positive integer, got {self.data_parallel_size}")
        if self.routing not in ROUTING:
            raise ValueError(f"routing: expected one of {', '.join(ROUTING)}, got {self.routing!r}")
        if (self.prefill_size > 0) != (self.decode_size > 0) or min(self.prefill_size, self.decode_size) < 0:
            raise ValueError("disaggregate: expected prefill=P,decode=D with P and D positive integers")
        if self.disaggregated and self.data_parallel_size > 1:
            raise ValueError("data_parallel_size: not with disaggregate (give the replicas as prefill=P,decode=D)")

    @classmethod
    def disaggregate(cls, text: str, ray_address: str | None = None) -> ParallelConfig:
        """From `--disaggregate prefill=P,decode=D`; a ValueError naming what is wrong."""
        sizes: dict[str, int] = {}
        for part in text.split(","):
            key, sep, value = part.strip().partition("=")
            if not sep or key not in ("prefill", "decode") or not value.isdigit() or int(value) < 1 or key in sizes:
                raise ValueError(f"disaggregate: expected prefill=P,decode=D (positive integers), got {text!r}")
            sizes[key] = int(value)
        if set(sizes) != {"prefill", "decode"}:
            raise ValueError(f"disaggregate: expected prefill=P,decode=D (both), got {text!r}")
        return cls(ray_address=ray_address, prefill_size=sizes["prefill"], decode_size=sizes["decode"])

    @property
    def disaggregated(self) -> bool:
        return self.prefill_size > 0

    @property
    def num_replicas(self) -> int:
        return self.prefill_size + self.decode_size if self.disaggregated else self.data_parallel_size

    @property
    def uses_ray(self) -> bool:
        """More than one replica, or a cluster named: the cores run as Ray actors."""
        return self.data_parallel_size > 1 or self.disaggregated or self.ray_address is not None
