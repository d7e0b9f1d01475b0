"""`stepline report`: its options, and the page it writes for a window with nothing wrong."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from stepline.cli import report
from stepline.cli.main import main
from stepline.store.store import Store


def test_the_page_is_required_and_whatif_is_on_unless_left_out() -> None:
    parser = argparse.ArgumentParser()
    report.add_arguments(parser)
    assert parser.parse_args(["--out", "x.html"]).whatif is True
    assert parser.parse_args(["--out", "x.html", "--no-whatif"]).whatif is False
    with pytest.raises(SystemExit):
        parser.parse_args([])


def test_a_quiet_window_still_gets_its_page(store: Store, store_url: str, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "incident.html"
    assert main(["report", "--since", "10m", "--store", store_url, "--out", str(out), "--no-whatif"]) == 0
    assert capsys.readouterr().out == f"{out}: 0 finding(s)\n"
    page = out.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and "the last 10m" in page
