"""The per-minute usage rollup: each minute's rows are `stepline usage`'s numbers for it, the collector's job rolls
each closed minute once (also across a restart), and long windows read the rollup, their edges from the steps."""

from __future__ import annotations

from collections import defaultdict
from datetime import UTC, datetime
from typing import Any

import pytest

from stepline.analysis import usage_by, usage_rollup
from stepline.analysis.usage_rollup import LAG_S, MAX_TRIES, MINUTE_US, UsageRollup
from stepline.core.clock import ManualClock
from stepline.diagnosis.findings import Window
from stepline.model.rows import Row, UsageMinute, micros
from stepline.sources.base import SourceError
from stepline.store.store import Store
from tests.analysis.test_usage import T0
from tests.analysis.test_usage_by import PRICE, _store

GPU = "NVIDIA H200"
FIRST = micros(T0) // MINUTE_US * MINUTE_US  # the minute the timeline (T0 .. T0 + 10 s) begins in
LAST = micros(T0 + 10) // MINUTE_US * MINUTE_US  # ... and ends in


def _minute(start_us: int, end_us: int) -> Window:
    return Window(datetime.fromtimestamp(start_us / 1e6, UTC), datetime.fromtimestamp(end_us / 1e6, UTC))


def _by_team(rows: list[UsageMinute]) -> dict[str, tuple[int, int, float, int | None]]:
    """team (or the line's name) -> requests, tokens, GPU-seconds, energy (mJ)."""
    out: dict[str, list[Any]] = defaultdict(lambda: [0, 0, 0.0, None])
    for r in rows:
        name = {"idle": usage_by.IDLE, "unattributed": usage_by.UNATTRIBUTED}.get(r.line, r.team or usage_by.NONE)
        g = out[name]
        g[0] += r.requests
        g[1] += r.prompt_tokens + r.generation_tokens
        g[2] += r.gpu_seconds
        if r.energy_mj is not None:
            g[3] = (g[3] or 0) + r.energy_mj
    return {k: tuple(v) for k, v in out.items()}


def _of_report(r: usage_by.Report) -> dict[str, tuple[int, int, float, int | None]]:
    return {g.name: (g.requests, g.tokens, g.gpu_seconds, None if g.energy_j is None else round(g.energy_j * 1000))
            for g in (*r.groups, r.idle, r.unattributed) if g.requests or g.gpu_seconds or g.energy_j}


def test_a_minutes_rows_are_the_report_of_that_minute(store: Store) -> None:
    _store(store)
    for minute in range(FIRST, LAST + MINUTE_US, MINUTE_US):
        rows = usage_rollup.minute_rows(store, minute, "h")
        assert rows and {r.ts for r in rows} == {minute} and {r.gpu_name for r in rows} == {GPU}
        expected = _of_report(usage_by.report(store, _minute(minute, minute + MINUTE_US), "team"))
        got = _by_team(rows)
        assert set(got) == set(expected)
        for name, (requests, tokens, gpu_seconds, energy) in expected.items():
            assert got[name][:2] == (requests, tokens)
            assert got[name][2] == pytest.approx(gpu_seconds)
            assert got[name][3] == energy
        # An engine's rows add up to its GPUs' time over the minute: 2 GPUs x 60 s.
        assert sum(r.gpu_seconds for r in rows) == pytest.approx(120.0)
    assert usage_rollup.minute_rows(store, FIRST, "another-host") == []


class _Emitted:
    def __init__(self) -> None:
        self.rows: list[Row] = []

    def __call__(self, batch: Any) -> None:
        self.rows += list(batch)


def _job(store: Store, clock: ManualClock) -> UsageRollup:
    return UsageRollup("h", clock, lambda: store)


def test_the_job_rolls_each_closed_minute_once_and_resumes_after_a_restart(store: Store) -> None:
    _store(store)
    # A minute rolled before (a row of it in the table): the job resumes after it.
    store.insert("usage_minutes", [UsageMinute(FIRST - MINUTE_US, "h", "e", "idle", GPU, "", "", "", "", "", "", "",
                                               0, 0, 0, 60_000_000, 120.0, 0, 2)], UsageMinute._fields)
    clock = ManualClock(LAST / 1e6 + 60 + LAG_S)  # the timeline's last minute just became due
    job, emitted = _job(store, clock), _Emitted()
    job.poll(emitted)
    assert sorted({r.ts for r in emitted.rows}) == list(range(FIRST, LAST + MINUTE_US, MINUTE_US))
    assert job.stats()["minutes_rolled"] == (LAST - FIRST) // MINUTE_US + 1
    job.poll(emitted)  # nothing new is due
    assert job.stats()["minutes_rolled"] == (LAST - FIRST) // MINUTE_US + 1
    store.insert("usage_minutes", emitted.rows, UsageMinute._fields)
    restarted, again = _job(store, clock), _Emitted()
    restarted.poll(again)
    assert again.rows == [] and restarted.stats()["minutes_rolled"] == 0
    clock.advance(60)  # one more minute closes: an engine seen in it still has its idle row
    restarted.poll(again)
    assert restarted.stats()["minutes_rolled"] == 1 and {r.ts for r in again.rows} <= {LAST + MINUTE_US}


def test_a_fresh_table_starts_at_the_last_closed_minute(store: Store) -> None:
    clock = ManualClock(LAST / 1e6 + 600.0)
    job = _job(store, clock)
    job.poll(_Emitted())
    assert job.stats()["minutes_rolled"] == 1


class _Failing:
    """A store that answers the job's resume and refuses every usage read."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def query(self, sql: str, parameters: dict[str, Any] | None = None) -> Any:
        if "usage_minutes" in sql:
            return self.store.query(sql, parameters)
        raise RuntimeError("store went away")


def test_a_failing_minute_is_tried_again_then_skipped_and_counted(store: Store) -> None:
    clock = ManualClock(LAST / 1e6 + 600.0)
    job = UsageRollup("h", clock, lambda: _Failing(store))
    for attempt in range(1, MAX_TRIES):
        with pytest.raises(SourceError, match=f"try {attempt} of {MAX_TRIES}"):
            job.poll(_Emitted())
    job.poll(_Emitted())
    assert job.stats() == {"minutes_rolled": 1, "minutes_skipped": 1, "rows": 0}


def test_a_store_that_does_not_answer_is_a_source_error() -> None:
    def refuse() -> Any:
        raise ConnectionRefusedError("nothing listens")

    with pytest.raises(SourceError, match="cannot read its last minute: ConnectionRefusedError"):
        UsageRollup("h", ManualClock(), refuse).poll(_Emitted())


def _rolled(store: Store) -> None:
    _store(store)
    rows = [r for m in range(FIRST, LAST + MINUTE_US, MINUTE_US) for r in usage_rollup.minute_rows(store, m, "h")]
    store.insert("usage_minutes", rows, UsageMinute._fields)


def test_a_long_window_reads_the_rollup_and_agrees_with_the_minutes_reports(store: Store) -> None:
    _rolled(store)
    window = _minute(FIRST, LAST + MINUTE_US)
    r = usage_rollup.report(store, window, "team", {GPU: PRICE}, from_s=0)
    assert r.source == "rollup" and r.engines == []
    minutes = [usage_by.report(store, _minute(m, m + MINUTE_US), "team") for m in range(FIRST, LAST + MINUTE_US,
                                                                                       MINUTE_US)]
    for g in (*r.groups, r.idle, r.unattributed):
        same = [x for m in minutes for x in (*m.groups, m.idle, m.unattributed) if x.name == g.name]
        assert g.requests == sum(x.requests for x in same)
        assert g.gpu_seconds == pytest.approx(sum(x.gpu_seconds for x in same))
        assert g.cost == pytest.approx(g.gpu_seconds * PRICE / 3600)
    # One exact pass over the same window: the same GPU time and requests in all, shared a little differently.
    exact = usage_by.report(store, window, "team")
    assert exact.source == "exact"
    assert r.gpu_seconds == pytest.approx(exact.gpu_seconds)
    assert sorted((g.name, g.requests, g.tokens) for g in r.groups) == sorted(
        (g.name, g.requests, g.tokens) for g in exact.groups)
    assert '"source": "rollup"' in usage_by.as_json(r) and "per-minute rollup" in usage_by.render(r)


def test_the_edges_outside_whole_minutes_come_from_the_steps(store: Store) -> None:
    _rolled(store)
    window = _minute(LAST + 30_000_000, LAST + 2 * MINUTE_US + 20_000_000)
    # The rollup ends before the window's first whole minute: not covered, one exact pass.
    assert usage_rollup.report(store, window, "team", from_s=0).source == "exact"
    start, end = FIRST - 30_000_000, LAST + MINUTE_US + 20_000_000
    r = usage_rollup.report(store, _minute(start, end), "team", from_s=0)
    parts = [usage_by.report(store, _minute(a, b), "team")
             for a, b in ((start, FIRST), (FIRST, LAST + MINUTE_US), (LAST + MINUTE_US, end))]
    assert r.source == "rollup" and r.gpu_seconds == pytest.approx(sum(p.gpu_seconds for p in parts))
    assert sum(g.requests for g in r.groups) == sum(g.requests for p in parts for g in p.groups) == 2


def test_short_windows_and_exact_asked_read_the_steps(store: Store) -> None:
    _rolled(store)
    window = _minute(FIRST, LAST + MINUTE_US)
    assert usage_rollup.report(store, window, "team").source == "exact"  # under ROLLUP_FROM_S
    assert usage_rollup.report(store, window, "team", from_s=0, exact=True).source == "exact"


def test_edges_with_more_steps_than_a_quick_pass_leave_the_report_on_the_whole_minutes(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    _rolled(store)
    start, end = FIRST - 30_000_000, LAST + MINUTE_US + 20_000_000
    kept = usage_rollup.report(store, _minute(start, end), "team", from_s=0)
    assert kept.source == "rollup"  # a few steps at the edges: walked
    monkeypatch.setattr(usage_rollup, "EDGE_MAX_STEPS", -1)  # as if 64 engines stepped there (these edges hold none)
    r = usage_rollup.report(store, _minute(start, end), "team", from_s=0)
    whole = _minute(FIRST, LAST + MINUTE_US)
    assert r.source == "rollup_minutes" and (r.window.start, r.window.end) == (whole.start, whole.end)
    rolled = usage_rollup.report(store, whole, "team", from_s=0)  # the same minutes, no edges
    assert r.gpu_seconds == pytest.approx(rolled.gpu_seconds) and r.gpu_seconds <= kept.gpu_seconds
    assert f"over its whole minutes from {whole.start:%Y-%m-%d %H:%M} to {whole.end:%Y-%m-%d %H:%M} UTC" in (
        usage_by.render(r))
    assert '"source": "rollup_minutes"' in usage_by.as_json(r)


@pytest.mark.parametrize("by", usage_by.DIMENSIONS)
def test_reading_only_what_a_grouping_needs_groups_the_same(store: Store, by: str) -> None:
    _rolled(store)
    window = _minute(FIRST, LAST + MINUTE_US)
    every = usage_rollup.rolled_lines(store, FIRST, LAST + MINUTE_US)
    needed = usage_rollup.rolled_lines(store, FIRST, LAST + MINUTE_US, by=by)
    assert len(needed) <= len(every)
    a, b = (usage_by.grouped(lines, window, by, {GPU: PRICE}) for lines in (every, needed))
    assert [(g.name, g.requests, g.tokens, round(g.gpu_seconds, 6), g.cost and round(g.cost, 9))
            for g in (*a.groups, a.idle, a.unattributed)] == [
        (g.name, g.requests, g.tokens, round(g.gpu_seconds, 6), g.cost and round(g.cost, 9))
        for g in (*b.groups, b.idle, b.unattributed)]
