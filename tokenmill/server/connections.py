"""Connection hygiene below the app, in uvicorn's protocol layer: deadlines for a client to send its
request, a cap on open connections, and the open-file limit.

uvicorn times out idle keep-alive connections, but nothing else: a client that opens a connection
and sends nothing, or trickles its headers a byte every few seconds, holds a socket (a file
descriptor) forever, and ~1,000 of them exhaust the process's descriptors (accept fails with EMFILE;
even `/health` gets no answer). Here each connection runs under a deadline for its phase:

- headers: from the connection's start, or from the first byte of a later request on it, the
  request line and headers must be complete within `header_timeout` seconds;
- body: then the body must be complete within `body_timeout` seconds;
- then the app has the request, with no deadline (a long stream is normal); between requests
  uvicorn's keep-alive timeout (`keep_alive_timeout`) closes an idle connection.

A connection past its deadline gets a 408 (when nothing was answered yet) and is closed. Open
connections are capped (`max_connections`, below the open-file limit): a connection past the cap
closes the oldest one that has no request in progress (an idle keep-alive, or one still sending
headers); if every one is busy, the new one gets a 503 and is closed. So a flood of slow clients
cannot take the last descriptor, and a real request still finds room. (The cap leaves room below
the open-file limit for a burst of accepts: see FD_RESERVE. A descriptor running out anyway makes
asyncio stop accepting for a second.)
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from collections import OrderedDict
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from tokenmill.server.front_door import AUTO_CONNECTIONS, ConnectionLimits

logger = logging.getLogger("tokenmill")

# Connections accepted at once: asyncio accepts up to the listen backlog in one go, each holding a
# descriptor before the cap can close any, and closes its evictions one loop turn later.
LISTEN_BACKLOG = 128
FD_RESERVE = 2 * LISTEN_BACKLOG + 64  # those bursts, and the process's own (model files, pipes, logs)
MIN_CONNECTIONS = 16
WARN_EVERY_S = 10.0


def raise_open_file_limit() -> int:
    """Raise the soft limit on open files to the hard limit (many connections need many descriptors);
    the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:  # (a kernel maximum below the hard limit, say)
            logger.warning("could not raise the open-file limit from %d to %d: %s", soft, target, e)
    return soft


def connection_cap(requested: int | None, busiest: int, open_files: int) -> int:
    """The cap on open connections: `requested`, else the larger of AUTO_CONNECTIONS and twice the
    requests the engine can hold (`busiest`: running + waiting), so that the engine's 429, not this
    cap, is what a busy server answers; in any case below the open-file limit."""
    fits = max(MIN_CONNECTIONS, open_files - FD_RESERVE)
    wanted = requested if requested is not None else max(AUTO_CONNECTIONS, 2 * busiest)
    cap = min(wanted, fits)
    if cap < wanted and requested is not None:
        logger.warning("max_connections %d lowered to %d: the open-file limit is %d", wanted, cap, open_files)
    if cap <= busiest:
        logger.warning(
            "at most %d connections (open-file limit %d), not above the %d requests the engine can hold "
            "(max_num_seqs + max_waiting): raise the limit (ulimit -n)",
            cap,
            open_files,
            busiest,
        )
    return cap


def _raw_response(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP/1.1 response with OpenAI's error JSON, for a connection about to be closed."""
    kind = "timeout_error" if status == 408 else "service_unavailable"
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": None}}).encode()
    head = f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
    return (head + "connection: close\r\n\r\n").encode() + body


class ConnectionGuard:
    """One server's open connections: their count against the cap, and the idle ones (no request in
    progress) oldest first, the first to close when a new connection needs room."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.members: set[GuardedH11Protocol] = set()
        self.idle: OrderedDict[GuardedH11Protocol, None] = OrderedDict()
        self.closed = {"header_timeout": 0, "body_timeout": 0, "evicted": 0, "refused": 0}
        self.last_warned = 0.0

    def admit(self, conn: GuardedH11Protocol) -> bool:
        """Make room for `conn` (closing the oldest idle connection if at the cap); False: no room."""
        if len(self.members) >= self.cap:
            if not self.idle:
                self.count("refused")
                return False
            victim, _ = self.idle.popitem(last=False)
            self.members.discard(victim)
            self.count("evicted")
            victim.transport.close()
        self.members.add(conn)
        return True

    def set_idle(self, conn: GuardedH11Protocol, idle: bool) -> None:
        if conn not in self.members:
            return
        if idle:
            self.idle.setdefault(conn, None)  # (keeps its place: idle since then)
        else:
            self.idle.pop(conn, None)

    def release(self, conn: GuardedH11Protocol) -> None:
        self.members.discard(conn)
        self.idle.pop(conn, None)

    def count(self, why: str) -> None:
        self.closed[why] += 1
        now = time.monotonic()
        if now - self.last_warned >= WARN_EVERY_S:
            self.last_warned = now
            logger.warning(
                "slow or surplus connections closed so far: %s (%d open, cap %d)",
                ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in self.closed.items()),
                len(self.members),
                self.cap,
            )


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol under the deadlines and the cap of the module docstring. A subclass per
    server (`guarded_protocol`) carries its limits and guard."""

    limits: ClassVar[ConnectionLimits]
    guard: ClassVar[ConnectionGuard]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.deadline: asyncio.TimerHandle | None = None
        self.phase = "headers"  # headers | body | app | idle (between requests)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if not self.guard.admit(self):
            transport.write(_raw_response(503, "Service Unavailable", "Too many open connections; retry later."))
            transport.close()
            return
        self.guard.set_idle(self, True)
        self._arm("headers", self.limits.header_timeout)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.guard.release(self)
        super().connection_lost(exc)

    def _follow(self) -> None:
        """Move to the phase h11's state shows, arming that phase's deadline."""
        if self.transport.is_closing():
            self._disarm()
            return
        theirs = self.conn.their_state
        self.guard.set_idle(self, theirs is h11.IDLE)
        if theirs is h11.IDLE:
            if self.conn.trailing_data[0]:  # part of a request's head is here
                if self.phase != "headers":
                    self._arm("headers", self.limits.header_timeout)
            elif self.phase != "headers":  # between requests: uvicorn's keep-alive timeout runs
                self._disarm("idle")
        elif theirs is h11.SEND_BODY:
            if self.phase != "body":
                self._arm("body", self.limits.body_timeout)
        else:  # the whole request is in (or the connection is ending): the app's time, no deadline
            self._disarm("app")

    def _arm(self, phase: str, seconds: float) -> None:
        self._disarm(phase)
        self.deadline = self.loop.call_later(seconds, self._expired, phase)

    def _disarm(self, phase: str | None = None) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None
        if phase is not None:
            self.phase = phase

    def _expired(self, phase: str) -> None:
        self.deadline = None
        if self.transport.is_closing():
            return
        seconds = self.limits.header_timeout if phase == "headers" else self.limits.body_timeout
        self.guard.count("header_timeout" if phase == "headers" else "body_timeout")
        if phase == "headers" or not self.cycle.response_started:  # nothing answered yet
            what = "request headers" if phase == "headers" else "request body"
            message = f"The {what} did not arrive within {seconds:g} s."
            self.transport.write(_raw_response(408, "Request Timeout", message))
        self.transport.close()


def guarded_protocol(limits: ConnectionLimits, cap: int) -> type[GuardedH11Protocol]:
    """The protocol class for one server (uvicorn's `http=`): its limits, and a guard of `cap` connections."""
    return type(
        "ServerH11Protocol",
        (GuardedH11Protocol,),
        {"limits": limits, "guard": ConnectionGuard(cap)},
    )
