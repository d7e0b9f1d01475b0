"""`stepline grafana-provisioning`: the files it writes, listed; an unusable input in one line, exit 2."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from stepline.cli import grafana_provisioning


def parse_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    grafana_provisioning.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_written_files_are_listed_and_a_folder_without_dashboards_is_said(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert grafana_provisioning.run(parse_args("--out", str(tmp_path / "o"), "--dashboards",
                                               str(tmp_path / "none"))) == 0
    out, err = capsys.readouterr()
    assert out.strip().endswith("provisioning/datasources/stepline.yaml")
    assert "wrote the datasources only" in err
    assert grafana_provisioning.run(parse_args("--out", str(tmp_path / "o"), "--query-url", "ftp://x")) == 2
    assert capsys.readouterr().err == ("stepline grafana-provisioning: query URL 'ftp://x' must be "
                                       "http(s)://host:port\n")


def test_the_generated_dashboards_are_provisioned_by_default(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert grafana_provisioning.run(parse_args("--out", str(tmp_path), "--query-url", "http://10.0.0.5:9124")) == 0
    written = [Path(line) for line in capsys.readouterr().out.splitlines()]
    assert {p.suffix for p in written} == {".yaml", ".json"} and all(p.is_file() for p in written)
    assert "10.0.0.5" in (tmp_path / "provisioning/datasources/stepline.yaml").read_text(encoding="utf-8")
