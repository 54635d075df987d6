"""How many threads torch should run on this CPU: one per physical core this process may use.

Hyperthread siblings share a core's arithmetic units; a second torch thread on a sibling competes
with the first instead of adding work, and leaves no room for the server's own threads. Cores are
counted from the kernel's topology files (Linux) for the CPUs in this process's affinity mask;
where those are missing, every CPU counts as a core.
"""

from __future__ import annotations

import os
from pathlib import Path


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
