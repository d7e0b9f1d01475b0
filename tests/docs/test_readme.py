"""The README and docs/ against the code: the README short with its two commands, every link and picture there, every
`stepline` command line they show a real one, the ports table the settings' defaults, the pages the operator needs."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from pathlib import Path

import pytest

from stepline.cli.main import build_parser
from stepline.config.settings import Settings
from stepline.store.discovery import locate_store
from stepline.store.url import DEFAULT_DATABASE

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
DOCS = sorted((ROOT / "docs").rglob("*.md"))
PAGES = {"README.md": README} | {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8") for p in DOCS}
# What issue 27 asks docs/ to hold (the operator's first hour, then the reference).
REQUIRED = ("install-vllm", "deploy", "grafana", "alerts", "diagnose", "whatif-replay-matrix", "gateway",
            "architecture", "reliability", "security", "simulator", "development", "reference/cli",
            "reference/configuration", "reference/schema", "reference/sql-clients", "reference/metrics")


def _section(text: str, title: str) -> str:
    """The text from the heading `title` to the next heading of the same or a higher level."""
    level = title.split(" ", 1)[0]
    start = text.index(f"\n{title}\n")
    ends = [m.start() for m in re.finditer(rf"\n#{{1,{len(level)}}} ", text) if m.start() > start]
    return text[start:ends[0] if ends else len(text)]


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _code(text: str) -> list[str]:
    """Every line of code in a page: fenced blocks' lines (a trailing `\\` joins the next) and inline spans."""
    spans: list[str] = []
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, re.M | re.S):
        spans.extend(block.replace("\\\n", " ").splitlines())
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.M | re.S)
    spans.extend(" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose))  # a span may wrap a line
    return spans


def _command_lines() -> list[tuple[str, str, str]]:
    """(page, command, the rest of its line) for every `stepline COMMAND ...` the README and docs/ show."""
    found = []
    for page, text in PAGES.items():
        for span in _code(text):
            span = re.sub(r"'[^']*'|\"[^\"]*\"", "''", span.split(" #", 1)[0])  # quoted SQL and engine commands
            for m in re.finditer(r"(?<![\w/.-])stepline ([a-z][a-z-]*)([^|;&]*)", span):
                if m.group(1) != "stepline":  # `docker compose exec stepline stepline doctor`
                    found.append((page, m.group(1), m.group(2)))
    return found


def test_the_readme_is_short_and_its_first_commands_are_exactly_two() -> None:
    assert len(README.splitlines()) <= 250
    block = re.search(r"```sh\n(.*?)```", _section(README, "## Try it (a fresh machine, Python >= 3.11, no GPU)"),
                      re.S)
    assert block is not None
    commands = block.group(1).strip().splitlines()
    assert commands == ["pip install -e . && stepline demo", "bash tests/setup.sh && python -m pytest -q"]
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "bash tests/setup.sh\n" in ci and "python3 -m pytest -q\n" in ci, "CI runs the README's second command"
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert 'readme = "README.md"' in pyproject


def test_the_second_command_runs_where_the_first_left_its_store(working_dir: Path, runtime_dir: Path) -> None:
    """The README's order: `stepline demo` leaves ./stepline-data in the directory the suite then runs from, and the
    CLI reads that store when given none. Each test runs in an empty directory of its own with no $STEPLINE_STORE
    (tests/conftest.py), so the default store a test's CLI finds is one the test made."""
    assert Path.cwd() == working_dir and ROOT not in (working_dir, *working_dir.parents)
    assert list(working_dir.iterdir()) == [] and "STEPLINE_STORE" not in os.environ
    found = locate_store(None)
    assert found.url == f"chdb://{working_dir}/stepline-data" and found.searched == runtime_dir / "stepline"


def test_every_page_the_first_hour_needs_exists_and_the_readme_links_it() -> None:
    for name in REQUIRED:
        path = ROOT / "docs" / f"{name}.md"
        assert path.is_file(), f"docs/{name}.md is missing"
        assert f"(docs/{name}.md)" in README, f"the README does not link docs/{name}.md"


@pytest.mark.parametrize("page", sorted(PAGES))
def test_every_link_and_picture_resolves(page: str) -> None:
    base = ROOT if page == "README.md" else (ROOT / page).parent
    for target in re.findall(r"\]\(([^)\s]+)\)", PAGES[page]):
        if target.startswith(("http://", "https://", "#", "mailto:")):
            continue
        path = (base / target.split("#", 1)[0]).resolve()
        assert path.exists(), f"{page} links {target}, which does not exist"
        assert ROOT in path.parents, f"{page} links {target}, outside the repository"


def test_both_pictures_are_there_and_made_by_the_script() -> None:
    script = (ROOT / "docs" / "images" / "build.py").read_text(encoding="utf-8")
    for picture in ("timeline.png", "architecture.svg"):
        assert f"docs/images/{picture}" in README
        assert (ROOT / "docs" / "images" / picture).stat().st_size > 1000
        assert picture in script
    assert (ROOT / "docs" / "images" / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_stepline_command_line_shown_is_a_real_command_with_real_flags() -> None:
    commands = _subcommands(build_parser())
    lines = _command_lines()
    assert len(lines) > 30, "the command lines in the docs were not found"
    for page, name, rest in lines:
        assert name in commands, f"{page}: `stepline {name}` is no command"
        parser = commands[name]
        words = rest.split()
        nested = _subcommands(parser)
        if words and words[0] in nested:  # `alerts build`, `dashboards build`
            parser = nested[words[0]]
        known = {option for action in parser._actions for option in action.option_strings}
        unknown = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", rest)) - known
        assert not unknown, f"{page}: `stepline {name}{rest}` has no {sorted(unknown)}"


def test_the_ports_table_says_the_settings_defaults() -> None:
    table = _section(README, "## Ports and defaults")
    defaults = {f.name: f.default for f in dataclasses.fields(Settings)}
    listen = defaults["listen"]
    for port in ("metrics_port", "query_port", "otlp_port"):
        assert f"`{listen}:{defaults[port]}" in table, f"the ports table does not say {port} {defaults[port]}"
    assert f"`{defaults['plugin_socket']}`" in table
    assert f"{defaults['retention_days']} days" in table


def test_the_test_commands_prerequisites_are_named() -> None:
    development = " ".join((ROOT / "docs" / "development.md").read_text(encoding="utf-8").split())
    setup = (ROOT / "tests" / "setup.sh").read_text(encoding="utf-8")
    needed = dict(re.findall(r"^need (\S+) (\S+)$", setup, re.M))  # tool: the Debian package that provides it
    assert needed == {"chromium": "chromium", "promtool": "prometheus", "amtool": "prometheus-alertmanager",
                      "node": "nodejs", "npm": "npm"}
    for step in ("npm ci --prefix tests/clients/node", "pip install", "-e '.[test]'", "bash tests/realvllm/install.sh",
                 "bash tests/gateway/install.sh"):
        assert step in setup, f"tests/setup.sh does not run {step}"
    for package in needed.values():
        assert re.search(rf"(?<![\w-]){package}(?![\w-])", development), f"docs/development.md does not name {package}"
    assert "promtool" in development and "amtool" in development


def test_the_query_endpoint_section_names_the_database_and_port() -> None:
    page = (ROOT / "docs" / "reference" / "sql-clients.md").read_text(encoding="utf-8")
    text = " ".join(_section(page, "## Querying from other clients").split())
    defaults = {f.name: f.default for f in dataclasses.fields(Settings)}
    url = f"http://{defaults['listen']}:{defaults['query_port']}"
    assert f"database **`{DEFAULT_DATABASE}`**" in text
    assert f"`{url}`" in text
    assert (f"clickhouse_connect.get_client(host='{defaults['listen']}', port={defaults['query_port']}, "
            f"database='{DEFAULT_DATABASE}')") in text
    assert f"default database `{DEFAULT_DATABASE}`" in text and "protocol **http**" in text
