"""Request placement, the stage before the writers: reports placed on their requests, repeats left out and counted."""

from __future__ import annotations

import time
from collections.abc import Sequence

from prometheus_client import CollectorRegistry

from stepline.ingest.identity import RequestPlacement
from stepline.ingest.metrics import RequestMetrics, RowDrops
from stepline.ingest.spool import Spool
from stepline.model.rows import Event, Request, Row, micros
from stepline.store import batches
from stepline.store.errors import StoreUnreachable


def _report(request_id: str, source: str, finished: float, cached: int = 0) -> Request:
    nan = float("nan")
    return Request(micros(finished), "h", "e", 0, "m", request_id, source, "stop", micros(finished - 2.0), nan, nan,
                   nan, nan, nan, nan, nan, 10, cached, 5, 16, 0)


def _event(message: str) -> Event:
    return Event(micros(time.time()), "h", "e", "test", "k", "info", message, {})


class Placed:
    """A placement stage on a registry of its own."""

    def __init__(self, **options: object) -> None:
        self.registry = CollectorRegistry()
        self.stage = RequestPlacement(RequestMetrics(self.registry), **options)  # type: ignore[arg-type]

    def value(self, name: str, **labels: str) -> float | None:
        return self.registry.get_sample_value(name, labels)


def test_other_rows_pass_in_order_and_a_report_that_adds_nothing_is_left_out_counted_by_source() -> None:
    p = Placed()
    now = time.time()
    first, again = _report("r1", "plugin", now), _report("r1", "plugin", now)
    rows: list[Row] = [_event("a"), first, _event("b"), again]
    assert p.stage.place(rows) == [rows[0], first, rows[2]]
    assert p.value("stepline_requests_deduplicated_total", source="plugin") == 1


def test_reports_older_than_the_memory_are_looked_up_in_the_store_first() -> None:
    asked: list[Sequence[tuple[str, str]]] = []
    old = _report("old", "otlp", time.time() - 3600, cached=0)
    written = old._replace(source="plugin", cached_tokens=0)

    def lookup(keys: Sequence[tuple[str, str]]) -> list[Request]:
        asked.append(keys)
        return [written]

    p = Placed(lookup=lookup)
    assert p.stage.place([old]) == []  # the store's row already says all this report says
    assert asked == [[("e", "old")]]
    assert p.value("stepline_requests_unresolved_total") == 0


def test_a_lookup_that_fails_keeps_the_report_and_counts_it_unresolved() -> None:
    def down(keys: Sequence[tuple[str, str]]) -> list[Request]:
        raise StoreUnreachable("the store does not answer")

    p = Placed(lookup=down)
    old = _report("old", "plugin", time.time() - 3600)
    assert p.stage.place([old]) == [old]
    assert p.value("stepline_requests_unresolved_total") == 1


def test_the_reports_waiting_in_the_spool_are_remembered_at_start() -> None:
    spool = Spool(RowDrops(CollectorRegistry()), max_bytes=1 << 20)
    spooled = _report("r1", "plugin", time.time())
    data, kept, _ = batches.encode_valid("requests", [spooled])
    spool.append("requests", Request._fields, data, kept)
    p = Placed()
    p.stage.remember_spooled(spool)
    assert p.stage.place([spooled]) == []  # already on its way to the store
    assert p.value("stepline_requests_deduplicated_total", source="plugin") == 1
