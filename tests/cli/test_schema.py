"""`stepline schema`: the DDL for one node or a cluster, and the column reference."""

from __future__ import annotations

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


def test_the_readme_flag_is_gone(capsys: pytest.CaptureFixture[str]) -> None:
    """The column reference left the README for docs/reference/schema.md (`stepline docs build`): a flag that could
    only fail on today's README is no flag."""
    with pytest.raises(SystemExit) as exit_:
        main(["schema", "--readme", "README.md"])
    assert exit_.value.code == 2
    assert "unrecognized arguments: --readme" in capsys.readouterr().err
