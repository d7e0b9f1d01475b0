"""The real LiteLLM proxy (its own environment, tests/gateway/install.sh) with stepline's callback, in front of two
simulated engines as two lanes, routed by a size hook of the test's own: what the proxy did reaches the collector's
OTLP receiver as decision rows, with counts that match what the test sent."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stepline.model.rows import GatewayDecision
from stepline.sim.config import EngineConfig
from stepline.sim.vllm_server import SimServer, idle_workload, serve
from stepline.sources.otlp import OtlpReceiver
from stepline.testing.alertstack import free_port
from tests.sources.test_otlp import drain, make_receiver, receiver  # noqa: F401

VENV = Path(os.environ.get("STEPLINE_GATEWAY_VENV", Path.home() / ".cache" / "stepline" / "gateway"))
MODEL = "test/model"
KEY = "sk-stepline-test"
CALLBACK = "stepline.gateway.litellm"  # the module the proxy imports (in its own environment, not this one)
THRESHOLD_CHARS = 4000
# The size hook, written into the proxy's config directory (LiteLLM loads `module.instance` from there).
SIZE_LANES = '''\
"""The test's own size-routing hook, the seed's kind: characters against a bar set from a token estimate.

Loaded by the LiteLLM proxy from its config directory (`callbacks: ["size_lanes.hook"]`). It measures the prompt in
characters, sends it to the heavy lane at THRESHOLD_CHARS or more, and says what it measured and against what in the
request's metadata, where stepline's callback reads it. A prompt holding RAISE makes the measurement fail: the hook
goes on to the fast lane, as the seed's `except: return data` did, but reports what it swallowed.
"""

from __future__ import annotations

import os
from typing import Any

from litellm.integrations.custom_logger import CustomLogger

THRESHOLD_CHARS = int(os.environ.get("SIZE_LANES_THRESHOLD_CHARS", "4000"))
RAISE = "<make-the-hook-raise>"


def _measure(messages: Any) -> int:
    text = "".join(m["content"] for m in messages) if isinstance(messages, list) else str(messages)
    if RAISE in text:
        raise KeyError("content")
    return len(text)


class SizeLanes(CustomLogger):
    async def async_pre_call_hook(self, user_api_key_dict: Any, cache: Any, data: dict, call_type: Any) -> dict:
        metadata = data.setdefault("metadata", {})
        prompt = data.get("prompt") if data.get("messages") is None else data.get("messages")
        try:
            chars = _measure(prompt)
        except Exception as exc:  # fails open to the fast lane, and says so
            data["model"] = "fast"
            metadata["stepline_swallowed"] = f"{type(exc).__name__}: {exc}"
            return data
        data["model"] = "heavy" if chars >= THRESHOLD_CHARS else "fast"
        metadata.update({"stepline_size_chars": chars, "stepline_threshold": THRESHOLD_CHARS,
                         "stepline_threshold_unit": "chars"})
        return data


hook = SizeLanes()
'''


@pytest.fixture(scope="module")
def lanes() -> Iterator[dict[str, SimServer]]:
    servers = {lane: serve(idle_workload(600), EngineConfig(model=MODEL), port=0, speed=20.0)
               for lane in ("fast", "heavy")}
    yield servers
    for server in servers.values():
        server.stop()


@pytest.fixture
def proxy(tmp_path: Path, lanes: dict[str, SimServer], receiver: OtlpReceiver) -> Iterator[str]:  # noqa: F811
    if not (VENV / "bin" / "litellm").exists():
        pytest.fail(f"no LiteLLM proxy at {VENV}: run tests/gateway/install.sh (CI does)")
    (tmp_path / "size_lanes.py").write_text(SIZE_LANES)
    models = [{"model_name": lane, "litellm_params": {"model": f"hosted_vllm/{MODEL}", "api_base": f"{server.url}/v1",
                                                       "api_key": "none"}} for lane, server in lanes.items()]
    config = {"model_list": models, "litellm_settings": {
        "callbacks": ["size_lanes.hook", f"{CALLBACK}.proxy_handler", "prometheus"]}}
    (tmp_path / "config.yaml").write_text(json.dumps(config))  # JSON is YAML
    port = free_port()
    env = {**os.environ, "LITELLM_MASTER_KEY": KEY, "LITELLM_LOCAL_MODEL_COST_MAP": "true",
           "STEPLINE_OTLP_URL": f"{receiver.url}/v1/traces", "STEPLINE_GATEWAY_NAME": "lanes",
           "SIZE_LANES_THRESHOLD_CHARS": str(THRESHOLD_CHARS), "PYTHONPATH": str(tmp_path)}
    log = (tmp_path / "proxy.log").open("w")
    process = subprocess.Popen([str(VENV / "bin" / "litellm"), "--config", str(tmp_path / "config.yaml"),
                                "--host", "127.0.0.1", "--port", str(port)], env=env, stdout=log,
                               stderr=subprocess.STDOUT, cwd=tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health/liveliness", timeout=2):
                    break
            except OSError as exc:
                if process.poll() is not None or time.monotonic() > deadline:
                    started = (tmp_path / "proxy.log").read_text()[-3000:]
                    raise AssertionError(f"the LiteLLM proxy did not start: {started}") from exc
                time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


def _complete(url: str, prompt: str, **extra: Any) -> dict[str, Any]:
    body = json.dumps({"model": "fast", "prompt": prompt, "max_tokens": 4, **extra}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Authorization": f"Bearer {KEY}",
                                                                     "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return dict(json.loads(response.read()))


def _decisions(receiver: OtlpReceiver, n: int) -> list[GatewayDecision]:  # noqa: F811
    got: list[GatewayDecision] = []
    deadline = time.monotonic() + 30
    while len(got) < n and time.monotonic() < deadline:
        got.extend(r for r in drain(receiver) if isinstance(r, GatewayDecision))
        time.sleep(0.2)
    return got


def test_every_attempt_is_a_decision_with_its_size_lane_and_threshold(proxy: str, receiver: OtlpReceiver,  # noqa: F811
                                                                      lanes: dict[str, SimServer]) -> None:
    prose = "the quick brown fox jumps over the lazy dog " * 20  # 880 chars
    dense = json.dumps([{"id": i, "k": [i, i + 1]} for i in range(140)])  # 3,872 chars: just under the bar
    monster = "x" * (THRESHOLD_CHARS + 100)
    sent = [prose, prose, dense, monster, "<make-the-hook-raise> " + prose]
    for prompt in sent:
        _complete(proxy, prompt)
    decisions = _decisions(receiver, len(sent))
    assert len(decisions) == len(sent), decisions
    by_chars = {d.size_chars: d for d in decisions}
    assert {d.gateway for d in decisions} == {"lanes"}
    assert by_chars[len(monster)].lane == "heavy" and by_chars[len(monster)].engine == lanes["heavy"].url.split("//")[1]
    assert by_chars[len(dense)].lane == "fast" and len(dense) < THRESHOLD_CHARS
    assert all(d.status == 200 and d.threshold_unit in ("chars", "") for d in decisions)
    [raised] = [d for d in decisions if d.swallowed_exception]
    assert raised.swallowed_exception == "KeyError: 'content'" and raised.lane == "fast" and raised.threshold is None
    measured = [d for d in decisions if not d.swallowed_exception]
    assert all(d.threshold == THRESHOLD_CHARS and d.threshold_unit == "chars" for d in measured)
    assert all(d.request_id and d.first_byte_ts is not None and d.end_ts >= d.ts for d in decisions)


def test_a_client_that_leaves_mid_stream_is_a_disconnected_decision(proxy: str, receiver: OtlpReceiver  # noqa: F811
                                                                    ) -> None:
    body = json.dumps({"model": "fast", "prompt": "tell me a long story", "max_tokens": 400, "stream": True})
    with socket.create_connection(("127.0.0.1", int(proxy.rsplit(":", 1)[1])), timeout=30) as conn:
        conn.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode())
        seen = b""
        while b"data:" not in seen:  # until the first chunk came; then the client goes
            chunk = conn.recv(65536)
            assert chunk, seen
            seen += chunk
    _complete(proxy, "after the disconnect")  # a normal request after it
    decisions = _decisions(receiver, 2)
    assert len(decisions) == 2, decisions
    [gone] = [d for d in decisions if d.client_disconnected]
    assert gone.status == 499 and gone.lane == "fast"


def test_the_proxys_metrics_are_scraped_per_deployment(proxy: str, lanes: dict[str, SimServer]) -> None:
    from stepline.core.clock import ManualClock
    from stepline.model.rows import GatewaySample, Row
    from stepline.sources.base import SourceContext
    from stepline.sources.gateway_metrics import GatewayMetricsSource

    for i in range(3):
        _complete(proxy, f"short {i}")
    _complete(proxy, "x" * (THRESHOLD_CHARS + 10))
    source = GatewayMetricsSource(f"{proxy}/metrics/", SourceContext("h1", ManualClock(1.8e9)), gateway="lanes",
                                  token=KEY)
    rows: list[Row] = []
    source.poll(rows.extend)
    samples = [r for r in rows if isinstance(r, GatewaySample)]
    per_backend = {s.engine for s in samples if s.metric.startswith("litellm_deployment_")}
    assert {server.url.removeprefix("http://") for server in lanes.values()} <= per_backend, per_backend
