"""The generated alert rules in a real Prometheus and Alertmanager on loopback, paging a webhook that keeps what
it is sent: for the end-to-end alert tests and the time-to-truth benchmark (Debian's `prometheus` and
`prometheus-alertmanager`; `.ci/run` installs them)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any, TypeVar, cast

from stepline.alerting import yamlout
from stepline.alerting.config import AlertConfig
from stepline.alerting.prometheus import alertmanager, rule_groups
from stepline.core.listener import HttpServer, url

PROMETHEUS = shutil.which("prometheus")
ALERTMANAGER = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Webhook:
    """Alertmanager's webhook receiver: keeps every alert it is sent, with when it arrived."""

    def __init__(self) -> None:
        self.alerts: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        webhook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                received = time.time()
                with webhook._lock:
                    webhook.alerts.extend({**a, "received": received} for a in body.get("alerts", []))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                return  # the test's output is for the test

        self.server = HttpServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = url("127.0.0.1", self.server.server_port)

    def find(self, name: str, engine: str, status: str) -> dict[str, Any] | None:
        with self._lock:
            return next((a for a in self.alerts if a["labels"].get("alertname") == name
                         and a["labels"].get("engine") == engine and a["status"] == status), None)

    def names(self, engine: str) -> set[str]:
        with self._lock:
            return {a["labels"]["alertname"] for a in self.alerts if a["labels"].get("engine") == engine}

    def snapshot(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.alerts)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def wait_for(predicate: Callable[[], T | None], timeout_s: float, what: str) -> T:
    """The first truthy value of `predicate`, polled twice a second; AssertionError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.5)
    raise AssertionError(f"no {what} within {timeout_s:.0f} s")


class AlertStack:
    """Prometheus scraping a collector's /metrics every `scrape_s` and evaluating the rules of `cfg` at their groups'
    intervals, Alertmanager routing to `webhook` with 1 s group waits (`generated_waits`: the generated config's own,
    as deployed); `stop()` ends both."""

    def __init__(self, cfg: AlertConfig, webhook: Webhook, metrics_port: int, workdir: Path, *,
                 scrape_s: float = 1.0, generated_waits: bool = False) -> None:
        if not (PROMETHEUS and ALERTMANAGER):
            raise RuntimeError("needs Debian's prometheus and prometheus-alertmanager on PATH")
        self.webhook = webhook
        am_port, prom_port = free_port(), free_port()
        (workdir / "rules.yaml").write_text(yamlout.dump(rule_groups(cfg)))
        am = alertmanager(cfg)
        route = cast(dict[str, Any], am["route"])
        for r in (route, *route["routes"]) if not generated_waits else ():
            r.update(group_wait="1s", group_interval="1s")
        (workdir / "alertmanager.yaml").write_text(yamlout.dump(am))
        interval = f"{scrape_s:g}s"
        (workdir / "prometheus.yaml").write_text(yamlout.dump({
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "rule_files": [str(workdir / "rules.yaml")],
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]},
            "scrape_configs": [{"job_name": "stepline", "static_configs": [
                {"targets": [f"127.0.0.1:{metrics_port}"]}]}],
        }))
        self.processes = [
            _start([ALERTMANAGER, f"--config.file={workdir / 'alertmanager.yaml'}",
                    f"--storage.path={workdir / 'am'}", f"--web.listen-address=127.0.0.1:{am_port}",
                    "--cluster.listen-address="], workdir / "alertmanager.log"),
            _start([PROMETHEUS, f"--config.file={workdir / 'prometheus.yaml'}",
                    f"--storage.tsdb.path={workdir / 'prom'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
                   workdir / "prometheus.log"),
        ]

    def stop(self) -> None:
        for p in self.processes:
            p.terminate()
        for p in self.processes:
            p.wait(20)


def _start(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)
