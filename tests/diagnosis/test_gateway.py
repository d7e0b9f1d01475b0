"""lane_leak: monsters the router measured under its bar in characters that the engine counted over it in tokens."""

from __future__ import annotations

import pytest

from stepline.diagnosis.detectors import diagnose
from stepline.diagnosis.findings import Window
from stepline.diagnosis.gateway import gateway_fail_open, gateway_slot_leak, lane_leak, orphaned_engine_work
from stepline.model.rows import EngineSample, Event, GatewayDecision, GatewaySample, Request, Step
from stepline.store.store import Store
from tests.diagnosis.test_detectors import WINDOW, _ts, step

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
                                         chars, chars, None, float(BAR_CHARS), "chars", "healthy", None, 200, "",
                                         False, _ts(at + 0.5), _ts(at + 3), ""))
        requests.append(Request(_ts(at + 3), "h", LANES[lane], 0, "m", f"cmpl-{rid}-0", "plugin", "stop",
                                _ts(at + 0.01), 0.0, 0.4, 2.5, 2.9, 2.99, 0.4, 0.01, tokens, 0, 250, 250, 0))
    return decisions, requests



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
    assert e["largest_leak"] == "cmpl-router-53-0: 339,150 chars measured, 113,050 tokens counted"
    assert found.title == "2 monsters under the 400000-chars bar of router went to fast"
    assert store.query(found.sql).result_rows  # the SQL shows the joined rows


def test_each_decision_is_judged_against_its_own_bar(store: Store) -> None:
    """The router lowers its bar to 300k characters half way; the dense monsters come after, measured under the new
    bar too, and leak; the last decisions, two its hook failed open on, carry no bar that can be read (no unit)."""
    decisions, requests = _traffic(dense_monsters=2)
    lowered = [d._replace(threshold=300_000.0) if i >= len(decisions) // 2 else d for i, d in enumerate(decisions)]
    dense = [i for i, r in enumerate(requests) if r.prompt_tokens >= 113_000 and i >= 52]
    lowered = [d._replace(size_chars=290_000, lane="fast", engine=LANES["fast"]) if i in dense else d
               for i, d in enumerate(lowered)]
    moved = [r._replace(engine=LANES["fast"]) if i in dense else r for i, r in enumerate(requests)]
    at = 10.0 + 4 * len(decisions)
    for k in range(2):  # failed open before naming the bar's unit, sent fast; joined like the others
        rid = f"router-open-{k}"
        lowered.append(GatewayDecision(_ts(at + k), "h", LANES["fast"], "router", rid, 1, "fast",
                                       list(LANES.values()), 2_000, 2_000, None, 300_000.0, "", "healthy", None, 200,
                                       "KeyError('messages')", False, _ts(at + k + 0.5), _ts(at + k + 3), ""))
        moved.append(Request(_ts(at + k + 3), "h", LANES["fast"], 0, "m", f"cmpl-{rid}-0", "plugin", "stop",
                             _ts(at + k + 0.01), 0.0, 0.4, 2.5, 2.9, 2.99, 0.4, 0.01, 500, 0, 250, 250, 0))
    _insert(store, lowered, moved)
    [found] = lane_leak(store, ALL)
    e = found.evidence
    assert (e["leaked_requests"], e["threshold"], e["joined_without_a_bar"]) == (2, "300000 chars", 2)
    assert list(e["bars"]) == ["400000 chars", "300000 chars"]
    assert e["bars"]["300000 chars"].endswith("2 leaked") and e["bars"]["400000 chars"].endswith("0 leaked")


def test_a_router_that_says_no_bar_is_judged_against_the_bar_its_operator_declared(store: Store) -> None:
    """No metadata (a router stepline cannot change): the decisions carry sizes but no bar. `--lane-bar heavy=100000`
    put a lane_bar event on the timeline; the dense monsters the router sent fast are counted over it."""
    decisions, requests = _traffic(dense_monsters=2)
    bare = [d._replace(threshold=None, threshold_unit="") for d in decisions]
    _insert(store, bare, requests)
    assert lane_leak(store, ALL) == []  # nothing declared: nothing to judge them by
    store.insert("events", [Event(_ts(1), "h", "", "collector", "lane_bar", "info", "declared",
                                  {"lane": "heavy", "threshold": "100000", "threshold_unit": "tokens"})],
                 Event._fields)
    [found] = lane_leak(store, ALL)
    e = found.evidence
    assert (e["leaked_requests"], e["lanes_leaked_onto"], e["declared_bars"]) == (2, ["fast"],
                                                                                 {"heavy": "100,000 tokens"})
    assert e["largest_leak"].startswith("cmpl-router-53-0: 113,050 tokens counted, sent to fast")
    assert found.title == "2 prompts over heavy's declared 100,000-token bar went to fast"


def test_a_router_whose_monsters_all_went_heavy_has_no_leak(store: Store) -> None:
    _insert(store, *_traffic(dense_monsters=0))
    assert lane_leak(store, ALL) == []


def test_decisions_that_join_no_engine_request_are_no_baseline(store: Store) -> None:
    decisions, _ = _traffic(dense_monsters=2)
    _insert(store, decisions, [])
    assert lane_leak(store, ALL) == []


def _behind_a_service(shared: bool) -> tuple[list[GatewayDecision], list[Request]]:
    """The fast lane is a service (svc:8000) in front of two replicas that take its requests in turn; the router
    forwards no request id. `shared`: the collector knows who stands behind the service (`--backend`)."""
    decisions, requests = _traffic(dense_monsters=2)
    replicas = ("fast-0:8000", "fast-1:8000")
    fast = [i for i, d in enumerate(decisions) if d.lane == "fast"]
    turn = {i: replicas[k % 2] for k, i in enumerate(fast)}
    decisions = [d._replace(request_id="", engine="svc:8000", candidates=["svc:8000", LANES["heavy"]],
                            backend_engines=replicas if shared else ()) if i in turn else d._replace(request_id="")
                 for i, d in enumerate(decisions)]
    return decisions, [r._replace(engine=turn[i]) if i in turn else r for i, r in enumerate(requests)]


def test_behind_a_service_the_join_looks_across_its_replicas_and_says_so(store: Store) -> None:
    _insert(store, *_behind_a_service(shared=True))
    [found] = lane_leak(store, ALL)
    e = found.evidence
    assert (e["leaked_requests"], e["lanes_leaked_onto"], e["joined_by_time_and_size"]) == (2, ["fast"], 54)
    assert found.engine in ("fast-0:8000", "fast-1:8000")  # the replica the worst leak ran on
    assert list(e["shared_backends"]) == ["svc:8000"]
    assert e["shared_backends"]["svc:8000"].startswith("42 decisions; the engines behind it: fast-0:8000, fast-1:8000")


def test_behind_a_service_nobody_declared_the_decisions_join_nothing(store: Store) -> None:
    _insert(store, *_behind_a_service(shared=False))
    assert lane_leak(store, ALL) == []  # the heavy lane's joined, none leaked; the fast lane's join no engine


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


@pytest.mark.parametrize("misrouted", [0, 2, 3])
def test_a_hook_that_measured_over_the_bar_and_sent_it_below_failed_open(store: Store, misrouted: int) -> None:
    """Monsters measured over the bar, nothing swallowed, yet on the fast lane: the hook failed after measuring and
    returned the request as it came (the seed's `except: return data` with the size already logged)."""
    decisions, _ = _traffic(dense_monsters=0)
    over = [i for i, d in enumerate(decisions) if d.lane == "heavy"]
    for i in over[:misrouted]:
        decisions[i] = decisions[i]._replace(lane="fast", engine=LANES["fast"])
    store.insert("gateway_decisions", decisions, GatewayDecision._fields)
    found = gateway_fail_open(store, ALL)
    if misrouted < 3:
        assert found == []
        return
    [f] = found
    assert (f.engine, f.evidence["routed_against_its_measure"], f.evidence["failed_open"]) == (LANES["fast"], 3, 3)
    assert f.evidence["lanes_they_went_to"] == {"fast": 3}


def test_a_gateway_that_does_not_route_by_size_never_fails_open_by_measuring_nothing(store: Store) -> None:
    unsized = [d._replace(size_chars=None, size_bytes=None, threshold=None, threshold_unit="")
               for d in _traffic(dense_monsters=0)[0]]
    store.insert("gateway_decisions", unsized, GatewayDecision._fields)
    assert gateway_fail_open(store, ALL) == []


def test_no_failure_open_is_no_finding(store: Store) -> None:
    store.insert("gateway_decisions", _failing_open(0), GatewayDecision._fields)
    assert gateway_fail_open(store, ALL) == []


def test_fewer_than_three_swallowed_exceptions_are_named_at_info(store: Store) -> None:
    """The seed's router swallowed KeyError('messages') twice in 14 decisions: below a warning's three, but the
    hook's own record of an exception is no noise, and it is in diagnose's findings."""
    store.insert("gateway_decisions", _failing_open(2), GatewayDecision._fields)
    [found] = gateway_fail_open(store, ALL)
    assert (found.severity, found.evidence["swallowed_exceptions"], found.evidence["exceptions"]) == (
        "info", 2, ["KeyError: 'messages'"])


def _slots(store: Store, gateway_counts: list[float], engine_running: int, busy_tail: bool) -> None:
    """A heavy lane over the 10-minute window: the gateway's running-requests gauge every 5 s taking
    `gateway_counts` in turn (the last value held), the engine stepping with `engine_running` running all along
    (or, without `busy_tail`, stepping only in the first half, then idle), 8 decisions of clients that left."""
    engine = LANES["heavy"]
    gauges: list[GatewaySample] = []
    scraped: list[EngineSample] = []
    steps: list[Step] = []
    for i in range(120):
        value = gateway_counts[min(i, len(gateway_counts) - 1)]
        gauges.append(GatewaySample(_ts(5.0 * i), "h", engine, "router", "vllm_router_running_requests", "gauge",
                                     {"worker": f"http://{engine}"}, value, 0.0))
        scraped.append(EngineSample(_ts(5.0 * i), "h", engine, "0", "m", "vllm:num_requests_running", "gauge", {},
                                    float(engine_running if busy_tail or i < 60 else 0), 0.0))
    for i in range(1200):
        if busy_tail or i < 600:
            steps.append(step(0.5 * i, n=i)._replace(engine=engine, running=engine_running, waiting=0,
                                                      num_generation_requests=engine_running))
    gone = [d._replace(engine=engine, lane="heavy", client_disconnected=True, status=499)
            for d in _traffic(dense_monsters=0)[0][:8]]
    store.insert("gateway_samples", gauges, GatewaySample._fields)
    store.insert("engine_samples", scraped, EngineSample._fields)
    if steps:
        store.insert("steps", steps, Step._fields)
    store.insert("gateway_decisions", gone, GatewayDecision._fields)


def test_slots_the_gateway_holds_while_the_engine_idles_are_a_leak(store: Store) -> None:
    _slots(store, [float(min(8, i // 8)) for i in range(120)], engine_running=0, busy_tail=False)
    [found] = gateway_slot_leak(store, ALL)
    e = found.evidence
    assert (found.kind, found.severity, found.engine) == ("gateway_slot_leak", "critical", "heavy-0:8000")
    assert (e["leaked_slots"], e["gateway_in_flight_last"], e["engine_running_plus_waiting_max"]) == (8, 8, 0)
    assert e["engine_busy_steps"] == 0 and e["client_disconnects"] == "8 of 8 decisions to this backend"
    assert found.title == "router holds 8 slots on heavy-0:8000, the engine 0: engine idle"


@pytest.mark.parametrize(("gateway", "engine"), [(4.0, 4), (5.0, 4)])  # in step; one in transit
def test_a_gateway_in_step_with_its_engine_has_no_leak(store: Store, gateway: float, engine: int) -> None:
    _slots(store, [gateway], engine_running=engine, busy_tail=True)
    assert gateway_slot_leak(store, ALL) == []


def _refusing_lane(store: Store, engine_running: int) -> None:
    """LiteLLM in front, its hook's slots on the heavy lane: 4 served, 2 clients left mid-stream (slots never given
    back), then 6 refusals (429, before any deployment: no backend) over 40 s, the heavy engine holding
    `engine_running` all along, as its steps and its own gauge say."""
    engine = LANES["heavy"]
    decisions = [d._replace(engine=engine, lane="heavy", ts=_ts(10.0 + i), end_ts=_ts(12.0 + i))
                 for i, d in enumerate(_traffic(dense_monsters=0)[0][:6])]
    decisions[4:6] = [d._replace(client_disconnected=True, status=499) for d in decisions[4:6]]
    refused = [d._replace(engine="", ts=_ts(100.0 + 8 * i), end_ts=_ts(100.0 + 8 * i), status=429,
                          error_type="HTTPException", request_id=f"refused-{i}", client_disconnected=False)
               for i, d in enumerate(decisions)]
    store.insert("gateway_decisions", decisions + refused, GatewayDecision._fields)
    store.insert("engine_samples", [EngineSample(_ts(5.0 * i), "h", engine, "0", "m", "vllm:num_requests_running",
                                                 "gauge", {}, float(engine_running), 0.0) for i in range(40)],
                 EngineSample._fields)
    if engine_running:
        store.insert("steps", [step(0.5 * i, n=i)._replace(engine=engine, running=engine_running, waiting=0,
                                                            num_generation_requests=engine_running)
                               for i in range(400)], Step._fields)


def test_a_lane_refusing_while_its_engine_holds_nothing_is_a_slot_leak(store: Store) -> None:
    """Where the gateway exports no slot count (LiteLLM's hook slots), its answers show the leak."""
    _refusing_lane(store, engine_running=0)
    [found] = gateway_slot_leak(store, ALL)
    e = found.evidence
    assert (found.kind, found.severity, found.engine) == ("gateway_slot_leak", "critical", "heavy-0:8000")
    assert (e["refused"], e["refusing_for_s"], e["statuses"], e["engines_behind_lane"]) == (
        6, 40.0, [429], ["heavy-0:8000"])
    assert (e["engines_running_plus_waiting_max"], e["client_disconnects_on_lane"]) == (0, 2)
    assert found.title == "router refused 6 on lane heavy for 40s, its engines holding nothing"


def test_a_lane_refusing_while_its_engine_is_full_is_no_leak(store: Store) -> None:
    _refusing_lane(store, engine_running=4)
    assert gateway_slot_leak(store, ALL) == []


def _left(store: Store, finished_after_s: float) -> None:
    """Six clients that left 2 s into their requests; the engine finished each `finished_after_s` after that."""
    decisions, requests = _traffic(dense_monsters=0)
    gone = [d._replace(client_disconnected=True, status=499, end_ts=d.ts + 2_000_000) for d in decisions[:6]]
    ran = [r._replace(ts=d.end_ts + round(finished_after_s * 1e6)) for d, r in zip(gone, requests[:6], strict=True)]
    _insert(store, gone, ran)


def test_requests_that_ran_on_after_their_clients_left_are_orphaned_work(store: Store) -> None:
    _left(store, finished_after_s=30.0)
    [found] = orphaned_engine_work(store, ALL)
    e = found.evidence
    assert (found.kind, found.engine, e["orphaned_requests"]) == ("orphaned_engine_work", "fast-0:8000", 6)
    assert e["engine_s_after_disconnect"] == 180.0 and e["tokens_generated"] == 6 * 250
    assert found.title == "6 requests ran on fast-0:8000 180s after their clients left"


def test_requests_that_ended_as_their_clients_left_are_not(store: Store) -> None:
    _left(store, finished_after_s=0.2)
    assert orphaned_engine_work(store, ALL) == []


def _silent(shifted: int, *, chosen_by_client: bool = False, later_small: bool = False) -> list[GatewayDecision]:
    """A router's first attempts, 120 over the window, measured in characters (LiteLLM's callback counts them
    itself) with no bar recorded: every fourth a monster (over 400k characters), the rest prose. In the earlier half
    the monsters go heavy; in the later half `shifted` of them go fast (a hook that fails open, silently). With
    `chosen_by_client` the lanes follow no size (clients pick them); with `later_small` the later half's monsters
    are ordinary requests (the size mix changed, not the routing)."""
    out = []
    monsters = 0
    for i in range(120):
        monster = i % 4 == 0 and not (later_small and i >= 60)
        chars = 420_000 + 1_000 * i if monster else 2_000 + 300 * i
        lane = "heavy" if monster else "fast"
        if chosen_by_client:
            lane = "heavy" if i % 3 == 0 else "fast"
        if monster and i >= 60:
            monsters += 1
            if monsters <= shifted:
                lane = "fast"
        at = 10.0 + 4.5 * i
        out.append(GatewayDecision(_ts(at), "h", LANES[lane], "litellm", f"call-{i}", 1, lane, list(LANES),
                                   chars, chars, None, None, "", "", None, 200, "", False, _ts(at + 0.5),
                                   _ts(at + 3), ""))
    return out


@pytest.mark.parametrize("shifted", [2, 7, 8, 15])
def test_monsters_the_gateway_used_to_send_heavy_going_fast_with_nothing_recorded_failed_open(
        store: Store, shifted: int) -> None:
    """Of the later half's 15 monsters, `shifted` go fast: 2 are too few, 7 a minority (a router near its bar in
    another unit), 8 and 15 the routing moved."""
    store.insert("gateway_decisions", _silent(shifted), GatewayDecision._fields)
    found = gateway_fail_open(store, ALL)
    if shifted < 8:
        assert found == []
        return
    [f] = found
    e = f.evidence
    assert (f.engine, e["failed_open"], e["routed_against_its_earlier_rule"]) == (LANES["fast"], shifted, shifted)
    assert (e["swallowed_exceptions"], e["unmeasured_decisions"], e["routed_against_its_measure"]) == (0, 0, 0)
    assert e["went_to_instead"] == {"fast": shifted} and e["lanes_they_went_to"] == {"fast": shifted}
    # The bar as routed is the least monster the earlier half sent heavy (call-0: 420,000 characters).
    assert e["bar_as_routed"].startswith("420,000 (the least size heavy took before ")
    assert "0 of 15 at or over it went elsewhere then" in e["bar_as_routed"]
    assert e["size_mix_at_or_over_the_bar"] == "25.0% of 60 before, 25.0% of 60 after"
    assert f.title == f"litellm: {shifted} of 120 routing decisions failed open"
    assert store.query(f.sql).result_rows


def test_lanes_clients_choose_set_no_rule_to_fail_against(store: Store) -> None:
    store.insert("gateway_decisions", _silent(0, chosen_by_client=True), GatewayDecision._fields)
    assert gateway_fail_open(store, ALL) == []


def test_fewer_monsters_later_is_a_size_mix_that_changed_not_a_failure(store: Store) -> None:
    store.insert("gateway_decisions", _silent(0, later_small=True), GatewayDecision._fields)
    assert gateway_fail_open(store, ALL) == []
