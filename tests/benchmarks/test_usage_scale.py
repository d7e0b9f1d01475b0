"""Usage and SLO at scale (benchmarks/usage_scale.py): the rollup it puts in a scale store, minutes rolled for real
and copied back to the span's start, and the rows its timings say each query reads."""

from __future__ import annotations

import time
from types import ModuleType

import pytest

from stepline.analysis.usage_rollup import LAG_S, MINUTE_US
from stepline.model.rows import micros
from stepline.store.store import Store
from tests.benchmarks.script import load


@pytest.fixture(scope="module")
def us() -> ModuleType:
    load("scale_data")
    load("scale_queries")  # both imported by name, as `python usage_scale.py` finds them beside it
    return load("usage_scale")


def test_the_rolled_minutes_are_copied_back_to_the_spans_first_minute(us: ModuleType, store: Store) -> None:
    sd = load("scale_data")
    shape = sd.Shape(end_s=int(time.time()) - 60, hours=0.1, engines=2, steps_hours=0.05)
    sd.synthesise(lambda _label, sql: store.client.command(sql), shape)
    end_us = int(store.query("SELECT toUnixTimestamp64Micro(max(ts)) FROM steps").result_rows[0][0])
    made = us.roll_up(store, ["node-0"], shape.start_s * 1_000_000, end_us, 2)
    per_minute = {int(ts): int(n) for ts, n in store.query(
        "SELECT toUnixTimestamp64Micro(ts), count() FROM usage_minutes GROUP BY ts").result_rows}
    last = (end_us - micros(LAG_S)) // MINUTE_US * MINUTE_US  # the collector's rollup, LAG_S behind the end
    first = shape.start_s * 1_000_000 // MINUTE_US * MINUTE_US
    assert sorted(per_minute) == list(range(first, last, MINUTE_US))
    assert made["host_minutes"] == 2 and made["rows"] == per_minute[last - MINUTE_US] + per_minute[last - 2 * MINUTE_US]
    assert made["rows_after_copy"] == sum(per_minute.values())
    # A copy has its block's rows: the minute a block before the rolled one has as many.
    assert per_minute[last - 3 * MINUTE_US] == per_minute[last - MINUTE_US]


def test_the_rows_a_query_reads_are_the_engines_estimate_and_leave_its_timing(us: ModuleType, store: Store) -> None:
    store.client.command("INSERT INTO usage_minutes (ts, host, engine, line) SELECT now64(6) - number, 'h', 'e', "
                         "'idle' FROM numbers(1000)")
    reader = us.Counting(store.client, estimate=True)
    assert reader.query("SELECT sum(gpu_seconds) FROM usage_minutes").result_rows == [(0.0,)]
    assert reader.read_rows == 1000 and reader.estimating_s > 0
    plain = us.Counting(store.client)
    plain.query("SELECT 1")
    assert plain.read_rows == 0 and plain.estimating_s == 0
