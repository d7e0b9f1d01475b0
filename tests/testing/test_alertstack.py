"""The alert stack the end-to-end alert tests run: a webhook that keeps what Alertmanager sends, the poll they wait
with, and Prometheus and Alertmanager started on loopback with the generated rules and a config their own tools
accept."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import urllib.request
from pathlib import Path

import pytest

from stepline.alerting.config import AlertConfig
from stepline.testing.alertstack import ALERTMANAGER, PROMETHEUS, AlertStack, Webhook, free_port, wait_for


def test_a_free_port_can_be_bound() -> None:
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
    assert 1024 <= port <= 65535


def test_the_webhook_keeps_each_alert_with_when_it_arrived() -> None:
    webhook = Webhook()
    try:
        alert = {"status": "firing", "labels": {"alertname": "EngineStalled", "engine": "vllm-0"}}
        body = json.dumps({"alerts": [alert, {**alert, "status": "resolved"}]}).encode()
        request = urllib.request.Request(webhook.url, body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as answer:
            assert answer.status == 200
        found = webhook.find("EngineStalled", "vllm-0", "resolved")
        assert found is not None and found["received"] > 0
        assert webhook.names("vllm-0") == {"EngineStalled"}
        assert webhook.find("EngineStalled", "vllm-1", "firing") is None
        assert len(webhook.snapshot()) == 2
    finally:
        webhook.close()


def test_wait_for_returns_the_first_truthy_value_or_names_what_never_came() -> None:
    answers = iter([None, 0, "page"])
    assert wait_for(lambda: next(answers), 5, "page") == "page"
    with pytest.raises(AssertionError, match="no page within 1 s"):
        wait_for(lambda: None, 1, "page")


@pytest.mark.skipif(not (PROMETHEUS and ALERTMANAGER), reason="needs prometheus and prometheus-alertmanager "
                    "(tests/setup.sh installs them)")
def test_the_stack_starts_on_configs_promtool_and_amtool_accept(tmp_path: Path) -> None:
    webhook = Webhook()
    stack = AlertStack(AlertConfig(), webhook, free_port(), tmp_path, scrape_s=2.0)
    try:
        for tool, args in (("promtool", ["check", "config", "prometheus.yaml"]),
                           ("amtool", ["check-config", "alertmanager.yaml"])):
            done = subprocess.run([str(shutil.which(tool)), *args], cwd=tmp_path, capture_output=True, text=True,
                                  timeout=60)
            assert done.returncode == 0, done.stdout + done.stderr
        assert 'scrape_interval: "2s"' in (tmp_path / "prometheus.yaml").read_text()
        assert all(p.poll() is None for p in stack.processes), (tmp_path / "prometheus.log").read_text()
    finally:
        stack.stop()
        webhook.close()
    assert all(p.returncode is not None for p in stack.processes)
