"""The benchmarks' headline figures: the first table of benchmarks/RESULTS.md, copied by `stepline docs build` between
two markers of docs/development.md, so the figures the docs quote are written once, where they were measured."""

from __future__ import annotations

import re
from pathlib import Path

BEGIN = ("<!-- headline figures: copied by `stepline docs build` from the first table of benchmarks/RESULTS.md; "
         "edit them there -->")
END = "<!-- end of headline figures -->"
PAGE = Path("development.md")  # under the docs folder
RESULTS = Path("benchmarks") / "RESULTS.md"  # under the repository root, the docs folder's parent


class HeadlineError(ValueError):
    """RESULTS.md has no table, or the page has no markers; the message says which."""


def table(results: str) -> str:
    """RESULTS.md's first table (its header, rule and rows), as written there."""
    m = re.search(r"^\|.*\|\n\|[ :|-]+\|\n(?:\|.*\|\n?)+", results, re.M)
    if m is None:
        raise HeadlineError("benchmarks/RESULTS.md has no table of headline figures")
    return m.group(0).rstrip("\n") + "\n"


def with_table(page: str, results: str) -> str:
    """`page` with the text between its markers replaced by RESULTS.md's headline table."""
    head, begin, rest = page.partition(BEGIN + "\n")
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise HeadlineError(f"the page has no {BEGIN!r} ... {END!r} block to fill")
    return f"{head}{BEGIN}\n{table(results)}{END}{tail}"


def page_text(docs: Path) -> str | None:
    """What docs/development.md should hold under the docs folder `docs`; None where the folder is not a checkout's
    (no benchmarks/RESULTS.md beside it, or no page)."""
    results, page = docs.parent / RESULTS, docs / PAGE
    if not results.is_file() or not page.is_file():
        return None
    return with_table(page.read_text(encoding="utf-8"), results.read_text(encoding="utf-8"))
