"""The Ray cluster a data-parallel server runs on: a local one it starts, or an existing one it joins.

A local cluster is started on the loopback address, without the dashboard and with usage statistics
off (nothing leaves the machine). `--ray-address` joins an existing cluster instead (`auto`, or the
head's `host:port` / `ray://host:10001`); its nodes need tokenmill installed and the model folder at
the same path. Ray not installed, or a cluster not reachable, is a clear error at start.
"""

from __future__ import annotations

import logging
import os
import socket
from types import ModuleType

logger = logging.getLogger("tokenmill")

OBJECT_STORE_BYTES = 128 * 1024**2  # a local cluster's object store: only small messages go through it
CONNECT_TIMEOUT_S = 10


def ray_module() -> ModuleType:
    """Ray, or a ValueError (a setting that cannot be met here) that says how to get it."""
    try:
        import ray
    except ImportError:
        raise ValueError(
            "data_parallel_size / ray_address: engine replicas run on Ray, which is not installed here "
            "(pip install 'ray>=2.55,<3'; `make install` does)"
        ) from None
    return ray


def connect(address: str | None, num_cpus: int) -> None:
    """Join the cluster at `address`, or start a local one with `num_cpus` CPUs (at least the
    machine's); nothing if this process is already connected. A ValueError naming `ray_address` when
    nothing answers there (checked first: Ray itself would retry for minutes)."""
    ray = ray_module()
    if address is not None:
        _check_reachable(address)
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        if address is None:
            ray.init(
                _node_ip_address="127.0.0.1",
                include_dashboard=False,
                num_cpus=max(num_cpus, os.cpu_count() or 1),
                object_store_memory=OBJECT_STORE_BYTES,
                configure_logging=False,
            )
            logger.info("started a local Ray cluster on 127.0.0.1")
        else:
            ray.init(address=address, configure_logging=False)
            logger.info("joined the Ray cluster at %s", address)
    except Exception as e:  # Ray raises ConnectionError, RuntimeError, ValueError... for the same cause
        where = f"the Ray cluster at {address!r}" if address is not None else "a local Ray cluster"
        raise ValueError(f"ray_address: could not reach {where}: {type(e).__name__}: {e}") from None


def _check_reachable(address: str) -> None:
    """For an address with a port (`host:port`, `ray://host:port`), that something accepts a
    connection there within CONNECT_TIMEOUT_S; `auto` and the like are left to Ray."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise ValueError(f"ray_address: nothing answers at {address} ({e}); is the Ray cluster running?") from None
