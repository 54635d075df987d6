"""ParallelConfig: how many engine replicas a server runs, how requests are routed, which Ray cluster."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.distributed.router import ROUTING


@dataclass(frozen=True)
class ParallelConfig:
    data_parallel_size: int = 1  # engine cores, each a Ray actor with its own model copy and KV cache
    routing: str = "least_loaded"  # or "prefix": to the replica holding the longest cached prefix
    ray_address: str | None = None  # an existing cluster ("auto", "ray://host:10001", ...); None: a local one

    def __post_init__(self) -> None:
        if isinstance(self.data_parallel_size, bool) or not isinstance(self.data_parallel_size, int):
            raise ValueError(f"data_parallel_size: expected a positive integer, got {self.data_parallel_size!r}")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size: expected a positive integer, got {self.data_parallel_size}")
        if self.routing not in ROUTING:
            raise ValueError(f"routing: expected one of {', '.join(ROUTING)}, got {self.routing!r}")

    @property
    def uses_ray(self) -> bool:
        """More than one replica, or a cluster named: the cores run as Ray actors."""
        return self.data_parallel_size > 1 or self.ray_address is not None
