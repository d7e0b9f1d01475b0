"""A gateway's bar as whatif reads it: its unit, its measured units per token, and the shard lever it prices."""

from __future__ import annotations

from stepline.diagnosis.findings import Window
from stepline.model.rows import GatewayDecision, Request
from stepline.store.store import Store
from stepline.whatif.levers import shard_levers
from stepline.whatif.router import RouterBar, router_bars
from tests.diagnosis.test_detectors import WINDOW
from tests.diagnosis.test_gateway import _traffic

ALL = Window(WINDOW.start, WINDOW.end)



def test_the_routers_bar_comes_with_its_measured_units_per_token(store: Store) -> None:
    decisions, requests = _traffic(dense_monsters=2)
    store.insert("gateway_decisions", decisions, GatewayDecision._fields)
    store.insert("requests", requests, Request._fields)
    [bar] = router_bars(store, ALL)
    # 52 prose requests at 4 characters per token, 2 dense ones at 3: the median is prose's.
    assert (bar.gateway, bar.threshold, bar.unit, bar.per_token, bar.joined) == ("router", 400_000.0, "chars", 4.0,
                                                                                   54)
    assert bar.tokens == 100_000
    assert bar.in_unit(8_192) == "~32,768 chars at router's measured 4.00 chars/token"


def test_decisions_that_join_nothing_give_no_bar(store: Store) -> None:
    decisions, _ = _traffic(dense_monsters=2)
    store.insert("gateway_decisions", decisions, GatewayDecision._fields)
    assert router_bars(store, ALL) == []


def test_sharding_offers_the_routers_bar_counted_in_tokens() -> None:
    bar = RouterBar("router", 400_000.0, "chars", 3.94, 1849)
    [own, *rest] = shard_levers([], None, [bar])
    assert (own.name, own.shard_tokens) == ("shard at 101,523 tokens (router's bar)", 101_523)
    assert "400,000 chars, ~101,523 tokens at its measured 3.94 chars/token over 1849 requests" in own.note
    assert all("at router's measured 3.94 chars/token" in lever.note for lever in rest)
    tokens = RouterBar("edge", 100_000.0, "tokens", 1.0, 60)
    assert shard_levers([], None, [tokens])[0].shard_tokens == 100_000
