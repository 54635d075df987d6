"""Issue 42 item 6: slow clients are timed out and cannot exhaust the server's file descriptors.

`tokenmill serve` runs as a process with 1,024 descriptors at most (soft limit 256, which it raises to
the hard limit at start), 1 s header, body and keep-alive deadlines: 1,100 connections trickling a
header byte every half second are closed after the header deadline (or to make room), while /health
keeps answering within the second."""

from __future__ import annotations

import os
import re
import resource
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace

import httpx
import pytest

from tokenmill.server.connections import FD_RESERVE, ConnectionGuard, connection_cap

HARD_FILES = 1024
TRICKLERS = 1100


@dataclass
class Served:
    proc: subprocess.Popen[str]
    host: str
    port: int
    log: list[str]

    @property
    def base(self) -> str:
        return f"http://{self.host}:{self.port}"


def _limit_files() -> None:  # (in the server's process, before exec)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, HARD_FILES))


@pytest.fixture(scope="module")
def served(tiny_model_dir) -> Iterator[Served]:
    cmd = [sys.executable, "-m", "tokenmill.cli", "serve", str(tiny_model_dir("llama")), "--port", "0"]
    cmd += ["--max-model-len", "256", "--kv-cache-memory", str(64 * 24576)]
    cmd += ["--header-timeout", "1", "--body-timeout", "1", "--keep-alive-timeout", "1"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env, preexec_fn=_limit_files)
    log: list[str] = []
    try:
        assert proc.stderr is not None
        found = None
        deadline = time.monotonic() + 60
        while found is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line, "".join(log)
            log.append(line)
            found = re.search(r"on http://(127\.0\.0\.1):(\d+)", line)
        assert found is not None, "no address logged"
        threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True).start()  # type: ignore[arg-type]
        yield Served(proc, found.group(1), int(found.group(2)), log)
    finally:
        proc.kill()
        proc.wait()


def _answer(s: socket.socket, wait: float) -> tuple[bytes, float]:
    """What the server sends until it closes the connection (or `wait` passes), and when it closed."""
    start, data = time.monotonic(), b""
    s.settimeout(wait)
    try:
        while chunk := s.recv(4096):
            data += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return data, time.monotonic() - start


def test_the_open_file_limit_is_raised_and_the_cap_stays_below_it(served):
    line = next(line for line in served.log if "serving" in line)
    assert f"at most {HARD_FILES - FD_RESERVE} connections, open-file limit {HARD_FILES}" in line, line


def test_a_silent_connection_gets_a_408_after_the_header_deadline(served):
    with socket.create_connection((served.host, served.port)) as s:
        data, took = _answer(s, 5)
    assert data.startswith(b"HTTP/1.1 408 ") and b'"type": "timeout_error"' in data, data
    assert 0.9 < took < 3, took


def test_a_slow_body_gets_a_408_after_the_body_deadline(served):
    with socket.create_connection((served.host, served.port)) as s:
        s.sendall(b"POST /tokenize HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n" + b'{"prompt": ')
        data, took = _answer(s, 5)
    assert data.startswith(b"HTTP/1.1 408 ") and b"request body" in data, data
    assert 0.9 < took < 3, took


def test_a_client_within_the_deadlines_is_served_and_idles_out_after_keep_alive(served):
    with socket.create_connection((served.host, served.port)) as s:
        for piece in (b"GET /heal", b"th HTTP/1.1\r\nho", b"st: x\r\n\r\n"):  # 0.6 s of headers: within 1 s
            s.sendall(piece)
            time.sleep(0.3)
        s.settimeout(5)
        assert s.recv(4096).startswith(b"HTTP/1.1 200 ")
        data, took = _answer(s, 5)  # then idle: closed by the keep-alive timeout
    assert data == b"" and 0.5 < took < 3, (data, took)


def test_1100_trickling_connections_are_closed_while_health_keeps_answering(served):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < TRICKLERS + 200:
        pytest.skip(f"this process may open {hard} files")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, TRICKLERS + 200), hard))
    head = b"GET /health HTTP/1.1\r\nhost: x\r\n"
    socks: list[socket.socket] = []
    closed: set[int] = set()
    health: list[float] = []
    try:
        for _ in range(TRICKLERS):  # (a few seconds: the server accepts at most 128 at a time)
            s = socket.create_connection((served.host, served.port), timeout=10)
            s.setblocking(False)
            socks.append(s)
        deadline = time.monotonic() + 6
        step = 0
        while len(closed) < TRICKLERS and time.monotonic() < deadline:
            for i, s in enumerate(socks):
                if i not in closed and _trickle(s, head[step % len(head) : step % len(head) + 1]):
                    closed.add(i)
            t = time.monotonic()
            assert httpx.get(f"{served.base}/health", timeout=5).status_code == 200
            health.append(time.monotonic() - t)
            step += 1
            time.sleep(0.5)
    finally:
        for s in socks:
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert len(closed) == TRICKLERS, f"{TRICKLERS - len(closed)} trickling connections still open"
    assert max(health) < 1.0, health
    assert not any("Too many open files" in line for line in served.log)
    assert any("slow or surplus connections closed" in line for line in served.log)


def _trickle(s: socket.socket, byte: bytes) -> bool:
    """Send one byte; True once the server has answered (a 408) or closed the connection."""
    try:
        s.recv(4096)  # (b"": closed; else its 408, then closed)
        return True
    except BlockingIOError:
        pass
    except OSError:
        return True
    try:
        s.send(byte)
    except OSError:
        return True
    return False


# -- the cap, alone --------------------------------------------------------------------------------


class _Conn:
    """A stand-in for a connection's protocol: its transport records the close."""

    def __init__(self, closed: list[_Conn]) -> None:
        self.transport = SimpleNamespace(close=lambda: closed.append(self))


def test_the_cap_closes_the_oldest_idle_connection_else_refuses():
    guard = ConnectionGuard(cap=2)
    closed: list[_Conn] = []
    a, b, c, d = (_Conn(closed) for _ in range(4))
    assert guard.admit(a) and guard.admit(b)
    guard.set_idle(a, True)
    guard.set_idle(b, True)
    guard.set_idle(a, False)  # a is busy now: b is the oldest idle one
    assert guard.admit(c) and closed == [b]
    assert not guard.admit(d)  # a and c busy (c never went idle): no room
    assert guard.closed["evicted"] == 1 and guard.closed["refused"] == 1
    guard.release(a)
    assert guard.admit(d)


def test_the_automatic_cap_is_above_the_engine_and_below_the_open_files():
    assert connection_cap(None, busiest=128, open_files=1 << 20) == 1024
    assert connection_cap(None, busiest=4096, open_files=1 << 20) == 8192
    assert connection_cap(None, busiest=128, open_files=1024) == 1024 - FD_RESERVE
    assert connection_cap(5000, busiest=128, open_files=2048) == 2048 - FD_RESERVE
    assert connection_cap(50, busiest=128, open_files=2048) == 50
