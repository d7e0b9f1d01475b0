"""Fuzzing what the sources take from outside: /metrics text and plugin datagrams (and the shared helpers).

The property throughout: an input ends in valid rows, or in a clean one-line error and a counter (the runner's
source errors, the receivers' own counts); never an uncaught exception, a hang, an internal 500 or a row the
store cannot take. OTLP is fuzzed in test_fuzz_otlp.py, the query endpoint in test_fuzz_query.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import socket
import struct
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from stepline.core.clock import ManualClock
from stepline.ingest.metrics import IngestMetrics
from stepline.ingest.runner import MAX_AHEAD_S, Runner
from stepline.ingest.writer import Writers
from stepline.model.rows import EngineSample, Request, Row
from stepline.plugin import wire
from stepline.sources.base import Emit, SourceContext
from stepline.sources.plugin_receiver import PluginReceiver
from stepline.sources.vllm_metrics import ExpositionError, VllmMetricsSource, parse_exposition
from stepline.testing.sink import MemorySink
from tests.conftest import VLLM_METRICS_FIXTURE

NOW = float(int(time.time()))
FIXTURE = VLLM_METRICS_FIXTURE.read_bytes()
INT64 = 1 << 63
FAST = settings(max_examples=100, deadline=10_000, suppress_health_check=[HealthCheck.too_slow])


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def logged_errors() -> Iterator[list[logging.LogRecord]]:
    """ERROR records of stepline's loggers (a runner logs a source's bug at ERROR, with its traceback)."""
    handler = _Errors()
    logger = logging.getLogger("stepline")
    logger.addHandler(handler)
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)


def one_line(message: str) -> bool:
    return bool(message) and "\n" not in message


class Bench:
    """A runner on a manual clock, writing into memory: the path every source's rows take."""

    def __init__(self) -> None:
        self.metrics = IngestMetrics(CollectorRegistry())
        self.runner = Runner([], Writers(MemorySink(), self.metrics), self.metrics, "fuzz", clock=ManualClock(NOW))

    def value(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0


def mutate(data: bytes, draw: Any, alphabet: bytes) -> bytes:
    """A few byte-level edits: overwrite, insert, delete, duplicate a span."""
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 6))):
        at = draw(st.integers(0, len(out)))
        op = draw(st.sampled_from(["set", "insert", "delete", "duplicate"]))
        if op == "set" and out:
            out[min(at, len(out) - 1)] = draw(st.sampled_from(alphabet))
        elif op == "insert":
            out[at:at] = bytes(draw(st.lists(st.sampled_from(alphabet), min_size=1, max_size=8)))
        elif op == "delete":
            del out[at : at + draw(st.integers(1, 16))]
        else:
            start = draw(st.integers(0, len(out)))
            out[at:at] = out[start : start + draw(st.integers(1, 32))]
    return bytes(out)


# ---- (a) the /metrics exposition ---------------------------------------------------------------------------

METRIC_NAMES = st.sampled_from([
    "vllm:num_requests_running", "vllm:prompt_tokens_total", "vllm:prompt_tokens_created",
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum", "vllm:cache_config_info",
    "process_start_time_seconds", "http_requests_total", "vllm:", "vllm:a b", "vllm:x{", "",
])
SAMPLE_VALUES = st.sampled_from(["1", "0", "-1", "3.5e-3", "NaN", "+Inf", "-Inf", "1e400", "-1e400", "0x10", "",
                                 "abc", "9" * 400, "1 1700000000000", "1 abc"])
LABEL_TEXT = st.text(max_size=10) | st.sampled_from(['"', "\\", "\n", "}", ",", "=", "+Inf", "\\u0000"])
LABELS = st.dictionaries(st.sampled_from(["model_name", "engine", "le", "reason", "a b", "", "0x", "é"]), LABEL_TEXT,
                         max_size=3)
EXPOSITION_LINES = st.one_of(
    st.builds(lambda n, t: f"# TYPE {n} {t}", METRIC_NAMES,
              st.sampled_from(["counter", "gauge", "histogram", "summary", "info", "untyped", "stateset", "x", ""])),
    st.builds(lambda n, h: f"# HELP {n} {h}", METRIC_NAMES, st.text(max_size=10)),
    st.builds(lambda n, labels, v, quote: n + ("{" + ",".join(f'{k}="{quote(x)}"' for k, x in labels.items()) + "}"
                                              if labels else "") + f" {v}",
              METRIC_NAMES, LABELS, SAMPLE_VALUES,
              st.sampled_from([str, lambda x: x.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")])),
    st.text(max_size=30),
)


@st.composite
def mutated(draw: st.DrawFn, data: bytes, alphabet: bytes) -> bytes:
    return mutate(data, draw, alphabet)


EXPOSITIONS = st.one_of(
    st.lists(EXPOSITION_LINES, max_size=20).map(lambda lines: "\n".join(lines).encode()),
    mutated(FIXTURE, b' \n{}",=#\\:_.+-0123456789eINaf\xff\x00'),
    st.binary(max_size=200),
)
CONTENT_TYPES = st.sampled_from(["text/plain; version=0.0.4", "application/openmetrics-text", "text/html", "", "x"])


@FAST
@given(EXPOSITIONS)
def test_the_exposition_parser_gives_vllm_samples_or_one_clear_line(body: bytes) -> None:
    try:
        samples, start_time = parse_exposition(body.decode("utf-8", errors="replace"))
    except ExpositionError as exc:
        assert one_line(str(exc))
        return
    assert samples and all(s.metric.startswith("vllm:") and not s.metric.endswith("_created") for s in samples)
    assert {s.kind for s in samples} <= {"counter", "gauge", "bucket", "sum", "count", "info"}
    assert start_time is None or math.isfinite(start_time)


@FAST
@given(st.lists(st.tuples(EXPOSITIONS, CONTENT_TYPES), min_size=1, max_size=3))
def test_scraping_any_page_yields_rows_or_a_counted_source_error(pages: list[tuple[bytes, str]]) -> None:
    bench = Bench()
    # The real page between fuzzed ones: state carried across scrapes (deltas, restarts, up/down) is fuzzed too.
    pages = [pages[0], (FIXTURE, "text/plain"), *pages[1:]]
    served = iter(pages)
    source = VllmMetricsSource("http://10.0.0.7:8000", SourceContext("h", ManualClock(NOW)),
                               fetch=lambda url, timeout: next(served)[::-1])
    rows: list[Row] = []
    with logged_errors() as errors:
        for _ in pages:
            before = bench.value("stepline_source_errors_total", source=source.name)
            ok = bench.runner.poll_once(_Tap(source, rows))
            after = bench.value("stepline_source_errors_total", source=source.name)
            assert after == before + (0 if ok else 1)
            assert bench.value("stepline_source_up", source=source.name) == (1 if ok else 0)
    assert errors == []
    for row in rows:
        assert not (isinstance(row, EngineSample) and math.isnan(row.delta)), row


class _Tap:
    """Wraps a source, keeping a copy of what it emits."""

    def __init__(self, source: Any, rows: list[Row]) -> None:
        self.source, self.rows = source, rows
        self.name = source.name

    def poll(self, emit: Emit) -> None:
        def keep(batch: Any) -> None:
            listed = list(batch)
            self.rows.extend(listed)
            emit(listed)

        self.source.poll(keep)

    def stats(self) -> dict[str, int]:
        """The source's own counts, when it keeps any (the runner exports them)."""
        counts: dict[str, int] = getattr(self.source, "stats", dict)()
        return counts


# ---- (b) plugin datagrams ----------------------------------------------------------------------------------

TIMESTAMPS = st.sampled_from([NOW, NOW - 1, NOW + 3600, NOW - 400 * 86400, 0.0, -1.0, 1e305, -1e305, math.nan,
                              math.inf, -math.inf, wire.MAX_TS, 2.0**63 / 1e6 - 1]) | st.floats(width=64)
F32 = st.floats(width=32)


def _u(bits: int) -> st.SearchStrategy[int]:
    return st.integers(0, (1 << bits) - 1) | st.sampled_from([0, (1 << bits) - 1])


STEP_PAYLOADS = st.builds(
    lambda ts, it, idx, el, counts, kv, more, flags, n1, n2, samples: wire.STEP.pack(
        ts, it, idx, el, *counts, kv, *more, flags, n1, n2) + samples,
    TIMESTAMPS, _u(64), _u(16), F32, st.tuples(*[_u(32)] * 7), F32, st.tuples(*[_u(32)] * 6), _u(8),
    st.integers(0, 4), st.integers(0, 4), st.binary(max_size=40),
)
REQUEST_PAYLOADS = st.builds(
    lambda ts, idx, floats, counts, reason, rid, id_len: wire.REQUEST.pack(
        ts, idx, *floats, *counts, reason, len(rid) if id_len is None else id_len) + rid,
    TIMESTAMPS, _u(16), st.tuples(*[F32] * 6), st.tuples(*[_u(32)] * 5), st.integers(0, 9),
    st.binary(max_size=12) | st.text(max_size=8).map(str.encode), st.none() | _u(16),
)
CONFIG_PAYLOADS = st.one_of(st.binary(max_size=40), st.builds(
    lambda v: json.dumps(v).encode(), st.recursive(st.none() | st.integers() | st.text(max_size=5),
                                                   lambda inner: st.lists(inner, max_size=3)
                                                   | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                                                   max_leaves=8)))
RECORDS = st.builds(
    lambda kind, payload, length: wire.RECORD.pack(kind, len(payload) if length is None else length) + payload,
    st.sampled_from([1, 2, 3]) | _u(8), st.one_of(STEP_PAYLOADS, REQUEST_PAYLOADS, CONFIG_PAYLOADS),
    st.none() | _u(16),
)
DATAGRAMS = st.builds(
    lambda magic, version, name, name_len, numbers, records: wire.HEADER.pack(
        magic, version, 0, len(name) if name_len is None else name_len, *numbers) + name + b"".join(records),
    st.just(wire.MAGIC) | st.binary(min_size=4, max_size=4), st.just(wire.VERSION) | _u(8),
    st.text(max_size=8).map(str.encode) | st.binary(max_size=8), st.none() | _u(16),
    st.tuples(_u(32), _u(32), _u(64), _u(64)), st.lists(RECORDS, max_size=4),
)


@settings(max_examples=200, deadline=10_000)
@given(DATAGRAMS)
def test_decoding_structured_datagrams_is_clean(data: bytes) -> None:
    try:
        datagram = wire.decode(data)
    except wire.WireError as exc:
        assert one_line(str(exc))
    else:
        for record in datagram.records:
            if isinstance(record, wire.StepRecord | wire.RequestRecord):
                assert -wire.MAX_TS < record.ts < wire.MAX_TS  # micros() of it fits the store's Int64


@pytest.fixture(scope="module")
def plugin() -> Iterator[PluginReceiver]:
    with tempfile.TemporaryDirectory(prefix="stepline-") as directory:
        receiver = PluginReceiver(SourceContext("h", ManualClock(NOW)), os.path.join(directory, "p.sock"),
                                  window_s=0.01)
        receiver.start()
        yield receiver
        receiver.stop()


@FAST
@given(st.lists(DATAGRAMS | st.binary(min_size=1, max_size=300), min_size=1, max_size=4))
def test_any_datagram_is_counted_and_its_rows_fit_the_store(plugin: PluginReceiver, datagrams: list[bytes]) -> None:
    bench = Bench()
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sender.connect(plugin.socket_path)
    valid = wire.encode_header(b"e", 1, 1, 0, 0) + wire.encode_step(wire.StepRecord(
        NOW, 1, 0, 5.0, 1, 2, 3, 4, 5, 6, 7, 0.5, 8, 9, 0, 0, 0, 0, False, (0.1,), (0.2,)))
    for data in [*datagrams, valid]:
        sender.send(data)
    sender.close()
    before = plugin.stats()
    rows: list[Row] = []
    with logged_errors() as errors:
        # A poll reads for the receiver's 10 ms window: on a busy machine that can be one datagram, so poll on
        # until every datagram sent is counted (or a hundred polls have not managed it).
        for _ in range(100):
            assert bench.runner.poll_once(_Tap(plugin, rows))
            if plugin.stats()["datagrams"] - before["datagrams"] >= len(datagrams) + 1:
                break
    after = plugin.stats()
    assert errors == []
    assert after["datagrams"] - before["datagrams"] == len(datagrams) + 1
    bad = after["malformed"] - before["malformed"]
    assert bench.value("stepline_source_counts_total", source="plugin", counter="datagrams") == after["datagrams"]
    assert bad <= len(datagrams)
    for row in rows:
        assert -INT64 <= row.ts < INT64
        if isinstance(row, Request):
            assert -INT64 <= row.arrival_ts < INT64  # a row the store cannot take would wedge its writer
    in_range = sum(1 for r in rows if NOW * 1e6 - 30 * 86400e6 <= r.ts <= (NOW + MAX_AHEAD_S) * 1e6)
    dropped = sum(bench.value("stepline_writer_rows_dropped_total", table=t, reason="ts_out_of_range")
                  for t in ("steps", "requests", "events"))
    assert in_range + dropped == len(rows)


def test_packing_helpers_agree_with_the_wire_layouts() -> None:
    # The strategies above pack fields positionally: a layout change must fail here, not silently shrink the fuzz.
    assert wire.STEP.size == struct.calcsize("<dQHfIIIIIIIfIIIIIIBHH")
    assert wire.REQUEST.size == struct.calcsize("<dHffffffIIIIIBH")
