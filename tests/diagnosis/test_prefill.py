"""Long prefills: the decoders slowed beside them, the requests queued behind them, and chunk settings that the
steps show are not in effect."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from clickhouse_connect.driver.query import QueryResult

from stepline.diagnosis.prefill import (
    _LONG_PREFILLS,
    LongPrefill,
    config_not_in_effect,
    head_of_line_blocking,
    long_prefills,
    prefill_interference,
)
from stepline.model.rows import Event
from stepline.model.schema import REQUESTS_BY_PROMPT
from stepline.queries.query import Query
from stepline.store.store import Store
from tests.diagnosis.conftest import Timelines
from tests.diagnosis.test_detectors import T0, WINDOW, _monster, config, insert, request, steady, step
from tests.diagnosis.test_runs import chunks, decode_only


@pytest.fixture(scope="module")
def monster(timelines: Timelines) -> Store:
    """test_detectors' monster prefill (on its engine e0) in the module's store."""
    _monster(timelines.store)
    return timelines.store


def test_the_monsters_prefill_spans_the_steps_that_carried_it(monster: Store) -> None:
    assert long_prefills(monster, WINDOW) == {"e0": [LongPrefill(
        "monster", 250_000, 0, start=T0 + timedelta(seconds=100), end=T0 + timedelta(seconds=129),
        queue_end=T0 + timedelta(seconds=100), min_uncached_tokens=4 * 8192,
        first_chunk_ran=timedelta(milliseconds=1200))]}


def test_interference_and_queueing_are_two_findings_of_one_prefill(monster: Store) -> None:
    [slowed] = prefill_interference(monster, WINDOW)
    assert (slowed.kind, slowed.severity, slowed.evidence["request_id"]) == ("prefill_interference", "critical",
                                                                             "monster")
    assert slowed.title == "monster (250k uncached) prefill: ITL p99 1.20s vs 10ms"
    assert slowed.score == pytest.approx(4 * 1.2 * 30)  # request-seconds the four decoders were held
    [queued] = head_of_line_blocking(monster, WINDOW)  # told apart here; causes.merge folds them
    e = queued.evidence
    assert (e["request_id"], e["queued_requests"], e["counted_from_queue_s"]) == ("monster", 20, 1.0)
    assert (e["waiting_before"], e["waiting_peak_inside"], e["waiting_min_after"]) == (0, 30, 0)
    assert e["longest_queued"][0] == "short0 30.0s"
    assert _shown(monster, queued.sql)["queued_requests"] == 20  # the SQL counts the same requests


def _shown(store: Store, sql: str) -> dict[str, Any]:
    """The one row a finding's SQL gives, by column name."""
    result = store.query(sql)
    [row] = result.result_rows
    return dict(zip(result.column_names, row, strict=True))


def test_every_figure_a_finding_shows_is_what_its_sql_reads(monster: Store) -> None:
    # The SQL a finding shows is the query that ran, bound to the finding's one prefill: each figure both ways.
    [slowed] = prefill_interference(monster, WINDOW)
    e, shown = slowed.evidence, _shown(monster, slowed.sql)
    assert (shown["steps_inside"], shown["chunk_tokens"], shown["waiting_max_inside"]) == (30, 8192, 30)
    assert {k: e[k] for k in ("chunk_tokens", "waiting_max_inside")} == {
        "chunk_tokens": shown["chunk_tokens"], "waiting_max_inside": shown["waiting_max_inside"]}
    assert e["step_p50_inside_ms"] == round(shown["step_p50_inside_ms"], 1)
    assert e["step_p50_decode_only_outside_ms"] == round(shown["step_p50_decode_only_outside_ms"], 1)
    assert (e["itl_p50_inside_s"], e["itl_p99_inside_s"]) == tuple(round(v, 3) for v in shown["itl_inside_s"])
    assert (e["itl_p50_outside_s"], e["itl_p99_outside_s"]) == tuple(round(v, 3) for v in shown["itl_outside_s"])
    assert e["delayed_request_s"] == round(shown["delayed_request_s"], 1)
    assert e["own_steps_share"] == round(shown["own_steps_share"], 3)
    [queued] = head_of_line_blocking(monster, WINDOW)
    e, shown = queued.evidence, _shown(monster, queued.sql)
    assert (e["queued_requests"], e["queue_total_s"], e["queue_max_s"]) == (
        shown["queued_requests"], round(shown["queue_total_s"], 1), round(shown["queue_max_s"], 1))
    assert e["longest_queued"] == [f"{rid} {q:.1f}s" for rid, q in shown["worst"]]


def test_a_queue_that_was_there_before_the_prefill_is_not_its_doing(store: Store) -> None:
    _monster(store)  # a store of its own: the step added here would change the monster of the others
    insert(store, [step(98.75, waiting=30, n=999)])  # just before its first chunk's step began (98.8 s)
    assert head_of_line_blocking(store, WINDOW) == []
    assert [f.kind for f in prefill_interference(store, WINDOW)] == ["prefill_interference"]


def test_a_prefill_still_running_is_named_by_what_it_prefilled_so_far(timelines: Timelines) -> None:
    window = timelines.add("in_flight", [config(), *decode_only(0, 500), *chunks(520, 6, 1000)])
    [found] = prefill_interference(timelines.store, window)
    assert found.title.startswith("a prefill of 49k tokens so far prefill: ITL p99 1.20s")
    assert found.evidence["request_id"] == "" and found.evidence["prompt_tokens"] == 6 * 8192
    assert found.evidence["in_flight"].startswith("no finished request in the window was this prefill")


def test_a_long_prompt_served_from_the_prefix_cache_is_no_long_prefill(timelines: Timelines) -> None:
    rows = [*steady(), request("cached-monster", 300.0, 0.0, 0.2, 5.0, 250_000, cached=249_000),
            step(300.1, 15.0, prefill=1000, n=9000)]
    window = timelines.add("cache_hit", rows)
    assert long_prefills(timelines.store, window) == {}
    assert prefill_interference(timelines.store, window) == []


def test_a_budget_the_steps_exceed_is_not_in_effect(timelines: Timelines) -> None:
    window = timelines.add("over_budget", [*steady(), step(300.0, 900.0, prefill=9000, n=9000)])
    [found] = config_not_in_effect(timelines.store, window)
    assert (found.severity, found.title) == ("warning", "max_num_batched_tokens=8192 but 1 steps carried up to 9002")
    assert found.evidence == {"max_num_batched_tokens": 8192, "steps_over_budget": 1, "max_step_tokens": 9002}


def test_a_budget_that_never_binds_while_requests_wait_is_told(timelines: Timelines) -> None:
    window = timelines.add("never_binds", [*steady(), step(300.0, 15.0, prefill=512, waiting=3, n=9000)])
    [found] = config_not_in_effect(timelines.store, window)
    assert (found.severity, found.title) == ("info", "max_num_batched_tokens=8192 never binds: steps carry at most 514")
    assert found.evidence["waiting_max"] == 3


def test_without_configured_limits_there_is_nothing_to_check(timelines: Timelines) -> None:
    rows = [r for r in steady() if not isinstance(r, Event)] + [step(300.0, 900.0, prefill=9000, n=9000)]
    assert config_not_in_effect(timelines.store, timelines.add("unconfigured", rows)) == []


def test_the_long_prefill_candidates_are_read_from_the_requests_by_prompt_projection(store: Store) -> None:
    # Enough requests (many granules) that the projection reads fewer marks than the table: short ones, and in
    # every granule a long one served from the cache (read, then ruled out); two long uncached ones, one reported
    # twice (the plugin's report, then OTLP's without cached tokens): merged as from the table, never twice.
    store.client.command(
        "INSERT INTO requests (ts, host, engine, request_id, source, arrival_ts, queue_seconds, ttft_seconds, "
        "prompt_tokens, cached_tokens) SELECT {t0:DateTime64(6)} + toIntervalMillisecond(number), 'h', 'e0', "
        "concat('r', toString(number)), 'plugin', {t0:DateTime64(6)}, 0.01, 0.1, "
        "if(number % 1000 = 0, 300000, 100) AS prompt, prompt FROM numbers(200000)",
        parameters={"t0": T0 + timedelta(seconds=10)})
    insert(store, [request("long1", 100, 0.5, 20, 5, 200_000, cached=1000),
                   request("long2", 110, 0.5, 10, 5, 50_000)])
    insert(store, [request("long1", 100, 0.5, 20, 5, 200_000)._replace(source="otlp", cached_tokens=0)])
    query = Query(_LONG_PREFILLS, engine="", start=WINDOW.start, end=WINDOW.end, budget_engines=["e0"],
                  min_uncached=[32_768], unknown=2**63, least_uncached=32_768)

    class ByPrompt:
        """The store's client, told to fail any query that does not read the projection."""

        def query(self, sql: str, parameters: dict[str, Any] | None = None) -> QueryResult:
            return store.client.query(sql, parameters=parameters,
                                      settings={"force_optimize_projection_name": REQUESTS_BY_PROMPT.name})

    rows = [(r[1], r[2], r[3]) for r in query.rows(ByPrompt())]
    assert rows == [("long1", 200_000, 1000), ("long2", 50_000, 0)]
    assert rows == [(r[1], r[2], r[3]) for r in query.rows(store)]  # the same as from the table's rows
