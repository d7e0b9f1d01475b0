"""The reads usage is attributed from: steps, the requests alive in a window, and the GPUs' energy readings."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from stepline.model.rows import GpuSample, Request, Step, micros
from stepline.queries.usage import EARLIEST_SCHEDULED, GPU_ENERGY, REQUESTS, STEPS
from stepline.store.store import Store
from tests.queries.conftest import Rows

T0 = (datetime.now(UTC) - timedelta(hours=1)).replace(microsecond=0)


def _us(offset: float) -> int:
    return micros(T0.timestamp() + offset)


def _step(at: float, engine: str = "e0") -> Step:
    return Step(_us(at), "h", engine, 0, "m", round(at * 10), 20.0, 0, 0, 2, 2, 2, 0, 0, 0.5, 0, 0, 0, 0, 0, 0, [],
                [], False)


def _request(rid: str, arrival: float, finish: float, queue: float = 0.5) -> Request:
    return Request(_us(finish), "h", "e0", 0, "m", rid, "plugin", "stop", _us(arrival), queue, 0.1,
                   finish - arrival - queue - 0.1, finish - arrival - queue, finish - arrival, queue + 0.1, 0.01, 100,
                   0, 10, 10, 0)


def _gpu(at: float, engine: str, energy: int | None) -> GpuSample:
    return GpuSample(_us(at), "h", engine, 0, f"GPU-{engine}", "H200", 1.0, 1.0, 300.0, energy, 1.0, 1.0, 1.0, 1.0,
                     1, 2, 0.0, 0.0, 0, 0.0, 0.0, 0, [], 0.0, 0.0, 0.0, {})


def test_each_read_keeps_to_its_engine_and_span_in_walking_order(store: Store, rows: Rows) -> None:
    store.insert("steps", [_step(3), _step(1), _step(2), _step(9), _step(2, engine="e1")], Step._fields)
    store.insert("requests", [_request("before", 0, 0.9), _request("across", 0.5, 5), _request("after", 8, 9)],
                 Request._fields)
    store.insert("gpu_samples", [_gpu(1, "e0", None), _gpu(2, "e0", 5), _gpu(2, "", 7)], GpuSample._fields)
    span = {"engine": "e0", "host": "", "lo": _us(1), "hi": _us(4)}
    assert [r[3] for r in rows(STEPS, **span)] == [_us(1), _us(2), _us(3)]
    assert [r[3] for r in rows(REQUESTS, **span)] == ["across"]
    assert rows(EARLIEST_SCHEDULED, **span) == [(_us(1.0),)]
    assert [(r[1], r[4]) for r in rows(GPU_ENERGY, **span)] == [("e0", None), ("e0", 5)]
    assert len(rows(STEPS, **{**span, "engine": ""})) == 4
