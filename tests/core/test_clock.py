"""Clocks: the system one, and the manual one tests and fast replay move by hand."""

from __future__ import annotations

import threading
import time

import pytest

from stepline.core.clock import Clock, ManualClock, SystemClock


def test_the_manual_clock_moves_only_when_told_and_its_sleep_advances_it() -> None:
    clock: Clock = ManualClock(100.0)
    assert clock.time() == clock.monotonic() == 100.0
    clock.sleep(2.5)
    assert clock.time() == 102.5
    assert isinstance(clock, ManualClock)
    clock.advance(0.5)
    clock.set(10.0)  # set may go anywhere: a replay starting over
    assert clock.monotonic() == 10.0


def test_the_manual_clock_refuses_to_go_back() -> None:
    with pytest.raises(ValueError, match=r"cannot go back \(-1 s\)"):
        ManualClock().advance(-1)


def test_advances_from_many_threads_all_count() -> None:
    clock = ManualClock(0.0)

    def thousand_seconds() -> None:
        for _ in range(1000):
            clock.advance(1.0)

    threads = [threading.Thread(target=thousand_seconds) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert clock.time() == 4000.0


def test_the_system_clock_is_the_real_time() -> None:
    clock: Clock = SystemClock()
    before = time.time()
    start = clock.monotonic()
    clock.sleep(0.01)
    assert clock.monotonic() - start >= 0.01
    assert before <= clock.time() <= time.time()
