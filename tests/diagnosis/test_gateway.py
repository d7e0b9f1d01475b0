"""lane_leak: monsters the router measured under its bar in characters that the engine counted over it in tokens."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from stepline.diagnosis.detectors import diagnose
from stepline.diagnosis.findings import Window
from stepline.diagnosis.gateway import gateway_fail_open, lane_leak
from stepline.model.rows import GatewayDecision, Request
from stepline.store.store import Store
from tests.diagnosis.test_detectors import WINDOW, _ts

BAR_CHARS = 400_000  # set from a token estimate: 100k tokens at ~4 characters per token
LANES = {"fast": "fast-0:8000", "heavy": "heavy-0:8000"}


def _traffic(dense_monsters: int, *, gateway: str = "router") -> tuple[list[GatewayDecision], list[Request]]:
    """40 prose requests (4 chars/token), 12 prose monsters and `dense_monsters` dense-JSON monsters of 113k
    tokens (3 chars/token), routed by characters against BAR_CHARS, each served by its lane's engine."""
    sizes = [(1_000 + 1_200 * i, 4.0) for i in range(40)] + [(110_000 + 5_000 * i, 4.0) for i in range(12)]
    sizes += [(113_000 + 50 * i, 3.0) for i in range(dense_monsters)]
    decisions, requests = [], []
    for i, (tokens, per_token) in enumerate(sizes):
        chars, lane, at = int(tokens * per_token), "", 10.0 + 4 * i
        lane = "heavy" if chars >= BAR_CHARS else "fast"
        rid = f"{gateway}-{i}"
        decisions.append(GatewayDecision(_ts(at), "h", LANES[lane], gateway, rid, 1, lane, list(LANES.values()),
                                         chars, chars, None, float(BAR_CHARS), "chars", "healthy", 200, "", False,
                                         _ts(at + 0.5), _ts(at + 3), ""))
        requests.append(Request(_ts(at + 3), "h", LANES[lane], 0, "m", f"cmpl-{rid}-0", "plugin", "stop",
                                _ts(at + 0.01), 0.0, 0.4, 2.5, 2.9, 2.99, 0.4, 0.01, tokens, 0, 250, 250, 0))
    return decisions, requests


@pytest.fixture
def store(chdb_dir: Path) -> Iterator[Store]:
    s = Store.open(f"chdb://{chdb_dir}?database=gw_{uuid.uuid4().hex[:10]}")
    s.ensure_schema(30)
    yield s
    s.client.command(f"DROP DATABASE IF EXISTS `{s.database}`")
    s.close()


def _insert(store: Store, decisions: list[GatewayDecision], requests: list[Request]) -> None:
    store.insert("gateway_decisions", decisions, GatewayDecision._fields)
    store.insert("requests", requests, Request._fields)


ALL = Window(WINDOW.start, WINDOW.end)


def test_dense_monsters_under_a_character_bar_leak_onto_the_fast_lane(store: Store) -> None:
    _insert(store, *_traffic(dense_monsters=2))
    [found] = lane_leak(store, ALL)
    e = found.evidence
    assert (found.kind, found.severity, found.engine) == ("lane_leak", "warning", "fast-0:8000")
    assert (e["leaked_requests"], e["monsters"], e["lanes_leaked_onto"]) == (2, 14, ["fast"])
    assert e["threshold"] == "400000 chars"
    assert e["threshold_in_tokens"].startswith("100,000 (at the median 4.00 chars/token")
    assert e["leaked_chars_per_token"] == "3.00..3.00"
    assert e["threshold_that_would_have_held"] == "339,000 chars"  # 113,000 tokens at 3 chars: 339,000
    assert e["largest_leak"] == "router-53: 339,150 chars measured, 113,050 tokens counted"
    assert found.title == "2 monsters under the 400000-chars bar of router went to fast"
    assert store.query(found.sql).result_rows  # the SQL shows the joined rows


def test_a_router_whose_monsters_all_went_heavy_has_no_leak(store: Store) -> None:
    _insert(store, *_traffic(dense_monsters=0))
    assert lane_leak(store, ALL) == []


def test_decisions_that_join_no_engine_request_are_no_baseline(store: Store) -> None:
    decisions, _ = _traffic(dense_monsters=2)
    _insert(store, decisions, [])
    assert lane_leak(store, ALL) == []


def test_diagnose_names_the_leak_beside_the_engines(store: Store) -> None:
    _insert(store, *_traffic(dense_monsters=2, gateway="edge"))
    assert [f.kind for f in diagnose(store.client, ALL) if f.kind == "lane_leak"] == ["lane_leak"]


def _failing_open(n: int, total: int = 50) -> list[GatewayDecision]:
    """`total` decisions of a router whose hook, on `n` of them, raised before measuring and routed fast."""
    decisions, _ = _traffic(dense_monsters=0)
    out = []
    for i, d in enumerate(decisions[:total]):
        if i < n:
            d = d._replace(size_chars=None, size_bytes=None, threshold=None, threshold_unit="", lane="fast",
                           swallowed_exception="KeyError: 'messages'")
        out.append(d)
    return out


def test_a_hook_that_swallows_its_errors_is_found(store: Store) -> None:
    store.insert("gateway_decisions", _failing_open(4), GatewayDecision._fields)
    [found] = gateway_fail_open(store, ALL)
    e = found.evidence
    assert (found.kind, e["failed_open"], e["decisions"], e["share"]) == ("gateway_fail_open", 4, 50, "8.0%")
    assert e["exceptions"] == ["KeyError: 'messages'"] and e["lanes_they_went_to"] == {"fast": 4}
    assert found.title == "router: 4 of 50 routing decisions failed open (KeyError: 'messages')"


@pytest.mark.parametrize("n", [0, 2])
def test_fewer_than_three_failures_open_are_no_finding(store: Store, n: int) -> None:
    store.insert("gateway_decisions", _failing_open(n), GatewayDecision._fields)
    assert gateway_fail_open(store, ALL) == []
