"""The merged read of `requests`: a request's reports are one row with the fields of both, times the earliest."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from stepline.model.rows import Request, micros
from stepline.queries.query import moment
from stepline.queries.requests import FIRST_TOKEN, MERGED, PROMPT_BAND, SCHEDULED, merged, merged_matching
from stepline.store.store import Store
from tests.queries.conftest import Rows

T0 = (datetime.now(UTC) - timedelta(hours=1)).replace(microsecond=0)
NAN = float("nan")


def _plugin(rid: str, at: float, prompt: int = 5000, engine: str = "e0") -> Request:
    """The plugin's report: finish reason, cached tokens, preemptions; finished `at` s after T0, arrived 2 s before."""
    return Request(micros(T0.timestamp() + at), "h", engine, 1, "m", rid, "plugin", "stop",
                   micros(T0.timestamp() + at - 2), 0.25, 0.2, 1.5, 1.7, 2.0, 0.5, 0.01, prompt, 4096, 150, 200, 1)


def _otlp(rid: str, at: float, prompt: int = 5000, engine: str = "e0") -> Request:
    """OTLP's report of the same request: its span ends 2 ms later, and knows no cached tokens or finish reason."""
    return Request(micros(T0.timestamp() + at + 0.002), "h", engine, 0, "m", rid, "otlp", "",
                   micros(T0.timestamp() + at - 2), 0.25, NAN, 1.5, 1.7, 2.0, 0.5, 0.01, prompt, 0, 150, 200, 0)


def _reports(store: Store, *batches: list[Request]) -> None:
    """Each batch its own insert (its own part), with background merges stopped: the table holds every report."""
    store.client.command(f"SYSTEM STOP MERGES `{store.database}`.`requests`")
    for batch in batches:
        store.insert("requests", batch, Request._fields)
    assert store.query("SELECT count() FROM requests").result_rows[0][0] == sum(len(b) for b in batches)


def test_two_reports_of_one_request_read_as_one_row_with_the_fields_of_both(store: Store, rows: Rows) -> None:
    _reports(store, [_plugin("a", 10.0)], [_otlp("a", 10.0), _otlp("b", 20.0)])
    found = rows(f"SELECT request_id, source, finish_reason, cached_tokens, preemptions, engine_index, "
                 f"toUnixTimestamp64Micro(ts) FROM {MERGED} ORDER BY request_id")
    assert found == [("a", "plugin", "stop", 4096, 1, 1, micros(T0.timestamp() + 10.0)),
                     ("b", "otlp", "", 0, 0, 0, micros(T0.timestamp() + 20.002))]


def test_a_database_qualified_table_merges_too(store: Store, rows: Rows) -> None:
    _reports(store, [_plugin("a", 10.0)], [_otlp("a", 10.0)])
    table = f"`{store.database}`.`requests`"
    assert rows(f"SELECT count(), sum(cached_tokens) FROM {merged(table)}") == [(1, 4096)]


def test_merged_matching_merges_the_reports_the_condition_picks(store: Store, rows: Rows) -> None:
    _reports(store, [_plugin("a", 10.0), _plugin("c", 30.0, prompt=100)],
             [_otlp("a", 10.0), _otlp("b", 20.0, engine="e1")])
    table = merged_matching("engine = {engine:String} AND prompt_tokens >= {least:UInt64}",
                            ("ts", "arrival_ts", "cached_tokens", "source"))
    found = rows(f"SELECT engine, request_id, toUnixTimestamp64Micro(ts), cached_tokens, source FROM {table} "
                 "ORDER BY request_id", engine="e0", least=1000)
    assert found == [("e0", "a", micros(T0.timestamp() + 10.0), 4096, "plugin")]


def test_merged_matching_merges_only_what_the_table_merges() -> None:
    # The table's key comes through as it is, asked for or not, the host included: a fleet's engines may share a
    # name, and a cluster keeps each host's requests on the shards of its (host, engine).
    assert merged_matching("1", ("host", "request_id", "arrival_ts")) == merged_matching("1", ())
    assert "GROUP BY host, engine, request_id, arrival_ts)" in merged_matching("1", ("prompt_tokens",))
    with pytest.raises(KeyError):
        merged_matching("1", ("no_such_column",))


def test_a_requests_moments_are_its_arrival_plus_queue_and_ttft(store: Store, rows: Rows) -> None:
    _reports(store, [_plugin("a", 10.0)])
    arrival = micros(T0.timestamp() + 8.0)
    assert rows(f"SELECT toUnixTimestamp64Micro({SCHEDULED}), toUnixTimestamp64Micro({FIRST_TOKEN}) "
                f"FROM {MERGED}") == [(arrival + 250_000, arrival + 500_000)]


@pytest.mark.parametrize(("prompt", "band"), [(1023, "< 1k"), (1024, "1k-8k"), (8192, "8k-32k"),
                                              (99_999, "32k-100k"), (100_000, ">= 100k")])
def test_prompt_bands(store: Store, rows: Rows, prompt: int, band: str) -> None:
    _reports(store, [_plugin("a", 10.0, prompt=prompt)])
    assert rows(f"SELECT {PROMPT_BAND} FROM {MERGED}") == [(band,)]


def test_a_window_of_the_merged_read_reads_only_the_days_it_can_hold(store: Store, rows: Rows) -> None:
    # force_index_by_date refuses a read that prunes no partition by ts: FINAL merging across partitions did not.
    yesterday = Request(*_plugin("old", 0.0)[:0], micros(T0.timestamp() - 86_400), *_plugin("old", 0.0)[1:])
    _reports(store, [_plugin("a", 10.0)], [yesterday])
    since = T0.replace(hour=0, minute=0, second=0)
    found = rows(f"SELECT request_id FROM {MERGED} WHERE ts >= {moment('since')}", since=since,
                 settings={"force_index_by_date": 1})
    assert found == [("a",)]
