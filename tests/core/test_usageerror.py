"""UsageError: the one error a refused argument raises, which `stepline` prints on one line and exits 2 for."""

from __future__ import annotations

import pytest

from stepline.cli.main import main
from stepline.config.settings import SettingsError
from stepline.core.timeparse import parse_duration
from stepline.core.usageerror import UsageError


def test_it_is_a_value_error_that_keeps_its_message() -> None:
    error = UsageError("--since '5x' is not a duration")
    assert isinstance(error, ValueError) and str(error) == "--since '5x' is not a duration"
    assert issubclass(SettingsError, UsageError)


def test_a_refused_argument_raises_it_naming_the_argument() -> None:
    with pytest.raises(UsageError, match="'soon'"):
        parse_duration("soon")


def test_the_command_line_prints_it_on_one_line_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["timeline", "--around", "soon"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("stepline: ") and err.count("\n") == 1 and "soon" in err
