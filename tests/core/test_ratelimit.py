"""Rate-limited warnings: the first of a key is logged, repeats within the interval are counted and told later."""

from __future__ import annotations

import logging
import time

import pytest

from stepline.core.ratelimit import RateLimitedLog

LOGGER = logging.getLogger("tests.ratelimit")


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER.name]


def test_a_repeat_within_the_interval_is_suppressed(caplog: pytest.LogCaptureFixture) -> None:
    limited = RateLimitedLog(LOGGER, interval_s=60.0)
    with caplog.at_level(logging.WARNING, LOGGER.name):
        assert limited.warning("drop", "dropped %d rows", 5)
        assert not limited.warning("drop", "dropped %d rows", 6)
        assert limited.warning("error", "store unreachable")  # another key has an interval of its own
    assert _messages(caplog) == ["dropped 5 rows", "store unreachable"]


def test_after_the_interval_the_next_warning_says_how_many_were_suppressed(caplog: pytest.LogCaptureFixture) -> None:
    limited = RateLimitedLog(LOGGER, interval_s=0.05)
    with caplog.at_level(logging.WARNING, LOGGER.name):
        limited.warning("drop", "dropped")
        assert not limited.warning("drop", "dropped")
        assert not limited.warning("drop", "dropped")
        time.sleep(0.06)
        assert limited.warning("drop", "dropped %s", "again")
        time.sleep(0.06)
        assert limited.warning("drop", "dropped")  # the count was told once, and starts over
    assert _messages(caplog) == ["dropped", "dropped again (2 similar messages suppressed)", "dropped"]


def test_mark_counts_a_message_someone_else_logged(caplog: pytest.LogCaptureFixture) -> None:
    limited = RateLimitedLog(LOGGER, interval_s=60.0)
    limited.mark("drop")
    with caplog.at_level(logging.WARNING, LOGGER.name):
        assert not limited.warning("drop", "dropped")
    assert _messages(caplog) == []
