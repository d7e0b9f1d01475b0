"""`stepline alerts build`: the files written and listed, with what the options point them at."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from stepline.cli import alerts


def test_the_selector_and_datasource_reach_the_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    alerts.add_arguments(parser)
    args = parser.parse_args(["build", "--out", str(tmp_path / "alerts"), "--selector", 'job="edge"',
                              "--datasource-uid", "prom-edge", "--kustomization", ""])
    assert alerts.run(args) == 0
    listed = capsys.readouterr().out.splitlines()
    assert str(tmp_path / "alerts" / "prometheus-rules.yaml") in listed and all(Path(p).is_file() for p in listed)
    assert 'job="edge"' in (tmp_path / "alerts" / "prometheus-rules.yaml").read_text(encoding="utf-8")
    assert "prom-edge" in (tmp_path / "alerts" / "grafana" / "alert-rules.yaml").read_text(encoding="utf-8")
    with pytest.raises(SystemExit):
        parser.parse_args([])  # the action is required


def test_the_objectives_file_makes_the_burn_rate_rules(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    objectives = tmp_path / "objectives.toml"
    objectives.write_text('[[objective]]\nname = "search_first_byte"\nsli = "gateway_first_byte"\n'
                          'scope = "tenant"\nthreshold_seconds = 2.0\ntarget = 0.995\n')
    parser = argparse.ArgumentParser()
    alerts.add_arguments(parser)
    args = parser.parse_args(["build", "--out", str(tmp_path / "alerts"), "--kustomization", "",
                              "--objectives", str(objectives)])
    assert alerts.run(args) == 0
    capsys.readouterr()
    rules = (tmp_path / "alerts" / "prometheus-rules.yaml").read_text(encoding="utf-8")
    assert 'objective: search_first_byte' in rules and "vector(0.005)" in rules
    assert "sum by (objective, tenant)" in rules and "sum by (objective, model)" not in rules
