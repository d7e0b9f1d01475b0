"""Durations on the command line: units, plain seconds, and a clear refusal naming the text."""

import math

import pytest

from stepline.config.settings import SettingsError
from stepline.core.timeparse import parse_duration
from stepline.core.usageerror import UsageError


def test_units_and_plain_seconds() -> None:
    assert [parse_duration(t) for t in ("90s", "30m", "2h", "1d", "45", "0.5m")] == [90, 1800, 7200, 86400, 45, 30]


@pytest.mark.parametrize("text", ["", "m", "ten minutes", "5w", "-1h", "0", "nanm", "infs", str(math.inf)])
def test_what_is_not_a_duration_is_refused_naming_it(text: str) -> None:
    with pytest.raises(UsageError, match="duration") as refused:
        parse_duration(text)
    assert repr(text) in str(refused.value)
    assert not isinstance(refused.value, SettingsError)  # a usage error, not a setting the collector runs with


def test_a_bad_setting_is_a_usage_error_too() -> None:
    assert issubclass(SettingsError, UsageError)
