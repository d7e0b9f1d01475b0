"""`stepline diagnose` in this process: the window it reads, and an empty store (no finding, exit 0)."""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime, timedelta

import pytest

from stepline.cli import diagnose
from stepline.cli.main import main
from stepline.store.store import Store


def test_the_window_is_the_last_since_or_from_to() -> None:
    parser = argparse.ArgumentParser()
    diagnose.add_arguments(parser)
    now = datetime(2026, 1, 1, 12, tzinfo=UTC)
    last = diagnose.window_of(parser.parse_args(["--since", "2h", "--engine", "e0"]), now)
    assert (last.start, last.end, last.engine) == (now - timedelta(hours=2), now, "e0")
    given = diagnose.window_of(parser.parse_args(["--from", "11:00", "--to", "11:30"]), now)
    assert (given.start, given.end, given.engine) == (now - timedelta(hours=1), now - timedelta(minutes=30), "")


def test_an_empty_store_has_no_findings(store: Store, store_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diagnose", "--since", "5m", "--store", store_url]) == 0
    out = capsys.readouterr().out
    assert out.startswith("no findings") and "(0 findings for " in out and "via embedded store" in out
    assert main(["diagnose", "--since", "5m", "--store", store_url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []
