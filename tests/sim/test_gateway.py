"""The simulated size router: where its units send a request, how its slots leak, what it reports."""

from __future__ import annotations

import pytest

from stepline.sim.config import EngineConfig
from stepline.sim.engine import Simulation
from stepline.sim.gateway import (
    FAIL_OPEN_EXCEPTION,
    SATURATED,
    GatewayConfig,
    GatewayRequest,
    Lane,
    SimGateway,
    measure,
)
from stepline.sim.workloads import one_request

LANES = (Lane("fast", "fast-0", 64), Lane("heavy", "heavy-0", 2))
BAR_CHARS = 400_000.0


def _request(rid: str, tokens: int, content: str = "prose", at: float = 1.0, output: int = 50,
             leaves: int | None = None) -> GatewayRequest:
    return GatewayRequest(one_request(rid, at, tokens, output), content, leaves)


def test_dense_json_measures_under_a_character_bar_its_tokens_exceed() -> None:
    gateway = SimGateway(GatewayConfig(LANES, BAR_CHARS))
    workloads = gateway.route([_request("prose", 120_000), _request("json", 113_000, "json")], 60, 10)
    assert [a.request_id for a in workloads["heavy-0"].arrivals] == ["prose"]
    assert [a.request_id for a in workloads["fast-0"].arrivals] == ["json"]
    sizes = measure(_request("json", 113_000, "json"))
    assert 0.97 * 339_000 <= sizes["chars"] <= 1.03 * 339_000 and sizes["bytes"] == sizes["chars"]
    assert sizes["tokens"] == round(sizes["chars"] / 4)  # the router's estimate undercounts dense JSON too


def test_a_bar_in_estimated_tokens_leaks_dense_json_as_well() -> None:
    gateway = SimGateway(GatewayConfig(LANES, 100_000, "tokens"))
    workloads = gateway.route([_request("json", 113_000, "json"), _request("code", 140_000, "code")], 60, 10)
    assert [a.request_id for a in workloads["fast-0"].arrivals] == ["json"]  # ~85k estimated: under the bar
    assert [a.request_id for a in workloads["heavy-0"].arrivals] == ["code"]  # ~105k estimated


def test_a_hook_that_fails_open_routes_to_the_default_lane_unmeasured() -> None:
    gateway = SimGateway(GatewayConfig(LANES, BAR_CHARS, fail_open=frozenset({"json"})))
    workloads = gateway.route([_request("json", 200_000, "json")], 60, 10)
    assert [a.request_id for a in workloads["fast-0"].arrivals] == ["json"]
    decision = gateway.decisions["json"]
    assert decision.sizes == {"chars": None, "bytes": None, "tokens": None}
    assert decision.swallowed == FAIL_OPEN_EXCEPTION


def _serve_heavy(config: GatewayConfig, count: int) -> tuple[SimGateway, Simulation]:
    """`count` heavy requests 40 s apart (each prefills alone in ~25 s) whose clients all leave after 3 tokens,
    served behind the heavy gate."""
    gateway = SimGateway(config)
    requests = [_request(f"h{i}", 160_000 + i, at=1.0 + 40 * i, output=200, leaves=3) for i in range(count)]
    workloads = gateway.route(requests, 40.0 * count + 5, 120)
    gate = gateway.gate("heavy-0")
    assert gate is not None
    sim = Simulation(workloads["heavy-0"], EngineConfig(), on_step=gate.on_step, admit=gate.admit)
    sim.advance_to(40.0 * count + 120)
    return gateway, sim


def test_slots_released_on_success_only_wedge_the_lane_after_its_disconnects() -> None:
    gateway, sim = _serve_heavy(GatewayConfig(LANES, BAR_CHARS, leak_on_disconnect=True), 5)
    gate = gateway.gate("heavy-0")
    assert gate is not None and (gate.held, gate.leaked) == (2, 2)
    assert sim.refused == 3 and sim.is_done()  # the engine finished what it got, then was sent nothing
    records = {r["request_id"]: r for r in gateway.records({"fast-0": 0.0, "heavy-0": 1000.0})}
    assert [records[f"h{i}"]["status"] for i in range(5)] == [499, 499, 429, 429, 429]
    assert records["h4"]["error_type"] == SATURATED and records["h4"]["in_flight"] == 2
    assert records["h0"]["client_disconnected"] and records["h0"]["start_s"] == 1001.0


def test_slots_released_on_every_exit_keep_the_lane_open() -> None:
    gateway, sim = _serve_heavy(GatewayConfig(LANES, BAR_CHARS), 5)
    gate = gateway.gate("heavy-0")
    assert gate is not None and (gate.held, gate.leaked, sim.refused) == (0, 0, 0)


@pytest.mark.parametrize("cancel", [True, False])
def test_a_disconnect_passed_upstream_aborts_the_engine_request(cancel: bool) -> None:
    gateway = SimGateway(GatewayConfig(LANES, BAR_CHARS, cancel_upstream=cancel))
    workloads = gateway.route([_request("c", 1_000, output=300, leaves=10)], 30, 30)
    [arrival] = workloads["fast-0"].arrivals
    expected = ("abort", 10) if cancel else ("length", 300)
    assert (arrival.finish_reason, arrival.output_tokens) == expected


def test_a_gateway_needs_two_distinct_lanes_and_a_known_unit() -> None:
    with pytest.raises(ValueError, match="unit must be one of chars, bytes, tokens"):
        GatewayConfig(LANES, BAR_CHARS, "words")
    with pytest.raises(ValueError, match="lanes need engines and names of their own"):
        GatewayConfig((LANES[0], LANES[0]), BAR_CHARS)
