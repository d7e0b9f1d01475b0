"""The real LiteLLM proxy (its own environment, tests/gateway/install.sh) with stepline's callback, in front of two
simulated engines as two lanes, routed by a size hook of the test's own: what the proxy did reaches the collector's
OTLP receiver as decision rows, with counts that match what the test sent."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from stepline.model.rows import GatewayDecision
from stepline.sim.config import EngineConfig
from stepline.sim.vllm_server import SimServer, idle_workload, serve
from stepline.sources.otlp import OtlpReceiver
from stepline.testing.alertstack import free_port
from tests.gateway.proxy import KEY, REFUSE, VENV, available, install, leave_mid_stream, litellm_proxy, send
from tests.gateway.proxy import complete as _complete
from tests.sources.test_otlp import drain, make_receiver, receiver  # noqa: F401

MODEL = "test/model"
TEAM_AUTH = Path(__file__).with_name("team_auth.py")
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
    _installed()
    with litellm_proxy(tmp_path, {lane: f"{server.url}/v1" for lane, server in lanes.items()}, MODEL,
                       f"{receiver.url}/v1/traces", THRESHOLD_CHARS) as url:
        yield url


def _installed() -> None:
    """The proxy's environment, with this checkout's callback in it (reinstalled once per process)."""
    if not available():
        pytest.fail(f"no LiteLLM proxy at {VENV}: run tests/gateway/install.sh (CI does)")
    install()


@pytest.fixture
def failing_proxy(tmp_path: Path, lanes: dict[str, SimServer], receiver: OtlpReceiver  # noqa: F811
                  ) -> Iterator[tuple[str, dict[str, str]]]:
    """The proxy with the fast lane's deployment down (a closed local port) and `fallbacks` from it to the heavy
    lane; a third group, `gone`, is down too. No retries unless a request asks (`num_retries`), no cooldown (a dead
    group stays in the chain, so every request walks the same one). Its URL and each group's backend (host:port)."""
    _installed()
    backends = {"fast": f"http://127.0.0.1:{free_port()}/v1", "heavy": f"{lanes['heavy'].url}/v1",
                "gone": f"http://127.0.0.1:{free_port()}/v1"}
    settings = {"fallbacks": [{"fast": ["heavy"]}], "num_retries": 0, "disable_cooldowns": True}
    with litellm_proxy(tmp_path, backends, MODEL, f"{receiver.url}/v1/traces", THRESHOLD_CHARS,
                       router_settings=settings) as url:
        yield url, {lane: b.removeprefix("http://").removesuffix("/v1") for lane, b in backends.items()}


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


def test_a_request_the_hook_refuses_is_a_decision_of_its_size_on_its_lane(proxy: str, receiver: OtlpReceiver  # noqa: F811
                                                                          ) -> None:
    """Refused before any deployment is called (the hook's 429, as a lane whose slots are all held refuses): the
    decision has the size the request had, the lane the hook chose (metadata `stepline_lane`), the refusal's status
    and reason, and no backend."""
    prompt = f"{REFUSE} " + "the quick brown fox jumps over the lazy dog " * 200  # 8,823 chars: heavy
    status, call_id = send(proxy, prompt)
    assert status == 429
    [refused] = _decisions(receiver, 1)
    assert (refused.request_id, refused.size_chars, refused.lane, refused.status, refused.engine) == (
        call_id, len(prompt), "heavy", 429, "")
    assert refused.threshold == THRESHOLD_CHARS and refused.error_type == "HTTPException"


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


def test_fallbacks_and_retries_are_numbered_attempts_of_one_request(failing_proxy: tuple[str, dict[str, str]],
                                                                    receiver: OtlpReceiver) -> None:  # noqa: F811
    url, engine = failing_proxy
    # Each kind of request, and the chain of (lane, status) the router walks for it.
    kinds: dict[str, tuple[dict[str, Any], list[tuple[str, int]], int]] = {
        "fallback": ({}, [("fast", 500), ("heavy", 200)], 200),
        "retry": ({"num_retries": 1}, [("fast", 500), ("fast", 500), ("heavy", 200)], 200),
        "all_fail": ({"fallbacks": ["gone"]}, [("fast", 500), ("gone", 500)], 500)}
    counts = {"fallback": 3, "retry": 2, "all_fail": 1}
    sent: dict[str, str] = {}  # request id -> kind
    for kind, n in counts.items():
        extra, _, answered = kinds[kind]
        for i in range(n):
            status, call_id = send(url, f"{kind} {i}", **extra)
            assert status == answered and call_id, (kind, status, call_id)
            sent[call_id] = kind
    expected = sum(len(kinds[kind][1]) for kind in sent.values())
    decisions = _decisions(receiver, expected)
    time.sleep(1.5)  # anything recorded twice would come by now
    decisions += [r for r in drain(receiver) if isinstance(r, GatewayDecision)]
    assert len(decisions) == expected, [(d.request_id, d.attempt, d.lane, d.status) for d in decisions]
    by_request: dict[str, list[GatewayDecision]] = defaultdict(list)
    for d in decisions:
        by_request[d.request_id].append(d)
    assert set(by_request) == set(sent)
    for request_id, attempts in by_request.items():
        _, chain, _ = kinds[sent[request_id]]
        attempts.sort(key=lambda d: d.attempt)
        assert [d.attempt for d in attempts] == list(range(1, len(chain) + 1)), attempts  # once each, in order
        assert [(d.lane, d.status) for d in attempts] == chain, attempts
        assert [d.engine for d in attempts] == [engine[lane] for lane, _ in chain]
        assert all(a.end_ts <= b.ts for a, b in pairwise(attempts)), attempts
        fallback_group = "gone" if sent[request_id] == "all_fail" else "heavy"
        assert all(d.candidates == ["fast", fallback_group] for d in attempts), attempts
        assert all(d.error_type for d in attempts if d.status != 200)
        assert all(d.size_chars and d.threshold == THRESHOLD_CHARS for d in attempts)


def test_who_sent_each_request_is_its_keys_alias_team_and_user(tmp_path: Path, lanes: dict[str, SimServer],
                                                               receiver: OtlpReceiver) -> None:  # noqa: F811
    """Two virtual keys of two teams (tests/gateway/team_auth.py); one request names its end user (OpenAI's `user`
    field), one is refused by the size hook: every decision says who sent it, the model its backend was asked for,
    and never the key itself."""
    _installed()
    with litellm_proxy(tmp_path, {lane: f"{server.url}/v1" for lane, server in lanes.items()}, MODEL,
                       f"{receiver.url}/v1/traces", THRESHOLD_CHARS, auth=TEAM_AUTH) as url:
        sent = [send(url, "alpha asks", key="sk-alpha-1", user="customer-7"), send(url, "beta asks", key="sk-beta-1"),
                send(url, f"{REFUSE} alpha again", key="sk-alpha-1")]
        decisions = {d.request_id: d for d in _decisions(receiver, 3)}  # before the proxy stops: it sends them
    assert [status for status, _ in sent] == [200, 200, 429], sent
    assert set(decisions) == {i for _, i in sent}, (sent, list(decisions.values()))
    who = [(d.key, d.team, d.user, d.end_user, d.model, d.status) for d in (decisions[i] for _, i in sent[:3])]
    assert who == [("alpha-key", "alpha", "ann", "customer-7", MODEL.rpartition("/")[2], 200),
                   ("beta-key", "beta", "bo", "", MODEL.rpartition("/")[2], 200),
                   ("alpha-key", "alpha", "ann", "", "", 429)], who
    assert not any("sk-" in str(d) for d in decisions.values())
