"""The options several commands share say the same thing in each."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from stepline.cli import options
from stepline.cli.main import build_parser, main
from stepline.store.discovery import RUNTIME_DIR_HELP, announce, runtime_dir
from stepline.store.store import Store

# Every command that reads the timeline, and the arguments it needs beside the store.
READERS = {
    "query": ["SELECT 1"], "requests": [], "timeline": ["--around", "12:00:00"], "status": [], "usage": [],
    "slo": [], "diagnose": [], "report": ["--no-whatif", "--out", "report.html"], "whatif": ["--replays", "0"],
}


def test_every_command_that_reads_the_store_says_where_it_is_found() -> None:
    assert RUNTIME_DIR_HELP in options.READ_STORE_HELP
    subcommands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name in READERS:
        store = next(a for a in subcommands[name]._actions if a.dest == "store")
        assert store.help == options.READ_STORE_HELP, name


@pytest.mark.parametrize("command", sorted(READERS))
def test_every_command_that_reads_finds_the_running_collectors_store_from_any_directory(
        command: str, store: Store, store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    # A collector announced itself (this process stands in for it); the user is in another directory, with no
    # ./stepline-data and no $STEPLINE_STORE: the runtime file is how the command finds the store.
    path = announce(store_url, "", "", runtime_dir())
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("STEPLINE_STORE", raising=False)
    try:
        code = main([command, *READERS[command]])
    finally:
        path.unlink()
    out = capsys.readouterr()
    # An empty window: whatif has no requests to replay (2), the others print what they find (none).
    assert code == (2 if command == "whatif" else 0), out
    assert "no store at" not in out.err and not (tmp_path / "stepline-data").exists()
    if command == "whatif":
        assert "no requests" in out.err or "nothing" in out.err, out.err
