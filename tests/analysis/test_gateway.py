"""The gateway's tables for a terminal: lanes, the largest requests beside their engine's count, slots per minute."""

from __future__ import annotations

import pytest

from stepline.analysis import gateway
from stepline.diagnosis.findings import Window
from stepline.model.rows import GatewayDecision, Request
from stepline.store.store import Store
from tests.diagnosis.test_detectors import WINDOW
from tests.diagnosis.test_gateway import LANES, _traffic


@pytest.fixture
def store(store: Store) -> Store:
    """The suite's store (tests/conftest.py) holding a router's decisions, its heavy lane holding 3 slots."""
    decisions, requests = _traffic(dense_monsters=1)
    held = [d._replace(in_flight=3) if d.lane == "heavy" else d for d in decisions]
    store.insert("gateway_decisions", held, GatewayDecision._fields)
    store.insert("requests", requests, Request._fields)
    return store


ALL = Window(WINDOW.start, WINDOW.end)


def test_lanes_count_each_lanes_decisions(store: Store) -> None:
    table = gateway.lanes(store, ALL).splitlines()
    fast = next(line for line in table if " fast " in line).split()
    heavy = next(line for line in table if " heavy " in line).split()
    assert fast[:5] == ["router", "fast", LANES["fast"], "41", "41"]  # 40 prose requests and the dense monster
    assert heavy[:5] == ["router", "heavy", LANES["heavy"], "12", "12"] and heavy[-1] == "3"


def test_the_largest_requests_say_what_was_measured_and_what_was_counted(store: Store) -> None:
    lines = gateway.largest(store, ALL, 100_000)
    assert len(lines) == 13
    assert "router-52: measured 339,000 chars (under the bar) -> fast lane; the engine counted 113,000 tokens" in lines


def test_slots_per_minute_sit_beside_the_engine(store: Store) -> None:
    table = gateway.slots(store, ALL, LANES["heavy"]).splitlines()
    assert table[0].split()[:3] == ["minute", "(UTC)", "gateway"] and len(table) > 2
    assert all(line.split()[1] == "3" for line in table[2:])
