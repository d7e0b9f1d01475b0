"""The SLI counters: each request judged once per objective, good and bad counted apart, labels bounded."""

from __future__ import annotations

import logging
import math

import pytest
from prometheus_client import CollectorRegistry

from stepline.config.objectives import Objective
from stepline.config.slo import Slo
from stepline.core.clock import ManualClock
from stepline.model.rows import UNKNOWN_FINISH_REASON, GatewayDecision, Request, micros
from stepline.watchdog.metrics import WatchdogMetrics
from stepline.watchdog.slo import SliCounters
from stepline.watchdog.tap import Watchdog

T = 1_700_000_000.0
NAN = math.nan


def _request(rid: str, *, ttft: float = 0.5, tpot: float = 0.02, reason: str = "stop", source: str = "plugin",
             model: str = "m", engine: str = "e1", arrival_shift_us: int = 0) -> Request:
    return Request(micros(T + 3), "h", engine, 0, model, rid, source, reason, micros(T) + arrival_shift_us,
                   0.1, 0.4, 2.0, 2.5, 3.0, ttft, tpot, 100, 0, 100, 200, 0)


def _decision(status: int, *, lane: str = "fast", disconnected: bool = False, first_byte_s: float | None = None,
              team: str = "", key: str = "") -> GatewayDecision:
    first_byte = None if first_byte_s is None else micros(T + first_byte_s)
    return GatewayDecision(micros(T), "h", "e1", "router", "r1", 1, lane, [], 10, 10, None, None, "", "", None,
                           status, "", disconnected, first_byte, micros(T + 1), "", team=team, key=key)


def _counts(m: WatchdogMetrics, objective: str, lane: str = "", model: str = "m",
            tenant: str = "") -> tuple[float | None, float | None]:
    labels = {"objective": objective, "engine": "e1", "model": model, "lane": lane, "tenant": tenant}
    r = m.registry
    return (r.get_sample_value("stepline_slo_requests_total", labels),
            r.get_sample_value("stepline_slo_good_requests_total", labels))


def test_good_and_bad_requests_move_the_counters_by_objective() -> None:
    m = WatchdogMetrics(CollectorRegistry())
    slis = SliCounters(m.slo, Slo(ttft_p99_seconds=1.0, tpot_seconds=0.05))
    slis.request(_request("ok"), "")
    slis.request(_request("slow-first-token", ttft=4.0), "")
    slis.request(_request("slow-decode", tpot=0.2, reason="length"), "")
    slis.request(_request("failed", reason="error"), "")
    slis.request(_request("aborted", reason="abort"), "")
    assert _counts(m, "ttft") == (5, 4)
    assert _counts(m, "tpot") == (5, 4)
    assert _counts(m, "availability") == (5, 3)


def test_a_bad_request_alone_still_exports_its_good_counter_at_zero() -> None:
    m = WatchdogMetrics(CollectorRegistry())
    SliCounters(m.slo).request(_request("failed", reason="error"), "")
    assert _counts(m, "availability") == (1, 0)


def test_a_request_reported_twice_counts_once_from_the_first_report_that_knows_each_field() -> None:
    m = WatchdogMetrics(CollectorRegistry())
    slis = SliCounters(m.slo)
    # The span comes first, without a finish reason; the plugin's report, microseconds apart, tells it.
    slis.request(_request("a", reason=UNKNOWN_FINISH_REASON, source="otlp", tpot=NAN), "")
    slis.request(_request("a", reason="error", arrival_shift_us=1), "")
    slis.request(_request("a", reason="error", arrival_shift_us=1), "")  # a replayed batch
    assert _counts(m, "ttft") == (1, 1)
    assert _counts(m, "tpot") == (1, 1)
    assert _counts(m, "availability") == (1, 0)
    # The same id arriving a minute later is another request (a client's retry reuses its X-Request-Id).
    slis.request(_request("a", arrival_shift_us=60_000_000), "")
    assert _counts(m, "availability") == (2, 1)


@pytest.mark.parametrize(("status", "disconnected", "good"), [(200, False, True), (429, False, True),
                                                              (502, False, False), (503, False, False),
                                                              (0, False, False), (0, True, True)])
def test_gateway_availability_counts_answers_below_500(status: int, disconnected: bool, good: bool) -> None:
    m = WatchdogMetrics(CollectorRegistry())
    SliCounters(m.slo).decision(_decision(status, disconnected=disconnected))
    assert _counts(m, "gateway_availability", lane="fast", model="") == (1, 1 if good else 0)


def test_label_sets_past_the_bound_are_dropped_counted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    m = WatchdogMetrics(CollectorRegistry())
    slis = SliCounters(m.slo, Slo(objectives=(Objective("ttft", "ttft"),)), max_series=2)
    with caplog.at_level(logging.WARNING, logger="stepline.watchdog.slo"):
        for i in range(5):
            slis.request(_request(f"r{i}", model=f"model-{i}"), "")
    assert _counts(m, "ttft", model="model-1") == (1, 1)
    assert _counts(m, "ttft", model="model-2") == (None, None)
    assert m.registry.get_sample_value("stepline_slo_requests_dropped_total", {"objective": "ttft"}) == 3
    assert len([r for r in caplog.records if "not counted" in r.getMessage()]) == 1  # once a minute


def test_the_tap_counts_requests_under_the_lane_of_the_engines_latest_decision() -> None:
    m = WatchdogMetrics(CollectorRegistry())
    dog = Watchdog(m, lambda rows: None, host="h", clock=ManualClock())
    dog.observe([_request("before")])
    dog.observe([_decision(200, lane="heavy"), _request("after", ttft=60.0)])
    assert _counts(m, "ttft") == (1, 1)
    assert _counts(m, "ttft", lane="heavy") == (1, 0)
    assert _counts(m, "gateway_availability", lane="heavy", model="") == (1, 1)


def test_a_tenants_objectives_count_the_gateways_decisions_under_who_sent_them() -> None:
    m = WatchdogMetrics(CollectorRegistry())
    slis = SliCounters(m.slo, Slo(ttft_p99_seconds=1.0, objectives=(
        Objective("tenant_first_byte", "gateway_first_byte", scope="tenant"),
        Objective("lane_up", "gateway_availability", scope="lane"))))
    slis.decision(_decision(200, first_byte_s=0.3, team="search"))
    slis.decision(_decision(200, first_byte_s=4.0, team="search"))  # a first byte late
    slis.decision(_decision(502, key="alice"))  # failed before a byte: bad (the key names the tenant without a team)
    slis.decision(_decision(0, disconnected=True, key="alice"))  # left first: the first byte says nothing
    assert _counts(m, "tenant_first_byte", lane="fast", model="", tenant="search") == (2, 1)
    assert _counts(m, "tenant_first_byte", lane="fast", model="", tenant="alice") == (1, 0)
    # An objective kept per lane keeps no tenant label value: its series do not multiply by tenants.
    assert _counts(m, "lane_up", lane="fast", model="") == (4, 3)
