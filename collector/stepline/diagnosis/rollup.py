"""Sums, counts and extremes of steps over a window, read from the steps' per-minute and per-second projections.

A window splits into whole minutes (read per minute), the whole seconds either side of them (read per second)
and the partial seconds at its edges (read step by step). Each part is aggregated on its own and the parts
combine, so the answer is what the same aggregates over every step in [start, end] give, for a few thousand
rows read instead of millions. Only aggregates the projections hold (schema.STEP_AGGREGATES) read this way,
and only those whose parts combine (sums, counts, min, max, argMax); quantiles cannot, see `whole_minutes`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from stepline.queries.query import moment
from stepline.store.reads import Row

MINUTE, SECOND, ROW = "toStartOfMinute(ts)", "toStartOfSecond(ts)", "ts"
HOUR = "toStartOfHour(ts)"
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
ROWS_UP_TO = timedelta(hours=1)
"""Windows this short read the steps themselves: on a busy node their rows cost less than the projections' parts."""


@dataclass(frozen=True)
class Part:
    """Steps whose `bucket` lies in [lo, hi) ([lo, hi] when `closed`); lo None: from the first step on."""

    bucket: str
    lo: datetime | None
    hi: datetime
    closed: bool = False
    outside: tuple[datetime, datetime] | None = None  # only the steps outside [outside[0], outside[1])


@dataclass(frozen=True)
class Agg:
    """One aggregate: `inner` over each part's steps (one the projections hold), `outer` over the parts' results,
    a template where {} is the part's column (e.g. "sum({})", or "argMax({}, p_last)" naming another's)."""

    alias: str
    inner: str
    outer: str


def _floor(moment: datetime, unit: timedelta) -> datetime:
    return _EPOCH + (moment - _EPOCH) // unit * unit


def _ceil(moment: datetime, unit: timedelta) -> datetime:
    floor = _floor(moment, unit)
    return floor if floor == moment else floor + unit


def parts(start: datetime | None, end: datetime, *, minutes: bool = True, seconds: bool = True,
          edges: bool = True) -> list[Part]:
    """[start, end] as whole minutes (when `minutes`), whole seconds and partial seconds; start None: unbounded.
    A window up to ROWS_UP_TO long is one part of rows. Without `seconds` (a table with no per-second projection),
    whole minutes and one part of the rows outside them (at both ends: one read); without `edges` too, the whole
    minutes only (a window up to ROWS_UP_TO long, or without a whole minute, is still one part of rows)."""
    second, minute = timedelta(seconds=1), timedelta(minutes=1)
    s0, s1 = (None if start is None else _ceil(start, second)), _floor(end, second)
    if start is not None and s0 is not None and (s0 >= s1 or end - start <= ROWS_UP_TO):
        return [Part(ROW, start, end, closed=True)]
    if start is not None and not seconds:
        first, last = _ceil(start, minute), _floor(end, minute)
        if not minutes or first >= last:
            return [Part(ROW, start, end, closed=True)]
        return [Part(MINUTE, first, last)] + ([Part(ROW, start, end, closed=True, outside=(first, last))]
                                              if edges else [])
    out = [Part(ROW, start, s0)] if start is not None and s0 is not None and start < s0 else []
    m0, m1 = (None if s0 is None else _ceil(s0, minute)), _floor(s1, minute)
    if minutes and (m0 is None or m0 < m1):
        if s0 is not None and m0 is not None and s0 < m0:
            out.append(Part(SECOND, s0, m0))
        out.append(Part(MINUTE, m0, m1))
        if m1 < s1:
            out.append(Part(SECOND, m1, s1))
    else:
        out.append(Part(SECOND, s0, s1))
    out.append(Part(ROW, s1, end, closed=True))
    return out


def rolled(aggs: Sequence[Agg], where: str, start: datetime | None, end: datetime, *,
           keys: Sequence[tuple[str, str]] = (("engine", "engine"),), minutes: bool = True, table: str = "steps",
           seconds: bool = True, edges: bool = True) -> tuple[str, dict[str, datetime]]:
    """Per `keys` (alias, expression over the steps' columns and `bucket`), `aggs` over the steps in [start, end]
    that match `where`, as exactly as over the rows. A key over `bucket` must be whole minutes (or whole seconds
    with minutes=False): e.g. toStartOfInterval(bucket, toIntervalSecond(60)). Returns the SQL and the bounds
    it binds (beside whatever placeholders `where` and `keys` hold). `table` is another table with a per-minute
    projection of the aggregates (its per-second parts read rows: a few seconds at either end); `seconds` False
    for one without a per-second projection, or whose rows a time condition cannot prune (requests, sorted by
    request: every read of rows by time scans the finish times of the days it touches, so the edges are one read);
    `edges` False (with `seconds` False) for the whole minutes only, where the partial ones at the ends may go."""
    key_list = ", ".join(alias for alias, _ in keys)
    branches = []
    bounds: dict[str, datetime] = {}
    for i, part in enumerate(parts(start, end, minutes=minutes, seconds=seconds, edges=edges)):
        conditions = [f"bucket {'<=' if part.closed else '<'} {moment(f'p{i}_hi')}"]
        bounds[f"p{i}_hi"] = part.hi
        if part.outside is not None:
            conditions.append(f"NOT (bucket >= {moment(f'p{i}_olo')} AND bucket < {moment(f'p{i}_ohi')})")
            bounds[f"p{i}_olo"], bounds[f"p{i}_ohi"] = part.outside
        if part.lo is not None:
            conditions.insert(0, f"bucket >= {moment(f'p{i}_lo')}")
            bounds[f"p{i}_lo"] = part.lo
        columns = [f"{expression} AS {alias}" for alias, expression in keys] + [
            f"{a.inner} AS p_{a.alias}" for a in aggs]
        branches.append(f"WITH {part.bucket} AS bucket SELECT {', '.join(columns)} FROM {table} "
                        f"WHERE {' AND '.join(conditions)} AND ({where}) GROUP BY {key_list}")
    outer = "".join(", " + a.outer.replace("{}", f"p_{a.alias}") + f" AS {a.alias}" for a in aggs)
    union = "\n    UNION ALL\n    ".join(branches)
    return f"SELECT {key_list}{outer}\nFROM (\n    {union}\n)\nGROUP BY {key_list} ORDER BY {key_list}", bounds


def whole_minutes(start: datetime, end: datetime) -> tuple[datetime, datetime] | None:
    """The whole minutes inside [start, end], for quantiles read from the per-minute projection (which cannot
    combine with the edges): None when there is not one."""
    minute = timedelta(minutes=1)
    lo, hi = _ceil(start, minute), _floor(end, minute)
    return (lo, hi) if lo < hi else None


# Quantiles over a window this many whole hours long or more come from per-hour states (the window's whole hours;
# the partial hours at its ends, under 2 of 12, are left out); shorter windows from the whole minutes.
HOURS_FROM = 12


@dataclass(frozen=True)
class Span:
    """Whole buckets [lo, hi) of a window that approximate quantiles are read over, and how to say so."""

    bucket: str  # the bucket expression the projection is keyed by
    lo: datetime
    hi: datetime
    says: str  # for the evidence

    def reads(self, sql_over: Callable[[str], str]) -> str:
        """The SQL `sql_over` writes over buckets of the expression it is given, over this span's buckets (e.g.
        queries.baselines.decode_approximate)."""
        return sql_over(self.bucket)


def approximate_span(start: datetime, end: datetime) -> Span | None:
    """The whole hours of a window HOURS_FROM hours long or more, else its whole minutes; None without either.
    An engine the hours do not hold (it started in the last partial hour) is read over `minute_span`."""
    hour = timedelta(hours=1)
    lo, hi = _ceil(start, hour), _floor(end, hour)
    if hi - lo >= HOURS_FROM * hour:
        return Span(HOUR, lo, hi, "per-hour projection, bfloat16 (within ~1%), the window's whole hours")
    return minute_span(start, end)


def minute_span(start: datetime, end: datetime) -> Span | None:
    """The whole minutes of a window; None without one."""
    minutes = whole_minutes(start, end)
    if minutes is None:
        return None
    lo, hi = minutes
    return Span(MINUTE, lo, hi, "per-minute projection, bfloat16 (within ~1%)")


def approximate_rows(read: Callable[[Span, list[str]], Iterable[Row]], engines: Sequence[str],
                     start: datetime, end: datetime) -> dict[str, tuple[Row, Span]]:
    """engine -> (its row of `read(span, engines)`, which has a column `engine`, the span it came from) for
    `engines`: over the window's approximate_span, then over its whole minutes for the engines the hours held
    nothing of."""
    out: dict[str, tuple[Row, Span]] = {}
    span = approximate_span(start, end)
    if span is None or not engines:
        return out
    out.update((str(row.engine), (row, span)) for row in read(span, list(engines)))
    rest = [e for e in engines if e not in out]
    if rest and span.bucket == HOUR and (minutes := minute_span(start, end)) is not None:
        out.update((str(row.engine), (row, minutes)) for row in read(minutes, rest))
    return out
