"""The window a command line names, and how it is said in one phrase."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from stepline.analysis.window import describe, window_from
from stepline.core.usageerror import UsageError
from stepline.diagnosis.findings import Window

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


def test_since_reaches_back_from_now_or_from_to() -> None:
    assert window_from("30m", None, None, "e0", NOW) == Window(NOW - timedelta(minutes=30), NOW, "e0")
    assert window_from("1h", None, "11:00", now=NOW) == Window(NOW - timedelta(hours=2), NOW - timedelta(hours=1))


def test_from_and_to_name_the_window_whatever_since_says() -> None:
    window = window_from("30m", "2026-01-01T00:00:00", str(NOW.timestamp()), now=NOW)
    assert (window.start, window.end) == (datetime(2026, 1, 1, tzinfo=UTC), NOW)
    assert window_from("30m", "11:00:00", None, now=NOW).start == NOW - timedelta(hours=1)


@pytest.mark.parametrize(("since", "from_", "to", "message"), [
    ("soon", None, None, "soon"),
    ("30m", "12:00:00", "11:00:00", "the window start 2026-01-01 12:00:00 is not before its end 11:00:00"),
    ("30m", "12:00:00", None, "is not before its end 12:00:00"),
    ("30m", "yesterday", None, "time 'yesterday' is not ISO 8601"),
])
def test_a_window_that_does_not_run_forward_is_a_usage_error(since: str, from_: str | None, to: str | None,
                                                             message: str) -> None:
    with pytest.raises(UsageError, match=message):
        window_from(since, from_, to, now=NOW)


def test_described_with_its_engine() -> None:
    window = Window(NOW - timedelta(hours=1), NOW, "e0")
    assert describe(window) == "2026-01-01 11:00:00..12:00:00 UTC on engine e0"
    assert describe(Window(window.start, window.end)) == "2026-01-01 11:00:00..12:00:00 UTC"
