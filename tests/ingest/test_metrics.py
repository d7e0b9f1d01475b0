"""The ingest path's metrics: declared on the registry given, drops counted (and logged) where rows are given up."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry

from stepline.ingest.metrics import IngestMetrics, RowDrops
from stepline.ingest.spool import Spool


def _dropped(registry: CollectorRegistry, table: str, reason: str) -> float | None:
    return registry.get_sample_value("stepline_writer_rows_dropped_total", {"table": table, "reason": reason})


def test_a_drop_is_counted_and_logged_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    registry = CollectorRegistry()
    drops = RowDrops(registry)
    with caplog.at_level(logging.WARNING, logger="stepline.ingest.metrics"):
        drops("steps", 3, "queue_full")
        drops("steps", 2, "queue_full")
        drops("events", 0, "spool_corrupt")  # a segment too damaged to say its rows: the spool names it itself
    assert _dropped(registry, "steps", "queue_full") == 5
    assert _dropped(registry, "events", "spool_corrupt") == 0
    assert [r.getMessage() for r in caplog.records] == ["dropped 3 steps rows: queue_full"]


def test_a_caller_with_a_line_of_its_own_only_counts(caplog: pytest.LogCaptureFixture) -> None:
    registry = CollectorRegistry()
    with caplog.at_level(logging.WARNING, logger="stepline.ingest.metrics"):
        RowDrops(registry).count("events", 4, "ts_out_of_range")
    assert _dropped(registry, "events", "ts_out_of_range") == 4
    assert caplog.records == []


def test_the_spool_counts_what_it_gives_up_itself() -> None:
    registry = CollectorRegistry()
    spool = Spool(RowDrops(registry), max_bytes=100)  # no writer: the spool reports to the counter it is given
    spool.append("events", ("ts",), b"x" * 80, 8)
    spool.append("events", ("ts",), b"y" * 80, 9)
    assert _dropped(registry, "events", "spool_full") == 8
    assert spool.rows() == 9


def test_every_ingest_metric_is_on_the_registry_it_is_given() -> None:
    registry = CollectorRegistry()
    metrics = IngestMetrics(registry)
    assert metrics.registry is registry and metrics.writer.drops is metrics.drops
    names = {family.name for family in registry.collect()}
    assert {"stepline_writer_rows_dropped", "stepline_writer_rows_written", "stepline_source_up",
            "stepline_requests_deduplicated", "stepline_spool_bytes"} <= names
