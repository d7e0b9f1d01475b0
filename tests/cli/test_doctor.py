"""`stepline doctor` on the command line, beside `stepline collect` and `stepline sim` running as processes of their
own: the embedded store is another process's, so the doctor reads it through the collector's query endpoint, and
finds the collector as an operator's shell does (its runtime file) or by --store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from stepline.app.doctor import CHECKS
from stepline.cli import doctor
from stepline.cli.main import main
from stepline.testing.alertstack import free_port
from stepline.testing.sink import wait_until


@dataclass(frozen=True)
class Running:
    engine: str  # sim=URL
    store: str
    run_dir: Path
    query_port: int


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1):
            return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    work = tmp_path_factory.mktemp("doctor-cli")
    sock = f"{tempfile.mkdtemp(prefix='stepline-')}/p.sock"
    engine_port, otlp_port, metrics_port, query_port = (free_port() for _ in range(4))
    env = {**os.environ, "XDG_RUNTIME_DIR": str(work / "run"), "STEPLINE_STORE": "", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    store = f"chdb://{work / 'store'}"
    collect = subprocess.Popen(
        [sys.executable, "-m", "stepline", "collect", "--engine", f"sim=http://127.0.0.1:{engine_port}", "--store",
         store, "--plugin-socket", sock, "--otlp-port", str(otlp_port), "--metrics-port", str(metrics_port),
         "--query-port", str(query_port), "--scrape-interval", "0.5", "--flush-interval", "0.2"],
        stdout=(work / "collect.log").open("wb"), stderr=subprocess.STDOUT, env=env, cwd=work)
    sim: subprocess.Popen[bytes] | None = None
    try:
        wait_until(lambda: _answers(f"http://127.0.0.1:{metrics_port}/metrics") or collect.poll() is not None, 60)
        assert collect.poll() is None, (work / "collect.log").read_text()
        # Started after the collector, so that the plugin's engine_config (sent once, at start) reaches it.
        sim = subprocess.Popen(
            [sys.executable, "-m", "stepline", "sim", "--workload", "idle", "--port", str(engine_port), "--model",
             "test/model", "--plugin-socket", sock, "--otlp-endpoint", f"http://127.0.0.1:{otlp_port}",
             "--engine-name", "sim"], stdout=(work / "sim.log").open("wb"), stderr=subprocess.STDOUT, env=env)
        wait_until(lambda: _answers(f"http://127.0.0.1:{engine_port}/metrics") or sim.poll() is not None, 60)
        assert sim.poll() is None, (work / "sim.log").read_text()
        yield Running(f"sim=http://127.0.0.1:{engine_port}", store, work / "run", query_port)
    finally:
        for process in (sim, collect):
            if process is not None:
                process.terminate()
                process.wait(30)


def test_a_wired_engine_prints_one_ok_line_a_check_and_exits_0(running: Running, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str],
                                                               tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(running.run_dir))  # found by its runtime file, as from a shell
    # ... in a directory of its own: where the README's `stepline demo` ran, ./stepline-data is the store it names.
    monkeypatch.chdir(tmp_path)
    assert main(["doctor", "--engine", running.engine, "--wait", "10"]) == 0
    out = capsys.readouterr()
    lines = out.out.splitlines()
    assert [line.split(":")[0].split() for line in lines] == [
        ["OK", name] for name in CHECKS[:-2]] + [["SKIP", "prometheus"], ["SKIP", "alertmanager"]], out.out
    collector = next(line for line in lines if line.startswith("OK   collector: "))
    assert collector.endswith(f"scrapes sim; SQL at http://127.0.0.1:{running.query_port}")
    assert "SKIP prometheus: give --prometheus URL to check that it scrapes the collector" in lines
    assert out.err == "stepline doctor: waiting up to 10 s for steps and spans...\n"


def test_json_says_which_check_failed_and_the_exit_code_is_1(running: Running, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    gone = f"http://127.0.0.1:{free_port()}"
    code = main(["doctor", "--engine", running.engine, "--store", running.store, "--alertmanager", gone, "--wait",
                 "10", "--json"])
    out = capsys.readouterr()
    answer = json.loads(out.out)
    assert code == 1 and answer["ok"] is False and out.err == ""
    by_name = {c["check"]: c for c in answer["checks"]}
    assert list(by_name) == list(CHECKS)
    assert {n: c["status"] for n, c in by_name.items()} == {n: "OK" for n in CHECKS} | {
        "prometheus": "SKIP", "alertmanager": "FAIL"}
    assert by_name["alertmanager"]["message"].startswith(f"{gone} unreachable: ")


def test_a_wait_that_is_not_positive_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--wait", "0"]) == 2
    assert capsys.readouterr().err == "stepline: --wait must be positive, got 0\n"


def test_an_engine_that_is_no_url_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--engine", "localhost:8000"]) == 2
    assert capsys.readouterr().err == "stepline: --engine 'localhost:8000' must be [NAME=]http(s)://host:port\n"


def test_the_help_names_the_command_and_what_its_exit_code_counts(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    assert f"doctor {doctor.HELP}" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit):
        main(["doctor", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Exit 0 when no check FAILs (a SKIP, a check not asked for or not possible, does not count), 1 otherwise" \
        in text
    for flag in ("--engine [NAME=]URL", "--prometheus URL", "--alertmanager URL", "--wait SECONDS", "--no-probe",
                 "--json", '--prometheus-selector MATCHERS'):
        assert flag in text
