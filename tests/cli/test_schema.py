"""`stepline schema`: the DDL for one node or a cluster, and the column reference."""

from __future__ import annotations

from pathlib import Path

import pytest

from stepline.cli.main import main
from stepline.model import schema


def test_schema_prints_cluster_ddl(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema", "--cluster", "fleet", "--retention", "14"]) == 0
    out = capsys.readouterr().out
    assert out.count("ENGINE = Distributed(`fleet`") == len(schema.TABLES)  # every timeline table
    assert "INTERVAL 14 DAY" in out


def test_one_node_in_a_database_of_its_own(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema", "--database", "timeline"]) == 0
    out = capsys.readouterr().out
    assert "CREATE TABLE IF NOT EXISTS `timeline`.`steps`" in out and "Distributed" not in out
    assert out.count(";\n") >= 6


def test_a_readme_without_the_markers_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# no markers\n", encoding="utf-8")
    assert main(["schema", "--readme", str(readme)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"stepline: cannot update {readme}: ") and err.count("\n") == 1
