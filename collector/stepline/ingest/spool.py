"""Where batches wait for the store: on disk (the default) or in memory, oldest dropped first when full.

Every batch a writer cuts becomes a segment — its rows in ClickHouse's Native format, exactly what the
store is sent — before it is inserted, and the segment goes only once the store has taken it. A segment
is inserted with its `token` as `insert_deduplication_token`, the same on every retry and after a restart
(it is kept in the segment), and the tables keep a deduplication window: an insert whose reply was lost,
or a segment replayed after a kill -9 that had in fact been written, is stored once. Tokens carry a
random id drawn each time a spool opens, so a new segment never repeats an old one's token.

On disk a segment is one file, `<seq>.<table>.seg`, written to a temporary name, fsynced and renamed,
so a crash leaves whole segments or none. What a kill -9 can lose is what had not yet been cut into a
segment: at most one flush interval of rows (`--flush-interval`, 1 s by default).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import struct
import threading
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from stepline.core.ratelimit import RateLimitedLog
from stepline.store.errors import StoreError

log = logging.getLogger(__name__)

MAGIC = b"STEPLINE-SPOOL-2"  # 2: the payload is Native bytes
_HEAD = struct.Struct("<16sIIQ")  # magic, header length, payload crc32, payload length
CACHE_BYTES = 64 << 20  # batches kept in memory beside their files, so a healthy store never reads them back

# Counts (table, rows, reason) for every row the spool gives up, where it gives them up: the collector's
# `stepline.ingest.metrics.RowDrops`.
OnDrop = Callable[[str, int, str], None]


class SpoolError(StoreError):
    """The spool directory cannot be used; the message is one line naming it."""


@dataclass(frozen=True)
class Segment:
    """One batch of one table, waiting for the store."""

    seq: int
    table: str
    columns: tuple[str, ...]
    rows: int
    size: int
    token: str


class Spool:
    """Segments of every table under one bound; each table's segments leave in the order they came."""

    def __init__(self, on_drop: OnDrop, *, max_bytes: int, directory: str | None = None) -> None:
        """`directory` None keeps segments in memory (no restart safety), bounded by `max_bytes` of rows."""
        if max_bytes < 1:
            raise ValueError(f"spool: max_bytes must be at least 1, got {max_bytes}")
        self.directory = directory
        self.max_bytes = max_bytes
        self._on_drop = on_drop
        self._lock = threading.Lock()
        self._pending: dict[str, list[Segment]] = {}
        self._claimed: set[int] = set()
        self._cache: dict[int, bytes] = {}
        self._cached_bytes = 0
        self._bytes = 0
        self._next = 1
        self._log = RateLimitedLog(log, interval_s=10.0)
        self.run_id = secrets.token_hex(8)
        if directory is not None:
            self._open(directory)

    # -- what the writers call ---------------------------------------------------------------------------

    def append(self, table: str, columns: Sequence[str], data: bytes, rows: int) -> Segment:
        """Keep one batch (Native bytes); on disk it is durable when this returns. Makes room by dropping the oldest."""
        with self._lock:
            seq = self._next
            self._next += 1
        segment = Segment(seq, table, tuple(columns), rows, len(data), f"stepline-{self.run_id}-{seq}")
        if self.directory is not None:
            self._write(segment, data)
        with self._lock:
            self._pending.setdefault(table, []).append(segment)
            self._bytes += segment.size
            if self.directory is None or self._cached_bytes + segment.size <= CACHE_BYTES:
                self._cache[seq] = data
                self._cached_bytes += segment.size
            dropped = self._make_room()
        for victim in dropped:
            self._discard(victim, "spool_full")
        return segment

    def claim(self, table: str) -> Segment | None:
        """The table's oldest segment, held so that making room will not drop it while it is inserted."""
        with self._lock:
            pending = self._pending.get(table)
            if not pending:
                return None
            self._claimed.add(pending[0].seq)
            return pending[0]

    def release(self, segment: Segment) -> None:
        """The insert failed: the segment waits for the next try (and may be dropped to make room)."""
        with self._lock:
            self._claimed.discard(segment.seq)

    def load(self, segment: Segment) -> bytes | None:
        """The segment's Native bytes; None when its file is unreadable (then it is dropped, counted)."""
        with self._lock:
            data = self._cache.get(segment.seq)
        if data is not None:
            return data
        try:
            _, loaded = _read(self._path(segment))
        except (OSError, ValueError, EOFError, TypeError, struct.error) as exc:
            self._log.warning(f"load:{segment.table}", "spool segment %s is unreadable, dropping its %d rows: %s",
                            self._path(segment), segment.rows, exc)
            self.ack(segment)
            self._on_drop(segment.table, segment.rows, "spool_corrupt")
            return None
        return loaded

    def ack(self, segment: Segment) -> None:
        """The store has the segment (or it was given up): forget it."""
        with self._lock:
            self._claimed.discard(segment.seq)
            pending = self._pending.get(segment.table, [])
            if segment not in pending:
                return
            pending.remove(segment)
            self._bytes -= segment.size
            if self._cache.pop(segment.seq, None) is not None:
                self._cached_bytes -= segment.size
        if self.directory is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path(segment))

    def rows(self, table: str | None = None) -> int:
        """Rows waiting, for one table or all."""
        with self._lock:
            tables = [table] if table is not None else list(self._pending)
            return sum(s.rows for t in tables for s in self._pending.get(t, []))

    def size_bytes(self) -> int:
        with self._lock:
            return self._bytes

    def pending(self, table: str) -> list[Segment]:
        with self._lock:
            return list(self._pending.get(table, []))

    # -- on disk -----------------------------------------------------------------------------------------

    def _open(self, directory: str) -> None:
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
            names = sorted(os.listdir(directory))
        except OSError as exc:
            raise SpoolError(f"cannot use the spool directory {directory}: {exc.strerror}") from None
        for name in names:
            path = os.path.join(directory, name)
            if name.endswith(".tmp"):  # a segment a crash interrupted before it was whole: never acknowledged
                os.unlink(path)
                continue
            if not name.endswith(".seg"):
                continue
            try:
                seq_text, table, _ = name.split(".")
                header = _read_header(path)
                segment = Segment(int(seq_text), table, tuple(header["columns"]), int(header["rows"]),
                                  os.path.getsize(path), str(header["token"]))
            except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
                log.warning("spool segment %s is unreadable, dropping it: %s", path, exc)
                os.unlink(path)
                self._on_drop(name.split(".")[1] if name.count(".") == 2 else "unknown", 0, "spool_corrupt")
                continue
            self._pending.setdefault(table, []).append(segment)
            self._bytes += segment.size
            self._next = max(self._next, segment.seq + 1)
        waiting = sum(s.rows for segments in self._pending.values() for s in segments)
        if waiting:
            log.info("spool %s: %d rows from before the restart wait for the store", directory, waiting)

    def _path(self, segment: Segment) -> str:
        assert self.directory is not None
        return os.path.join(self.directory, f"{segment.seq:016d}.{segment.table}.seg")

    def _write(self, segment: Segment, payload: bytes) -> None:
        header = json.dumps({"table": segment.table, "columns": segment.columns, "rows": segment.rows,
                             "token": segment.token}).encode()
        head = _HEAD.pack(MAGIC, len(header), zlib.crc32(payload), len(payload))
        _write_atomically(self._path(segment), head + header + payload)

    def _make_room(self) -> list[Segment]:
        """Under the lock: take the oldest unclaimed segments out until the spool is within its bound."""
        dropped: list[Segment] = []
        while self._bytes > self.max_bytes:
            candidates = [s for segments in self._pending.values() for s in segments if s.seq not in self._claimed]
            if not candidates:
                break
            victim = min(candidates, key=lambda s: s.seq)
            self._pending[victim.table].remove(victim)
            self._bytes -= victim.size
            if self._cache.pop(victim.seq, None) is not None:
                self._cached_bytes -= victim.size
            dropped.append(victim)
        return dropped

    def _discard(self, segment: Segment, reason: str) -> None:
        if self.directory is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path(segment))
        self._on_drop(segment.table, segment.rows, reason)


def _write_atomically(path: str, data: bytes) -> None:
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(directory or ".", os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a power loss
    finally:
        os.close(dir_fd)


def _read_header(path: str) -> dict[str, Any]:
    with open(path, "rb") as fh:
        magic, header_len, _, _ = _HEAD.unpack(fh.read(_HEAD.size))
        if magic != MAGIC:
            raise ValueError("not a stepline spool segment")
        header: dict[str, Any] = json.loads(fh.read(header_len))
    return header


def _read(path: str) -> tuple[dict[str, Any], bytes]:
    with open(path, "rb") as fh:
        data = fh.read()
    magic, header_len, crc, payload_len = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise ValueError("not a stepline spool segment")
    start = _HEAD.size + header_len
    payload = data[start:start + payload_len]
    if len(payload) != payload_len or zlib.crc32(payload) != crc:
        raise ValueError("checksum mismatch (a torn or altered segment)")
    return json.loads(data[_HEAD.size:start]), payload
