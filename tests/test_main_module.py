"""`python -m stepline` (stepline.__main__) is the `stepline` command: same help, same exit status."""

from __future__ import annotations

import runpy
import subprocess
import sys

import pytest


def test_python_m_stepline_help_lists_the_commands() -> None:
    done = subprocess.run([sys.executable, "-m", "stepline", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: stepline ")
    for command in ("collect", "query", "diagnose", "whatif", "dashboards", "demo"):
        assert f"\n    {command} " in done.stdout, command


def _run_module(monkeypatch: pytest.MonkeyPatch, *args: str) -> int | str | None:
    monkeypatch.setattr(sys, "argv", ["stepline", *args])
    with pytest.raises(SystemExit) as exited:
        runpy.run_module("stepline", run_name="__main__")
    return exited.value.code


def test_the_module_exits_with_the_commands_status(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert _run_module(monkeypatch, "schema", "--retention", "7") == 0
    assert "INTERVAL 7 DAY" in capsys.readouterr().out
    assert _run_module(monkeypatch, "query", "SELECT 1", "--store", "mysql://x/y") == 2
    assert capsys.readouterr().err.startswith("stepline: store URL 'mysql://x/y' has scheme 'mysql'")
