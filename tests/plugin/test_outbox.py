"""The plugin's outbox on real Unix datagram sockets: batches sealed on time, sent by a thread of its own, a backlog
coalesced and drained as the sidecar reads, every lost record counted by reason."""

from __future__ import annotations

import gc
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from stepline.core.clock import ManualClock
from stepline.plugin import wire
from stepline.plugin.outbox import Outbox

ENGINE = b"engine-a"


class Sidecar:
    """The collector's end: a bound datagram socket, read only when the test says so."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)

    def read(self, timeout_s: float = 5.0) -> tuple[wire.Header, bytes]:
        """The next datagram's header and records (as the bytes the outbox was given)."""
        self.sock.settimeout(timeout_s)
        data = self.sock.recv(wire.MAX_DATAGRAM + 1)
        header, offset = wire.decode_header(data)
        return header, data[offset:]

    def fill(self, path: str) -> int:
        """Queue another sender's datagrams until the kernel refuses more (net.unix.max_dgram_qlen); how many."""
        other = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        other.setblocking(False)
        other.connect(path)
        sent = 0
        try:
            while True:
                other.send(wire.encode_header(b"filler", 1, 1, sent, 0))
                sent += 1
        except BlockingIOError:
            return sent
        finally:
            other.close()

    def waiting(self) -> int:
        """Datagrams queued for it right now (read off the queue)."""
        count = 0
        self.sock.setblocking(False)
        try:
            while True:
                self.sock.recv(wire.MAX_DATAGRAM + 1)
                count += 1
        except BlockingIOError:
            return count

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def path(sock_dir: str) -> str:
    return os.path.join(sock_dir, "plugin.sock")


@pytest.fixture
def sidecar(path: str) -> Iterator[Sidecar]:
    s = Sidecar(path)
    yield s
    s.close()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(1000.0)


@pytest.fixture
def outboxes() -> Iterator[Callable[..., Outbox]]:
    made: list[Outbox] = []

    def make(path: str, monotonic: Callable[[], float], **options: Any) -> Outbox:
        box = Outbox(path, ENGINE, monotonic=monotonic, **options)
        made.append(box)
        return box

    yield make
    for box in made:
        box.close(timeout_s=0)


def _until(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def test_records_wait_in_the_open_batch_until_a_flush(sidecar: Sidecar, path: str, clock: ManualClock,
                                                      outboxes: Callable[..., Outbox]) -> None:
    box = outboxes(path, clock.monotonic, flush_interval_s=60.0)
    box.put([b"one", b"two"])
    assert box.records_held == 2 and sidecar.waiting() == 0
    box.flush()
    header, body = sidecar.read()
    assert body == b"onetwo"
    assert (header.engine, header.pid, header.sequence, header.dropped) == (ENGINE.decode(), os.getpid(), 0, 0)
    assert _until(lambda: box.accounting() == (2, {}, 0))  # the sender counts a datagram once its send returns


def test_the_flush_interval_seals_the_batch_and_the_sender_sends_it(sidecar: Sidecar, path: str, clock: ManualClock,
                                                                    outboxes: Callable[..., Outbox]) -> None:
    box = outboxes(path, clock.monotonic, flush_interval_s=0.05)
    box.put([b"a"])
    clock.advance(0.1)
    box.put([b"b"])  # the interval has passed: sealed, and the sender thread wakes for it
    header, body = sidecar.read()
    assert (header.sequence, body) == (0, b"ab")
    box.put([b"c"], flush_now=True)  # an engine going idle is flushed at once
    header, body = sidecar.read()
    assert (header.sequence, body) == (1, b"c")
    assert _until(lambda: box.datagrams_sent == 2 and box.records_sent == 3)


def test_a_record_larger_than_a_datagram_is_dropped_and_counted(sidecar: Sidecar, path: str, clock: ManualClock,
                                                                outboxes: Callable[..., Outbox]) -> None:
    box = outboxes(path, clock.monotonic)
    assert box.body_limit == wire.MAX_DATAGRAM - wire.HEADER.size - len(ENGINE)
    box.put([b"x" * (box.body_limit + 1), b"ok"], flush_now=True)
    assert sidecar.read()[1] == b"ok"
    assert _until(lambda: box.accounting() == (1, {"too_large": 1}, 0))  # counted once its send returns


def test_without_a_sidecar_records_are_dropped_and_it_is_retried_later(path: str, clock: ManualClock,
                                                                        outboxes: Callable[..., Outbox]) -> None:
    box = outboxes(path, clock.monotonic, reconnect_interval_s=5.0)
    box.put([b"lost"], flush_now=True)
    assert _until(lambda: box.records_held == 0)
    assert box.dropped == {"no_sidecar": 1}
    late = Sidecar(path)
    try:
        box.put([b"too soon"], flush_now=True)  # within the reconnect interval: not tried again yet
        assert _until(lambda: box.records_held == 0) and box.dropped == {"no_sidecar": 2}
        clock.advance(5.0)
        box.put([b"found"], flush_now=True)
        header, body = late.read()
        assert body == b"found" and header.dropped == 2  # what was lost reaches the sidecar in the header
    finally:
        late.close()


def test_a_backlog_is_bounded_then_coalesced_and_drained_as_the_sidecar_reads(
        sidecar: Sidecar, path: str, clock: ManualClock, outboxes: Callable[..., Outbox]) -> None:
    record = b"r" * 1000
    box = outboxes(path, clock.monotonic, max_buffer_bytes=20 * len(record))
    filler = sidecar.fill(path)  # the sidecar's queue is full before the engine sends anything
    for _ in range(100):
        box.put([record], flush_now=True)
    sent, dropped, held = box.accounting()
    # Bounded to max_buffer_bytes (20 batches), beside one batch put back whole when the socket was full.
    assert sent == 0 and dropped["buffer_full"] >= 100 - 20 - box.body_limit // len(record)
    assert held * len(record) <= 20 * len(record) + box.body_limit and sent + dropped["buffer_full"] + held == 100
    datagrams = records = seen_filler = 0
    while records < held:  # the sidecar reads: the outbox drains as fast as it does
        header, body = sidecar.read()
        if header.engine == "filler":
            seen_filler += 1
            continue
        datagrams, records = datagrams + 1, records + len(body) // len(record)
    assert seen_filler == filler and _until(lambda: box.records_held == 0)
    assert box.accounting() == (held, {"buffer_full": dropped["buffer_full"]}, 0)
    assert datagrams == box.datagrams_sent < held  # the backlog left in datagrams of several batches


def test_close_sends_what_it_can_then_counts_and_logs_the_rest(sidecar: Sidecar, path: str,
                                                               outboxes: Callable[..., Outbox],
                                                               caplog: pytest.LogCaptureFixture) -> None:
    box = outboxes(path, time.monotonic)  # close() waits out its timeout on the outbox's own clock
    for _ in range(40):  # more than the sidecar's queue takes, which nobody reads
        box.put([b"r" * 30_000], flush_now=True)
    with caplog.at_level(logging.WARNING, "stepline.plugin"):
        box.close(timeout_s=0.1)
    sent, dropped, held = box.accounting()
    assert held == 0 and dropped["closed"] > 0 and sent + dropped["closed"] == 40
    assert any("closing; dropped" in r.getMessage() and "(closed)" in r.getMessage() for r in caplog.records)
    box.put([b"after"])
    assert box.dropped["closed"] == dropped["closed"] + 1


def test_an_outbox_nobody_holds_is_collected_and_its_sender_stops(path: str, clock: ManualClock) -> None:
    box = Outbox(path, ENGINE, idle_wait_s=0.02, monotonic=clock.monotonic)
    box.start()
    senders = [t for t in threading.enumerate() if t.name == "stepline-plugin-sender"]
    assert senders
    del box
    gc.collect()
    assert _until(lambda: not any(t.is_alive() for t in senders), timeout_s=5.0)
