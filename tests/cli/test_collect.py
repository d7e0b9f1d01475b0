"""`stepline collect`: what its options make of the collector's settings (the rest comes from the environment)."""

from __future__ import annotations

import argparse

import pytest

from stepline.cli import collect
from stepline.config.settings import SettingsError


def parse_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    collect.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_options_become_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPLINE_RETENTION_DAYS", "9")
    settings = collect.settings_of(parse_args(
        "--engine", "a=http://127.0.0.1:8000", "--engine", "http://127.0.0.1:8001", "--disable-source", "gpu",
        "--disable-source", "host", "--spool-max-bytes", "1G", "--scrape-interval", "2.5", "--engine-process",
        "a=123", "--store", "chdb:///tmp/x"))
    assert settings.engines == ("a=http://127.0.0.1:8000", "http://127.0.0.1:8001")
    assert settings.disabled_sources == frozenset({"gpu", "host"}) and settings.engine_processes == ("a=123",)
    assert (settings.spool_max_bytes, settings.scrape_interval_s, settings.store) == (1 << 30, 2.5, "chdb:///tmp/x")
    assert settings.retention_days == 9  # not on the command line: from the environment
    assert collect.settings_of(parse_args("--retention", "7")).retention_days == 7


def test_a_bad_setting_is_a_settings_error_naming_it() -> None:
    with pytest.raises(SettingsError, match="role node scrapes no engine"):
        collect.settings_of(parse_args("--role", "node", "--engine", "http://127.0.0.1:8000"))
    with pytest.raises(SystemExit):
        parse_args("--spool-max-bytes", "lots")
