"""The watch on the query endpoint's clients: a closed connection gets its query killed, once; a live one, or one
that sends its next request, does not."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator

import pytest

from stepline.endpoints.watch import Watch, Watchers


@pytest.fixture
def watchers() -> Iterator[Watchers]:
    w = Watchers()
    w.start()
    yield w
    w.stop()


def _wait(predicate: Callable[[], object], seconds: float = 3.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_client_that_closes_gets_its_query_killed_once(watchers: Watchers) -> None:
    ours, theirs = socket.socketpair()
    killed: list[int] = []
    Watch(watchers, ours).on_gone(lambda: killed.append(1))
    theirs.close()
    _wait(lambda: killed)
    time.sleep(0.6)  # two more looks: still once
    assert killed == [1]
    ours.close()


def test_a_client_still_there_or_sending_its_next_request_is_left_alone(watchers: Watchers) -> None:
    ours, theirs = socket.socketpair()
    killed: list[int] = []
    watch = Watch(watchers, ours)
    watch.on_gone(lambda: killed.append(1))
    theirs.sendall(b"GET /ping HTTP/1.1\r\n\r\n")  # pipelined: readable, but not closed
    time.sleep(0.6)
    assert killed == []
    assert ours.recv(4) == b"GET "  # peeked, never consumed: the handler reads it whole
    watch.stop()
    theirs.close()
    time.sleep(0.6)
    assert killed == []  # no longer watched once its query ended
    ours.close()
