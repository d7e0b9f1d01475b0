"""A request reported by the plugin and by OTLP is one row with every field either knows, in any order, across a
collector restart, a retry and a replayed batch (against the embedded ClickHouse)."""

from __future__ import annotations

import gc
import math
import struct
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from prometheus_client import CollectorRegistry

from stepline.app.collector import Collector
from stepline.config.settings import Settings
from stepline.ingest.merge import RecentRequests, arrival_tolerance_us, known_fields
from stepline.ingest.metrics import IngestMetrics
from stepline.ingest.writer import Writers
from stepline.model.rows import UNKNOWN_FINISH_REASON, Request, micros
from stepline.plugin import wire
from stepline.sources.otlp_decode import PROTOBUF, decode
from stepline.sources.registry import REGISTRY
from stepline.store import batches
from stepline.store.errors import StoreUnreachable
from stepline.store.store import Store
from stepline.testing.sink import MemorySink, wait_until

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
    w = Writers(store, IngestMetrics(CollectorRegistry()), flush_interval_s=0.01)
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


def test_the_plugins_finish_reason_wins_over_a_span_that_has_none(store: Store, writers: Writers) -> None:
    # vLLM's span gives no finish reason: its row says UNKNOWN_FINISH_REASON, which must lose the table's max merge to
    # every reason the plugin sends ("abort" sorts first of them), whichever report comes first.
    reasons = [r for r in wire.FINISH_REASONS if r]
    assert _otlp("x").finish_reason == UNKNOWN_FINISH_REASON
    writers.write([_otlp(f"{reason}-span-first") for reason in reasons])
    writers.write([_plugin(f"{reason}-plugin-first")._replace(finish_reason=reason) for reason in reasons])
    _written(store, 2 * len(reasons))
    writers.write([_plugin(f"{reason}-span-first")._replace(finish_reason=reason) for reason in reasons])
    writers.write([_otlp(f"{reason}-plugin-first") for reason in reasons])
    writers.stop()
    assert sorted((r.request_id, r.finish_reason) for r in _stored(store)) == sorted(
        (f"{reason}-{first}", reason) for reason in reasons for first in ("span-first", "plugin-first"))
    # The table merges so too where the collector wrote both reports (a replayed spool, two collectors).
    plugin = _plugin("both")._replace(finish_reason="abort")
    store.insert("requests", [_otlp("both")._replace(arrival_ts=plugin.arrival_ts), plugin], Request._fields)
    assert store.query("SELECT finish_reason FROM requests FINAL WHERE request_id = 'both'").result_rows == [
        ("abort",)]


def test_a_batch_inserted_again_counts_once(store: Store) -> None:
    # A replayed spool segment whose deduplication token the table no longer holds (or a copy sent by hand).
    # The span of "a" as the writers place it: under its request's arrival (its own can lie a microsecond off).
    span = _otlp("a")._replace(arrival_ts=_plugin("a").arrival_ts)
    batch = batches.encode("requests", [span, _plugin("a"), _plugin("b")])
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


# Identity: which request a report is of (stepline.ingest.merge). Reports built by hand, at an instant of their own.
T0 = 1_780_000_000.0


def _report(rid: str, source: str, arrival: float, e2e: float = 2.0, prompt: int = 1000, generated: int = 10,
            cached: int = 0) -> Request:
    """A report of a request that arrived at `arrival`: the plugin's with its fields, the span's without them."""
    plugin = source == "plugin"
    return Request(micros(arrival + e2e), HOST, "eng", 1 if plugin else 0, "m", rid, source,
                   "stop" if plugin else "", micros(arrival), 0.1, 0.2, e2e - 0.3, e2e - 0.1, e2e, 0.3,
                   (e2e - 0.3) / 9 if plugin else math.nan, prompt, cached if plugin else 0, generated, 16,
                   0)


def test_a_reused_id_later_is_another_request() -> None:
    recent = RecentRequests()
    first = _report("cmpl-x-0", "plugin", T0, prompt=18_105, cached=0)._replace(model_name="")
    again = _report("cmpl-x-0", "plugin", T0 + 120, prompt=18_105, cached=18_048)._replace(model_name="")
    assert recent.place(first) == first and recent.place(again) == again
    # Each one's span, 1 µs off its plugin arrival (nanoseconds against float seconds), joins its own request.
    for plugin in (first, again):
        span = _report("cmpl-x-0", "otlp", plugin.arrival_ts / 1e6 + 1e-6, prompt=18_105)
        placed = recent.place(span._replace(model_name="served"))  # a field the plugin lacked: written
        assert placed is not None and placed.arrival_ts == plugin.arrival_ts
        assert recent.place(span) is None  # the same span again adds nothing


def test_two_requests_side_by_side_under_one_id_stay_two_in_any_order() -> None:
    # Sent together with one X-Request-Id: the same prompt, the same output, arrivals 300 µs apart. In the first
    # order the second's span comes before its plugin report and after the first's: it must not join the first.
    # (The plugin reports lack the model, the spans name it: every report adds a field, so every one is written.)
    pairs = {name: (_report("dup", "plugin", at)._replace(model_name=""),
                    _report("dup", "otlp", at + 1e-6)._replace(model_name="served"))
             for name, at in (("a", T0), ("b", T0 + 0.0003))}
    a_plugin, a_span = pairs["a"]
    b_plugin, b_span = pairs["b"]
    for order in ([a_plugin, b_span, b_plugin, a_span], [a_span, b_span, a_plugin, b_plugin],
                  [b_plugin, a_plugin, a_span, b_span], [b_span, a_plugin, a_span, b_plugin]):
        recent = RecentRequests()
        keys = {}
        for report in order:
            placed = recent.place(report)
            assert placed is not None
            keys[report] = placed.arrival_ts
        assert keys[a_plugin] == keys[a_span] != keys[b_plugin] == keys[b_span], order


def test_a_second_report_of_one_source_is_another_request_unless_it_is_the_same_report() -> None:
    recent = RecentRequests()
    plugin = _report("r", "plugin", T0)
    assert recent.place(plugin) == plugin
    assert recent.place(plugin) is None  # a retried batch, a replayed spool: the same report
    twin = _report("r", "plugin", T0 + 1e-6)  # a plugin report 1 µs off: another request, however close
    assert recent.place(twin) == twin


def test_token_counts_that_differ_are_different_requests() -> None:
    recent = RecentRequests()
    recent.place(_report("r", "plugin", T0, prompt=1000)._replace(model_name=""))
    span = _report("r", "otlp", T0, prompt=999)
    placed = recent.place(span)
    assert placed == span  # its own request: written with its own arrival
    assert recent.place(_report("r", "otlp", T0, generated=10, prompt=1000)._replace(model_name="x")) is not None


def test_the_arrival_tolerance_is_the_wire_s_float32_e2e() -> None:
    # A 20-minute request: float32 keeps e2e to about 60 µs, so the plugin's arrival can lie that far from the span's.
    e2e = 1200.0
    off = e2e + 3.3e-5 - struct.unpack("<f", struct.pack("<f", e2e + 3.3e-5))[0]  # float32's rounding of it
    assert abs(off) > 2e-6
    report = _report("long", "otlp", T0, e2e=e2e)
    assert arrival_tolerance_us(report) >= abs(off) * 1e6 and arrival_tolerance_us(report) < 1000
    recent = RecentRequests()
    recent.place(_report("long", "plugin", T0 + 3.3e-5, e2e=e2e)._replace(model_name=""))
    placed = recent.place(report._replace(model_name="served"))
    assert placed is not None and placed.arrival_ts == micros(T0 + 3.3e-5)
    # A short request's two reports must agree to within microseconds.
    assert arrival_tolerance_us(_report("short", "otlp", T0, e2e=0.5)) <= 3


def test_requests_sharing_an_id_are_rows_of_their_own_in_the_store(store: Store, writers: Writers) -> None:
    # The case, as the real engine reports it: an uncached 18k prompt, then the same prompt again under the
    # same X-Request-Id, now served from the prefix cache; each reported by the plugin and by a span.
    first = _report("cmpl-retry-0", "plugin", NOW - 200, prompt=18_105, cached=0)._replace(model_name="")
    again = _report("cmpl-retry-0", "plugin", NOW - 100, prompt=18_105, cached=18_048)._replace(model_name="")
    spans = [_report("cmpl-retry-0", "otlp", r.arrival_ts / 1e6, prompt=18_105)._replace(model_name="served")
             for r in (first, again)]
    writers.write([first, spans[1]])
    writers.write([spans[0], again])
    writers.stop()
    assert store.query("SELECT count(), sum(prompt_tokens), sum(cached_tokens), groupArray(model_name) "
                       "FROM requests FINAL").result_rows == [(2, 36_210, 18_048, ["served", "served"])]


def test_the_dedup_memory_is_bounded_in_time_and_count() -> None:
    now = [0.0]
    recent = RecentRequests(window_s=60, max_entries=3, monotonic=lambda: now[0])
    a = _report("a", "plugin", T0)
    assert recent.place(a) == a and recent.place(a) is None
    for rid in "bcd":
        assert recent.place(a._replace(request_id=rid))
    assert len(recent) == 3 and recent.place(a) == a  # "a" was pushed out by count
    now[0] = 61.0
    assert recent.place(a._replace(request_id="b"))  # and "b" by age


def test_a_report_is_written_again_only_for_a_field_the_earlier_ones_lacked() -> None:
    recent = RecentRequests()
    span = _report("a", "otlp", T0)
    assert recent.place(span) == span
    plugin = _report("a", "plugin", T0, cached=900)
    assert recent.place(plugin) == plugin  # finish reason, cached tokens, TPOT: new
    assert recent.place(span) is None and recent.place(plugin) is None
    assert recent.place(span._replace(preemptions=1))  # a count nobody gave yet
    assert known_fields(span) & ~known_fields(plugin) == 0
    assert known_fields(plugin._replace(cached_tokens=0, model_name="")) < known_fields(plugin)


def test_known_fields_gives_a_bit_for_each_field_a_report_knows() -> None:
    merged = [name for name in Request._fields if name not in ("ts", "host", "engine", "request_id", "arrival_ts")]
    plugin = _report("a", "plugin", T0, cached=900)

    def known(name: str, value: Any) -> bool:
        return bool(known_fields(plugin._replace(**{name: value})) & 1 << merged.index(name))

    for name in merged:
        value = getattr(plugin, name)
        if name == "source":
            assert known(name, "plugin") and not known(name, "otlp")
        elif isinstance(value, float):  # seconds: 0.0 is a time, NaN is unknown
            assert known(name, 0.0) and known(name, 2.5) and not known(name, math.nan)
        elif isinstance(value, int):  # counts: 0 is unknown
            assert known(name, 7) and not known(name, 0)
        else:  # text: empty is unknown
            assert known(name, "x") and not known(name, "")


def test_a_request_reported_by_the_plugin_and_by_otlp_is_written_once() -> None:
    metrics = IngestMetrics(CollectorRegistry())
    sink = MemorySink()
    writers = Writers(sink, metrics, flush_interval_s=0.01)
    writers.start()
    plugin = _report("r1", "plugin", T0)
    otlp = _report("r1", "otlp", T0)
    assert writers.write([plugin, otlp, plugin._replace(engine="other")]) == 2
    writers.stop()
    assert [(r.engine, r.source) for r in sink.rows("requests")] == [("eng", "plugin"), ("other", "plugin")]
    assert metrics.registry.get_sample_value("stepline_requests_deduplicated_total", {"source": "otlp"}) == 1


def test_a_report_older_than_the_memory_is_looked_up_in_the_store(store: Store, store_url: str) -> None:
    # A 25-minute request whose span was written, then the collector restarted; the plugin's report comes from its
    # backlog. The new collector remembers only the last ten minutes' requests: it asks the store for this one.
    old = NOW - 1500
    span = _report("slow", "otlp", old, e2e=5.0)._replace(model_name="served")
    plugin = _report("slow", "plugin", old + 2e-6, e2e=5.0, cached=512)
    before = _collector(store_url)
    try:
        assert before.writers is not None
        before.writers.write([span])
    finally:
        before.stop()
    after = _collector(store_url)
    try:
        assert after.writers is not None
        assert after.writers.write([plugin]) == 1
    finally:
        after.stop()
    assert store.query("SELECT count(), sum(cached_tokens), any(model_name), any(source) FROM requests FINAL"
                       ).result_rows == [(1, 512, "served", "plugin")]
    assert after.metrics.registry.get_sample_value("stepline_requests_unresolved_total") == 0


def test_a_lookup_that_fails_is_counted_and_the_report_kept(caplog: pytest.LogCaptureFixture) -> None:
    def down(keys: Sequence[tuple[str, str]]) -> list[Request]:
        raise StoreUnreachable(f"the store at chdb://x does not answer (asked for {len(keys)} ids)")

    metrics = IngestMetrics(CollectorRegistry())
    sink = MemorySink()
    writers = Writers(sink, metrics, flush_interval_s=0.01, lookup=down)
    writers.start()
    report = _report("old", "plugin", time.time() - 3600)
    assert writers.write([report]) == 1
    writers.stop()
    assert [(r.request_id, r.arrival_ts) for r in sink.rows("requests")] == [("old", report.arrival_ts)]
    assert metrics.registry.get_sample_value("stepline_requests_unresolved_total") == 1
    assert "does not answer (asked for 1 ids)" in caplog.text


def test_the_memory_of_requests_leaves_nothing_for_the_garbage_collector_to_follow() -> None:
    # The memory may hold 500,000 requests for ten minutes; kept as objects, each full collection (gctune's) walked
    # them all with the GIL held. Plain tuples of numbers and strings leave the collector's lists at its first pass.
    reports = [_report(f"r{i}", "plugin", T0 + i)._replace(model_name="") for i in range(2_000)]
    reports += [_report(f"r{i}", "otlp", T0 + i)._replace(model_name="served") for i in range(0, 2_000, 2)]  # joined
    reports += [_report("r1", "plugin", T0 + 500)]  # another request under a known id
    gc.collect()
    before = len(gc.get_objects())
    recent = RecentRequests()
    for report in reports:
        assert recent.place(report) is not None
    del reports, report
    gc.collect()
    assert len(recent) == 2_000
    assert len(gc.get_objects()) - before < 20  # the memory itself and its lock, not one object per request
