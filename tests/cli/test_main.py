"""The command line, run as a user runs it: a real process, real stores, one clear line on errors."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stepline.cli import schema
from stepline.cli.main import COMMANDS, build_parser, main


def _stepline(*args: str, cwd: Path | None = None, timeout: float = 120,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stepline", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env={**os.environ, **(env or {})})


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_subcommand_has_useful_help() -> None:
    subcommands = _subcommands(build_parser())
    assert set(subcommands) >= {"collect", "query", "status", "schema", "sim", "demo"}
    for name, sub in subcommands.items():
        text = sub.format_help()
        assert sub.description, name
        assert "--store" in text or name in ("schema", "sim", "alerts", "dashboards", "grafana-provisioning",
                                             "docs", "prometheus-config"), name


def test_a_command_line_builds_only_its_commands_options() -> None:
    subcommands = _subcommands(build_parser("schema"))
    assert list(subcommands) == list(COMMANDS)  # every command keeps its line in `stepline --help`
    assert {a.dest for a in subcommands["schema"]._actions} >= {"cluster", "database", "retention_days"}
    assert [a.dest for a in subcommands["matrix"]._actions] == ["help"]
    assert build_parser("schema").parse_args(["schema"]).func is schema.run


def test_usage_errors_are_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["timeline", "--around", "soon"]) == 2
    assert capsys.readouterr().err == "stepline: time 'soon' is not ISO 8601, epoch seconds or HH:MM:SS\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("query", "SELECT 1", "--store", "mysql://x/y"), "stepline: store URL 'mysql://x/y' has scheme 'mysql'"),
        (("status", "--store", "chdb:///nonexistent/stepline"), "stepline: no store at /nonexistent/stepline"),
        (("query", "SELECT 1", "--store", "http://127.0.0.1:9/x"),
         "stepline: cannot reach the store at http://127.0.0.1:9/x"),
        (("collect", "--store", "chdb://store", "--spool-dir", "/proc/version/spool"),
         "stepline: cannot use the spool directory /proc/version/spool: Not a directory"),
        (("collect", "--engine", "localhost:8000"), "stepline: engine 'localhost:8000' must be http(s)://"),
    ],
)
def test_bad_input_is_one_clear_line(args: tuple[str, ...], message: str, tmp_path: Path) -> None:
    result = _stepline(*args, cwd=tmp_path, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert result.stderr.startswith(message), result.stderr


@pytest.fixture(scope="module")
def demo_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A store filled by `stepline demo --fast` in a process of its own."""
    cwd = tmp_path_factory.mktemp("demo")
    result = _stepline("demo", "--fast", "--duration", "120", cwd=cwd, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "gen tok/s" in result.stdout and "look further" in result.stdout
    # The demo ends with its diagnosis: the monster prefill that starved decode comes first, with numbers.
    diagnosis = result.stdout.split("what stepline diagnose says about", 1)[1]
    first = diagnosis.splitlines()[1]
    assert first.startswith("1. CRITICAL  prefill_interference"), diagnosis[:500]
    assert "uncached) prefill: ITL p99" in diagnosis.splitlines()[2]
    yield cwd / "stepline-data"


def test_demo_leaves_samples_and_events_that_query_reads(demo_store: Path) -> None:
    url = f"chdb://{demo_store}"
    result = _stepline("query", "SELECT kind, count() AS n FROM events GROUP BY kind ORDER BY kind", "--store", url)
    assert result.returncode == 0, result.stderr
    assert "collector_started" in result.stdout and "engine_up" in result.stdout
    assert "via embedded store" in result.stderr
    result = _stepline("query", "SELECT count() AS n FROM engine_samples", "--store", url, "--format", "csv")
    assert result.returncode == 0, result.stderr
    header, count = result.stdout.split()
    assert header == '"n"' and int(count) > 10_000
    status = _stepline("status", "--store", url)
    assert status.returncode == 0, status.stderr
    assert "collector: not running" in status.stdout and "engine_samples" in status.stdout


def test_query_goes_through_a_running_collector(demo_store: Path) -> None:
    url = f"chdb://{demo_store}"
    collector = subprocess.Popen(
        [sys.executable, "-m", "stepline", "collect", "--store", url, "--metrics-port", "0", "--query-port", "0",
         "--engine", "http://127.0.0.1:9", "--otlp-port", "0", "--plugin-socket", str(demo_store.parent / "p.sock")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (demo_store / "stepline-collector.json").exists():
            assert collector.poll() is None, collector.communicate()[1]
            assert time.monotonic() < deadline
            time.sleep(0.2)
        result = _stepline("query", "SELECT count() FROM engine_samples", "--store", url, "--format", "TabSeparated")
        assert result.returncode == 0, result.stderr
        assert int(result.stdout.split()[-1]) > 10_000
        status = _stepline("status", "--store", url)
        assert "vllm_metrics:127.0.0.1:9  DOWN" in status.stdout, status.stdout
        # Diagnosis and the report read through the collector's read-only endpoint too.
        diagnosis = _stepline("diagnose", "--since", "3h", "--store", url)
        assert diagnosis.returncode == 1, diagnosis.stderr  # critical: the monster's prefill starved decode
        assert "CRITICAL  prefill_interference" in diagnosis.stdout and "via collector pid" in diagnosis.stdout
        report = _stepline("report", "--since", "3h", "--out", str(demo_store.parent / "incident.html"),
                           "--store", url)
        assert report.returncode == 0, report.stderr
        assert "prefill_interference" in (demo_store.parent / "incident.html").read_text(encoding="utf-8")
        refused = _stepline("query", "DROP TABLE engine_samples", "--store", url)
        assert refused.returncode == 1 and "read-only" in refused.stderr
        second = _stepline("collect", "--store", url, "--metrics-port", "0", "--query-port", "0", "--otlp-port", "0",
                           "--plugin-socket", str(demo_store.parent / "p2.sock"), timeout=60)
        assert second.returncode == 2
        assert second.stderr.startswith(f"stepline: the embedded store {demo_store} is in use by another process "
                                        f"(collector pid {collector.pid}, query endpoint http://127.0.0.1:")
        assert len(second.stderr.strip().splitlines()) == 1
    finally:
        collector.terminate()
        _, stderr = collector.communicate(timeout=60)
    assert collector.returncode == 0, stderr
    assert "draining and stopping" in stderr
    after = _stepline("query", "SELECT count() FROM events WHERE kind = 'collector_stopped'", "--store", url,
                      "--format", "TabSeparated")
    assert after.stdout.strip() == "2"


def test_query_and_status_find_the_running_collector_from_any_directory(tmp_path: Path) -> None:
    here, elsewhere, run = tmp_path / "here", tmp_path / "elsewhere", tmp_path / "run"
    here.mkdir()
    elsewhere.mkdir()
    env = {"XDG_RUNTIME_DIR": str(run), "STEPLINE_STORE": ""}
    collector = subprocess.Popen(
        [sys.executable, "-m", "stepline", "collect", "--metrics-port", "0", "--query-port", "0",
         "--engine", "http://127.0.0.1:9", "--otlp-port", "0", "--plugin-socket", str(tmp_path / "p.sock")],
        cwd=here, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    runtime_file = run / "stepline" / f"collector-{collector.pid}.json"
    try:
        deadline = time.monotonic() + 60
        while not runtime_file.exists():
            assert collector.poll() is None, collector.communicate()[1]
            assert time.monotonic() < deadline
            time.sleep(0.2)
        deadline = time.monotonic() + 30
        while True:  # the collector's first event reaches the store with its first flush
            result = _stepline("query", "SELECT kind FROM events WHERE kind = 'collector_started'", cwd=elsewhere,
                               env=env)
            if result.returncode or "collector_started" in result.stdout or time.monotonic() > deadline:
                break
        assert result.returncode == 0, result.stderr
        assert "collector_started" in result.stdout and f"via collector pid {collector.pid}" in result.stderr
        assert "cut at" not in result.stdout
        # A value longer than the table's cell is cut, and the table says so once, below it.
        cut = _stepline("query", "SELECT repeat('x', 100) AS long FROM numbers(3)", cwd=elsewhere, env=env)
        assert cut.stdout.splitlines()[2] == "x" * 59 + "…"
        assert cut.stdout.splitlines()[-1] == (
            "(some values cut at 60 characters; --format tsv or json shows them whole)")
        whole = _stepline("query", "SELECT repeat('x', 100) AS long", "--format", "tsv", cwd=elsewhere, env=env)
        assert whole.stdout.splitlines()[1] == "x" * 100
        deadline = time.monotonic() + 30
        status = _stepline("status", cwd=elsewhere, env=env)
        while "vllm_metrics:127.0.0.1:9" not in status.stdout and time.monotonic() < deadline:
            status = _stepline("status", cwd=elsewhere, env=env)  # its first poll may not have failed yet
        assert status.returncode == 0, status.stderr
        assert f"collector pid {collector.pid}" in status.stdout and str(runtime_file) in status.stdout
        assert ("vllm_metrics:127.0.0.1:9  DOWN   engine 127.0.0.1:9 unreachable at http://127.0.0.1:9/metrics: "
                "[Errno 111] Connection refused") in status.stdout, status.stdout
        # --store and $STEPLINE_STORE win over the running collector.
        explicit = _stepline("query", "SELECT 1", "--store", f"chdb://{elsewhere}/none", cwd=elsewhere, env=env)
        assert explicit.returncode == 2 and explicit.stderr.startswith(f"stepline: no store at {elsewhere}/none")
        from_env = _stepline("query", "SELECT 1", cwd=elsewhere, env={**env, "STEPLINE_STORE": "chdb:///nowhere"})
        assert from_env.returncode == 2 and from_env.stderr.startswith("stepline: no store at /nowhere")
    finally:
        collector.terminate()
        _, stderr = collector.communicate(timeout=60)
    assert collector.returncode == 0, stderr
    assert not runtime_file.exists()  # a clean stop withdraws it
    gone = _stepline("query", "SELECT 1", cwd=elsewhere, env=env)
    assert gone.returncode == 2
    assert gone.stderr.strip() == (f"stepline: no store at {elsewhere}/stepline-data: run `stepline collect` or "
                                   f"`stepline demo` first (and no running collector announced itself in "
                                   f"{run}/stepline)")


def test_demo_fills_steps_and_requests(demo_store: Path) -> None:
    url = f"chdb://{demo_store}"
    # The slowest step carries a prefill chunk; its decode-only neighbours are far faster.
    result = _stepline("query", "SELECT num_ctx_tokens, elapsed_ms, (SELECT quantileExact(0.5)(elapsed_ms) FROM steps "
                       "WHERE num_ctx_tokens = 0) AS decode_p50 FROM steps ORDER BY elapsed_ms DESC LIMIT 1",
                       "--store", url, "--format", "TabSeparated")
    assert result.returncode == 0, result.stderr
    ctx_tokens, slowest_ms, decode_p50_ms = (float(x) for x in result.stdout.split())
    assert ctx_tokens > 0 and slowest_ms > 10 * decode_p50_ms
    counts = _stepline("query", "SELECT source, count() FROM requests GROUP BY source", "--store", url,
                       "--format", "TabSeparated")
    by_source = dict(line.split("\t") for line in counts.stdout.strip().splitlines())
    assert int(by_source["plugin"]) > 50 and "otlp" not in by_source  # OTLP reported the same requests: deduped
    slowest = _stepline("requests", "--slowest", "5", "--store", url)
    assert slowest.returncode == 0, slowest.stderr
    assert len([line for line in slowest.stdout.splitlines() if "burst-" in line]) == 5


def test_demo_fills_gpu_and_host_samples_and_the_timeline_joins_them(demo_store: Path) -> None:
    url = f"chdb://{demo_store}"
    result = _stepline("query", "SELECT (SELECT count() FROM gpu_samples), (SELECT count() FROM host_samples), "
                       "(SELECT count() FROM timeline WHERE isFinite(sm_clock_mhz) AND power_w > 0), "
                       "(SELECT countIf(has(clock_event_flags, 'sw_power_cap')) FROM timeline "
                       "WHERE prefill_tokens > 0)",
                       "--store", url, "--format", "TabSeparated")
    assert result.returncode == 0, result.stderr
    gpu_rows, host_rows, joined, capped = (int(x) for x in result.stdout.split())
    assert gpu_rows > 1000 and host_rows >= 1 and joined > 500 and capped > 0
    moment = _stepline("query", "SELECT toUnixTimestamp(argMax(ts, elapsed_ms)) FROM steps", "--store", url,
                       "--format", "TabSeparated").stdout.strip()
    around = _stepline("timeline", "--around", moment, "--window", "10", "--store", url)
    assert around.returncode == 0, around.stderr
    assert "sw_power_cap" in around.stdout and around.stdout.startswith("time (UTC)")


def test_version_says_the_installed_package_and_the_schema(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    from stepline.model.schema import SCHEMA_VERSION

    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"stepline {version('stepline')} (timeline schema {SCHEMA_VERSION})\n"
