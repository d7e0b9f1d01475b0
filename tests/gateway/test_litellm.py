"""The real LiteLLM proxy (its own environment, tests/gateway/install.sh) with stepline's callback, in front of two
simulated engines as two lanes, routed by a size hook of the test's own: what the proxy did reaches the collector's
OTLP receiver as decision rows, with counts that match what the test sent."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stepline.model.rows import GatewayDecision
from stepline.sim.config import EngineConfig
from stepline.sim.vllm_server import SimServer, idle_workload, serve
from stepline.sources.otlp import OtlpReceiver
from tests.gateway.proxy import KEY, VENV, available, leave_mid_stream, litellm_proxy
from tests.gateway.proxy import complete as _complete
from tests.sources.test_otlp import drain, make_receiver, receiver  # noqa: F401

MODEL = "test/model"
THRESHOLD_CHARS = 4000


@pytest.fixture(scope="module")
def lanes() -> Iterator[dict[str, SimServer]]:
    servers = {lane: serve(idle_workload(600), EngineConfig(model=MODEL), port=0, speed=20.0)
               for lane in ("fast", "heavy")}
    yield servers
    for server in servers.values():
        server.stop()


@pytest.fixture
def proxy(tmp_path: Path, lanes: dict[str, SimServer], receiver: OtlpReceiver) -> Iterator[str]:  # noqa: F811
    if not available():
        pytest.fail(f"no LiteLLM proxy at {VENV}: run tests/gateway/install.sh (CI does)")
    with litellm_proxy(tmp_path, {lane: f"{server.url}/v1" for lane, server in lanes.items()}, MODEL,
                       f"{receiver.url}/v1/traces", THRESHOLD_CHARS) as url:
        yield url


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
    leave_mid_stream(proxy, "tell me a long story", 400)
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
