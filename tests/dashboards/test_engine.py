"""The engine timeline: each step's scheduling, latency and cache beside its GPUs, read from the store."""

from __future__ import annotations

import math
from typing import Any

import pytest

from stepline.alerting.config import AlertConfig
from stepline.config.slo import Slo
from stepline.dashboards import engine
from stepline.diagnosis.common import utc
from stepline.store.store import Store
from tests.dashboards.conftest import GOLDEN, STEPS, answer, context, panel_sql, panels, problems, rendered
from tests.diagnosis.test_detectors import ENGINE, T0

MODEL = rendered(engine.dashboard)


def test_the_uid_and_slug_links_point_at_are_stable() -> None:
    # The requests dashboard and bookmarks link to /d/<uid>/<slug>: renaming either breaks them.
    assert (engine.UID, engine.SLUG) == ("stepline-engine-timeline", "stepline-engine-timeline")
    assert MODEL["uid"] == engine.UID
    assert (GOLDEN / "engine-timeline.json").read_text().count(f'"uid": "{engine.UID}"') == 1


def test_it_has_the_panels_an_operator_reads_a_step_by() -> None:
    assert list(panels(MODEL)) == [
        "Step duration", "Prefill vs decode tokens per step", "Running and waiting", "KV cache usage and preemptions",
        "Inter-token latency", "Prefix-cache hit rate", "Spec-decode acceptance", "SM clock", "Power",
        "DRAM bandwidth", "NVLink and PCIe"]
    assert {v["name"] for v in MODEL["templating"]["list"]} == {"datasource", "prometheus", "host", "engine"}


def test_every_query_reads_schema_tables_and_runs_at_every_interval(timeline: Store) -> None:
    assert not problems(timeline, MODEL)


def _by_time(rows: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Rows keyed by seconds since the timeline's start."""
    return {round(utc(r["time"]).timestamp() - T0.timestamp()): r for r in rows}


def test_steps_per_second_show_the_prefill_and_the_queue(timeline: Store) -> None:
    ctx = context(1000)
    queue = _by_time(answer(timeline, panel_sql(MODEL, "Running and waiting"), ctx))
    assert len(queue) == STEPS and {r["engine"] for r in queue.values()} == {ENGINE}
    assert (queue[3]["running"], queue[3]["waiting"]) == (2, 3)
    assert queue[60]["running"] == 3  # the second with the prefill: two decoding and one prefilling
    tokens = _by_time(answer(timeline, panel_sql(MODEL, "Prefill vs decode tokens per step"), ctx))
    assert (tokens[60]["prefill"], tokens[60]["decode"]) == (1024, 2)  # mean of its two steps
    duration = _by_time(answer(timeline, panel_sql(MODEL, "Step duration"), ctx))
    assert (duration[60]["max"], duration[60]["mean"]) == (250.0, 130.0)


def test_minutes_read_the_same_figures(timeline: Store) -> None:
    ctx = context(60_000)
    minutes = answer(timeline, panel_sql(MODEL, "Step duration"), ctx)
    # A minute is shown from its start: one that starts before the range (a partial first minute) is not.
    starts = {math.floor((T0.timestamp() + i) / 60) * 60_000 for i in range(STEPS)}
    assert len(minutes) == len({s for s in starts if s >= ctx.from_ms})
    assert max(r["max"] for r in minutes) == 250.0
    itl = answer(timeline, panel_sql(MODEL, "Inter-token latency"), context(60_000))
    assert max(r["max"] for r in itl) == pytest.approx(0.25)
    assert min(r["p50"] for r in itl) == pytest.approx(0.01, rel=0.01)  # bfloat16 quantiles: ~3 digits


def test_gpu_panels_show_the_engines_gpus(timeline: Store) -> None:
    clock = answer(timeline, panel_sql(MODEL, "SM clock"), context(1000))
    assert {r["gpu"] for r in clock} == {f"{ENGINE}/gpu0"} and {r["sm_clock_min"] for r in clock} == {1900.0}
    assert {r["power"] for r in answer(timeline, panel_sql(MODEL, "Power"), context(60_000))} == {400.0}


def test_the_engine_variable_narrows_every_panel(timeline: Store) -> None:
    assert answer(timeline, panel_sql(MODEL, "Running and waiting"), context(1000, engine=[ENGINE]))
    assert not answer(timeline, panel_sql(MODEL, "Running and waiting"), context(1000, engine=["another"]))
    assert not answer(timeline, panel_sql(MODEL, "SM clock"), context(1000, engine=["another"]))


def test_thresholds_come_from_the_shared_config() -> None:
    config = AlertConfig(slo=Slo(itl_p99_seconds=0.05, itl_p99_critical_seconds=0.5), kv_usage_warning_ratio=0.8,
                         kv_usage_critical_ratio=0.95)
    shown = panels(rendered(engine.dashboard, config))

    def lines(title: str) -> list[tuple[float | None, str]]:
        return [(s["value"], s["color"]) for s in shown[title]["fieldConfig"]["defaults"]["thresholds"]["steps"]]

    assert lines("Inter-token latency") == [(None, "transparent"), (0.05, "orange"), (0.5, "red")]
    assert lines("KV cache usage and preemptions") == [(None, "transparent"), (0.8, "orange"), (0.95, "red")]
