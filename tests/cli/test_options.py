"""The options several commands share say the same thing in each."""

from __future__ import annotations

import argparse

from stepline.cli import options
from stepline.cli.main import build_parser
from stepline.store.discovery import RUNTIME_DIR_HELP


def test_every_command_that_reads_the_store_says_where_it_is_found() -> None:
    assert RUNTIME_DIR_HELP in options.READ_STORE_HELP
    subcommands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name in ("query", "requests", "timeline", "status"):
        store = next(a for a in subcommands[name]._actions if a.dest == "store")
        assert store.help == options.READ_STORE_HELP, name
