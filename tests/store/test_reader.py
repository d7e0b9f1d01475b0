"""What `stepline status` and `stepline query` print: a DOWN source with its reason, and cut values said to be cut."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from stepline.ingest.metrics import IngestMetrics
from stepline.ingest.runner import Runner
from stepline.ingest.writer import Writers
from stepline.sources.base import Emit, SourceError
from stepline.store.reader import SourceHealth, source_health
from stepline.store.store import Store
from stepline.store.url import StoreUrlError, parse_store_url, reading_store_url
from stepline.testing.sink import MemorySink


class Flaky:
    """Fails with whatever `error` says, or succeeds when it is empty."""

    name = "gpu"
    error = "no NVML: NVML Shared Library Not Found"

    def poll(self, emit: Emit) -> None:
        if self.error:
            raise SourceError(self.error)


def _errors(metrics: IngestMetrics) -> dict[str, str]:
    return {s.labels["source"]: s.labels["error"] for family in metrics.registry.collect()
            if family.name == "stepline_source_last_error_info" for s in family.samples if s.value}


def test_the_runner_exports_a_failing_sources_last_error_and_forgets_it_on_recovery() -> None:
    metrics = IngestMetrics(CollectorRegistry())
    runner = Runner([], Writers(MemorySink(), metrics), metrics, "h")
    source = Flaky()
    runner.poll_once(source)
    runner.poll_once(source)
    assert _errors(metrics) == {"gpu": "no NVML: NVML Shared Library Not Found"}
    source.error = "NVML:\n  driver/library version mismatch " + "x" * 300
    runner.poll_once(source)
    (error,) = _errors(metrics).values()  # one series per source: the old reason is gone
    assert error.startswith("NVML: driver/library version mismatch xx") and len(error) == 200 and error[-1] == "…"
    source.error = ""
    runner.poll_once(source)
    assert _errors(metrics) == {}
    assert "stepline_source_last_error_info{" not in generate_latest(metrics.registry).decode()


@pytest.fixture
def served_metrics() -> Iterator[tuple[IngestMetrics, str]]:
    metrics = IngestMetrics(CollectorRegistry())

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = generate_latest(metrics.registry)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            """Quiet."""

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield metrics, f"http://127.0.0.1:{server.server_address[1]}/metrics"
    server.shutdown()
    server.server_close()


def test_source_health_reads_the_reason_beside_down(served_metrics: tuple[IngestMetrics, str]) -> None:
    metrics, url = served_metrics
    runner = Runner([], Writers(MemorySink(), metrics), metrics, "h")
    runner.poll_once(Flaky())
    metrics.sources.source_up.labels("host").set(1)
    assert source_health(url) == {"gpu": SourceHealth(False, "no NVML: NVML Shared Library Not Found"),
                                  "host": SourceHealth(True, "")}


def test_a_server_url_without_a_password_takes_the_store_password_as_the_collector_does(tmp_path: Path) -> None:
    secret = tmp_path / "clickhouse_password"
    secret.write_text("s3cret:/@\n")
    env = {"STEPLINE_STORE_PASSWORD_FILE": str(secret)}
    merged = parse_store_url(reading_store_url("http://clickhouse:8123/stepline", env))
    assert (merged.username, merged.password, merged.host) == ("default", "s3cret:/@", "clickhouse")
    # What the command line names itself stays as it is: an embedded store, a URL given with its password.
    assert reading_store_url("chdb:///var/lib/stepline", env) == "chdb:///var/lib/stepline"
    assert reading_store_url("http://u:given@clickhouse:8123/db", env) == "http://u:given@clickhouse:8123/db"
    assert reading_store_url("http://clickhouse:8123/db", {}) == "http://clickhouse:8123/db"
    with pytest.raises(StoreUrlError, match="STEPLINE_STORE_PASSWORD_FILE='/nonexistent/pw': No such file"):
        reading_store_url("http://clickhouse:8123/db", {"STEPLINE_STORE_PASSWORD_FILE": "/nonexistent/pw"})


def test_a_cli_command_reads_a_password_protected_server_with_the_collectors_secret_file(
        store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # Compose's sidecar: $STEPLINE_STORE names the server without a password, the secret file holds it
    # (deploy/docker-compose.yml); `docker compose exec stepline stepline ...` runs with that environment.
    from stepline.cli.main import main
    from stepline.endpoints.query import QueryEndpoint

    endpoint = QueryEndpoint(store.reader(), port=0, password="s3cret", database=store.database)
    endpoint.start()
    try:
        monkeypatch.setenv("STEPLINE_STORE", f"{endpoint.url.rstrip('/')}/{store.database}")
        assert main(["query", "SELECT 41 + 1"]) == 2  # no password: the server refuses
        assert "Authentication failed" in capsys.readouterr().err
        (tmp_path / "clickhouse_password").write_text("s3cret\n")
        monkeypatch.setenv("STEPLINE_STORE_PASSWORD_FILE", str(tmp_path / "clickhouse_password"))
        assert main(["query", "SELECT 41 + 1", "--format", "csv"]) == 0
        assert capsys.readouterr().out.splitlines()[-1] == "42"
        monkeypatch.setenv("STEPLINE_STORE_PASSWORD_FILE", str(tmp_path / "absent"))
        assert main(["query", "SELECT 1"]) == 2
        assert capsys.readouterr().err.startswith("stepline: cannot read the store password: "
                                                  "STEPLINE_STORE_PASSWORD_FILE=")
    finally:
        endpoint.stop()
