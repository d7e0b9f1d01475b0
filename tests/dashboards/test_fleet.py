"""The fleet overview: every engine's liveness, throughput, latency by prompt band, queues and what happened."""

from __future__ import annotations

import pytest

from stepline.alerting.config import AlertConfig
from stepline.config.slo import Slo
from stepline.dashboards import fleet
from stepline.dashboards.macros import ALL, QueryContext
from stepline.store.store import Store
from tests.dashboards.conftest import (
    GOLDEN,
    INTERVALS_MS,
    STEPS,
    answer,
    context,
    panel_sql,
    panels,
    problems,
    promql,
    rendered,
)
from tests.diagnosis.test_detectors import ENGINE
from tests.diagnosis.test_hardware import decode_tokens, speculative_run

MODEL = rendered(fleet.dashboard)


def test_the_uid_is_stable() -> None:
    assert fleet.UID == MODEL["uid"] == "stepline-fleet"
    assert f'"uid": "{fleet.UID}"' in (GOLDEN / "fleet-overview.json").read_text()


def test_it_answers_is_every_engine_up_fast_and_not_queueing() -> None:
    assert list(panels(MODEL)) == [
        "Engines up", "Engines known", "Firing alerts", "Generation throughput",
        "Decode rate per request, by prompt band", "Time to first token", "Inter-token latency", "Queue depth",
        "KV cache usage", "Findings and events"]
    up = panels(MODEL)["Engines up"]
    assert [(s["value"], s["color"]) for s in up["fieldConfig"]["defaults"]["thresholds"]["steps"]] == [
        (None, "red"), (1, "green")]


def test_every_query_reads_schema_tables_and_runs_at_every_interval(timeline: Store) -> None:
    assert not problems(timeline, MODEL)


def test_throughput_counts_the_tokens_generated_each_second(timeline: Store) -> None:
    rows = answer(timeline, panel_sql(MODEL, "Generation throughput"), context(1000))
    assert len(rows) == STEPS
    assert sorted({r["tokens_per_s"] for r in rows}) == [2.0, 4.0]  # two decoding; a second with two steps


def test_throughput_of_a_drafting_engine_is_the_tokens_its_requests_got(store_url: str) -> None:
    run, window = speculative_run(store_url)
    generated = sum(decode_tokens(s) for s in run.steps)
    scheduled = sum(s.num_generation_tokens for s in run.steps)
    assert scheduled > 1.4 * generated  # the drafts scheduled and rejected, which the panel once counted
    store = Store.open(store_url)
    try:
        # The store keeps what vLLM reported, scheduled tokens (drafts included); the panel reads tokens generated.
        assert store.query("SELECT sum(num_generation_tokens) FROM steps").result_rows == [(scheduled,)]
        span = (int(window.start.timestamp() * 1000) - 120_000, int(window.end.timestamp() * 1000) + 60_000)
        for interval_ms in INTERVALS_MS:  # every row, per-second projection, per-minute projection
            ctx = QueryContext(*span, interval_ms, {"host": ALL, "engine": ALL})
            rows = answer(store, panel_sql(MODEL, "Generation throughput"), ctx)
            assert sum(r["tokens_per_s"] for r in rows) * interval_ms / 1000 == pytest.approx(generated)
    finally:
        store.client.command(f"DROP DATABASE IF EXISTS `{store.database}`")
        store.close()


def test_decode_rate_is_a_range_per_prompt_band(timeline: Store) -> None:
    bands = answer(timeline, panel_sql(MODEL, "Decode rate per request, by prompt band"), context(1000))
    # Each request generates 100 tokens: 1, 5 and 30 s of decode.
    assert [(b["band"], b["requests"]) for b in bands] == [("< 1k", 1), ("1k-8k", 1), ("32k-100k", 1)]
    assert [b["tok_per_s_p50"] for b in bands] == pytest.approx([100.0, 20.0, 100 / 30])
    assert [b["ttft_p99"] for b in bands] == pytest.approx([0.1, 1.0, 2.0])


def test_the_queue_gauge_and_the_events(timeline: Store) -> None:
    queue = answer(timeline, panel_sql(MODEL, "Queue depth"), context(1000))
    assert len(queue) == STEPS // 5 and {r["engine"] for r in queue} == {ENGINE}
    assert sorted({r["waiting"] for r in queue}) == [0.0, 1.0, 2.0]
    events = answer(timeline, panel_sql(MODEL, "Findings and events"), context(1000))
    assert [(e["kind"], e["severity"]) for e in events] == [("gpu_xid", "critical"), ("engine_config", "info")]


def test_prometheus_panels_select_the_configured_collector() -> None:
    exprs = promql(rendered(fleet.dashboard, AlertConfig(selector='job="edge"')))
    assert len(exprs) == 3
    assert all('job="edge"' in e for e in exprs if "stepline_" in e)
    assert any(e.startswith("sum by (alertname, severity, engine) (ALERTS") for e in exprs)


def test_slo_lines_come_from_the_shared_config() -> None:
    shown = panels(rendered(fleet.dashboard, AlertConfig(slo=Slo(ttft_p99_seconds=3.0))))
    steps = shown["Time to first token"]["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert [(s["value"], s["color"]) for s in steps] == [(None, "transparent"), (3.0, "red")]
