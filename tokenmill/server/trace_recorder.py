"""`tokenmill serve --record-trace FILE`: one JSON line per finished request, for `tokenmill doctor --workload
trace:FILE`.

The file opens with a header line (`{"tokenmill_trace": 1, "privacy": ..., "block_size": ..., ...}`),
then a line per finished generation request: its arrival (seconds since recording started), prompt and
output lengths, the sequences it ran (n), its finish reason, the prompt tokens the prefix cache served,
its measured TTFT and TPOT (seconds; TPOT over each sequence's tokens after the first), and its prompt:
- privacy `hashes` (the default): the prompt's chained block hashes, one per BLOCK_SIZE tokens (the last,
  partial block too): a block's hash is a keyed BLAKE2b of the previous block's hash and the block's
  token ids, keyed by a salt drawn at random when recording starts and held only in memory. Equal
  prompt prefixes give equal hash chains, so the doctor replays the trace's prefix sharing exactly,
  while the tokens (and, the salt being secret and never written, any guess at them) stay on the server;
- privacy `tokens`: the prompt's token ids themselves.

The event loop only hands each finished request to a bounded queue (`AsyncEngine.on_finished`); a
writer thread hashes, formats and writes. A full queue (the disk slower than the traffic) drops the
record and counts it. When the file would pass `max_bytes` it is renamed FILE.1 (then FILE.2, ...: the
lowest number the oldest, nothing deleted) and a new FILE starts with the same header (same run, same
salt: hashes compare across the parts). A write that fails (a full disk, a removed folder) logs the
error once and stops the recording; the server runs on.

With several models (`serve --models`), each model records to a file of its own, FILE with the model's
name before its suffix (`trace.jsonl` -> `trace.chat.jsonl`; characters other than letters, digits,
`.`, `_` and `-` become `_`), each header naming its model, each read by `doctor --workload trace:FILE`
as a one-model trace. A model's recorder lives as long as the server (a model unloaded and loaded again
appends to the same file, same salt, arrivals on the same clock); it records what the model's engine
(in the server's process, its core in a child) finishes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import re
import secrets
import threading
import time
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenmill.engine.async_engine import FinishedRequest

logger = logging.getLogger("tokenmill")

FORMAT_VERSION = 1
BLOCK_SIZE = 16  # tokens a hash covers: fine enough that a shared prefix is replayed to within 16 tokens
PRIVACY = ("hashes", "tokens")
QUEUE_LIMIT = 4096  # finished requests waiting for the writer; past it they are dropped (and counted)
DIGEST_BYTES = 8  # 16 hex digits a block


def block_hashes(token_ids: Sequence[int], block_size: int, salt: bytes) -> list[str]:
    """The chained, keyed hashes of `token_ids` in blocks of `block_size` (a trailing partial block
    included): block k's hash is BLAKE2b keyed by `salt` over block k-1's digest and block k's ids."""
    out: list[str] = []
    previous = b""
    for start in range(0, len(token_ids), block_size):
        h = hashlib.blake2b(previous, digest_size=DIGEST_BYTES, key=salt)
        h.update(array("q", token_ids[start : start + block_size]).tobytes())
        previous = h.digest()
        out.append(previous.hex())
    return out


def rotated_parts(path: Path) -> list[Path]:
    """FILE's rotated parts, oldest first (FILE.1, FILE.2, ...), then FILE itself if it exists."""
    parts = []
    n = 1
    while (part := path.with_name(f"{path.name}.{n}")).exists():
        parts.append(part)
        n += 1
    return parts + ([path] if path.exists() else [])


def model_trace_path(path: str | Path, model: str) -> Path:
    """The trace file of model `model` when the server records to `path` (see the module docstring)."""
    path = Path(path)
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", model)
    return path.with_name(f"{path.stem}.{safe}{path.suffix}")


def model_trace_paths(path: str | Path, models: Sequence[str]) -> dict[str, Path]:
    """Each model's trace file; two names that would share one are refused."""
    paths = {name: model_trace_path(path, name) for name in models}
    if len(set(paths.values())) != len(paths):
        raise ValueError(f"record_trace: two model names give the same trace file under {path}; rename one")
    return paths


class TraceRecorder:
    """Finished requests to `path` as JSON lines, written by a thread of its own (see the module docstring)."""

    def __init__(self, path: str | Path, privacy: str = "hashes", max_bytes: int = 256 << 20, model: str = "") -> None:
        if privacy not in PRIVACY:
            raise ValueError(f"record_trace_privacy: expected one of {', '.join(PRIVACY)}, got {privacy!r}")
        if max_bytes < 1:
            raise ValueError(f"record_trace_max_bytes: expected a positive integer, got {max_bytes}")
        self.path = Path(path)
        self.privacy = privacy
        self.max_bytes = max_bytes
        self._salt = secrets.token_bytes(32)  # held here only: never written
        self._start = time.monotonic()
        self.header = {
            "tokenmill_trace": FORMAT_VERSION,
            "privacy": privacy,
            "block_size": BLOCK_SIZE,
            "run": secrets.token_hex(8),
            "started_unix": round(time.time(), 3),
            "model": model,
        }
        self._queue: queue.Queue[FinishedRequest] = queue.Queue(QUEUE_LIMIT)
        self._closing = threading.Event()
        self.failed: str | None = None  # why recording stopped
        self.written = 0  # request lines written
        self.dropped = 0  # finished requests dropped with the queue full
        self._file: Any = None
        self._size = 0  # bytes in the current file
        self.written_in_file = 0  # request lines in the current file
        self._open_new()  # (an error here is the operator's to see at start: raised)
        self._thread = threading.Thread(target=self._run, name="tokenmill-trace-recorder", daemon=True)
        self._thread.start()

    # -- on the event loop --------------------------------------------------------------------------

    def record(self, finished: FinishedRequest) -> None:
        """Queue one finished request; never blocks (a full queue drops it)."""
        if self.failed is not None or self._closing.is_set():
            return
        try:
            self._queue.put_nowait(finished)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                logger.warning("trace recording: the writer is behind; dropping finished requests (counted)")

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued, then stop."""
        self._closing.set()
        self._thread.join(timeout)
        if self.dropped:
            logger.warning("trace recording: %d finished requests were dropped (the writer was behind)", self.dropped)

    # -- the writer thread --------------------------------------------------------------------------

    def _run(self) -> None:
        while not (self._closing.is_set() and self._queue.empty()):
            try:
                item = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            lines = [self.line(item)]
            while len(lines) < 256:  # what else is queued goes out in the same write
                try:
                    lines.append(self.line(self._queue.get_nowait()))
                except queue.Empty:
                    break
            if self.failed is None:
                self._write(lines)
        self._close_file()

    def line(self, f: FinishedRequest) -> str:
        """The JSON line of one finished request."""
        t = f.times
        per_sequence = f.output_tokens / max(1, f.sequences)
        ttft = tpot = None
        if t.first_token_time is not None:
            ttft = round(t.first_token_time - t.arrival_time, 6)
            if t.finished_time is not None and per_sequence > 1:
                tpot = round((t.finished_time - t.first_token_time) / (per_sequence - 1), 6)
        row: dict[str, Any] = {
            "arrival": round(max(0.0, t.arrival_time - self._start), 6),
            "prompt_len": len(f.prompt_token_ids),
            "output_len": f.output_tokens,
            "n": f.sequences,
            "finish": f.finish_reason,
            "cached": f.cached_tokens,
            "ttft": ttft,
            "tpot": tpot,
        }
        if self.privacy == "tokens":
            row["prompt_token_ids"] = list(f.prompt_token_ids)
        else:
            row["hashes"] = block_hashes(f.prompt_token_ids, BLOCK_SIZE, self._salt)
        return json.dumps(row, separators=(",", ":")) + "\n"

    def _write(self, lines: list[str]) -> None:
        try:
            for text in lines:
                data = text.encode("utf-8")
                if self._size + len(data) > self.max_bytes and self.written_in_file:
                    self._rotate()
                self._file.write(data)
                self._size += len(data)
                self.written += 1
                self.written_in_file += 1
            self._file.flush()
        except OSError as e:
            self.failed = str(e)
            logger.error("trace recording stopped: cannot write %s (%s); the server goes on", self.path, e)
            self._close_file()

    def _open_new(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab")  # noqa: SIM115 (held open by the writer thread)
        header = (json.dumps(self.header) + "\n").encode("utf-8")
        self._file.write(header)
        self._file.flush()
        self._size = self._file.tell()
        self.written_in_file = 0

    def _rotate(self) -> None:
        self._file.close()
        n = 1
        while self.path.with_name(f"{self.path.name}.{n}").exists():
            n += 1
        os.replace(self.path, self.path.with_name(f"{self.path.name}.{n}"))
        self._open_new()

    def _close_file(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None
