"""Who used the GPUs, per minute: the collector rolls `stepline usage`'s lines of each closed minute into
`usage_minutes`, and long windows (the Usage dashboard, `stepline usage` over more than ROLLUP_FROM_S) read them.

A minute's rows are exactly what stepline.analysis.usage_by gives for that minute's window at the time it was rolled
up, grouped by engine, line (request, idle, unattributed) and every dimension a request is grouped by. The collector
rolls a minute LAG_S after it closed, so that late reports (the plugin's, OTLP's spans, the gateway's decisions)
arrive first; a request still running then has no report yet, and its part of the minute counts as unattributed in
the rollup (an exact pass over the same minute later gives it to the request). Summed over many minutes, the rollup
differs from one exact pass over the whole window by that, and because each minute's step cost is fitted over that
minute's steps (and the requests alive in it).

`UsageRollup` is the collector's job, polled like a source: it resumes after the last minute its host has in the
table (none: the last closed minute), rolls at most MAX_MINUTES_PER_POLL minutes a poll, and never more than
MAX_BACKFILL_S behind. `report` picks the rollup or the exact pass for a window; from the rollup, the window's edges
outside its whole minutes come from exact passes where they hold few steps (EDGE_MAX_STEPS), else the report covers
the whole minutes only and says so.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from datetime import UTC, datetime

from stepline.analysis import usage_by
from stepline.analysis.usage_by import Line, Report, Who
from stepline.core.clock import Clock
from stepline.core.oneline import one_line
from stepline.core.ratelimit import RateLimitedLog
from stepline.diagnosis.findings import Window
from stepline.model.rows import UsageMinute, micros
from stepline.queries.query import moment
from stepline.queries.usage import STEP_COUNT
from stepline.queries.window import EACH_ENGINE
from stepline.sources.base import Emit, SourceError
from stepline.store.reads import Reads, first_or_none, named, scalar

log = logging.getLogger(__name__)

MINUTE_US = 60_000_000
LAG_S = 120.0  # a minute is rolled this long after it closed: reports of requests that finished in it arrive first
MAX_MINUTES_PER_POLL = 30  # a collector catching up after a stop rolls this many a minute, not all at once
MAX_BACKFILL_S = 86_400.0  # a collector stopped for longer resumes this far back, not at its last minute
MAX_TRIES = 3  # a minute that fails this many polls in a row is skipped, counted and logged
ROLLUP_FROM_S = 3600.0  # `stepline usage` reads the rollup for windows longer than this
MAX_TAIL_S = 900.0  # ... where the rollup reaches this close to the window's end (the rest is an exact pass)
# The edges outside the rollup's whole minutes are walked step by step (usage.usage: ~40 us a step on a loaded 2-core
# machine, so 20k steps is about a second): where they hold more steps than this (a window's ragged first minute
# and the minutes not yet rolled, on more than a few engines: 64 engines step ~170k times a minute), the report
# keeps to the rollup's whole minutes and says so, as the Usage dashboard does.
EDGE_MAX_STEPS = 20_000

_FROM = moment("lo")
_TO = moment("hi")
_DIMENSIONS = ("gpu_name", "model", "lane", "adapter", "`key`", "team", "`user`", "end_user")
_WHO_FIELDS = tuple(f.name for f in dataclasses.fields(Who))  # the dimensions but the GPU's, as the rollup names them
# What a report grouped by each dimension reads of the rows (usage_by.Who.value), beside the engine and the GPU model
# (for its price): grouping a week of a node's rows (4M) by these only, not every dimension, saves a third.
_READS = {"engine": (), "tenant": ("team", "`key`", "end_user", "`user`"), "key": ("`key`",), "user": ("`user`",)}


def rolled_sql(by: str = "") -> str:
    """The rollup's lines over [lo, hi), whole minutes: one per engine, line and group of `by` ('': of every
    dimension); the dimensions `by` does not read are ''."""
    needed = ("gpu_name", *_READS.get(by, (by,))) if by else _DIMENSIONS
    dims = [d if d in needed else f"'' AS {d}" for d in _DIMENSIONS]
    return f"""
SELECT host, engine, toString(line) AS kind, {', '.join(dims)}, sum(requests) AS requests_sum,
       sum(prompt_tokens) AS prompt_tokens_sum, sum(generation_tokens) AS generation_tokens_sum,
       sum(engine_us) AS engine_us_sum, sum(gpu_seconds) AS gpu_seconds_sum, sum(energy_mj) AS energy_mj_sum,
       max(gpus) AS gpus_max
FROM usage_minutes
WHERE {EACH_ENGINE} AND ts >= {_FROM} AND ts < {_TO}
GROUP BY host, engine, kind, {', '.join(d for d in _DIMENSIONS if d in needed)}
"""


ROLLED = rolled_sql()
# The first and last minute the rollup holds in [lo, hi).
ROLLED_SPAN = f"""
SELECT minOrNull(toUnixTimestamp64Micro(ts)) AS first_us, maxOrNull(toUnixTimestamp64Micro(ts)) AS last_us
FROM usage_minutes
WHERE {EACH_ENGINE} AND ts >= {_FROM} AND ts < {_TO}
"""
# The last minute a host rolled up.
LAST_ROLLED = "SELECT maxOrNull(toUnixTimestamp64Micro(ts)) AS last_us FROM usage_minutes WHERE host = {host:String}"


def minute_rows(reader: Reads, minute_us: int, host: str) -> list[UsageMinute]:
    """The usage_minutes rows of the minute starting at `minute_us`, for the engines of `host`."""
    window = Window(_moment(minute_us), _moment(minute_us + MINUTE_US))
    sums: dict[tuple[object, ...], UsageMinute] = {}
    for line in usage_by.lines(reader, window, host).lines:
        if line.kind == "unattributed" and not (line.engine_us or line.energy_mj):
            continue  # an engine whose busy time all went to requests: no row to say so
        w = line.who
        row = UsageMinute(minute_us, line.host, line.engine, line.kind, line.gpu_name, w.model, w.lane, w.adapter,
                          w.key, w.team, w.user, w.end_user, line.requests, line.prompt_tokens,
                          line.generation_tokens, line.engine_us, line.gpu_seconds, line.energy_mj, line.gpus)
        key = row[1:12]  # host, engine, line, GPU model and the dimensions
        sums[key] = row if key not in sums else _add(sums[key], row)
    return list(sums.values())


def _add(a: UsageMinute, b: UsageMinute) -> UsageMinute:
    energy = None if a.energy_mj is None and b.energy_mj is None else (a.energy_mj or 0) + (b.energy_mj or 0)
    return a._replace(requests=a.requests + b.requests, prompt_tokens=a.prompt_tokens + b.prompt_tokens,
                      generation_tokens=a.generation_tokens + b.generation_tokens,
                      engine_us=a.engine_us + b.engine_us, gpu_seconds=a.gpu_seconds + b.gpu_seconds,
                      energy_mj=energy, gpus=max(a.gpus, b.gpus))


def roll(reader: Reads, host: str, start_s: float, end_s: float) -> list[UsageMinute]:
    """The rows of every whole minute in [start_s, end_s) (the demo rolls up what it replayed)."""
    first = -(-micros(start_s) // MINUTE_US) * MINUTE_US
    return [row for m in range(first, micros(end_s) - MINUTE_US + 1, MINUTE_US) for row in minute_rows(reader, m, host)]


class UsageRollup:
    """The collector's rollup job: each poll (a minute apart) rolls the minutes closed at least LAG_S ago."""

    name = "usage_rollup"

    def __init__(self, host: str, clock: Clock, reader_factory: Callable[[], Reads], *, lag_s: float = LAG_S,
                 max_minutes: int = MAX_MINUTES_PER_POLL) -> None:
        self._host = host
        self._clock = clock
        self._reader_factory = reader_factory
        self._reader: Reads | None = None
        self._lag_us = micros(lag_s)
        self._max_minutes = max_minutes
        self._next: int | None = None  # the next minute to roll (its start, us); None: read it from the table
        self._tries = 0
        self._counts = {"minutes_rolled": 0, "minutes_skipped": 0, "rows": 0}
        self._skip_log = RateLimitedLog(log, interval_s=300.0)

    def stats(self) -> Mapping[str, int]:
        return dict(self._counts)

    def poll(self, emit: Emit) -> None:
        """Roll the minutes due; SourceError (the runner counts and logs it) when the store does not answer."""
        due = (micros(self._clock.time()) - self._lag_us) // MINUTE_US * MINUTE_US  # minutes before it are due
        try:
            reader = self._reader = self._reader or self._reader_factory()
            if self._next is None:
                self._next = self._resume(reader, due)
        except Exception as exc:  # the store is down or refused: the next poll tries again
            self._reader = None
            raise SourceError(f"usage rollup cannot read its last minute: {_one_line(exc)}") from exc
        self._next = max(self._next, due - micros(MAX_BACKFILL_S) // MINUTE_US * MINUTE_US)
        for _ in range(self._max_minutes):
            if self._next >= due:
                return
            self._roll_one(reader, emit)

    def _resume(self, reader: Reads, due: int) -> int:
        row = first_or_none(reader.query(LAST_ROLLED, parameters={"host": self._host}))
        last = row.last_us if row is not None else None
        return due - MINUTE_US if last is None else int(last) + MINUTE_US

    def _roll_one(self, reader: Reads, emit: Emit) -> None:
        assert self._next is not None
        minute = self._next
        try:
            rows = minute_rows(reader, minute, self._host)
        except Exception as exc:
            self._tries += 1
            if self._tries < MAX_TRIES:
                self._reader = None  # a fresh client next time
                raise SourceError(f"usage rollup of {_moment(minute):%Y-%m-%d %H:%M} failed (try {self._tries} of "
                                  f"{MAX_TRIES}): {_one_line(exc)}") from exc
            self._counts["minutes_skipped"] += 1
            self._skip_log.warning("skip", "usage rollup skipped %s after %d failed tries (%d skipped in all): %s",
                                   f"{_moment(minute):%Y-%m-%d %H:%M}", MAX_TRIES, self._counts["minutes_skipped"],
                                   _one_line(exc))
            rows = []
        self._tries = 0
        self._next = minute + MINUTE_US
        if rows:
            emit(rows)
            self._counts["rows"] += len(rows)
        self._counts["minutes_rolled"] += 1


def rolled_lines(reader: Reads, lo_us: int, hi_us: int, engine: str = "", by: str = "") -> list[Line]:
    """The rollup's lines over whole minutes [lo_us, hi_us); with `by`, only what grouping by it reads (the other
    dimensions '')."""
    rows = named(reader.query(rolled_sql(by), parameters={"engine": engine, "lo": lo_us, "hi": hi_us}))
    return [Line(host=str(r.host), engine=str(r.engine), kind=str(r.kind), gpu_name=str(r.gpu_name),
                 who=Who(**{name: str(getattr(r, name)) for name in _WHO_FIELDS}), requests=int(r.requests_sum),
                 prompt_tokens=int(r.prompt_tokens_sum), generation_tokens=int(r.generation_tokens_sum),
                 engine_us=int(r.engine_us_sum), gpu_seconds=float(r.gpu_seconds_sum),
                 energy_mj=None if r.energy_mj_sum is None else int(r.energy_mj_sum), gpus=int(r.gpus_max))
            for r in rows]


def rolled_span(reader: Reads, window: Window, from_s: float = ROLLUP_FROM_S) -> tuple[int, int] | None:
    """The whole minutes [lo, hi) of `window` the rollup answers for, or None where the exact pass should: a window
    of `from_s` or less, or one the rollup does not cover from its first whole minute to within MAX_TAIL_S of its
    end (a minute without any engine has no rows: a rollup that begins later is taken as not covering it)."""
    start, end = micros(window.start.timestamp()), micros(window.end.timestamp())
    if end - start <= micros(from_s):
        return None
    lo, hi = -(-start // MINUTE_US) * MINUTE_US, end // MINUTE_US * MINUTE_US
    row = first_or_none(reader.query(ROLLED_SPAN, parameters={"engine": window.engine, "lo": lo, "hi": hi}))
    first_us, last_us = (None, None) if row is None else (row.first_us, row.last_us)
    if (first_us is None or last_us is None or int(first_us) != lo
            or int(last_us) + MINUTE_US < end - micros(MAX_TAIL_S)):
        return None
    return lo, int(last_us) + MINUTE_US


def report(reader: Reads, window: Window, by: str, prices: Mapping[str, float] | None = None, *,
           from_s: float = ROLLUP_FROM_S, exact: bool = False) -> Report:
    """`usage_by.report` over `window`, from the rollup where it covers the window (rolled_span), its edges outside
    whole rolled minutes from exact passes (where they hold more than EDGE_MAX_STEPS steps, the report is over the
    rolled minutes only: its window says which, its source is 'rollup_minutes'); else (or with `exact`) one exact
    pass."""
    usage_by.check(by)
    span = None if exact else rolled_span(reader, window, from_s)
    if span is None:
        return usage_by.report(reader, window, by, prices)
    lo, hi = span
    lines: list[Line] = rolled_lines(reader, lo, hi, window.engine, by)
    edges = [(a, b) for a, b in ((micros(window.start.timestamp()), lo), (hi, micros(window.end.timestamp())))
             if b > a]
    if sum(_steps(reader, a, b, window.engine) for a, b in edges) > EDGE_MAX_STEPS:
        return usage_by.grouped(lines, Window(_moment(lo), _moment(hi), window.engine), by, prices,
                                source="rollup_minutes")
    for a, b in edges:
        lines += usage_by.lines(reader, Window(_moment(a), _moment(b), window.engine)).lines
    return usage_by.grouped(lines, window, by, prices, source="rollup")


def _steps(reader: Reads, lo_us: int, hi_us: int, engine: str) -> int:
    """The steps of [lo_us, hi_us] an exact pass would walk (those of requests scheduled before aside)."""
    return int(scalar(reader.query(STEP_COUNT, parameters={"engine": engine, "host": "", "lo": lo_us, "hi": hi_us})))


def _moment(us: int) -> datetime:
    return datetime.fromtimestamp(us / 1e6, UTC)


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {one_line(exc, 200)}"


__all__ = ["EDGE_MAX_STEPS", "LAG_S", "ROLLUP_FROM_S", "UsageRollup", "minute_rows", "report", "roll", "rolled_lines",
           "rolled_span", "rolled_sql"]
