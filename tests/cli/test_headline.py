"""`stepline docs build` copies RESULTS.md's headline table into docs/development.md, and `--check` tells when the copy
drifted; a page without its markers is one line, exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from stepline.cli import headline
from stepline.cli.main import main

RESULTS = """# Benchmark results

Measured on a machine.

| what | target | result |
| --- | --- | --- |
| ingest | >= 0.5x | 0.62x |
| footprint (2026-12-05) | reported | 510 MiB |

## Ingest

| round | rows/s |
| --- | --- |
| 0 | 1 |
"""
PAGE = f"# Development\n\nFigures:\n\n{headline.BEGIN}\n| what | old |\n{headline.END}\n\nThe end.\n"


def checkout(tmp_path: Path, page: str = PAGE) -> Path:
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "RESULTS.md").write_text(RESULTS, encoding="utf-8")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "development.md").write_text(page, encoding="utf-8")
    return tmp_path / "docs"


def test_the_table_is_the_first_one_as_written() -> None:
    assert headline.table(RESULTS) == ("| what | target | result |\n| --- | --- | --- |\n| ingest | >= 0.5x | 0.62x |\n"
                                       "| footprint (2026-12-05) | reported | 510 MiB |\n")
    with pytest.raises(headline.HeadlineError, match="no table"):
        headline.table("# Benchmark results\n\nnothing measured\n")


def test_build_fills_the_block_and_check_tells_its_drift(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    docs = checkout(tmp_path)
    page = docs / "development.md"
    assert main(["docs", "build", "--out", str(docs), "--check"]) == 1
    assert f"{page}: differs from the code" in capsys.readouterr().err
    assert main(["docs", "build", "--out", str(docs)]) == 0
    assert str(page) in capsys.readouterr().out.splitlines()
    text = page.read_text(encoding="utf-8")
    assert text == (f"# Development\n\nFigures:\n\n{headline.BEGIN}\n{headline.table(RESULTS)}{headline.END}\n\n"
                    "The end.\n")
    assert main(["docs", "build", "--out", str(docs), "--check"]) == 0
    (tmp_path / "benchmarks" / "RESULTS.md").write_text(RESULTS.replace("0.62x", "0.71x"), encoding="utf-8")
    assert main(["docs", "build", "--out", str(docs), "--check"]) == 1
    assert page.read_text(encoding="utf-8") == text  # --check writes nothing


def test_a_page_without_the_markers_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    docs = checkout(tmp_path, "# Development\n\nno block\n")
    assert main(["docs", "build", "--out", str(docs)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("stepline: the page has no ") and err.count("\n") == 1
    assert (docs / "development.md").read_text(encoding="utf-8") == "# Development\n\nno block\n"


def test_docs_outside_a_checkout_get_the_reference_pages_only(tmp_path: Path) -> None:
    assert headline.page_text(tmp_path / "docs") is None
    assert main(["docs", "build", "--out", str(tmp_path / "docs")]) == 0
    assert not (tmp_path / "docs" / "development.md").exists()
