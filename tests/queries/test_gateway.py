"""The join of a gateway's decisions to the engine's requests for gateways that forward no request id: by time and
size on the backend chosen, one request to one decision, refused where nothing tells candidates apart."""

from __future__ import annotations

import uuid

import pytest

from stepline.diagnosis.findings import Finding, Window
from stepline.diagnosis.gateway import gateway_fail_open, lane_leak, orphaned_engine_work
from stepline.model.rows import GatewayDecision, Request
from stepline.queries.gateway import JOIN_OUTCOMES, join_outcomes, joined
from stepline.queries.query import Query
from stepline.store.reads import Row
from stepline.store.store import Store
from tests.diagnosis.test_detectors import WINDOW
from tests.diagnosis.test_gateway import LANES, _traffic

ALL = Window(WINDOW.start, WINDOW.end)
DENSE = (52, 53)  # _traffic's dense-JSON monsters, measured under the bar
_PAIRS = joined("d.ts, d.request_id, r.request_id, m.matched_by", "1", ("prompt_tokens",))
_OUTCOMES = join_outcomes("1")



def _engine_id(gateway: str, i: int) -> str:
    """An id vLLM made up itself, unrelated to anything the gateway knows."""
    return f"cmpl-{uuid.uuid5(uuid.NAMESPACE_DNS, f'{gateway}-{i}').hex[:16]}-0"


def _lag_us(i: int) -> int:
    return (5 + (i * 37) % 196) * 1000  # 5 to 200 ms from decision to arrival


def _without_ids(decisions: list[GatewayDecision], requests: list[Request], *, keep: set[int] | None = None,
                 shift_s: float = 0.0) -> tuple[list[GatewayDecision], list[Request]]:
    """The traffic as a gateway that forwards no request id sends it (but the decisions in `keep`): decisions name
    none, the engine made its own ids up, and each request arrived 5-200 ms after its decision; all `shift_s` later."""
    shift = round(shift_s * 1e6)
    out_d, out_r = [], []
    for i, (d, r) in enumerate(zip(decisions, requests, strict=True)):
        first_byte = None if d.first_byte_ts is None else d.first_byte_ts + shift
        d = d._replace(ts=d.ts + shift, first_byte_ts=first_byte, end_ts=d.end_ts + shift)
        if keep is not None and i in keep:
            out_d.append(d)
            out_r.append(r._replace(ts=r.ts + shift, arrival_ts=r.arrival_ts + shift))
            continue
        out_d.append(d._replace(request_id=""))
        out_r.append(r._replace(request_id=_engine_id(d.gateway, i), ts=r.ts + shift, arrival_ts=d.ts + _lag_us(i)))
    return out_d, out_r


def _insert(store: Store, decisions: list[GatewayDecision], requests: list[Request]) -> None:
    store.insert("gateway_decisions", decisions, GatewayDecision._fields)
    store.insert("requests", requests, Request._fields)


def _rows(store: Store, sql: str) -> list[Row]:
    return Query(sql, engine="", start=ALL.start, end=ALL.end).rows(store)


def _outcomes(store: Store) -> dict[str, dict[str, int]]:
    return {str(r[0]): dict(zip(JOIN_OUTCOMES, (int(v) for v in r[1:]), strict=True)) for r in _rows(store, _OUTCOMES)}


def _leak(findings: list[Finding], gateway: str) -> Finding:
    [found] = [f for f in findings if f.title.endswith(f"of {gateway} went to fast")]
    return found


def test_without_request_ids_the_leak_counts_what_it_counts_with_them(store: Store) -> None:
    # One router forwards ids; "edge", in front of the same backends 2 s later, forwards none.
    _insert(store, *_traffic(dense_monsters=2))
    _insert(store, *_without_ids(*_traffic(dense_monsters=2, gateway="edge"), shift_s=2.0))
    findings = lane_leak(store, ALL)
    by_id, by_time = _leak(findings, "router").evidence, _leak(findings, "edge").evidence
    assert (by_time["leaked_requests"], by_time["monsters"], by_time["lanes_leaked_onto"]) == (2, 14, ["fast"])
    different = {"joined_by_id", "joined_by_time_and_size", "request_ids", "largest_leak"}
    assert {k: v for k, v in by_time.items() if k not in different} == {
        k: v for k, v in by_id.items() if k not in different}
    assert (by_id["joined_by_id"], by_id["joined_by_time_and_size"]) == (54, 0)
    assert (by_time["joined_by_id"], by_time["joined_by_time_and_size"]) == (0, 54)
    assert by_time["time_matches_refused"] == {"ambiguous": 0, "taken": 0, "unjoined": 0}
    # The leaked requests by the engine's own ids: the ones the edge's dense monsters became, nobody else's.
    assert by_time["request_ids"] == sorted(_engine_id("edge", i) for i in DENSE)
    assert by_time["largest_leak"] == f"{_engine_id('edge', 53)}: 339,150 chars measured, 113,050 tokens counted"
    assert _outcomes(store)["edge"] == {"id": 0, "time_and_size": 54, "time": 0, "ambiguous": 0, "taken": 0,
                                        "unjoined": 0}


def test_a_gateway_forwarding_ids_for_some_requests_joins_the_rest_by_time_and_size(store: Store) -> None:
    decisions, requests = _without_ids(*_traffic(dense_monsters=2), keep=set(range(1, 54, 2)))
    _insert(store, decisions, requests)
    [found] = lane_leak(store, ALL)
    e = found.evidence
    assert (e["leaked_requests"], e["monsters"], e["joined_by_id"], e["joined_by_time_and_size"]) == (2, 14, 27, 27)
    assert e["request_ids"] == sorted([_engine_id("router", 52), "cmpl-router-53-0"])  # one of each
    pairs = {str(r[2]): str(r[3]) for r in _rows(store, _PAIRS)}
    assert pairs[_engine_id("router", 52)] == "time_and_size" and pairs["cmpl-router-53-0"] == "id"
    assert _outcomes(store)["router"] == {"id": 27, "time_and_size": 27, "time": 0, "ambiguous": 0, "taken": 0,
                                          "unjoined": 0}


def test_two_requests_of_one_size_that_arrived_together_are_refused_not_guessed(store: Store) -> None:
    decisions, requests = _without_ids(*_traffic(dense_monsters=2))
    # A client that bypassed the gateway sent a request of the first dense monster's size, 100 ms after it.
    twin = requests[DENSE[0]]._replace(request_id="cmpl-bypass-0", arrival_ts=requests[DENSE[0]].arrival_ts + 100_000)
    _insert(store, decisions, [*requests, twin])
    [found] = lane_leak(store, ALL)
    e = found.evidence
    assert e["time_matches_refused"] == {"ambiguous": 1, "taken": 0, "unjoined": 0}
    assert (e["leaked_requests"], e["joined_by_time_and_size"]) == (1, 53)
    assert e["request_ids"] == [_engine_id("router", DENSE[1])]
    joined_ids = {str(r[2]) for r in _rows(store, _PAIRS)}
    assert "cmpl-bypass-0" not in joined_ids and _engine_id("router", DENSE[0]) not in joined_ids


def test_of_two_requests_of_one_size_the_one_that_arrived_clearly_nearer_is_matched(store: Store) -> None:
    decisions, requests = _without_ids(*_traffic(dense_monsters=2))
    late = requests[DENSE[0]]._replace(request_id="cmpl-bypass-0", arrival_ts=decisions[DENSE[0]].ts + 1_500_000)
    _insert(store, decisions, [*requests, late])
    [found] = lane_leak(store, ALL)
    assert found.evidence["request_ids"] == sorted(_engine_id("router", i) for i in DENSE)
    assert found.evidence["time_matches_refused"] == {"ambiguous": 0, "taken": 0, "unjoined": 0}


def test_a_request_goes_to_one_decision_the_nearest(store: Store) -> None:
    decisions, requests = _without_ids(*_traffic(dense_monsters=0))
    first = decisions[0]
    # The gateway tried the same request twice, 100 ms apart; only the first reached the engine.
    again = first._replace(ts=first.ts + 100_000, attempt=2)
    _insert(store, [first, again], [requests[0]._replace(arrival_ts=first.ts + 20_000)])
    assert [(r[0], r[2], r[3]) for r in _rows(store, _PAIRS)] == [
        (_rows(store, "SELECT min(ts) FROM gateway_decisions")[0][0], _engine_id("router", 0), "time_and_size")]
    assert _outcomes(store)["router"] == {"id": 0, "time_and_size": 1, "time": 0, "ambiguous": 0, "taken": 1,
                                          "unjoined": 0}


def test_an_id_joined_request_is_nobodys_candidate(store: Store) -> None:
    decisions, requests = _without_ids(*_traffic(dense_monsters=0))
    idless, own = decisions[0], requests[0]._replace(arrival_ts=decisions[0].ts + 300_000)
    # A decision 100 ms later names its request, of the same size, which arrived 5 ms after it.
    named = idless._replace(ts=idless.ts + 100_000, request_id="named")
    theirs = own._replace(request_id="cmpl-named-0", arrival_ts=named.ts + 5_000)
    _insert(store, [idless, named], [own, theirs])
    assert sorted((str(r[1]), str(r[2]), str(r[3])) for r in _rows(store, _PAIRS)) == [
        ("", _engine_id("router", 0), "time_and_size"), ("named", "cmpl-named-0", "id")]


@pytest.mark.parametrize(("tokens", "joins"), [(1_000, True), (3_900, True), (4_100, False), (240, False)])
def test_a_request_whose_size_is_far_from_what_the_gateway_measured_is_another(store: Store, tokens: int,
                                                                               joins: bool) -> None:
    """With no id-joined pair to learn the gateway's characters per token from, the prior's 4 may be 4x off
    (numeric JSON runs ~1): a request within 4x of the size joins, one beyond it is another."""
    decisions, requests = _without_ids(*_traffic(dense_monsters=0))  # the first measured 4,000 chars
    _insert(store, decisions[:1], [requests[0]._replace(prompt_tokens=tokens)])
    assert len(_rows(store, _PAIRS)) == int(joins)
    assert _outcomes(store)["router"]["unjoined"] == int(not joins)


def test_a_request_on_another_backend_is_not_a_candidate(store: Store) -> None:
    decisions, requests = _without_ids(*_traffic(dense_monsters=0))
    _insert(store, decisions[:1], [requests[0]._replace(engine=LANES["heavy"])])
    assert _rows(store, _PAIRS) == []


def test_decisions_that_measured_nothing_join_by_time_alone(store: Store) -> None:
    decisions, requests = _without_ids(*_traffic(dense_monsters=0))
    failed = [d._replace(size_chars=None, size_bytes=None, threshold=None, threshold_unit="",
                         swallowed_exception="KeyError: 'messages'") if i < 4 else d for i, d in enumerate(decisions)]
    _insert(store, failed, requests)
    [found] = gateway_fail_open(store, ALL)
    assert found.evidence["request_ids"] == sorted(_engine_id("router", i) for i in range(4))
    assert (found.evidence["joined_by_id"], found.evidence["joined_by_time"]) == (0, 4)


def test_orphaned_work_is_found_without_request_ids(store: Store) -> None:
    decisions, requests = _without_ids(*_traffic(dense_monsters=0))
    gone = [d._replace(client_disconnected=True, status=499, end_ts=d.ts + 2_000_000) for d in decisions[:6]]
    ran = [r._replace(ts=d.end_ts + 30_000_000) for d, r in zip(gone, requests[:6], strict=True)]
    _insert(store, gone, ran)
    [found] = orphaned_engine_work(store, ALL)
    assert (found.evidence["orphaned_requests"], found.evidence["joined_by_time_and_size"]) == (6, 6)
    assert found.evidence["longest"].startswith("cmpl-")


@pytest.mark.parametrize(("after_s", "joins"), [(-1.9, True), (-2.1, False), (2.4, True), (2.6, False)])
def test_an_arrival_joins_within_the_clocks_skew_of_the_decision_and_its_first_byte(store: Store, after_s: float,
                                                                                    joins: bool) -> None:
    decisions, requests = _without_ids(*_traffic(dense_monsters=0))  # its first byte 0.5 s after the decision
    _insert(store, decisions[:1], [requests[0]._replace(arrival_ts=decisions[0].ts + round(after_s * 1e6))])
    assert len(_rows(store, _PAIRS)) == int(joins)


def test_a_stranger_that_fits_the_size_a_little_better_is_no_reason_to_guess(store: Store) -> None:
    decisions, requests = _without_ids(*_traffic(dense_monsters=2))
    # A prose request of the size the dense monster's characters stand for at 4 per token, 100 ms after it.
    dense = requests[DENSE[0]]
    measured = decisions[DENSE[0]].size_chars
    assert measured is not None
    prose = dense._replace(request_id="cmpl-bypass-0", prompt_tokens=measured // 4,
                           arrival_ts=dense.arrival_ts + 100_000)
    _insert(store, decisions, [*requests, prose])
    [found] = lane_leak(store, ALL)
    assert found.evidence["time_matches_refused"] == {"ambiguous": 1, "taken": 0, "unjoined": 0}
    assert found.evidence["request_ids"] == [_engine_id("router", DENSE[1])]
