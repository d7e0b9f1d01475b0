"""The objectives over a window from the store: the SQL judges each request as the collector's counters do."""

from __future__ import annotations

import math
import time
from collections import Counter

from stepline.analysis.slo import SloStatus, render, statuses
from stepline.config.objectives import GATEWAY_SLIS, Objective, judge_decision, judge_request
from stepline.config.slo import Slo
from stepline.model.rows import UNKNOWN_FINISH_REASON, GatewayDecision, Request, micros
from stepline.store.store import Store

NOW = time.time()
NAN = math.nan
SLO = Slo(ttft_p99_seconds=1.0, tpot_seconds=0.05)


def _request(rid: str, *, ttft: float = 0.5, tpot: float = 0.02, reason: str = "stop", model: str = "m",
             engine: str = "e1", source: str = "plugin", ago: float = 600.0) -> Request:
    at = NOW - ago
    return Request(micros(at), "h", engine, 0, model, rid, source, reason, micros(at - 3), 0.1, 0.4, 2.0, 2.5, 3.0,
                   ttft, tpot, 100, 0, 100, 200, 0)


def _decision(rid: str, status: int, lane: str, *, engine: str = "e1", disconnected: bool = False,
              first_byte_s: float | None = None, team: str = "", key: str = "") -> GatewayDecision:
    at = NOW - 600
    first_byte = None if first_byte_s is None else micros(at - 3 + first_byte_s)
    return GatewayDecision(micros(at - 3), "h", engine, "router", rid, 1, lane, [], 10, 10, None, None, "", "", None,
                           status, "", disconnected, first_byte, micros(at), "", team=team, key=key)


REQUESTS = [
    _request("ok"), _request("slow", ttft=3.0), _request("slow-decode", tpot=0.3, reason="length"),
    _request("err", reason="error"), _request("gone", reason="abort", model="big"),
    _request("span-only", tpot=NAN, reason=UNKNOWN_FINISH_REASON, source="otlp", model="big"),
    _request("old", reason="error", ago=40 * 86400),  # before the window
]
DECISIONS = [_decision("ok", 200, "fast", first_byte_s=0.4, team="search"),
             _decision("slow", 200, "fast", first_byte_s=2.5, team="search"),
             _decision("err", 502, "heavy", team="batch"),  # no first byte, failed: bad by both
             _decision("gone", 0, "heavy", disconnected=True, key="alice"),  # left before a byte: not judged by it
             _decision("x", 0, "heavy")]  # nobody named: the tenant ''
SCOPES = {"lane": "lane", "engine": "engine", "tenant": "tenant"}


def _stored(store: Store) -> None:
    store.insert("requests", REQUESTS, Request._fields)
    store.insert("gateway_decisions", DECISIONS, GatewayDecision._fields)


def _by_hand(slo: Slo) -> dict[tuple[str, str], tuple[int, int]]:
    """(objective, scope) -> (total, good) as the collector's counters judge the same rows."""
    counts: Counter[tuple[str, str, bool]] = Counter()
    recent = [r for r in REQUESTS if r.ts >= micros(NOW - 30 * 86400)]
    lanes = {d.request_id: d.lane for d in DECISIONS}
    for o in slo.objectives:
        if o.sli in GATEWAY_SLIS:
            for d in DECISIONS:
                verdict = judge_decision(o.sli, slo.threshold(o), d)
                if verdict is not None:
                    counts[(o.name, f"{o.scope}={getattr(d, SCOPES[o.scope])}", verdict)] += 1
            continue
        for r in recent:
            good = judge_request(o.sli, slo.threshold(o), r)
            scope = f"lane={lanes.get(r.request_id, '')}" if o.scope == "lane" else f"model={r.model_name}"
            if good is not None:
                counts[(o.name, scope, good)] += 1
    keys = {(name, scope) for name, scope, _ in counts}
    return {k: (counts[(*k, True)] + counts[(*k, False)], counts[(*k, True)]) for k in keys}


def test_the_store_agrees_with_the_counters_judgement(store: Store) -> None:
    _stored(store)
    found = statuses(store, SLO, since=NOW - 30 * 86400)
    assert {(s.objective, s.scope): (s.total, s.good) for s in found} == _by_hand(SLO)
    ttft = next(s for s in found if s.objective == "ttft" and s.scope == "model=m")
    assert ttft.ratio == 3 / 4 and math.isclose(ttft.budget_used, 25.0)


def test_a_tenant_is_kept_by_the_gateways_slis(store: Store) -> None:
    slo = Slo(ttft_p99_seconds=1.0, objectives=(
        Objective("tenant_first_byte", "gateway_first_byte", scope="tenant"),
        Objective("tenant_availability", "gateway_availability", scope="tenant", target=0.999)))
    _stored(store)
    found = {(s.objective, s.scope): (s.total, s.good) for s in statuses(store, slo, since=NOW - 30 * 86400)}
    assert found == _by_hand(slo)
    # search: one first byte in time, one late; batch failed before a byte; alice left first (not judged by it).
    assert found[("tenant_first_byte", "tenant=search")] == (2, 1)
    assert found[("tenant_first_byte", "tenant=batch")] == (1, 0)
    assert ("tenant_first_byte", "tenant=alice") not in found
    assert found[("tenant_availability", "tenant=alice")] == (1, 1)
    assert found[("tenant_availability", "tenant=")] == (1, 0)


def test_a_lane_scoped_request_objective_takes_the_lane_of_its_decision(store: Store) -> None:
    slo = Slo(ttft_p99_seconds=1.0, objectives=(Objective("ttft", "ttft", scope="lane"),))
    _stored(store)
    found = statuses(store, slo, since=NOW - 30 * 86400)
    assert {(s.scope, s.total, s.good) for s in found} == {
        (scope, total, good) for (_, scope), (total, good) in _by_hand(slo).items()}
    assert {s.scope for s in found} == {"lane=fast", "lane=heavy", "lane="}


def test_the_table_shows_the_sli_the_target_and_the_budget() -> None:
    text = render([SloStatus("ttft", "ttft", "model=m", 1000, 995, 0.99)])
    assert text.splitlines()[0].split() == ["objective", "scope", "total", "good", "SLI", "target", "budget", "used",
                                            "budget", "left"]
    assert text.splitlines()[2].split() == ["ttft", "model=m", "1000", "995", "99.500%", "99.000%", "50.0%", "50.0%"]
