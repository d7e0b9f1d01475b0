"""Every hand-written page against the repository: each path it names exists, each `stepline` command line it shows
parses with the real parser, each `STEPLINE_*` variable, `stepline_*` metric and `stepline.*` name it names is one
the code has, and each figure it quotes from benchmarks/RESULTS.md is the one RESULTS.md holds. A failure names the
page, the line and the claim."""

from __future__ import annotations

import argparse
import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

from stepline.cli import headline
from stepline.cli.main import build_parser
from stepline.model.schema import STORE_TABLES

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "collector" / "stepline"
# The pages people write (docs/reference/ is generated and checked against the code by tests/cli/test_docs.py).
PAGES = ("README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")),
         "deploy/README.md", "deploy/kubernetes/clickhouse-cluster.md", "alerts/README.md", "alerts/runbook.md",
         "benchmarks/README.md", "dashboards/README.md")
TEXT = {page: (ROOT / page).read_text(encoding="utf-8") for page in PAGES}
PATH_SUFFIXES = (".py", ".md", ".yaml", ".yml", ".json", ".toml", ".sh", ".txt", ".xml", ".svg", ".png", ".html")
# Paths a page names that are another project's (upstream sources cited beside what depends on them), keyed by page.
UPSTREAM = {
    "docs/architecture.md": {"async_llm.py"},  # vLLM's v1/engine/async_llm.py
    "docs/gateway.md": {"config.yaml"},  # the LiteLLM proxy's config
    # Kubernetes' KEPs, ClickHouse's tests, the Altinity operator's CRDs and examples.
    "deploy/README.md": {"kep.yaml", "tests/integration/test_keeper_multinode_simple/configs/",
                         "deploy/operator/parts/crd.yaml", "docs/chi-examples/", "docs/chk-examples/"},
}
# Paths that exist only once a user or a command has made them.
MADE_BY_USERS = {"deploy/.env", "deploy/fleet/.env", "grafana/dashboards/", "grafana/provisioning",
                 "provisioning/datasources/stepline.yaml", "provisioning/dashboards/stepline.yaml",
                 "stepline-data", "./stepline-data", "incident.html", "usage.csv", "dist/"}


class Span(NamedTuple):
    """A piece of code a page shows (an inline span or a line of a fenced block), with where it is."""

    page: str
    line: int
    text: str

    def where(self) -> str:
        return f"{self.page}:{self.line}"


def _spans(page: str) -> list[Span]:
    """Every line of every fenced block (a trailing `\\` joins the next) and every inline code span of a page."""
    text = TEXT[page]
    found: list[Span] = []
    fenced = list(re.finditer(r"^```[^\n]*\n(.*?)^```", text, re.M | re.S))
    for block in fenced:
        first = text.count("\n", 0, block.start(1)) + 1
        joined, start = "", first
        for offset, line in enumerate(block.group(1).splitlines()):
            if not joined:
                start = first + offset
            if line.endswith("\\"):
                joined += line[:-1] + " "
                continue
            found.append(Span(page, start, joined + line))
            joined = ""
    prose = re.sub(r"^```[^\n]*\n.*?^```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.M | re.S)
    for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", prose):
        found.append(Span(page, prose.count("\n", 0, m.start()) + 1, " ".join(m.group(1).split())))
    return found


def _links(page: str) -> Iterator[Span]:
    text = TEXT[page]
    for m in re.finditer(r"\]\(([^)\s]+)\)", text):
        yield Span(page, text.count("\n", 0, m.start()) + 1, m.group(1))


def _repo_paths(span: Span) -> Iterator[str]:
    """The words of a span that name a file or folder here (not a URL, an absolute path or a pattern)."""
    for word in re.split(r"[\s,;()'\"=\[\]]+", span.text):
        word = word.rstrip(".:")
        if not word or re.search(r"://|[*<>{}$%…@|]|\.\.\.|^[/~.]?[/~]|^-", word):
            continue
        if word.startswith("./") and "/" not in word[2:]:
            word = word[2:]
        bare = word.split("::", 1)[0]
        if ":" in bare or not re.fullmatch(r"[\w./-]+", bare):
            continue
        if "/" in bare.strip("/") or bare.endswith(PATH_SUFFIXES) or (bare.endswith("/") and bare.count("/") == 1):
            yield word


def _candidates(page: str, path: str) -> list[Path]:
    base = (ROOT / page).parent
    return [ROOT / path, base / path, PACKAGE / path, ROOT / "collector" / path]


def _local(page: str, path: str) -> bool:
    """Whether a path's first folder is one of this repository's (the root's, the page's, the package's)."""
    first = path.strip("/").split("/", 1)[0]
    if "/" not in path.strip("/"):
        return path.endswith(PATH_SUFFIXES) or (ROOT / first).exists()
    return any((base / first).exists() for base in (ROOT, (ROOT / page).parent, PACKAGE, ROOT / "collector"))


FILES = {p.name for p in ROOT.rglob("*")
         if not any(part.startswith(".") or part == "node_modules" for part in p.relative_to(ROOT).parts[:-1])}


@pytest.mark.parametrize("page", PAGES)
def test_every_path_a_page_names_exists(page: str) -> None:
    problems = []
    for span in [*_spans(page), *_links(page)]:
        if span.text.startswith(("http://", "https://", "#", "mailto:")):
            continue
        for word in _repo_paths(span._replace(text=span.text.split("#", 1)[0])):
            path, _, test = word.partition("::")
            if path in MADE_BY_USERS or path in UPSTREAM.get(page, set()) or not _local(page, path):
                continue
            if "/" not in path:  # a bare file name: some file of that name is here
                if path not in FILES:
                    problems.append(f"{span.where()}: `{path}` is no file in the repository")
                continue
            found = next((c for c in _candidates(page, path) if c.exists()), None)
            if found is None:
                problems.append(f"{span.where()}: `{path}` does not exist")
            elif test and not re.search(rf"^(async )?def {re.escape(test.split('[')[0])}\(",
                                        found.read_text(encoding="utf-8"), re.M):
                problems.append(f"{span.where()}: `{word}`: {path} has no test {test}")
    assert not problems, "\n".join(problems)


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


# `stepline` where a shell runs it: first on the line, after `&&`, `;`, `|`, `$(`, variables set for it,
# `python -m`, or `docker compose exec SERVICE`.
COMMAND = (r"(?:^|&&\s*|;\s*|\|\s*|\$\(|(?:^|\s)(?:[A-Z_]+=\S*\s+)+|python3? -m |exec [\w-]+ )"
           r"stepline ([a-z][a-z-]*(?: [^|;&>)]*)?)")


def _command_lines() -> Iterator[tuple[Span, list[str]]]:
    """Every `stepline COMMAND ...` a page shows, as the words after `stepline` (to a pipe, `;`, `&` or a comment)."""
    for page in PAGES:
        for span in _spans(page):
            text = span.text.split(" #", 1)[0]
            if text.lstrip().startswith("#"):
                continue
            for m in re.finditer(COMMAND, text):
                rest = m.group(1)
                try:
                    words = shlex.split(rest)
                except ValueError:
                    words = rest.split()
                yield span, words


def _parses(words: list[str]) -> str | None:
    """Why the command line would not parse (an unknown command or option), or None."""
    parser, path = build_parser(), ["stepline"]
    while True:
        commands = _subcommands(parser)
        if not commands or not words or words[0] not in commands:
            break
        path.append(words[0])
        parser, words = commands[words[0]], words[1:]
    if len(path) == 1:
        return f"`stepline {words[0] if words else ''}` is no command"
    options = {option for action in parser._actions for option in action.option_strings}
    for word in words:
        option = word.split("=", 1)[0]
        if re.fullmatch(r"--?[a-z][a-z0-9-]*", option) and option not in options:
            return f"`{' '.join(path)}` has no option {option}"
    return None


def test_every_stepline_command_line_a_page_shows_is_a_real_one() -> None:
    lines = list(_command_lines())
    assert len(lines) > 60, "the command lines in the pages were not found"
    assert {span.page for span, _ in lines} >= {"README.md", "deploy/README.md", "alerts/README.md"}
    problems = [f"{span.where()}: `{span.text}`: {why}" for span, words in lines if (why := _parses(words))]
    assert not problems, "\n".join(problems)


# Where the names a page may cite live: the package, the deploy files, the generated rules and dashboards, the
# benchmarks, CI (not the tests: a name only a test spells is no name a user can meet; not caches).
CODE_ROOTS = ("collector", "deploy", "alerts", "dashboards", "benchmarks", ".ci", "pyproject.toml")


def _code_text() -> str:
    """Every file under CODE_ROOTS but Markdown and pictures, as one text."""
    parts = []
    for root in CODE_ROOTS:
        for path in [ROOT / root] if (ROOT / root).is_file() else sorted((ROOT / root).rglob("*")):
            inside = path.relative_to(ROOT).parts
            if (not path.is_file() or path.suffix in (".md", ".png", ".svg", ".pyc")
                    or any(part.startswith(".") and part not in (".ci", ".env.example") for part in inside)):
                continue
            try:
                parts.append(path.read_text(encoding="utf-8"))
            except UnicodeDecodeError:
                continue
    return "\n".join(parts)


@pytest.fixture(scope="module")
def code_text() -> str:
    return _code_text()


def _prose_names(pattern: str) -> Iterator[tuple[Span, str]]:
    for page in PAGES:
        for span in _spans(page):
            for m in re.finditer(pattern, span.text):
                yield span, m.group(0)


def test_every_variable_a_page_names_is_one_the_code_or_the_deploy_files_read(code_text: str) -> None:
    problems = [f"{span.where()}: `{name}` is read nowhere" for span, name in
                _prose_names(r"(?<![\w$])STEPLINE_[A-Z0-9_]*[A-Z0-9](?![\w*])")
                if not any(re.search(rf"(?<![\w]){n}(?![A-Z0-9_])", code_text)
                           for n in (name, name.removesuffix("_FILE")))]  # VAR_FILE: a secret's file (_SECRETS)
    assert not problems, "\n".join(problems)


def test_every_metric_a_page_names_is_exported_or_recorded(code_text: str) -> None:
    problems = [f"{span.where()}: `{name}` is no metric, recording rule or name the code has" for span, name in
                _prose_names(r"(?<![\w.-])stepline_[a-z0-9_:]*[a-z0-9](?![\w.*-])")
                if not any(re.search(rf"{n}(?![\w:])", code_text)
                           for n in (name, name.removesuffix("_total"), name.removesuffix("_info")))]
    assert not problems, "\n".join(problems)


def _defines(path: Path, names: list[str]) -> bool:
    """Whether the module at `path` defines the first name at its top level, and each further one somewhere in it."""
    text = path.read_text(encoding="utf-8")
    if not re.search(rf"^(?:(?:async )?def |class )?{re.escape(names[0])}\b", text, re.M):
        return False
    return all(re.search(rf"\b(?:def |class |self\.)?{re.escape(name)}\b", text) for name in names[1:])


def _resolves(dotted: str) -> bool:
    """Whether `stepline.a.b.C` is a module of the package, or a name a module of it defines (read, not imported:
    some modules import what only a vLLM or LiteLLM environment has)."""
    parts = dotted.split(".")[1:]
    for cut in range(len(parts), -1, -1):
        base = PACKAGE.joinpath(*parts[:cut])
        module = next((m for m in (base.with_suffix(".py"), base / "__init__.py") if m.is_file()), None)
        if module is not None:
            return cut == len(parts) or _defines(module, parts[cut:])
    return False


def test_every_stepline_name_a_page_names_is_in_the_code(code_text: str) -> None:
    problems = [f"{span.where()}: `{name}` is neither a module or name of the package nor a string the code uses"
                for span, name in _prose_names(r"(?<![\w/-])stepline(?:\.[A-Za-z_]\w*)+")
                if not _resolves(name) and f'"{name}"' not in code_text and f"'{name}'" not in code_text]
    assert not problems, "\n".join(problems)


def _table_cells(text: str, column: int = 0) -> list[str]:
    return [row.strip("|").split("|")[column].strip() for row in text.splitlines()
            if row.startswith("|") and not row.startswith("|---") and not row.startswith("| ---")]


def test_the_dashboard_tables_list_every_dashboard() -> None:
    titles = sorted(json.loads(p.read_text(encoding="utf-8"))["title"].removeprefix("stepline / ")
                    for p in (ROOT / "dashboards").glob("*.json"))
    for page in ("README.md", "docs/grafana.md"):
        section = TEXT[page].split("| dashboard |", 1)[1].split("\n\n", 1)[0]
        listed = sorted(cell for cell in _table_cells("| dashboard |" + section) if cell != "dashboard")
        assert listed == titles, f"{page}: its dashboard table lists {listed}, dashboards/ holds {titles}"


def test_the_dashboards_readme_names_every_file_with_its_uid() -> None:
    uids = {p.name: json.loads(p.read_text(encoding="utf-8"))["uid"] for p in (ROOT / "dashboards").glob("*.json")}
    rows = [line for line in TEXT["dashboards/README.md"].splitlines() if line.startswith("| `")]
    listed = {cells[0].strip(" `"): cells[1].strip(" `") for cells in (row.strip("|").split("|") for row in rows)}
    assert listed == uids, f"dashboards/README.md lists {listed}, dashboards/ holds {uids}"


def test_the_architecture_page_names_every_table_and_every_layer() -> None:
    page = TEXT["docs/architecture.md"]
    tables = page.split("| table | one row per | filled by |", 1)[1].split("\n\n", 1)[0]
    listed = [cell.strip("`") for cell in _table_cells(tables)]
    assert listed == [t.name for t in STORE_TABLES if t.name != "schema_version"], (
        f"docs/architecture.md's table of tables lists {listed}")
    layers = re.search(r"^LAYERS = \(([^)]*)\)", (ROOT / "tests" / "test_layout.py").read_text(encoding="utf-8"),
                       re.M | re.S)
    assert layers is not None
    folders = page.split("| Folder | What is in it |", 1)[1].split("\n\n", 1)[0]
    assert [cell.strip("`/") for cell in _table_cells(folders)] == re.findall(r'"(\w+)"', layers.group(1)), (
        "docs/architecture.md's code layout is not tests/test_layout.py's LAYERS, in order")


# --- figures quoted from benchmarks/RESULTS.md --------------------------------------------------------------------

RESULTS = (ROOT / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8")


class Figure(NamedTuple):
    """A figure a page quotes (`quote`, as the page writes it) and where RESULTS.md holds it: the headline table's row
    whose first cell starts with `source`, or the section whose heading starts with it; `says` is the text that row
    or section must hold. The newest measurement of each thing is the one to quote."""

    page: str
    quote: str
    source: str
    says: tuple[str, ...]


FIGURES = (
    Figure("docs/diagnose.md", "takes 1.61 s", "incident queries over 7 d of an 8-GPU node", ("**1.61 s** over 24 h",)),
    Figure("docs/diagnose.md", "1.84 s over 24 h of a 64-engine fleet", "the same, after diagnose rounds 2-5",
           ("**1.84 s** over 24 h", "34/34")),
    Figure("docs/install-vllm.md", "66-71 ms after a 5,000-step burst", "plugin backlog after a burst",
           ("5,000-step burst", "empty 66 ms after idle", "(71 ms with the sidecar frozen")),
    Figure("docs/usage.md", "0.00-1.65% at p90", "GPU time and energy per request", ("p90 0.00%", "1.65%")),
    Figure("docs/usage.md", "at most 4.7% over a window that cuts requests in half",
           "## GPU time and energy per request", ("up to 4.70% over a middle third",)),
    Figure("docs/limitations.md", "one LiteLLM worker here answers ~35/s", "LiteLLM callback",
           ("one proxy worker answered only 35 req/s",)),
    Figure("docs/deploy.md", "from 8 nodes (34 new parts/s per shard)", "## Write model (fleet)",
           ("8 nodes included** (33.7 parts/s per shard",)),
    Figure("docs/deploy.md", "1,029 against 2,798 a second per shard at 1,000 nodes", "## Write model (fleet)",
           ("gives 2,798 Keeper writes/s per shard at 1,000 nodes, against 1,029",)),
    Figure("docs/whatif-replay-matrix.md", "moved TTFT p99 by 17-33%",
           "### Against the real vLLM engine, run after run (2026-12-04):",
           ("17-33%",)),
    Figure("benchmarks/README.md", "fill once 12.8 min (561 s + 206 s), 3.2 GiB RSS, 12.4 GiB disk",
           "### 64 engines, `diagnose` round 5", ("synthesis 561 s, merge 206 s, 12.4 GiB on disk, peak RSS 3.2 GiB",)),
    Figure("benchmarks/README.md", "fill once 19 min (under load), 3.3 GiB RSS, 6.8 GiB disk",
           "### What synthesis took", ("(19 min 17 s wall) | 3.3 GiB | 6.8 GiB",)),
)


def _source(source: str) -> str:
    """The headline table's row, or the section (to the next heading of its level or higher), `source` starts."""
    if source.startswith("#"):
        level = source.split(" ", 1)[0]
        starts = [m.start() for m in re.finditer(rf"^{re.escape(source)}", RESULTS, re.M)]
        assert starts, f"benchmarks/RESULTS.md has no section {source!r}"
        start = starts[-1]
        body = RESULTS[start + len(source):]
        end = re.search(rf"^#{{1,{len(level)}}} ", body, re.M)
        return source + body[:end.start() if end else len(body)]
    rows = [row for row in headline.table(RESULTS).splitlines() if row.startswith(f"| {source}")]
    assert len(rows) == 1, f"benchmarks/RESULTS.md's headline table has {len(rows)} rows starting {source!r}"
    return rows[0]


@pytest.mark.parametrize("figure", FIGURES, ids=lambda f: f"{f.page}: {f.quote}")
def test_every_figure_quoted_from_the_results_is_what_they_say(figure: Figure) -> None:
    text = " ".join(TEXT[figure.page].split())
    assert figure.quote in text, (f"{figure.page} no longer quotes {figure.quote!r}: update FIGURES in this test "
                                  "with what it quotes now, and where RESULTS.md holds it")
    line = next(n for n, _ in enumerate(TEXT[figure.page].splitlines(), 1)
                if figure.quote.split()[0] in _)
    held = " ".join(_source(figure.source).split())
    for says in figure.says:
        assert says in held, (f"{figure.page}:{line} quotes {figure.quote!r}, but benchmarks/RESULTS.md "
                              f"({figure.source!r}) does not say {says!r}")


def test_the_figures_on_the_development_page_are_the_results_headline_table() -> None:
    page = TEXT["docs/development.md"]
    assert headline.table(RESULTS) in page
    assert headline.with_table(page, RESULTS) == page, (
        "docs/development.md's headline figures drifted from benchmarks/RESULTS.md: run `stepline docs build`")
