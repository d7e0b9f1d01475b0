"""End to end on loopback: the generated receivers in a real Alertmanager deliver a page to a Slack-compatible
incoming webhook and to a PagerDuty-compatible events endpoint, and a ticket to a generic webhook, each reading its
secret from a file, and what arrives names the cause (the alert's summary and description)."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any, cast

import pytest

from stepline.alerting import yamlout
from stepline.alerting.config import AlertConfig
from stepline.alerting.definitions import Alert, alerts
from stepline.alerting.prometheus import alertmanager
from stepline.alerting.receivers import Receiver
from stepline.core.listener import HttpServer, url
from stepline.testing.alertstack import ALERTMANAGER, free_port, wait_for

pytestmark = pytest.mark.skipif(not ALERTMANAGER,
                                reason="needs Debian's prometheus-alertmanager (.ci/run installs it)")

SLACK_PATH = "/services/T000/B000/stepline"
VALUES = {"engine": "e1", "state": "stalled", "age": "3m 0s", "budget": "2m 0s", "value_duration": "3m 0s",
          "waiting": "4", "running": "2", "finding": "critical engine_wedged: 4 requests waiting with GPUs idle"}


class Receivers:
    """A Slack incoming webhook, a PagerDuty events endpoint and a ticketing webhook on one loopback port: keeps
    every request (path, headers, JSON body) and answers as each service does."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, str], dict[str, Any]]] = []
        self._lock = threading.Lock()
        kept = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with kept._lock:
                    kept.requests.append((self.path, dict(self.headers), body))
                # Slack answers 200 "ok"; PagerDuty's Events API v2 202 with a JSON status.
                reply = b"ok" if self.path == SLACK_PATH else b'{"status": "success"}'
                self.send_response(202 if self.path == "/v2/enqueue" else 200)
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: object) -> None:
                return  # the test's output is for the test

        self.server = HttpServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = url("127.0.0.1", self.server.server_port)

    def at(self, path: str) -> list[tuple[dict[str, str], dict[str, Any]]]:
        with self._lock:
            return [(headers, body) for p, headers, body in self.requests if p == path]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _alert(name: str, severity: str) -> Alert:
    return next(a for a in alerts(AlertConfig()) if a.name == name and a.severity == severity)


def _fill(text: str) -> str:
    """The annotation as Prometheus would render it for engine e1."""
    return re.sub(r"\[([a-z_]+)\]", lambda m: VALUES.get(m.group(1), "?"), text)


def _posted(a: Alert, ends_at: datetime | None = None) -> dict[str, object]:
    out: dict[str, object] = {
        "labels": {"alertname": a.name, "severity": a.severity, "engine": "e1", "job": "stepline"},
        "annotations": {"summary": _fill(a.summary), "description": _fill(a.description),
                        "runbook_url": AlertConfig().runbook(a.name)},
        "startsAt": (datetime.now(UTC) - timedelta(minutes=3)).isoformat(),
    }
    if ends_at is not None:
        out["endsAt"] = ends_at.isoformat()
    return out


def _post(base: str, *posted: dict[str, object]) -> None:
    request = urllib.request.Request(f"{base}/api/v2/alerts", data=json.dumps(list(posted)).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=5) as response:
        assert response.status == 200


@pytest.fixture
def receivers() -> Iterator[Receivers]:
    r = Receivers()
    yield r
    r.close()


def _start_alertmanager(cfg: AlertConfig, workdir: Path) -> tuple[str, subprocess.Popen[bytes]]:
    """Alertmanager on a free loopback port with the generated config, 1 s group waits; (its URL, the process)."""
    am: Any = alertmanager(cfg)
    route = cast(dict[str, Any], am["route"])
    for r in (route, *route["routes"]):
        r.update(group_wait="1s", group_interval="1s")
    config = workdir / "alertmanager.yaml"
    config.write_text(yamlout.dump(am))
    port = free_port()
    log = workdir / "alertmanager.log"
    proc = subprocess.Popen([str(ALERTMANAGER), f"--config.file={config}", f"--storage.path={workdir / 'am'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
                            stdout=log.open("wb"), stderr=subprocess.STDOUT)
    base = url("127.0.0.1", port)

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"Alertmanager exited:\n{log.read_text()}")
        try:
            with urllib.request.urlopen(f"{base}/-/ready", timeout=1) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    wait_for(ready, 20, "Alertmanager ready")
    return base, proc


def test_a_page_reaches_slack_and_pagerduty_and_a_ticket_the_webhook_naming_the_cause(
        receivers: Receivers, tmp_path: Path) -> None:
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    # Written as an operator's `echo` would: a final newline Alertmanager trims.
    (secrets / "slack_api_url").write_text(f"{receivers.url}{SLACK_PATH}\n")
    (secrets / "pagerduty_routing_key").write_text("R0UTINGKEY0123456789\n")
    (secrets / "tickets_token").write_text("t0ken\n")
    cfg = AlertConfig(receivers=(
        Receiver.of("critical", "slack", api_url_file=str(secrets / "slack_api_url"), channel="#vllm-oncall"),
        Receiver.of("critical", "pagerduty", routing_key_file=str(secrets / "pagerduty_routing_key"),
                    url=f"{receivers.url}/v2/enqueue"),
        Receiver.of("warning", "webhook", url=f"{receivers.url}/tickets",
                    bearer_token_file=str(secrets / "tickets_token")),
    ))
    base, proc = _start_alertmanager(cfg, tmp_path)
    try:
        stalled, starved = _alert("EngineStalled", "critical"), _alert("DecodeStarvation", "warning")
        _post(base, _posted(stalled), _posted(starved))

        # Slack: the title names the alert, its engine and the cause; the text the whole description and runbook.
        [(_, slack)] = wait_for(lambda: receivers.at(SLACK_PATH), 20, "the Slack message")
        assert slack["channel"] == "#vllm-oncall"
        [attachment] = slack["attachments"]
        assert attachment["title"] == f"[FIRING] EngineStalled on e1: {_fill(stalled.summary)}"
        assert _fill(stalled.description) in attachment["text"], attachment["text"]
        assert "state stalled" in attachment["text"] and "stepline diagnose --engine e1" in attachment["text"]
        assert "Runbook: " + AlertConfig().runbook("EngineStalled") in attachment["text"]

        # PagerDuty: the key from its file, trimmed; the incident's summary names the cause.
        [(_, page)] = wait_for(lambda: receivers.at("/v2/enqueue"), 20, "the PagerDuty event")
        assert page["routing_key"] == "R0UTINGKEY0123456789" and page["event_action"] == "trigger"
        assert page["payload"]["severity"] == "critical"
        assert _fill(stalled.summary) in page["payload"]["summary"], page["payload"]

        # The ticket: only the warning, with the bearer token read from its file.
        [(headers, ticket)] = wait_for(lambda: receivers.at("/tickets"), 20, "the ticket")
        assert headers["Authorization"] == "Bearer t0ken"
        [sent] = ticket["alerts"]
        assert sent["labels"]["alertname"] == "DecodeStarvation"
        assert sent["annotations"]["description"] == _fill(starved.description)
        time.sleep(2)  # past a group interval: nothing crosses routes
        assert len(receivers.at(SLACK_PATH)) == len(receivers.at("/v2/enqueue")) == 1
        assert all(b["alerts"][0]["labels"]["severity"] == "warning" for _, b in receivers.at("/tickets"))

        # The page resolves: Slack says so, PagerDuty resolves the incident.
        _post(base, _posted(stalled, ends_at=datetime.now(UTC)))
        resolved = wait_for(lambda: [b for _, b in receivers.at(SLACK_PATH)
                                     if b["attachments"][0]["title"].startswith("[RESOLVED]")], 20, "the resolution")
        assert resolved[0]["attachments"][0]["text"].startswith(f"Resolved: {_fill(stalled.summary)}")
        wait_for(lambda: [b for _, b in receivers.at("/v2/enqueue") if b["event_action"] == "resolve"], 20,
                 "PagerDuty's resolve")
    finally:
        proc.terminate()
        proc.wait(20)
