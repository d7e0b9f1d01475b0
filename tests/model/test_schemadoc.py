"""The column reference (docs/reference/schema.md, `stepline schema --markdown`): generated from the column comments,
complete."""

from __future__ import annotations

from pathlib import Path

import pytest

from stepline.cli.main import main
from stepline.model import schema, schemadoc


def test_the_reference_page_carries_the_current_reference() -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "reference" / "schema.md").read_text(encoding="utf-8")
    assert schemadoc.markdown() in page, "docs/reference/schema.md drifted from schema.py: run `stepline docs build`"


def test_the_reference_lists_every_column_of_every_table_with_its_comment() -> None:
    sections = schemadoc.markdown().split("#### ")[1:]
    assert [s.split("`")[1] for s in sections] == [t.name for t in schema.STORE_TABLES]
    for section, table in zip(sections, schema.STORE_TABLES, strict=True):
        rows = [line for line in section.splitlines() if line.startswith("| `")]
        assert len(rows) == len(table.definition), table.name
        for row, column in zip(rows, table.definition, strict=True):
            name, type_, comment = (cell.strip() for cell in row.strip("|").split(" | "))
            assert name == f"`{column.name}`"
            assert type_.strip("`") == column.type.split(" CODEC(")[0] and "CODEC" not in type_
            assert comment == column.comment


def test_every_comment_is_one_line_ending_in_a_full_stop() -> None:
    for table in schema.STORE_TABLES:
        for column in table.definition:
            assert column.comment.endswith("."), f"{table.name}.{column.name}"
            assert "\n" not in column.comment and len(column.comment) >= 20, f"{table.name}.{column.name}"


def test_markdown_prints_the_reference(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema", "--markdown"]) == 0
    assert capsys.readouterr().out == schemadoc.markdown()
