"""The column reference (docs/reference/schema.md, and any page with the markers): generated from the column comments,
complete, and rewritten in place by `stepline schema --readme`."""

from __future__ import annotations

from pathlib import Path

import pytest

from stepline.cli.main import main
from stepline.model import schema, schemadoc

PAGE = f"# A page\n\nintro\n\n{schemadoc.BEGIN}\n| `gone` | `UInt8` | an old column |\n{schemadoc.END}\n\noutro\n"


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


def test_the_command_rewrites_only_the_reference(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stale = tmp_path / "page.md"
    stale.write_text(PAGE, encoding="utf-8")
    assert main(["schema", "--readme", str(stale)]) == 0
    text = stale.read_text(encoding="utf-8")
    head, rest = text.split(schemadoc.BEGIN, 1)
    inside, tail = rest.split(schemadoc.END, 1)
    assert head == PAGE.split(schemadoc.BEGIN)[0] and tail == PAGE.split(schemadoc.END)[1]
    assert "`gone`" not in inside and schemadoc.markdown().strip() in inside
    assert main(["schema", "--readme", str(stale)]) == 0
    assert stale.read_text(encoding="utf-8") == text
    assert capsys.readouterr().out.splitlines() == [f"{stale}: column reference updated",
                                                    f"{stale}: column reference already current"]


def test_a_readme_without_the_markers_is_one_clear_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bare = tmp_path / "README.md"
    bare.write_text("# nothing to fill\n", encoding="utf-8")
    assert main(["schema", "--readme", str(bare)]) == 2
    assert "has no" in capsys.readouterr().err
    assert bare.read_text(encoding="utf-8") == "# nothing to fill\n"


def test_markdown_prints_the_reference(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema", "--markdown"]) == 0
    assert capsys.readouterr().out == schemadoc.markdown()
