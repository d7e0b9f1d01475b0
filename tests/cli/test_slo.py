"""`stepline slo`: its options, the objectives of a store as a table or JSON, and a store without requests."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from stepline.cli import slo
from stepline.cli.main import build_parser, main
from stepline.model.rows import Request, micros
from stepline.store.store import Store


def _request(rid: str, reason: str, ttft: float) -> Request:
    at = time.time() - 3600
    return Request(micros(at), "h", "e1", 0, "m", rid, "plugin", reason, micros(at - 2), 0.1, 0.4, 1.5, 1.9, 2.0,
                   ttft, 0.02, 100, 0, 80, 100, 0)


def test_the_window_defaults_to_the_objectives_30_days() -> None:
    assert build_parser("slo").parse_args(["slo"]).since == "30d"
    assert "error budget" in slo.HELP


def test_it_prints_each_objective_with_its_budget(store: Store, store_url: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    store.insert("requests", [_request(f"ok{i}", "stop", 0.5) for i in range(98)]
                 + [_request("late", "stop", 30.0), _request("failed", "error", 0.5)], Request._fields)
    assert main(["slo", "--store", store_url, "--since", "1d", "--json"]) == 0
    found = {s["objective"]: s for s in json.loads(capsys.readouterr().out)}
    assert set(found) == {"ttft", "tpot", "availability"}  # no gateway: no decisions to judge
    assert (found["ttft"]["scope"], found["ttft"]["total"], found["ttft"]["good"]) == ("model=m", 100, 99)
    assert found["availability"]["good"] == 99 and found["tpot"]["good"] == 100
    assert found["ttft"]["budget_left"] == pytest.approx(0.0)
    assert main(["slo", "--store", store_url, "--since", "1d"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:2] == ["objective", "scope"] and len(lines) == 5


def test_a_store_without_requests_says_who_fills_them(store: Store, store_url: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["slo", "--store", store_url]) == 0
    assert capsys.readouterr().out.startswith("no finished requests in the last 30d")


def test_objectives_come_from_the_file_given(store: Store, store_url: str, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    store.insert("requests", [_request("ok", "stop", 0.5), _request("late", "stop", 3.0)], Request._fields)
    path = tmp_path / "objectives.toml"
    path.write_text('[[objective]]\nname = "tight_ttft"\nsli = "ttft"\nthreshold_seconds = 1.0\ntarget = 0.9\n')
    assert main(["slo", "--store", store_url, "--since", "1d", "--json", "--objectives", str(path)]) == 0
    [found] = json.loads(capsys.readouterr().out)
    assert (found["objective"], found["total"], found["good"], found["target"]) == ("tight_ttft", 2, 1, 0.9)


def test_a_bad_objectives_file_is_one_line_naming_it(store_url: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "objectives.toml"
    path.write_text('[[objective]]\nname = "x"\nsli = "ttft"\nscope = "tenant"\n')
    assert main(["slo", "--store", store_url, "--objectives", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert str(path) in err and "only a gateway knows the tenant" in err and len(err.splitlines()) == 1
