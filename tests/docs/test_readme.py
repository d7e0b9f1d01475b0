"""The README against the code: every command and its flags, the test prerequisites, the query endpoint."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

from stepline.cli.main import build_parser
from stepline.config.settings import Settings
from stepline.store.url import DEFAULT_DATABASE

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _section(title: str) -> str:
    """The README's text from the heading `title` to the next heading of the same or a higher level."""
    level = title.split(" ", 1)[0]
    start = README.index(f"\n{title}\n")
    ends = [m.start() for m in re.finditer(rf"\n#{{1,{len(level)}}} ", README) if m.start() > start]
    return README[start:ends[0] if ends else len(README)]


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _command_rows() -> dict[str, str]:
    """The command table's first cells, by subcommand name."""
    rows = re.findall(r"^\| `stepline ([a-z-]+)([^`]*)` \|", _section("## Command line"), re.M)
    return {name: usage for name, usage in rows}


def test_every_registered_subcommand_has_a_row_in_the_command_table() -> None:
    registered = set(_subcommands(build_parser()))
    listed = set(_command_rows())
    assert registered - listed == set(), "subcommands missing from the README's command table"
    assert listed - registered == set(), "README rows for commands the CLI does not have"


def test_each_row_shows_the_commands_required_flags_and_no_flag_it_lacks() -> None:
    rows = _command_rows()
    for name, parser in _subcommands(build_parser()).items():
        usage = rows.get(name, "")
        words = usage.split()
        nested = _subcommands(parser)
        if words and words[0] in nested:  # `alerts build`, `dashboards build`
            parser = nested[words[0]]
        flags = set(re.findall(r"--[a-z][a-z-]*", usage))
        known = {option for action in parser._actions for option in action.option_strings}
        required = {action.option_strings[0] for action in parser._actions if action.required and action.option_strings}
        assert flags - known == set(), f"`stepline {name}` has no such flags"
        assert required - flags == set(), f"the README's row for `stepline {name}` leaves out required flags"


def test_the_test_commands_prerequisites_are_named() -> None:
    development = " ".join(_section("## Development").split())
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    installed = {package for line in re.findall(r"apt-get install ([^;}]+)", ci)
                 for package in line.split() if not package.startswith("-")}
    assert {"chromium", "prometheus", "prometheus-alertmanager"} <= installed
    for package in installed | {"nodejs", "npm"}:
        assert re.search(rf"(?<![\w-]){package}(?![\w-])", development), f"the README does not name {package}"
    assert "promtool" in development and "amtool" in development


def test_the_query_endpoint_section_names_the_database_and_port() -> None:
    text = " ".join(_section("### Querying from other clients").split())
    defaults = {f.name: f.default for f in dataclasses.fields(Settings)}
    url = f"http://{defaults['listen']}:{defaults['query_port']}"
    assert f"database **`{DEFAULT_DATABASE}`**" in text
    assert f"`{url}`" in text
    assert (f"clickhouse_connect.get_client(host='{defaults['listen']}', port={defaults['query_port']}, "
            f"database='{DEFAULT_DATABASE}')") in text
    assert f"default database `{DEFAULT_DATABASE}`" in text and "protocol **http**" in text
    assert f"curl '{url}/?database={DEFAULT_DATABASE}'" in text


def test_the_code_layout_lists_every_layer_in_order() -> None:
    from tests.test_layout import LAYERS

    listed = re.findall(r"^\| `([a-z_]+)/` \|", _section("### Code layout"), re.M)
    assert tuple(listed) == LAYERS
