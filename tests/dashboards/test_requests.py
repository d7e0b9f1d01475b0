"""The requests dashboard: the slowest requests, each one click from the engine timeline around it, and how TTFT,
inter-token and end-to-end latency are distributed."""

from __future__ import annotations

import re
from typing import Any

import pytest

from stepline.dashboards import engine, requests
from stepline.model.rows import micros
from stepline.store.store import Store
from tests.dashboards.conftest import (
    GOLDEN,
    REQUESTS,
    SLOWEST,
    STEPS,
    answer,
    context,
    panel_sql,
    panels,
    problems,
    rendered,
)
from tests.diagnosis.test_detectors import ENGINE, T0

MODEL = rendered(requests.dashboard)


def test_the_uid_is_stable() -> None:
    assert requests.UID == MODEL["uid"] == "stepline-requests"
    assert f'"uid": "{requests.UID}"' in (GOLDEN / "requests.json").read_text()


def test_it_has_the_slowest_requests_and_the_latency_distributions() -> None:
    shown = panels(MODEL)
    assert list(shown) == ["Slowest requests", "Time to first token", "Inter-token latency", "End-to-end latency"]
    assert [p["type"] for p in shown.values()] == ["table", "histogram", "histogram", "histogram"]


def test_every_query_reads_schema_tables_and_runs_at_every_interval(timeline: Store) -> None:
    assert not problems(timeline, MODEL)


def test_the_slowest_request_comes_first_with_where_its_time_went(timeline: Store) -> None:
    rows = answer(timeline, panel_sql(MODEL, "Slowest requests"), context(1000))
    assert [r["request_id"] for r in rows] == ["slow", "mid", "fast"]
    _, arrival, queue, ttft, decode, prompt = SLOWEST
    slow = rows[0]
    assert (slow["queue_seconds"], slow["ttft_seconds"], slow["prompt_tokens"]) == pytest.approx((queue, ttft, prompt))
    assert slow["e2e_seconds"] == pytest.approx(ttft + decode)
    # The engine timeline it links to spans the request with PADDING_MS either side.
    start_ms = micros(T0.timestamp() + arrival) // 1000
    assert slow["from_ms"] == start_ms - requests.PADDING_MS
    assert slow["to_ms"] == start_ms + round((ttft + decode) * 1000) + requests.PADDING_MS


def _link(row: dict[str, Any]) -> str:
    """The panel's data link for one row, as Grafana fills in ${__data.fields.NAME}."""
    [link] = panels(MODEL)["Slowest requests"]["fieldConfig"]["defaults"]["links"]
    url: str = link["url"]
    return re.sub(r"\$\{__data\.fields\.(\w+)\}", lambda m: str(row[m.group(1)]), url)


def test_a_request_links_to_the_engine_timeline_around_it(timeline: Store) -> None:
    slow = answer(timeline, panel_sql(MODEL, "Slowest requests"), context(1000))[0]
    assert _link(slow) == (f"/d/{engine.UID}/{engine.SLUG}?from={slow['from_ms']}&to={slow['to_ms']}&var-host=h"
                           f"&var-engine={ENGINE}&${{datasource:queryparam}}&${{prometheus:queryparam}}")
    hidden = {o["matcher"]["options"] for o in panels(MODEL)["Slowest requests"]["fieldConfig"]["overrides"]
              if {"id": "custom.hidden", "value": True} in o["properties"]}
    assert hidden == {"from_ms", "to_ms"}  # read by the link only


def test_distributions_hold_one_row_per_observation(timeline: Store) -> None:
    ttft = answer(timeline, panel_sql(MODEL, "Time to first token"), context(1000))
    assert sorted(r["ttft_seconds"] for r in ttft) == pytest.approx(sorted(r[3] for r in REQUESTS))
    itl = answer(timeline, panel_sql(MODEL, "Inter-token latency"), context(1000))
    assert len(itl) == 2 * (STEPS + 1)  # two decoding requests a step, the prefill's step too
    assert max(r["itl_seconds"] for r in itl) == pytest.approx(0.25)
    assert len(answer(timeline, panel_sql(MODEL, "End-to-end latency"), context(1000))) == len(REQUESTS)
