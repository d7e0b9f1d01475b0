"""Security: listeners on loopback, secrets that never show, bounded request bodies, a store URL's password hidden.

A running collector with every secret set (from the environment, and from *_FILE) is probed over real HTTP; its
logs (at DEBUG), replies, /metrics, events and announcement file must hold none of them. The query endpoint's
read-only guarantees are in tests/clickhouse_http/test_guard.py, with the CLI's bound parameters.
"""

from __future__ import annotations

import base64
import gzip
import http.client
import logging
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import clickhouse_connect
import psutil  # type: ignore[import-untyped]
import pytest

from stepline.app.collector import Collector
from stepline.config.settings import Settings
from stepline.plugin import wire
from stepline.sources.otlp import OtlpReceiver
from stepline.store.discovery import BESIDE_STORE_FILE
from stepline.store.url import parse_store_url
from stepline.testing.sink import wait_until
from tests.sources.test_otlp import VLLM_ATTRIBUTES, export, good_span, request_of

TAG = uuid.uuid4().hex[:10]
SECRETS = {"STEPLINE_QUERY_PASSWORD": f"qpw-{TAG}", "STEPLINE_OTLP_TOKEN": f"otok-{TAG}",
           "STEPLINE_PLUGIN_TOKEN": f"ptok-{TAG}"}
GUESSES = (f"guess-pw-{TAG}", f"guess-token-{TAG}")  # wrong values clients sent: echoed nowhere either
STORE_PASSWORD = f"st0re-{TAG}"
EXPORT = request_of(good_span("sec-1")).SerializeToString()


class Capture(logging.Handler):
    """Every record, from every logger, at DEBUG and up."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def text(self) -> str:
        formatter = logging.Formatter()
        lines = []
        for record in self.records:
            lines.append(record.getMessage())
            if record.exc_info:
                lines.append(formatter.formatException(record.exc_info))
        return "\n".join(lines)


@dataclass
class Running:
    collector: Collector
    settings: Settings
    logs: Capture
    seen: list[str]  # every reply body and header the tests received

    @property
    def otlp(self) -> OtlpReceiver:
        return next(s for s in self.collector.sources if isinstance(s, OtlpReceiver))

    def query_port(self) -> int:
        assert self.collector.query_endpoint is not None
        return self.collector.query_endpoint.port

    def request(self, port: int, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
                *, raw: bytes | None = None) -> tuple[int, bytes]:
        """One HTTP exchange (or raw bytes); what came back is kept for the secrets check."""
        with socket.create_connection(("127.0.0.1", port), timeout=15) as sock:
            if raw is None:
                head = f"{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Length: {len(body)}\r\n"
                raw = (head + "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items()) + "\r\n").encode() + body
            sock.sendall(raw)
            response = http.client.HTTPResponse(sock, method=method)
            response.begin()
            reply = response.read()
        self.seen.append(f"{response.status} {response.getheaders()} {reply!r}")
        return response.status, reply


@pytest.fixture(scope="module", params=["env", "file"])
def running(request: pytest.FixtureRequest, chdb_dir: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Running]:
    """A collector with default settings but its ports (0) and paths, every secret set via env or *_FILE."""
    tmp = tmp_path_factory.mktemp(f"secrets-{request.param}")
    environ = dict(SECRETS)
    if request.param == "file":
        environ = {}
        for var, secret in SECRETS.items():
            (tmp / var).write_text(secret + "\n")
            environ[f"{var}_FILE"] = str(tmp / var)
    sockets = tempfile.mkdtemp(prefix="stepline-")
    logs, root = Capture(), logging.getLogger()
    level = root.level
    root.addHandler(logs)
    root.setLevel(logging.DEBUG)
    database = f"sec_{uuid.uuid4().hex[:10]}"
    settings = Settings.from_env(environ, store=f"chdb://{chdb_dir}?database={database}", metrics_port=0,
                                 query_port=0, otlp_port=0, plugin_socket=os.path.join(sockets, "p.sock"),
                                 spool_dir=str(tmp / "spool"), flush_interval_s=0.1)
    collector = Collector(settings)
    collector.start()
    try:
        yield Running(collector, settings, logs, [])
    finally:
        collector.stop()
        root.removeHandler(logs)
        root.setLevel(level)
        shutil.rmtree(sockets, ignore_errors=True)
        client = clickhouse_connect.get_client(dsn=f"chdb://{chdb_dir}")
        client.command(f"DROP DATABASE IF EXISTS `{database}`")
        client.close()


def test_every_listener_binds_loopback_by_default(running: Running) -> None:
    assert Settings().listen == "127.0.0.1"
    c = running.collector
    assert c.metrics_server is not None and c.query_endpoint is not None
    ports = {c.metrics_server.port, c.query_endpoint.port, running.otlp.port}
    bound = {conn.laddr for conn in psutil.Process().net_connections(kind="inet")
             if conn.status == psutil.CONN_LISTEN and conn.laddr.port in ports}
    assert {address.port for address in bound} == ports  # all three found, each on loopback only
    assert {address.ip for address in bound} == {"127.0.0.1"}
    mode = os.stat(running.settings.plugin_socket).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o660


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def test_request_bodies_are_bounded_over_http(running: Running) -> None:
    auth = {"Authorization": _basic("default", SECRETS["STEPLINE_QUERY_PASSWORD"])}
    query, limit = running.query_port(), 1 << 20  # the endpoint's default bound
    head = (f"POST / HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n"
            f"Authorization: {auth['Authorization']}\r\n\r\n")
    chunked = head.encode() + b"".join(b"10000\r\n" + b" " * 0x10000 + b"\r\n" for _ in range(20)) + b"0\r\n\r\n"
    assert running.request(query, "POST", "/", raw=chunked)[0] == 413  # no Content-Length, 1.25 MiB in chunks
    assert running.request(query, "POST", "/", b"SELECT 1 --" + b" " * limit, auth)[0] == 413
    bomb = gzip.compress(b"SELECT 1 --" + b" " * (8 * limit))
    status, body = running.request(query, "POST", "/", bomb, {**auth, "Content-Encoding": "gzip"})
    assert status == 413 and b"QUERY_IS_TOO_LARGE" in body
    chunked_bomb = (b"POST / HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\nContent-Encoding: gzip\r\n"
                    + f"Authorization: {auth['Authorization']}".encode() + b"\r\n\r\n"
                    + b"%x\r\n%s\r\n0\r\n\r\n" % (len(bomb), bomb))
    assert running.request(query, "POST", "/", raw=chunked_bomb)[0] == 413
    assert running.request(query, "POST", "/", b"SELECT 1", auth) == (200, b"1\n")
    # The OTLP receiver: Content-Length required (chunked bodies refused), 8 MiB after inflation.
    otlp = running.otlp
    token = {"Authorization": f"Bearer {SECRETS['STEPLINE_OTLP_TOKEN']}", "Content-Type": "application/x-protobuf"}
    before = otlp.stats()
    chunked_export = (b"POST /v1/traces HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n"
                      + "".join(f"{k}: {v}\r\n" for k, v in token.items()).encode() + b"\r\n"
                      + b"%x\r\n%s\r\n0\r\n\r\n" % (len(EXPORT), EXPORT))
    assert running.request(otlp.port, "POST", "/v1/traces", raw=chunked_export)[0] == 411
    export_bomb = gzip.compress(EXPORT + b"\0" * (9 << 20))
    gzipped = {**token, "Content-Encoding": "gzip"}
    assert running.request(otlp.port, "POST", "/v1/traces", export_bomb, gzipped)[0] == 413
    after = otlp.stats()
    assert (after["requests_unsupported"] - before["requests_unsupported"],
            after["requests_too_large"] - before["requests_too_large"]) == (1, 1)
    assert after["spans_accepted"] == before["spans_accepted"]


def test_secrets_are_never_logged_echoed_or_shown(running: Running) -> None:
    query, otlp = running.query_port(), running.otlp
    wrong, guess = GUESSES
    # Wrong and missing credentials, every way a client can send them; then the right ones.
    for headers, path in (({}, "/?query=SELECT%201"), ({"Authorization": _basic("default", wrong)}, "/"),
                          ({"X-ClickHouse-Key": wrong}, "/"), ({}, f"/?password={wrong}&query=SELECT%201"),
                          ({"Authorization": "Basic " + wrong}, "/")):
        assert running.request(query, "POST", path, b"SELECT 1", headers)[0] in (401, 403)
    password = SECRETS["STEPLINE_QUERY_PASSWORD"]
    assert running.request(query, "POST", "/", b"SELECT 1", {"X-ClickHouse-Key": password}) == (200, b"1\n")
    for authorization in ("", f"Bearer {guess}", f"Basic {SECRETS['STEPLINE_OTLP_TOKEN']}", f"Bearer{guess}"):
        headers = {"Content-Type": "application/x-protobuf", **({"Authorization": authorization} if authorization
                                                                  else {})}
        assert running.request(otlp.port, "POST", "/v1/traces", EXPORT, headers)[0] == 401
    accepted = otlp.stats()["requests_accepted"]
    export(otlp.url, [("llm_request", VLLM_ATTRIBUTES)],  # the SDK's own exporter, as vLLM sends
           headers={"Authorization": f"Bearer {SECRETS['STEPLINE_OTLP_TOKEN']}"})
    assert otlp.stats()["requests_accepted"] == accepted + 1
    # Plugin datagrams: without a credential, with another token's, with the right one.
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sender.connect(running.settings.plugin_socket)
    for credential in (b"", wire.credential_for(guess), wire.credential_for(SECRETS["STEPLINE_PLUGIN_TOKEN"])):
        sender.send(wire.encode_header(b"sec-engine", 1, 2, 0, 0, credential) + wire.encode_config({"model": "m"}))
    sender.close()
    wait_until(lambda: any(s.get("unauthorized", 0) >= 2 for s in _plugin_stats(running)))
    c = running.collector
    assert c.metrics_server is not None and c.store is not None
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{c.metrics_server.port}/metrics", timeout=10).read().decode()
    info = (Path(parse_store_url(running.settings.store).path) / BESIDE_STORE_FILE).read_text()
    wait_until(lambda: c.wait_for_rows("events", 2, 0.1) >= 2)
    events = str(c.store.query("SELECT kind, message, attributes FROM events").result_rows)
    shown = "\n".join([running.logs.text(), *running.seen, repr(running.settings), str(running.settings), metrics,
                       info, events])
    for refusal in ("Authentication failed", "Bearer <token>' header is required", "rejected a plugin datagram"):
        assert refusal in shown  # each refusal itself was logged
    for secret in (*SECRETS.values(), *GUESSES):
        assert secret not in shown


def _plugin_stats(running: Running) -> list[dict[str, int]]:
    return [s.stats() for s in running.collector.sources if s.name == "plugin" and hasattr(s, "stats")]


def test_a_store_urls_password_is_never_shown() -> None:
    url = parse_store_url(f"http://reader:{STORE_PASSWORD}@clickhouse.internal:8443/timeline")
    assert url.password == STORE_PASSWORD
    for text in (url.redacted(), repr(url), str(url)):
        assert STORE_PASSWORD not in text
    for bad in (f"http://reader:{STORE_PASSWORD}@h:99999/db", f"http://reader:{STORE_PASSWORD}@h:1/bad-name",
                f"reader:{STORE_PASSWORD}@h:8123", f"ftp://reader:{STORE_PASSWORD}@h/db",
                f"http://reader:{STORE_PASSWORD}@/db"):
        with pytest.raises(ValueError) as error:
            parse_store_url(bad)
        assert STORE_PASSWORD not in str(error.value) and "reader:***@" in str(error.value)


def test_settings_repr_hides_the_store_password() -> None:
    settings = Settings.from_env({}, store=f"http://reader:{STORE_PASSWORD}@h:8123/db")
    assert STORE_PASSWORD not in repr(settings)


def _stepline(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("STEPLINE_")}
    return subprocess.run([sys.executable, "-m", "stepline", *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd, env={**clean, **env})


def test_the_cli_never_prints_a_secret(tmp_path: Path) -> None:
    secret_file = tmp_path / "otlp-token"
    secret_file.write_text(SECRETS["STEPLINE_OTLP_TOKEN"])
    env = {**{k: v for k, v in SECRETS.items() if k != "STEPLINE_OTLP_TOKEN"},
           "STEPLINE_OTLP_TOKEN_FILE": str(secret_file)}
    store = f"http://reader:{STORE_PASSWORD}@127.0.0.1:9/timeline"
    runs = {
        "help": _stepline("--help", env=env, cwd=tmp_path),
        "collect-help": _stepline("collect", "--help", env=env, cwd=tmp_path),
        "query-help": _stepline("query", "--help", env=env, cwd=tmp_path),
        "bad-setting": _stepline("-v", "collect", "--metrics-port", "99999", env=env, cwd=tmp_path),
        "status": _stepline("-v", "status", "--store", store, env=env, cwd=tmp_path),
        "bad-store": _stepline("query", "SELECT 1", "--store", store.replace(":9/", ":99999/"), env=env, cwd=tmp_path),
        "missing-file": _stepline("collect", env={"STEPLINE_QUERY_PASSWORD_FILE": str(tmp_path / "absent")},
                                  cwd=tmp_path),
    }
    assert runs["bad-setting"].returncode == 2 and "metrics-port 99999" in runs["bad-setting"].stderr
    assert runs["missing-file"].returncode == 2 and "absent" in runs["missing-file"].stderr
    assert runs["bad-store"].returncode == 2 and "reader:***@" in runs["bad-store"].stderr
    assert runs["status"].returncode == 2 and "reader@127.0.0.1:9" in runs["status"].stderr
    outputs = {name: run.stdout + run.stderr for name, run in runs.items()}
    outputs["store-down"] = _collect_until_spooling(store, env, tmp_path)
    assert "reader@127.0.0.1:9/timeline" in outputs["store-down"]
    for name, output in outputs.items():
        for secret in (*SECRETS.values(), STORE_PASSWORD):
            assert secret not in output, name


def _collect_until_spooling(store: str, env: dict[str, str], cwd: Path) -> str:
    """`stepline -v collect` against a store that is down: it says so (and spools) until SIGTERM; its output."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("STEPLINE_")}
    args = ["-v", "collect", "--store", store, "--metrics-port", "0", "--query-port", "0", "--otlp-port", "0",
            "--plugin-socket", tempfile.mktemp(prefix="stepline-", suffix=".sock"), "--spool-dir", str(cwd / "spool")]
    process = subprocess.Popen([sys.executable, "-m", "stepline", *args], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, cwd=cwd, env={**clean, **env})
    assert process.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline and (line := process.stdout.readline()):
            lines.append(line)
            if "collecting into the spool" in line:
                break
    finally:
        process.terminate()
        rest, _ = process.communicate(timeout=60)
    return "".join(lines) + rest
