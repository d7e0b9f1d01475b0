"""`stepline query` in this process against an embedded store: the table, the formats, refusals and failures."""

from __future__ import annotations

import pytest

from stepline.cli import query
from stepline.cli.main import main
from stepline.store.store import Store


def test_a_table_cuts_long_values_and_says_so_once(store: Store, store_url: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["query", "SELECT number AS n, repeat('x', 100) AS long FROM numbers(2)", "--store", store_url]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0].split() == ["n", "long"]
    assert lines[2].endswith("x" * (query.TABLE_WIDTH - 1) + "…")
    assert lines[-1] == f"(some values cut at {query.TABLE_WIDTH} characters; --format tsv or json shows them whole)"
    assert err.startswith("(2 rows, via embedded store") and err.count("\n") == 1


@pytest.mark.parametrize(("fmt", "expected"), [("csv", '"n"\n0\n1\n'), ("TSV", "n\n0\n1\n"),
                                               ("json", '{"n":0}\n{"n":1}\n'), ("TabSeparated", "0\n1\n")])
def test_formats_by_short_name_or_clickhouse_name(fmt: str, expected: str, store: Store, store_url: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["query", "SELECT number AS n FROM numbers(2)", "--store", store_url, "--format", fmt]) == 0
    assert capsys.readouterr().out == expected


def test_writes_are_refused_and_failures_are_one_line(store: Store, store_url: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["query", "DROP TABLE steps", "--store", store_url]) == 1
    assert capsys.readouterr().err.startswith("stepline: query refused: ")
    assert main(["query", "SELECT nope FROM steps", "--store", store_url]) == 1
    err = capsys.readouterr().err
    assert err.startswith("stepline: query failed: ") and err.count("\n") == 1


def test_the_store_opened_directly_runs_the_query_under_the_endpoints_profile(
        store: Store, store_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    sql = "SELECT 1 AS x SETTINGS `output_format_schema` = '/tmp/stepline-cli-should-not-exist.proto'"
    assert main(["query", sql, "--store", store_url, "--format", "TSV"]) == 1
    assert "SETTING_CONSTRAINT_VIOLATION" in capsys.readouterr().err
    assert main(["query", "SELECT getSetting('readonly')", "--store", store_url, "--format", "TSV"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "2"
