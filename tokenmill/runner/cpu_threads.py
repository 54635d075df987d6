"""How many threads torch should run on this CPU: one per physical core this process may use.

Hyperthread siblings share a core's arithmetic units; a second torch thread on a sibling competes
with the first instead of adding work, and leaves no room for the server's own threads. Cores are
counted from the kernel's topology files (Linux) for the CPUs in this process's affinity mask;
where those are missing, every CPU counts as a core.

`torch_threads` sets torch's count for a block: the start-up's loading runs on one (its copies and
quantizing are many short memory-bound ops; each of torch's parallel ops waits for all its threads,
and on a CPU shared with other work a thread waits its turn to be scheduled: two threads made
quantizing a 1.1B model several times slower than one under a load average of 3 on 2 cores).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch


def physical_cores(sysfs: Path = Path("/sys/devices/system/cpu")) -> int:
    """Physical cores among the CPUs this process may run on (at least 1)."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    cores: set[tuple[str, str]] = set()
    for cpu in cpus:
        topology = sysfs / f"cpu{cpu}" / "topology"
        try:
            cores.add(
                ((topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip())
            )
        except OSError:
            cores.add(("cpu", str(cpu)))
    return max(1, len(cores))


@contextmanager
def torch_threads(count: int) -> Iterator[int]:
    """torch's threads set to `count` for the block, which is given the count before it; set back after."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield before
    finally:
        torch.set_num_threads(before)
