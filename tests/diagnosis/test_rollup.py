"""Per-second and per-minute projections: filled by inserts, equal to the rows, added to older stores, read exactly."""

from __future__ import annotations

import itertools
import json
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from stepline.diagnosis import common, rollup
from stepline.diagnosis.baseline import baselines
from stepline.diagnosis.common import window_summary
from stepline.diagnosis.detectors import as_json, diagnose
from stepline.diagnosis.findings import Window
from stepline.model import schema
from stepline.model.rows import Event, GpuSample, Request, Step, micros
from stepline.queries.query import Query
from stepline.store.store import Store
from tests.diagnosis.test_detectors import T0 as STEP_T0
from tests.diagnosis.test_detectors import WINDOW, _monster, insert, step

T0 = (datetime.now(UTC) - timedelta(hours=2)).replace(second=0, microsecond=0)  # recent: within the retention
PROJECTIONS = {("steps", "steps_per_second"), ("steps", "steps_per_minute"), ("steps", "steps_unscheduled_per_minute"),
               ("steps", "steps_baselines_per_hour"),
               ("gpu_samples", "gpu_samples_per_minute"), ("gpu_samples", "gpu_throttling_per_minute"),
               ("engine_samples", "engine_samples_per_minute"), ("requests", "requests_by_prompt"),
               ("requests", "requests_per_minute")}
FORCED = {"force_optimize_projection": 1}
ROWS_ONLY = {"optimize_use_projections": 0}


def _step(t: float, n: int) -> Step:
    """Steps that vary in every aggregated column: prefill now and then, waiting, KV, drafts, dummies, ITL."""
    prefill = 8000 if n % 11 == 0 else (300 if n % 7 == 0 else 0)
    decoding = n % 5
    return Step(micros(T0.timestamp() + t), "h", "e1" if n % 3 else "e0", 0, "m", n, 5.0 + (n * 37) % 200 / 3,
                1 if prefill else 0, prefill, decoding, decoding + n % 2, decoding + 1, n % 13, 0, (n % 20) / 19,
                prefill, prefill // 2, int(n % 17 == 0), n % 4, 3 * (n % 4), n % 9, [0.2] if prefill else [],
                [0.001 * (1 + (n * k) % 50) for k in range(decoding)], n % 23 == 0)


def _steps(count: int = 1500, every_s: float = 0.37) -> list[Step]:
    return [_step(i * every_s, i) for i in range(count)]


def _projections(store: Store) -> set[tuple[str, str]]:
    rows = store.query("SELECT table, name FROM system.projections WHERE database = {db:String}",
                       parameters={"db": store.database}).result_rows
    return {(str(t), str(n)) for t, n in rows}


def _per_bucket(store: Store, bucket: str, aggregates: tuple[str, ...], settings: dict[str, Any]) -> str:
    """The aggregates per host, engine and bucket, as text (so that NaN, an empty bucket's quantile, equals NaN)."""
    sql = (f"WITH {bucket} AS bucket SELECT host, engine, bucket AS b, {', '.join(aggregates)} FROM steps "
           "GROUP BY host, engine, b ORDER BY host, engine, b")
    return json.dumps(store.client.query(sql, settings=settings).result_rows, default=str)


def test_a_new_store_has_the_projections(store: Store) -> None:
    assert _projections(store) == PROJECTIONS


@pytest.mark.parametrize(("bucket", "aggregates"), [
    ("toStartOfSecond(ts)", schema.STEP_AGGREGATES),
    ("toStartOfMinute(ts)", schema.STEP_AGGREGATES + schema.STEP_BASELINES),
    ("toStartOfMinute(ts)", (schema.UNSCHEDULED_WHILE_WAITING,)),
    ("toStartOfHour(ts)", schema.STEP_BASELINES),
])
def test_projections_hold_what_the_rows_give(store: Store, bucket: str, aggregates: tuple[str, ...]) -> None:
    rows = _steps()
    for i in range(0, len(rows), 200):  # several inserts: several parts, as a collector's batches make
        store.insert("steps", rows[i:i + 200], Step._fields)
    projected = _per_bucket(store, bucket, aggregates, FORCED)  # raises if the projection cannot answer
    assert len(json.loads(projected)) > (1 if bucket == rollup.HOUR else 10)
    assert projected == _per_bucket(store, bucket, aggregates, ROWS_ONLY)


def test_the_requests_projection_holds_what_the_reports_give(store: Store) -> None:
    # Reports of every band, decoded or not (one token, or no TPOT), cached or not, from the plugin and from spans.
    reports = [Request(micros(T0.timestamp() + i * 1.3), "h", f"e{i % 2}", 0, "m", f"r{i}",
                       ("plugin", "otlp")[i % 3 == 0], "stop", micros(T0.timestamp() + i * 1.3 - 2), 0.01, 0.1, 1.0,
                       1.1, 1.2, 0.2, (0.02 + (i % 7) / 100) if i % 5 else float("nan"),
                       (100, 2000, 9000, 50_000, 150_000)[i % 5] + i, (i * 37) % 3000, 1 + i % 4, 0, 0)
               for i in range(600)]
    for i in range(0, len(reports), 100):
        store.insert("requests", reports[i:i + 100], Request._fields)
    sql = (f"WITH toStartOfMinute(ts) AS bucket SELECT engine, source, bucket AS b, {schema.PROMPT_BAND_INDEX} "
           f"AS band, {', '.join(schema.REQUEST_AGGREGATES)} FROM requests GROUP BY engine, source, b, band "
           "ORDER BY engine, source, b, band")
    projected = store.client.query(sql, settings={"force_optimize_projection_name": "requests_per_minute"}).result_rows
    assert len(projected) > 40 and {r[3] for r in projected} == {0, 1, 2, 3, 4}

    def text(rows: Any) -> str:  # NaN == NaN as text; sums of shares to 12 digits (the order of additions differs)
        return json.dumps([[f"{v:.12g}" if isinstance(v, float) else v for v in row] for row in rows], default=str)

    assert text(projected) == text(store.client.query(sql, settings=ROWS_ONLY).result_rows)


@pytest.mark.parametrize("aggregates", [schema.GPU_AGGREGATES, schema.GPU_THROTTLING])
def test_gpu_projections_hold_what_the_rows_give(store: Store, aggregates: tuple[str, ...]) -> None:
    nan = float("nan")
    # Busy or not, throttled for one reason, another or none (bits 0x4, 0x8, 0x1 idle: not a throttle).
    samples = [GpuSample(micros(T0.timestamp() + i * 0.1), "h", "e0", i % 2, "u", "H200", 1980.0 - i % 300, 3201.0,
                         300.0 + i % 400, 1000 * i, 50.0, 60.0, float(i % 100), 1.0, 10 * i, 10**9, 1e9, 2e9, 0,
                         3e9 + i, 4e9, (0x4, 0x8, 0x1, 0)[i % 4], [], nan if i % 2 else 70.0, 40.0, 30.0, {})
               for i in range(2000)]
    store.insert("gpu_samples", samples, GpuSample._fields)
    sql = ("WITH toStartOfMinute(ts) AS bucket SELECT gpu_index, bucket AS b, " + ", ".join(aggregates)
           + " FROM gpu_samples GROUP BY gpu_index, b ORDER BY gpu_index, b")
    projected = store.client.query(sql, settings=FORCED).result_rows
    assert len(projected) == 8
    assert json.dumps(projected, default=str) == json.dumps(store.client.query(sql, settings=ROWS_ONLY).result_rows,
                                                            default=str)  # NaN == NaN as text


def test_a_retried_insert_is_counted_once(store: Store) -> None:
    rows = _steps(300)
    for _ in range(2):  # the writer retries a batch with the same token after a failure it cannot see through
        store.client.insert(f"`{store.database}`.`steps`", rows, column_names=list(Step._fields),
                            settings={"insert_deduplication_token": "batch-1"})
    count = "WITH toStartOfMinute(ts) AS bucket SELECT count() FROM steps GROUP BY bucket"
    assert sum(r[0] for r in store.client.query(count, settings=FORCED).result_rows) == 300
    store.client.insert(f"`{store.database}`.`steps`", rows, column_names=list(Step._fields),
                        settings={"insert_deduplication_token": "batch-2"})  # a new batch, the same rows
    assert sum(r[0] for r in store.client.query(count, settings=FORCED).result_rows) == 600
    assert store.query("SELECT count() FROM steps").result_rows[0][0] == 600


def test_an_older_store_gets_the_projections_for_its_rows_too(store: Store) -> None:
    store.insert("steps", _steps(600), Step._fields)
    for table, name in PROJECTIONS:
        store.client.command(f"ALTER TABLE `{store.database}`.`{table}` DROP PROJECTION `{name}`",
                             settings={"mutations_sync": 2})
    assert _projections(store) == set()
    store.ensure_schema(30)
    store.ensure_schema(30)  # idempotent
    assert _projections(store) == PROJECTIONS
    deadline = time.monotonic() + 60
    while store.query("SELECT count() FROM system.mutations WHERE database = {db:String} AND NOT is_done",
                      parameters={"db": store.database}).result_rows[0][0]:
        assert time.monotonic() < deadline, "MATERIALIZE PROJECTION did not finish"
        time.sleep(0.2)
    built = store.query("SELECT DISTINCT name FROM system.projection_parts WHERE database = {db:String} AND active",
                        parameters={"db": store.database}).result_rows
    assert {"steps_per_second", "steps_per_minute"} <= {r[0] for r in built}
    assert _per_bucket(store, "toStartOfSecond(ts)", ("count()", "max(elapsed_ms)"), FORCED) == _per_bucket(
        store, "toStartOfSecond(ts)", ("count()", "max(elapsed_ms)"), ROWS_ONLY)


def test_cluster_ddl_keeps_projections_on_the_local_tables() -> None:
    statements = schema.ddl("stepline", 30, cluster="fleet")
    local = next(s for s in statements if "`stepline`.`steps_local`" in s.splitlines()[0])
    distributed = next(s for s in statements if s.splitlines()[0].endswith("`stepline`.`steps` ON CLUSTER `fleet`"))
    assert "PROJECTION `steps_per_second`" in local and "PROJECTION `steps_per_minute`" in local
    assert "PROJECTION" not in distributed  # a Distributed table reads each shard's projections through its tables


# -- reading windows exactly ---------------------------------------------------------------------------------------

WINDOWS = [  # (start, end) offsets from T0 in seconds: fractional edges, whole seconds, whole minutes, tiny
    (3.3, 517.91), (0.0, 540.0), (59.999999, 120.000001), (61.2, 61.9), (130.0, 131.0), (7.5, 300.37),
]


@pytest.mark.parametrize(("lo", "hi"), WINDOWS)
def test_parts_cover_a_window_once(monkeypatch: pytest.MonkeyPatch, lo: float, hi: float) -> None:
    monkeypatch.setattr(rollup, "ROWS_UP_TO", timedelta(0))
    start, end = T0 + timedelta(seconds=lo), T0 + timedelta(seconds=hi)
    parts = rollup.parts(start, end)
    assert parts[0].lo == start and parts[-1].hi == end and parts[-1].closed
    assert all(not p.closed for p in parts[:-1])
    assert all(a.hi == b.lo for a, b in itertools.pairwise(parts))  # contiguous, so no step twice
    for p in parts:
        unit = {rollup.MINUTE: 60, rollup.SECOND: 1}.get(p.bucket)
        if unit:
            assert p.lo is not None and p.lo.timestamp() % unit == 0 and p.hi.timestamp() % unit == 0, p


def test_parts_from_the_beginning_and_short_windows() -> None:
    end = T0 + timedelta(seconds=90.5)
    assert [(p.bucket, p.lo) for p in rollup.parts(None, end)] == [
        (rollup.MINUTE, None), (rollup.SECOND, T0 + timedelta(minutes=1)), (rollup.ROW, T0 + timedelta(seconds=90))]
    assert [p.bucket for p in rollup.parts(end - rollup.ROWS_UP_TO, end)] == [rollup.ROW]


def test_parts_of_a_table_without_a_per_second_projection() -> None:
    start, end = T0 + timedelta(seconds=7.5), T0 + timedelta(hours=2, seconds=30.25)
    minutes = (T0 + timedelta(minutes=1), T0 + timedelta(hours=2))
    # Whole minutes, then the rest in one read of rows: the partial minutes at both ends.
    assert rollup.parts(start, end, seconds=False) == [
        rollup.Part(rollup.MINUTE, *minutes), rollup.Part(rollup.ROW, start, end, closed=True, outside=minutes)]
    assert rollup.parts(start, end, seconds=False, edges=False) == [rollup.Part(rollup.MINUTE, *minutes)]
    assert rollup.parts(start, end, minutes=False, seconds=False) == [rollup.Part(rollup.ROW, start, end, closed=True)]
    short = end - rollup.ROWS_UP_TO
    assert rollup.parts(short, end, seconds=False, edges=False) == [rollup.Part(rollup.ROW, short, end, closed=True)]


@pytest.mark.parametrize(("lo", "hi"), WINDOWS)
def test_rolled_requests_without_seconds_equal_their_rows(store: Store, monkeypatch: pytest.MonkeyPatch,
                                                          lo: float, hi: float) -> None:
    reports = [Request(micros(T0.timestamp() + i * 0.9), "h", "e0", 0, "m", f"r{i}", "plugin", "stop",
                       micros(T0.timestamp() + i * 0.9 - 1), 0.01, 0.1, 1.0, 1.1, 1.2, 0.2, 0.03, 100 + i, i % 50, 5,
                       0, 0) for i in range(700)]
    reports.append(reports[0]._replace(ts=micros(T0.timestamp() + hi), request_id="at-the-end"))
    store.insert("requests", reports, Request._fields)
    aggs = (rollup.Agg("n", "countIf(prompt_tokens > 0)", "sum({})"), rollup.Agg("p", "sum(prompt_tokens)", "sum({})"))
    start, end = T0 + timedelta(seconds=lo), T0 + timedelta(seconds=hi)
    monkeypatch.setattr(rollup, "ROWS_UP_TO", timedelta(0))
    sql, bounds = rollup.rolled(aggs, "1", start, end, table="requests", seconds=False)
    projected = Query(sql, **bounds).rows(store)
    exact = store.query("SELECT engine, countIf(prompt_tokens > 0), sum(prompt_tokens) FROM requests WHERE ts >= "
                        "{a:DateTime64(6)} AND ts <= {b:DateTime64(6)} GROUP BY engine", parameters={
                            "a": start.replace(tzinfo=None), "b": end.replace(tzinfo=None)}).result_rows
    assert [tuple(r) for r in projected] == [tuple(r) for r in exact] and exact


def test_a_windows_engines_include_spans_alone_and_not_what_lies_just_outside(store: Store) -> None:
    start = T0 + timedelta(seconds=20)
    span = Request(micros(start.timestamp() + 10), "h", "spans-only", 0, "m", "s1", "otlp", "", micros(
        start.timestamp() + 8), 0.01, 0.1, 1.0, 1.1, 1.2, 0.2, 0.03, 100, 0, 5, 0, 0)
    before = span._replace(engine="just-before", ts=micros(start.timestamp() - 5))  # the window's first minute
    store.insert("requests", [span, before], Request._fields)
    store.insert("steps", [_step(30.0, 1)], Step._fields)
    for end in (start + timedelta(minutes=5), start + timedelta(hours=3)):
        assert common.engines(store, Window(start, end)) == ["e1", "spans-only"]


@pytest.mark.parametrize(("lo", "hi"), WINDOWS)
def test_window_summary_from_projections_equals_the_rows(store: Store, monkeypatch: pytest.MonkeyPatch,
                                                         lo: float, hi: float) -> None:
    rows = _steps()
    rows.append(_step(hi, 99_999))  # a step exactly at the window's end belongs to it
    store.insert("steps", rows, Step._fields)
    window = Window(T0 + timedelta(seconds=lo), T0 + timedelta(seconds=hi))
    monkeypatch.setattr(rollup, "ROWS_UP_TO", timedelta(0))
    projected = window_summary(store, window)
    monkeypatch.setattr(rollup, "ROWS_UP_TO", timedelta(days=1))
    assert projected == window_summary(store, window)
    assert projected  # the window holds steps


@pytest.mark.parametrize("engine", ["e0", ""])
def test_detectors_find_the_same_through_projections(store: Store, monkeypatch: pytest.MonkeyPatch,
                                                     engine: str) -> None:
    _monster(store, threshold=2048)
    insert(store, [step(300 + i, kv=0.99, preempted=i % 2, drafts=10, drafted=40, accepted=30 - i, n=8000 + i)
                   for i in range(20)])
    insert(store, [Event(WINDOW.start.replace(tzinfo=UTC).timestamp().__int__() * 1_000_000 + 60_000_000, "h", "",
                         "nvml", "gpu_xid", "critical", "XID 79", {"xid": "79"})])
    window = Window(WINDOW.start, WINDOW.end, engine)
    from_rows = json.loads(as_json(diagnose(store, window)))
    monkeypatch.setattr(rollup, "ROWS_UP_TO", timedelta(0))
    assert json.loads(as_json(diagnose(store, window))) == from_rows
    # head-of-line blocking behind the monster is told inside the monster's finding (one cause, one finding)
    told = {f["kind"] for f in from_rows} | {s["kind"] for f in from_rows for s in f["evidence"].get("symptoms", [])}
    assert {"prefill_interference", "head_of_line_blocking", "config_not_in_effect", "kv_pressure",
            "gpu_xid"} <= told


@pytest.mark.parametrize("limit", ["EXACT_MAX_STEPS", "EXACT_MAX_QUERY_STEPS"])
def test_long_windows_take_baselines_from_the_minute_projection(store: Store, monkeypatch: pytest.MonkeyPatch,
                                                                limit: str) -> None:
    _monster(store)
    exact = next(f for f in diagnose(store, WINDOW) if f.kind == "prefill_interference")
    # As if the window held a busy day of the engine, or a fleet's half hour beside it.
    monkeypatch.setattr(common, limit, 100)
    findings = diagnose(store, WINDOW)
    approximate = next(f for f in findings if f.kind == "prefill_interference")
    assert approximate.severity == exact.severity == "critical"
    assert "per-minute projection" in approximate.evidence["baseline_quantiles"]
    assert "baseline_quantiles" not in exact.evidence
    for key in ("itl_p99_outside_s", "itl_p50_outside_s", "step_p50_decode_only_outside_ms"):
        assert approximate.evidence[key] == pytest.approx(exact.evidence[key], rel=0.02), key

    def compared_with_the_baseline(key: str) -> bool:  # the baseline's figures, and the ratios taken against them
        return "outside" in key or "slowdown" in key or key == "baseline_quantiles"
    # The symptoms folded in read their own baselines the same way: the same ones, each with its own figures.
    assert {k: v for k, v in approximate.evidence.items() if not compared_with_the_baseline(k) and k != "symptoms"} == {
        k: v for k, v in exact.evidence.items() if not compared_with_the_baseline(k) and k != "symptoms"}
    assert [s["kind"] for s in approximate.evidence["symptoms"]] == [s["kind"] for s in exact.evidence["symptoms"]]
    assert "head_of_line_blocking" in {s["kind"] for s in approximate.evidence["symptoms"]}


def test_the_exact_budget_goes_to_the_engines_with_the_fewest_steps() -> None:
    steps = {f"e{i:02d}": 80_000 + 1_000 * i for i in range(13)} | {"busy": 150_000}
    # busy is over the per-engine limit; e00..e10 fit the 1M budget (935k steps), e11 and e12 do not.
    exact, approximate = common.exact_and_approximate(steps, True)
    assert (exact, approximate) == ([f"e{i:02d}" for i in range(11)], ["busy", "e11", "e12"])
    assert sum(steps[e] for e in exact) <= common.EXACT_MAX_QUERY_STEPS
    # Without whole minutes in the window there is no projection to read: every engine is exact.
    assert common.exact_and_approximate(steps, False) == (sorted(steps), [])


def test_the_span_of_approximate_quantiles() -> None:
    hour = T0.replace(minute=0)
    long = rollup.approximate_span(hour - timedelta(hours=12, minutes=20), hour + timedelta(minutes=7))
    assert long is not None and (long.bucket, long.lo, long.hi) == (rollup.HOUR, hour - timedelta(hours=12), hour)
    shorter = rollup.approximate_span(hour - timedelta(hours=11, minutes=20), hour + timedelta(minutes=7, seconds=3))
    assert shorter is not None and (shorter.bucket, shorter.lo, shorter.hi) == (
        rollup.MINUTE, hour - timedelta(hours=11, minutes=20), hour + timedelta(minutes=7))
    assert rollup.approximate_span(hour + timedelta(seconds=10), hour + timedelta(seconds=50)) is None
    assert long.reads(lambda bucket: f"WITH {bucket} AS bucket SELECT 1") == "WITH toStartOfHour(ts) AS bucket SELECT 1"


def test_windows_of_twelve_hours_take_baselines_from_the_hour_projection(store: Store,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # One engine decodes all along (a step a minute, 20 ms); another only after the window's last whole hour (30 ms).
    hour = datetime.fromtimestamp(STEP_T0.timestamp() // 3600 * 3600, UTC)  # step() counts from STEP_T0
    start = (hour - STEP_T0).total_seconds() - 13 * 3600
    insert(store, [step(start + 60 * i, elapsed_ms=20.0)._replace(engine="all-along") for i in range(13 * 60 + 15)])
    insert(store, [step((hour - STEP_T0).total_seconds() + 60 + 20 * i, elapsed_ms=30.0)._replace(engine="came-late")
                   for i in range(30)])
    window = Window(hour - timedelta(hours=13), hour + timedelta(minutes=20))
    monkeypatch.setattr(common, "EXACT_MAX_STEPS", 10)  # as if a day of busy engines
    base = baselines(store, window, ["all-along", "came-late"])
    along, late = base["all-along"], base["came-late"]
    assert along.decode_step_ms == pytest.approx(20.0, rel=0.01) and "per-hour" in along.approximate
    assert late.decode_step_ms == pytest.approx(30.0, rel=0.01) and "per-minute" in late.approximate
    assert along.evidence()["baseline_quantiles"] == along.approximate
