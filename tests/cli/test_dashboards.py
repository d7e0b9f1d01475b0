"""`stepline dashboards build`: one line per dashboard written."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from stepline.cli import dashboards
from stepline.dashboards.generate import DASHBOARDS


def test_each_dashboard_is_written_and_listed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    dashboards.add_arguments(parser)
    assert dashboards.run(parser.parse_args(["build", "--out", str(tmp_path)])) == 0
    listed = [Path(line) for line in capsys.readouterr().out.splitlines()]
    assert len(listed) == len(DASHBOARDS) and {p.parent for p in listed} == {tmp_path}
    assert all(json.loads(p.read_text(encoding="utf-8"))["uid"] for p in listed)


def test_the_objectives_file_makes_the_slo_dashboards_panels(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    objectives = tmp_path / "objectives.toml"
    objectives.write_text('[[objective]]\nname = "batch_up"\nsli = "gateway_availability"\nscope = "tenant"\n')
    parser = argparse.ArgumentParser()
    dashboards.add_arguments(parser)
    assert dashboards.run(parser.parse_args(["build", "--out", str(tmp_path), "--objectives", str(objectives)])) == 0
    capsys.readouterr()
    titles = [p["title"] for p in json.loads((tmp_path / "slo.json").read_text(encoding="utf-8"))["panels"]]
    assert any(t.startswith("batch_up:") for t in titles) and not any(t.startswith("ttft:") for t in titles)
