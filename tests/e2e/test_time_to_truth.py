"""Time to truth, live (benchmarks/time_to_truth.py runs every cause): causes served in real time beside a
collector, the alert rules in a real Prometheus and Alertmanager. Judged on the order of events, not on seconds:
the monster is named (by diagnose and by the watchdog's exported top finding) before its request finishes, and the
wedge's page names the wedge when it fires, within its budget and the telemetry's delays."""

from __future__ import annotations

import pytest

from stepline.drills.timetotruth import LiveResult, run_live
from stepline.testing.alertstack import ALERTMANAGER, PROMETHEUS

pytestmark = pytest.mark.skipif(not (PROMETHEUS and ALERTMANAGER),
                                reason="needs Debian's prometheus and prometheus-alertmanager (.ci/run installs them)")


def _finished_monster_named(result: LiveResult) -> bool:
    last = result.polls[-1].top if result.polls else None
    return last is not None and "-monster-" in last[3] and result.first_watchdog() is not None


def test_a_monster_prefill_is_named_before_its_request_finishes(store_url: str) -> None:
    r = run_live("monster_finished", store_url=store_url, stop_when=_finished_monster_named, tail_s=4.0)
    shown = [(round(r.since_onset(p.at) or 0, 1), p.state, p.top, p.watchdog_finding) for p in r.polls]
    assert r.request_finished is not None and r.onset is not None, (r.description, shown)
    correct, watchdog = r.first_correct(), r.first_watchdog()
    assert correct is not None and correct < r.request_finished, (r.description, shown)
    assert watchdog is not None and watchdog < r.request_finished, (r.description, shown)
    assert not r.wrong_before(), (r.wrong_before(), shown)


def test_a_wedge_pages_naming_the_wedge_within_its_budget(store_url: str) -> None:
    r = run_live("wedge", store_url=store_url, stop_when=lambda result: result.first_page() is not None, tail_s=2.0)
    shown = [(round(p.at - r.polls[0].at, 1), p.state, p.top, p.watchdog_finding) for p in r.polls]
    page = r.first_page()
    assert page is not None, (r.description, [a["labels"] for a in r.firing()], shown)
    assert page["labels"]["alertname"] in ("EngineStalled", "EngineWedgedWithQueue")
    assert "wedged_engine" in page["annotations"]["description"]
    delay = r.since_onset(page["received"])
    # Its budget (5 s at least) plus the engine's 5 s scrapes, Prometheus' 1 s scrape and evaluation, Alertmanager's
    # group wait, with room for a loaded CI machine; EngineStalled used to wait a minute beyond the budget.
    assert delay is not None and delay < 40, (delay, page["annotations"]["description"], shown)
    # The first page to fire is the wedge's own, not a symptom's.
    assert r.firing()[0]["labels"]["alertname"] in ("EngineStalled", "EngineWedgedWithQueue")
