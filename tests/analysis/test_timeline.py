"""The timeline view: each step beside its engine's GPU samples, and `stepline timeline --around`."""

from __future__ import annotations

import math
import re
import time
from datetime import UTC, datetime, timedelta

import pytest

from stepline.analysis import timeline
from stepline.core.usageerror import UsageError
from stepline.model import schema
from stepline.model.rows import GpuSample, Step, micros
from stepline.store.store import Store

T0 = float(int(time.time()) - 300)


def _step(t: float, elapsed_ms: float, prefill: int, engine: str = "e") -> Step:
    return Step(micros(t), "h", engine, 0, "m", round(t * 10), elapsed_ms, 1 if prefill else 0, prefill, 8, 8, 9, 0,
                0, 0.4, 0, 0, 0, 0, 0, 0, [], [], False)


def _gpu(t: float, index: int, sm: float, power: float, engine: str = "e", flags: tuple[str, ...] = ()) -> GpuSample:
    nan = math.nan
    return GpuSample(micros(t), "h", engine, index, f"GPU-{index}", "H200", sm, 2619, power, 1000, 50, 60, 90, 40,
                     10 << 30, 141 << 30, 1e6, 1e6, 0, 2e9, 2e9, 0, list(flags), 55.0 if power > 500 else 5.0, nan,
                     nan, {4242: 10 << 30})


@pytest.fixture
def filled(store: Store) -> Store:
    # Two GPUs serve engine "e" (TP=2); a third GPU serves nobody and must not appear.
    store.insert("steps", [_step(T0 + i * 0.5, 400 if 10 <= i < 20 else 20, 8192 if 10 <= i < 20 else 0)
                           for i in range(40)], Step._fields)
    gpus = []
    for i in range(200):
        t = T0 - 1 + i * 0.1
        hot = T0 + 5 <= t < T0 + 10
        for index in (0, 1):
            gpus.append(_gpu(t, index, 1410 if hot else 1980, 690 if hot else 300,
                             flags=("sw_power_cap",) if hot else ()))
        gpus.append(_gpu(t, 2, 210, 60, engine=""))
    store.insert("gpu_samples", gpus, GpuSample._fields)
    return store


def test_the_view_puts_each_step_beside_each_of_its_gpus(filled: Store) -> None:
    rows = filled.query("SELECT step, elapsed_ms, prefill_tokens, gpu_index, gpu_ts, sm_clock_mhz, power_w, "
                        "dram_bw_util_pct FROM timeline ORDER BY ts, gpu_index").result_rows
    assert len(rows) == 80  # 40 steps x the engine's 2 GPUs
    assert {r[3] for r in rows} == {0, 1}
    by_step = {(r[0], r[3]): r for r in rows}
    slow = by_step[(round((T0 + 6) * 10), 0)]
    assert slow[1] == 400 and slow[2] == 8192 and slow[5] == 1410 and slow[6] == 690 and slow[7] == 55.0
    fast = by_step[(round((T0 + 12) * 10), 1)]
    assert fast[1] == 20 and fast[5] == 1980
    # The sample joined is the latest at or before the step, never one after it.
    for r in rows:
        assert r[4] <= datetime.fromtimestamp(r[0] / 10, UTC).replace(tzinfo=None) + timedelta(microseconds=1)


def test_around_prints_buckets_with_throttle_flags(filled: Store) -> None:
    text = timeline.around(filled, filled.database, datetime.fromtimestamp(T0 + 7, UTC), window_s=5)
    lines = text.splitlines()
    assert lines[0].startswith("time (UTC)")
    hot = [line for line in lines if "sw_power_cap" in line]
    assert hot and all(" 1410 " in line and " 690 " in line for line in hot)
    assert len(lines) - 1 == 2 * 11  # one-second buckets T0+2 .. T0+12, both ends included, x 2 GPUs
    every = timeline.around(filled, filled.database, datetime.fromtimestamp(T0 + 7, UTC), window_s=1, bucket_s=0)
    assert len(every.splitlines()) - 1 == 2 * 5
    empty = timeline.around(filled, filled.database, datetime.fromtimestamp(T0 - 3600, UTC))
    assert empty.startswith("no engine steps between")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2026-11-29T21:36:30", datetime(2026, 11, 29, 21, 36, 30, tzinfo=UTC)),
        ("2026-11-29T22:36:30+01:00", datetime(2026, 11, 29, 21, 36, 30, tzinfo=UTC)),
        ("1795986990", datetime(2026, 11, 29, 21, 16, 30, tzinfo=UTC)),
        ("21:36:30", datetime(2026, 11, 29, 21, 36, 30, tzinfo=UTC)),
    ],
)
def test_moments_parse(text: str, expected: datetime) -> None:
    assert timeline.parse_moment(text, now=datetime(2026, 11, 29, 23, 0, tzinfo=UTC)) == expected


def test_a_bad_moment_is_named() -> None:
    with pytest.raises(UsageError, match="'yesterday' is not ISO 8601"):
        timeline.parse_moment("yesterday")


def _renamed_in_view() -> dict[str, tuple[str, str]]:
    """Each column the timeline view shows under another name than its table's: view name -> (table, column)."""
    select_list = schema.TIMELINE_COLUMNS
    renamed = {}
    for item in select_list.split(","):
        match = re.fullmatch(r"\s*([sg])\.(\w+) AS (\w+)\s*", item)
        if match and match.group(2) != match.group(3):
            renamed[match.group(3)] = ("steps" if match.group(1) == "s" else "gpu_samples", match.group(2))
    return renamed


def test_a_column_the_view_renames_says_so_in_its_comment() -> None:
    renamed = _renamed_in_view()
    assert renamed["prefill_tokens"] == ("steps", "num_ctx_tokens")
    for shown, (table, column) in renamed.items():
        comment = schema.TABLE_BY_NAME[table].column_comments[column]
        assert re.search(rf"\b{shown}\b", comment), f"{table}.{column}'s comment does not say it is {shown}"


def test_the_printed_headers_that_are_not_column_names_are_explained(filled: Store) -> None:
    header = timeline.around(filled, filled.database, datetime.fromtimestamp(T0 + 7, UTC), window_s=5).splitlines()[0]
    comments = schema.TABLE_BY_NAME["steps"].column_comments
    # `stepline timeline` keeps short headers; the steps column behind each says what it is printed as.
    for printed, column in (("prefill", "num_ctx_tokens"), ("decoding", "num_generation_requests")):
        assert f" {printed} " in header
        assert "`stepline timeline`" in comments[column] and re.search(rf"\b{printed}\b", comments[column])


def test_steps_without_gpu_samples_are_shown_with_empty_gpu_columns(store: Store) -> None:
    # A CPU engine (or a host without NVML) has steps and no GPU samples: the steps still make the timeline.
    store.insert("steps", [_step(T0 + i * 0.5, 7 if i % 4 else 230, 0 if i % 4 else 1024, engine="cpu")
                           for i in range(20)], Step._fields)
    moment = datetime.fromtimestamp(T0 + 5, UTC)
    text = timeline.around(store, store.database, moment, window_s=5)
    lines = text.splitlines()
    assert lines[0].startswith("time (UTC)"), text
    assert len(lines) - 1 == 10  # one-second buckets T0 .. T0+9, no GPU to multiply them
    first = lines[1].split()
    assert first[1] == "cpu" and first[2] == "-" and first[3] == "2" and first[4] == "230ms"
    assert first[7:11] == ["-", "-", "-", "-"] and first[-1] == "-"
    every = timeline.around(store, store.database, moment, window_s=1, bucket_s=0)
    assert len(every.splitlines()) - 1 == 5 and all(" cpu " in line for line in every.splitlines()[1:])
    assert timeline.around(store, store.database, moment, window_s=5, engine="other").startswith("no engine steps")
