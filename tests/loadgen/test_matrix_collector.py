"""`stepline matrix` while a collector holds the embedded store: its runs go through the collector's events endpoint."""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from pathlib import Path

import clickhouse_connect
import pytest

from stepline.app.collector import Collector
from stepline.config.settings import Settings
from stepline.loadgen import matrix
from stepline.sim.config import EngineConfig
from stepline.sim.vllm_server import SimServer, idle_workload, serve
from stepline.store.discovery import running
from stepline.testing.sink import wait_until

OTLP_TOKEN = "the-otlp-token"


@pytest.fixture
def engine() -> Iterator[SimServer]:
    handle = serve(idle_workload(), EngineConfig(model="test/model"), port=0, speed=1.0)
    yield handle
    handle.stop()


@pytest.fixture
def collector(store_url: str, sock_dir: str) -> Iterator[Collector]:
    settings = Settings.from_env({}, store=store_url, engines=(), metrics_port=0, query_port=0, otlp_port=0,
                                 plugin_socket=f"{sock_dir}/p.sock", flush_interval_s=0.1, otlp_token=OTLP_TOKEN)
    handle = Collector(settings)
    handle.start()
    yield handle
    handle.stop()


def parse_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    matrix.add_arguments(parser)
    return parser.parse_args(list(argv))


def matrix_runs(collector: Collector) -> list[tuple[str, str, str]]:
    """The matrix_run events, read through the collector's query endpoint."""
    assert collector.query_endpoint is not None and collector.store is not None
    client = clickhouse_connect.get_client(host="127.0.0.1", port=collector.query_endpoint.port,
                                           database=collector.store.database)
    try:
        rows = client.query("SELECT engine, attributes['run'], attributes['tokens_per_event_mean'] FROM events "
                            "WHERE kind = 'matrix_run' ORDER BY attributes['run']").result_rows
        return [(str(engine), str(run), str(mean)) for engine, run, mean in rows]
    finally:
        client.close()


def test_runs_go_through_the_running_collector_found_by_its_runtime_file(
    engine: SimServer, collector: Collector, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    ((path, announced),), _ = running()
    ingest = collector.events_ingest
    assert ingest is not None and (announced.events_url, announced.events_token) == (ingest.url, ingest.token)
    assert path.stat().st_mode & 0o777 == 0o600  # the token is the user's alone
    # No --store, no $STEPLINE_STORE, no ./stepline-data: the runtime file names the collector and its store.
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("STEPLINE_STORE", raising=False)
    args = parse_args("--engine", f"sim={engine.url}", "--streams", "2", "--max-tokens", "8",
                      "--long-prompt-tokens", "2048", "--repeat", "1")
    assert matrix.run(args) == 0
    out, err = capsys.readouterr()
    assert (f"stepline matrix: handed 3 matrix_run events to the running collector (pid {announced.pid}), which "
            f"writes them into {announced.store}") in out, err
    wait_until(lambda: len(matrix_runs(collector)) == 3)
    assert matrix_runs(collector) == [("sim", k, "1.000") for k in "abc"]
    assert not (tmp_path / "stepline-data").exists()


def test_a_wrong_token_is_refused_in_one_line_and_nothing_is_stored(
    engine: SimServer, collector: Collector, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    assert collector.events_ingest is not None
    url = collector.events_ingest.url
    argv = ("--engine", f"sim={engine.url}", "--streams", "1", "--max-tokens", "2", "--long-prompt-tokens", "64",
            "--repeat", "1", "--collector", url)
    monkeypatch.setenv("STEPLINE_OTLP_TOKEN", "not-the-token")
    assert matrix.run(parse_args(*argv)) == 2
    err = capsys.readouterr().err
    assert err == (f"stepline matrix: not stored: the collector at {url} refused the events: HTTP 401: a valid "
                   "'Authorization: Bearer <token>' header is required (the token is in the collector's runtime "
                   "file, or $STEPLINE_OTLP_TOKEN)\n")
    monkeypatch.delenv("STEPLINE_OTLP_TOKEN")
    assert matrix.run(parse_args(*argv)) == 2
    assert capsys.readouterr().err == ("stepline matrix: not stored: --collector needs the token the collector runs "
                                       "with in $STEPLINE_OTLP_TOKEN\n")
    time.sleep(0.5)  # five flush intervals: anything accepted would be in the store by now
    assert matrix_runs(collector) == []
    # The collector's OTLP token, given with --collector, is taken.
    monkeypatch.setenv("STEPLINE_OTLP_TOKEN", OTLP_TOKEN)
    assert matrix.run(parse_args(*argv)) == 0
    assert f"handed 3 matrix_run events to the collector at {url}" in capsys.readouterr().out
    wait_until(lambda: len(matrix_runs(collector)) == 3)
