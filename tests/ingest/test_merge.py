"""A request reported by the plugin and by OTLP is one row with every field either knows, in any order, across a
collector restart, a retry and a replayed batch (against the embedded ClickHouse)."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterator, Sequence

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from stepline.app.collector import Collector
from stepline.config.settings import Settings
from stepline.core.selfmetrics import SelfMetrics
from stepline.ingest.writer import Writers
from stepline.model.rows import Request, micros
from stepline.sources.otlp_decode import PROTOBUF, decode
from stepline.sources.registry import REGISTRY
from stepline.store import batches
from stepline.store.store import Store
from stepline.testing.sink import wait_until

HOST = "h"
NOW = time.time() - 30  # set again before each test: the collector remembers only the last ten minutes' requests


@pytest.fixture(autouse=True)
def _now_is_now(monkeypatch: pytest.MonkeyPatch) -> None:
    # A module-level instant grows older while the rest of the suite runs; past the collector's memory window
    # (RecentRequests.WINDOW_S) a restarted collector would rightly not remember the first reports.
    monkeypatch.setattr(sys.modules[__name__], "NOW", time.time() - 30)
CACHED = 20_875


def _plugin(rid: str, cached: int = CACHED, model: str = "served-model", at: float | None = None) -> Request:
    """What the plugin receiver makes of vLLM's FinishedRequestStats (a fully cached prompt, preempted twice)."""
    at = NOW if at is None else at
    return Request(micros(at), HOST, "eng", 1, model, rid, "plugin", "stop", micros(at - 2.0), 0.25, 0.05, 1.7,
                   1.75, 2.0, 0.3, 1.7 / 15, 20_876, cached, 16, 64, 2)


def _otlp(rid: str, at: float | None = None) -> Request:
    """What the OTLP receiver makes of vLLM's llm_request span for the same request: no finish reason, cached
    tokens, preemptions or engine index; a span ending 3 ms after the plugin's step."""
    at = NOW if at is None else at
    attrs = {"gen_ai.request.id": AnyValue(string_value=rid),
             "gen_ai.response.model": AnyValue(string_value="served-model"),
             "gen_ai.usage.prompt_tokens": AnyValue(int_value=20_876),
             "gen_ai.usage.completion_tokens": AnyValue(int_value=16),
             "gen_ai.request.max_tokens": AnyValue(int_value=64),
             "gen_ai.latency.time_in_queue": AnyValue(double_value=0.25),
             "gen_ai.latency.time_to_first_token": AnyValue(double_value=0.3),
             "gen_ai.latency.e2e": AnyValue(double_value=2.0),
             "gen_ai.latency.time_in_model_decode": AnyValue(double_value=1.7)}
    span = Span(name="llm_request", start_time_unix_nano=round((at - 2.0) * 1e9),
                end_time_unix_nano=round((at + 0.003) * 1e9),
                attributes=[KeyValue(key=k, value=v) for k, v in attrs.items()])
    message = ExportTraceServiceRequest()
    rs = message.resource_spans.add()
    rs.resource.attributes.add(key="service.name", value=AnyValue(string_value="eng"))
    rs.scope_spans.add().spans.append(span)
    (row,) = decode(message.SerializeToString(), PROTOBUF, HOST).rows
    return row


def _stored(store: Store) -> list[Request]:
    """The requests as every reader sees them: merged (FINAL), one row per request."""
    columns = ", ".join(f"toUnixTimestamp64Micro({n})" if n in ("ts", "arrival_ts") else n for n in Request._fields)
    return [Request._make(row) for row in store.query(
        f"SELECT {columns} FROM requests FINAL ORDER BY request_id").result_rows]


def _assert_merged(store: Store, ids: Sequence[str], *, model: str = "served-model") -> None:
    rows = _stored(store)
    assert [r.request_id for r in rows] == sorted(ids)
    for row in rows:
        # The plugin's fields ...
        assert (row.finish_reason, row.cached_tokens, row.preemptions, row.engine_index) == ("stop", CACHED, 2, 1)
        assert row.source == "plugin"
        # ... and those both know, which agree.
        assert row.model_name == model
        assert (row.prompt_tokens, row.generation_tokens, row.max_tokens) == (20_876, 16, 64)
        assert math.isclose(row.ttft_seconds, 0.3, rel_tol=1e-6) and math.isclose(row.e2e_seconds, 2.0)
        assert math.isclose(row.prefill_seconds, 0.05, rel_tol=1e-6)  # the span leaves it out: the plugin's
        # The earlier of the two reports' arrivals; within 1 µs: the span's nanoseconds and the plugin's float
        # seconds round the same instant apart.
        assert row.ts == micros(NOW) and abs(row.arrival_ts - micros(NOW - 2.0)) <= 1
    assert store.query("SELECT count(), sum(cached_tokens) FROM requests FINAL").result_rows == [
        (len(ids), CACHED * len(ids))]


@pytest.fixture
def writers(store: Store) -> Iterator[Writers]:
    w = Writers(store, SelfMetrics(), flush_interval_s=0.01)
    w.start()
    yield w
    w.stop()


def _written(store: Store, rows: int) -> None:
    wait_until(lambda: store.query("SELECT count() FROM requests").result_rows[0][0] >= rows)


def test_plugin_first_then_otlp(store: Store, writers: Writers) -> None:
    # "b"'s plugin row has no model yet (the collector had not seen the engine's configuration): the span has it.
    writers.write([_plugin("a"), _plugin("b", model="")])
    _written(store, 2)
    writers.write([_otlp("a"), _otlp("b")])
    writers.stop()
    _assert_merged(store, ["a", "b"])
    assert store.query("SELECT count() FROM requests").result_rows == [(3,)]  # a's span added nothing: not written


def test_otlp_first_then_plugin(store: Store, writers: Writers) -> None:
    writers.write([_otlp("a")])
    _written(store, 1)
    writers.write([_plugin("a")])
    writers.stop()
    _assert_merged(store, ["a"])


def test_both_in_one_batch_in_either_order(store: Store, writers: Writers) -> None:
    writers.write([_otlp("a"), _plugin("a"), _plugin("b"), _otlp("b")])
    writers.stop()
    _assert_merged(store, ["a", "b"])


def test_the_same_report_twice(store: Store, writers: Writers) -> None:
    writers.write([_otlp("a"), _otlp("a")])
    _written(store, 1)
    writers.write([_plugin("a"), _plugin("a")])
    writers.write([_otlp("a")])
    writers.stop()
    _assert_merged(store, ["a"])


def test_a_batch_inserted_again_counts_once(store: Store) -> None:
    # A replayed spool segment whose deduplication token the table no longer holds (or a copy sent by hand).
    batch = batches.encode("requests", [_otlp("a"), _plugin("a"), _plugin("b")])
    for token in ("one", "two", None):
        store.insert_native("requests", Request._fields, batch, token)
    _assert_merged(store, ["a", "b"])


def _collector(store_url: str) -> Collector:
    settings = Settings.from_env({}, store=store_url, engines=(), metrics_port=0, query_port=0,
                                 host_name=HOST, flush_interval_s=0.05,
                                 disabled_sources=frozenset(spec.name for spec in REGISTRY))
    collector = Collector(settings)
    collector.start()
    return collector


@pytest.mark.parametrize("first", ["plugin", "otlp"])
def test_the_second_report_after_a_collector_restart(store: Store, store_url: str, first: str) -> None:
    # r0 and r1: plugin rows written before the collector saw the engine's configuration (no model; the span has it).
    reports = {"plugin": [_plugin(f"r{i}", model="" if i < 2 else "served-model") for i in range(5)],
               "otlp": [_otlp(f"r{i}") for i in range(5)]}
    second = "otlp" if first == "plugin" else "plugin"
    before = _collector(store_url)
    try:
        assert before.writers is not None
        before.writers.write(reports[first])
    finally:
        before.stop()
    after = _collector(store_url)
    try:
        assert after.writers is not None
        after.writers.write(reports[second])
    finally:
        after.stop()
    _assert_merged(store, [f"r{i}" for i in range(5)])
    # The new collector knew what the store held: a span that adds nothing to the plugin's report is not written.
    rows = store.query("SELECT count() FROM requests").result_rows[0][0]
    assert rows == (7 if first == "plugin" else 10)


def test_a_run_like_the_real_engines_sums_every_cached_token(store: Store, writers: Writers) -> None:
    # 107 requests, OTLP first for 38 of them (as on the real vLLM engine), every report in its own batch.
    ids = [f"req-{i:03d}" for i in range(107)]
    for i, rid in enumerate(ids):
        first, second = (_otlp(rid), _plugin(rid)) if i < 38 else (_plugin(rid), _otlp(rid))
        writers.write([first])
        writers.write([second])
    writers.stop()
    _assert_merged(store, ids)
