"""The plugin's outbox: encoded records batched into datagrams and sent to the sidecar by a thread of its own.

The engine's thread only appends to the open batch and, every `flush_interval_s` (at once when the
engine goes idle), seals it and wakes the sender. The sender thread sends what is sealed, several
batches coalesced into one datagram when they have piled up, and when the sidecar's queue is full
(EAGAIN: it holds net.unix.max_dgram_qlen datagrams, 10 on many machines) waits in poll(2) until the
socket takes more. So a backlog drains as fast as the sidecar reads, whether or not the engine still
calls, and the engine never waits for the socket. The thread starts with the first batch (or
`start()`), and ends when the outbox is closed or garbage-collected.

Bounded: past `max_buffer_bytes` the oldest batches are dropped and counted (`buffer_full`). At exit
(atexit: vLLM gives stat loggers no shutdown call) what is still held is tried once, for at most
`exit_timeout_s`; what cannot be sent then is counted (`closed`) and logged. Every other drop is counted
by reason, carried to the sidecar in the next datagram's header, and logged at most once per
`log_interval_s`.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import random
import select
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence

from stepline.plugin import wire

log = logging.getLogger("stepline.plugin")

EMPTY, FULL, GONE = "empty", "full", "gone"  # what a send pass ended on
SEND_BUFFER_BYTES = 1 << 20  # asked for; the kernel caps it at net.core.wmem_max


class Outbox:
    """Sealed batches waiting for the socket, the thread that sends them, and the counts of what was lost."""

    def __init__(
        self,
        socket_path: str,
        engine: bytes,
        credential: bytes = b"",
        *,
        max_buffer_bytes: int = 8 << 20,
        flush_interval_s: float = 0.05,
        reconnect_interval_s: float = 5.0,
        log_interval_s: float = 60.0,
        exit_timeout_s: float = 1.0,
        writable_wait_s: float = 0.05,
        idle_wait_s: float = 2.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.socket_path = socket_path
        self._engine = engine
        self._credential = credential
        self.body_limit = wire.MAX_DATAGRAM - wire.HEADER.size - len(engine) - len(credential)
        self._max_buffer_bytes = max_buffer_bytes
        self._flush_interval_s = flush_interval_s
        self._reconnect_interval_s = reconnect_interval_s
        self._log_interval_s = log_interval_s
        self.exit_timeout_s = exit_timeout_s
        self._writable_wait_s = writable_wait_s
        self._idle_wait_s = idle_wait_s
        self._monotonic = monotonic
        # _lock guards the batches and the counters (held only for list and counter work, never a syscall);
        # _send_lock the socket and the sequence: one sender at a time, so datagrams leave in sequence order.
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._sender_idle = False  # the sender sleeps its idle wait: a new batch must wake it
        self._closed = False
        self._pending = bytearray()
        self._pending_records = 0
        self._queue: deque[tuple[bytes, int]] = deque()  # sealed batch bodies and their record counts
        self._queued_bytes = 0
        self._queued_records = 0
        self._in_flight = 0  # records taken off the queue by a send that has not finished
        self._sealed_at = monotonic()
        self._sock: socket.socket | None = None
        self._next_connect = 0.0
        self._pid = os.getpid() & wire.U32
        self._instance = random.getrandbits(32)
        self._sequence = 0
        self.records_sent = 0
        self.datagrams_sent = 0
        self.dropped: dict[str, int] = {}
        self.dropped_total = 0
        self.sender_errors = 0
        self._dropped_since_log: dict[str, int] = {}
        self._last_log = monotonic()
        self._exit_hook = functools.partial(_close_at_exit, weakref.ref(self))
        atexit.register(self._exit_hook)

    @property
    def records_held(self) -> int:
        """Records neither sent nor dropped yet: the open batch, the sealed ones, and one being sent."""
        with self._lock:
            return self._pending_records + self._queued_records + self._in_flight

    def accounting(self) -> tuple[int, dict[str, int], int]:
        """(records sent, records dropped by reason, records held), read together: they always add up."""
        with self._lock:
            return (self.records_sent, dict(self.dropped),
                    self._pending_records + self._queued_records + self._in_flight)

    # -- the engine's side: never waits on the socket -------------------------------------------------------------

    def put(self, records: Sequence[bytes], flush_now: bool = False) -> None:
        """Append records to the open batch; seal it when the flush interval has passed (or `flush_now`)."""
        now = self._monotonic()
        with self._lock:
            if self._closed:
                self._drop_locked("closed", len(records))
                return
            opened = not self._pending_records
            limit = self.body_limit
            for record in records:
                if len(record) > limit:
                    self._drop_locked("too_large", 1)
                    continue
                if len(self._pending) + len(record) > limit:
                    self._seal_locked(now)
                self._pending += record
                self._pending_records += 1
            if flush_now or now - self._sealed_at >= self._flush_interval_s:
                self._seal_locked(now)
                if not self._queue:
                    return
            elif opened and self._pending_records and self._sender_idle:
                # A batch opened while the sender sleeps its idle wait: it must wake to send it after one
                # interval even if record() is never called again (an engine that stops mid-work).
                self._sender_idle = False
            else:
                return
        self._wake_sender()

    def drop(self, reason: str, count: int) -> None:
        with self._lock:
            self._drop_locked(reason, count)

    def flush(self) -> None:
        """Seal the open batch and send what the socket takes now; the sender thread does the rest."""
        now = self._monotonic()
        with self._lock:
            self._seal_locked(now)
        if self._send_ready() == FULL:
            self._wake_sender()
        self._log_drops(self._monotonic())

    def start(self) -> None:
        """Start the sender thread now (off the engine's hot path) rather than with the first batch."""
        with self._lock:
            self._start_locked()

    def close(self, timeout_s: float | None = None) -> None:
        """Stop the sender, send what is held for up to `timeout_s` (default exit_timeout_s), count and log the rest."""
        deadline = self._monotonic() + (self.exit_timeout_s if timeout_s is None else timeout_s)
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._seal_locked(self._monotonic())
        atexit.unregister(self._exit_hook)
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            self._wake.set()
            thread.join(max(0.0, deadline - self._monotonic()))  # it stops at its next pass
        while self._send_ready() == FULL:
            remaining = deadline - self._monotonic()
            if remaining <= 0:
                break
            self._wait_writable(min(remaining, self._writable_wait_s))
        with self._lock:
            self._drop_queue_locked("closed")
        self._log_drops(self._monotonic(), final=True)
        with self._send_lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    # -- batches (callers hold _lock) -----------------------------------------------------------------------------

    def _seal_locked(self, now: float) -> None:
        self._sealed_at = now
        if not self._pending_records:
            return
        body = bytes(self._pending)
        self._queue.append((body, self._pending_records))
        self._queued_bytes += len(body)
        self._queued_records += self._pending_records
        self._pending.clear()
        self._pending_records = 0
        # Bounded: when the sidecar is slow, the oldest batches go first, and are counted.
        while self._queued_bytes > self._max_buffer_bytes and len(self._queue) > 1:
            old, count = self._queue.popleft()
            self._queued_bytes -= len(old)
            self._queued_records -= count
            self._drop_locked("buffer_full", count)

    def _take_locked(self) -> tuple[bytes, int] | None:
        """The oldest batch, with as many of the next as fit one datagram: a backlog drains in few datagrams."""
        if not self._queue:
            return None
        body, count = self._queue.popleft()
        if self._queue and len(body) + len(self._queue[0][0]) <= self.body_limit:
            parts, size = [body], len(body)
            while self._queue and size + len(self._queue[0][0]) <= self.body_limit:
                more, n = self._queue.popleft()
                parts.append(more)
                size += len(more)
                count += n
            body = b"".join(parts)
        self._queued_bytes -= len(body)
        self._queued_records -= count
        self._in_flight = count
        return body, count

    def _put_back_locked(self, body: bytes, count: int) -> None:
        self._queue.appendleft((body, count))
        self._queued_bytes += len(body)
        self._queued_records += count
        self._in_flight = 0

    def _drop_queue_locked(self, reason: str) -> None:
        count = self._queued_records
        self._queue.clear()
        self._queued_bytes = 0
        self._queued_records = 0
        if count:
            self._drop_locked(reason, count)

    def _drop_locked(self, reason: str, count: int) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + count
        self.dropped_total += count
        self._dropped_since_log[reason] = self._dropped_since_log.get(reason, 0) + count

    # -- the socket ----------------------------------------------------------------------------------------------

    def _send_ready(self) -> str:
        """Send queued batches while the socket takes them, without waiting: EMPTY, FULL (EAGAIN) or GONE."""
        with self._send_lock:
            while True:
                with self._lock:
                    taken = self._take_locked()
                if taken is None:
                    return EMPTY
                body, count = taken
                sock = self._connected()
                if sock is None:
                    with self._lock:
                        self._in_flight = 0
                        self._drop_locked("no_sidecar", count)
                        self._drop_queue_locked("no_sidecar")
                    return GONE
                header = wire.encode_header(self._engine, self._pid, self._instance, self._sequence,
                                            self.dropped_total, self._credential)
                try:
                    sock.send(header + body)
                except BlockingIOError:
                    with self._lock:
                        self._put_back_locked(body, count)  # the sidecar's queue is full: the sender waits for it
                    return FULL
                except OSError:
                    # The sidecar went away (ECONNREFUSED; EPIPE while it stops; ENOENT after a restart): retry later.
                    sock.close()
                    self._sock = None
                    self._next_connect = self._monotonic() + self._reconnect_interval_s
                    with self._lock:
                        self._in_flight = 0
                        self._drop_locked("no_sidecar", count)
                        self._drop_queue_locked("no_sidecar")
                    return GONE
                self._sequence += 1
                with self._lock:
                    self._in_flight = 0
                    self.records_sent += count
                    self.datagrams_sent += 1

    def _connected(self) -> socket.socket | None:
        if self._sock is not None:
            return self._sock
        now = self._monotonic()
        if now < self._next_connect:
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setblocking(False)
        try:
            # More bytes in flight before EAGAIN; refused (or capped) by some kernels, which costs only that.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        except OSError:
            log.debug("stepline plugin: could not raise the socket's send buffer")
        try:
            sock.connect(self.socket_path)
        except OSError:
            sock.close()
            self._next_connect = now + self._reconnect_interval_s
            return None
        self._sock = sock
        return sock

    def _wait_writable(self, timeout_s: float) -> None:
        """Wait until the sidecar's queue has room (poll(2) on a connected datagram socket), or the timeout."""
        sock = self._sock
        fd = sock.fileno() if sock is not None else -1
        if fd < 0:
            return
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        poller.poll(timeout_s * 1000)

    # -- the sender thread ---------------------------------------------------------------------------------------

    def _wake_sender(self) -> None:
        thread = self._thread
        if thread is not None and thread.is_alive():
            self._wake.set()
            return
        with self._lock:
            self._start_locked()

    def _start_locked(self) -> None:
        if self._closed or (self._thread is not None and self._thread.is_alive()):
            return
        thread = threading.Thread(target=_sender_main, args=(weakref.ref(self), self._wake),
                                  name="stepline-plugin-sender", daemon=True)
        try:
            thread.start()
        except RuntimeError:  # no thread to be had (limits, interpreter shutdown): flush() still sends inline
            self.sender_errors += 1
            if self.sender_errors == 1:
                log.exception("stepline plugin: could not start the sender thread; sending only on vLLM's log()")
            return
        self._thread = thread

    def _sender_pass(self) -> float | None:
        """One round of the sender thread: how long to wait before the next, or None to stop."""
        if self._closed:
            return None
        now = self._monotonic()
        with self._lock:
            # A batch left open by an engine that stopped calling record() goes out after one flush interval.
            if self._pending_records and now - self._sealed_at >= self._flush_interval_s:
                self._seal_locked(now)
        if self._send_ready() == FULL:
            self._wait_writable(self._writable_wait_s)
            wait = 0.0
        else:
            with self._lock:
                self._sender_idle = not self._pending_records
                wait = (self._idle_wait_s if self._sender_idle
                        else max(0.0, self._sealed_at + self._flush_interval_s - now))
        self._log_drops(self._monotonic())
        return wait

    def _log_drops(self, now: float, final: bool = False) -> None:
        with self._lock:
            if not self._dropped_since_log or (not final and now - self._last_log < self._log_interval_s):
                return
            parts = ", ".join(f"{n} ({reason})" for reason, n in sorted(self._dropped_since_log.items()))
            since = now - self._last_log
            self._dropped_since_log = {}
            self._last_log = now
        if final:
            log.warning("stepline plugin: closing; dropped %s records in the last %.0f s (sidecar socket %s)",
                        parts, since, self.socket_path)
        else:
            log.warning("stepline plugin: dropped %s records in the last %.0f s; sidecar socket %s",
                        parts, since, self.socket_path)


def _sender_main(ref: weakref.ref[Outbox], wake: threading.Event) -> None:
    """The sender thread. It holds its outbox only during a pass, so an outbox nobody uses is collected."""
    failures = 0
    while True:
        outbox = ref()
        if outbox is None:
            return
        try:
            wait = outbox._sender_pass()
        except Exception:  # a stepline bug must not kill sending for good: counted, logged once, retried
            outbox.sender_errors += 1
            failures += 1
            if failures == 1:
                log.exception("stepline plugin: the sender failed (counted; retried; later failures are counted only)")
            wait = outbox._idle_wait_s
        del outbox
        if wait is None:
            return
        wake.wait(wait)
        wake.clear()


def _close_at_exit(ref: weakref.ref[Outbox]) -> None:
    outbox = ref()
    if outbox is not None:
        outbox.close()
