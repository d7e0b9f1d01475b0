"""What every detector shares: engines, time and configuration (the SQL it runs is stepline.queries.query's)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

from stepline.diagnosis.findings import Finding, Window
from stepline.diagnosis.rollup import Agg, rolled
from stepline.queries.baselines import ALONE
from stepline.queries.query import Query, moment
from stepline.queries.window import EACH_ENGINE, ENGINES, IN_WINDOW
from stepline.store.reads import Reads, Result, Row

Detector = Callable[[Reads, Window], list[Finding]]


def utc(moment: datetime) -> datetime:
    """chDB may hand back DateTime64('UTC') without its zone: the store only holds UTC."""
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def number(value: Any, default: float = 0.0) -> float:
    """A float from a query cell; None and NaN become `default`."""
    if value is None:
        return default
    result = float(value)
    return default if math.isnan(result) else result


# Quantiles over more steps than this per engine come from the per-minute projection (bfloat16: ~3 significant
# digits; per hour over windows of rollup.HOURS_FROM hours) instead of every step: exact up to about 35 minutes of a
# busy engine, cheap beyond.
EXACT_MAX_STEPS = 100_000
# ... and one query reads at most this many steps exactly, of all the engines it asks about: beyond it, the engines
# with the most steps come from the projection, so that a fleet's window costs what a node's does (64 engines x
# 30 min are 5.2M steps: 0.65 s exact; an 8-GPU node's half hour, 650k steps, stays exact).
EXACT_MAX_QUERY_STEPS = 1_000_000


def exact_and_approximate(steps: dict[str, int], whole_minutes: bool) -> tuple[list[str], list[str]]:
    """The engines whose quantiles a query reads from every step and those it reads from the per-minute projection
    (only where the window holds whole minutes): exact up to EXACT_MAX_STEPS an engine and EXACT_MAX_QUERY_STEPS
    in all, the engines with the fewest steps first."""
    exact: list[str] = []
    approximate: list[str] = []
    total = 0
    for engine in sorted(steps, key=lambda e: (steps[e], e)):
        n = steps[engine]
        if whole_minutes and (n > EXACT_MAX_STEPS or total + n > EXACT_MAX_QUERY_STEPS):
            approximate.append(engine)
        else:
            exact.append(engine)
            total += n
    return sorted(exact), sorted(approximate)


class Memo:
    """One diagnosis reads each distinct query once: the detectors share engines, configurations and buckets."""

    def __init__(self, reader: Reads) -> None:
        self._reader = reader
        self._results: dict[str, Result] = {}
        self.by_engine: dict[str, dict[str, Row | None]] = {}  # see `rows_by_engine`

    def query(self, sql: str, parameters: dict[str, Any] | None = None) -> Result:
        key = sql + "\0" + repr(sorted((parameters or {}).items()))
        if key not in self._results:
            self._results[key] = self._reader.query(sql, parameters=parameters)
        return self._results[key]


def rows_by_engine(reader: Reads, sql: str, names: Sequence[str], **parameters: Any) -> dict[str, Row]:
    """engine -> its row of `sql` (bound to `engines` = some of `names`, and `parameters`; one row per engine, with
    a column `engine`), for those of `names` it has a row for. Within one diagnosis (a Memo) each engine is read once:
    the detectors ask the same query of overlapping sets of engines (the baselines of the engines each one
    suspects), and only the engines not read yet are asked for (over a day of 64 engines, two queries of 0.1 s
    fewer)."""
    cache = reader.by_engine if isinstance(reader, Memo) else {}
    known = cache.setdefault(sql + "\0" + repr(sorted(parameters.items())), {})
    missing = sorted({name for name in names if name not in known})
    if missing:
        known.update(dict.fromkeys(missing))
        known.update((str(row.engine), row) for row in Query(sql, engines=missing, **parameters).rows(reader))
    return {name: row for name in names if (row := known[name]) is not None}


# The engines with rows in some minutes of a table, from its per-minute projection (schema.REQUESTS_PER_MINUTE,
# ENGINE_SAMPLES_PER_MINUTE), and those of them with rows in the window itself.
def _touched(table: str) -> str:
    return (f"WITH toStartOfMinute(ts) AS bucket SELECT engine FROM {table} WHERE bucket >= {moment('lo')} AND "
            f"bucket <= {moment('hi')} GROUP BY engine")


def _in_window(table: str) -> str:
    return f"SELECT DISTINCT engine FROM {table} WHERE {ENGINES} AND {IN_WINDOW}"


def engines(reader: Reads, window: Window) -> list[str]:
    """The engines with steps, requests or engine samples in the window (or only the window's engine)."""
    if window.engine:
        return [window.engine]
    # Steps from their projections, exactly (0.06 s over a day of 64 engines).
    steps, bounds = rolled([], "1", window.start, window.end)
    seen = {str(r.engine) for r in Query(steps, **bounds).rows(reader)}
    # Requests and scraped samples are not sorted by time within an engine, and have no per-second projection: the
    # window's edges would read a day's times (0.1 s each over 64 engines). The engines of the minutes the window
    # touches come from their per-minute projections (a few ms); one found there and not among the steps (spans
    # alone, or scraped while idle) is looked up in the window itself.
    lo, hi = (datetime.fromtimestamp(t.timestamp() // 60 * 60, UTC) for t in (window.start, window.end))
    for table in ("requests", "engine_samples"):
        touched = {str(r.engine) for r in Query(_touched(table), lo=lo, hi=hi).rows(reader)} - seen
        if touched:
            seen.update(str(r.engine) for r in Query(_in_window(table), engines=sorted(touched),
                                                 start=window.start, end=window.end).rows(reader))
    return sorted(seen - {""})


_SUMMARY = (
    Agg("steps", "count()", "sum({})"),
    Agg("alone_steps", f"countIf({ALONE})", "sum({})"),
    Agg("prefill_steps", "countIf(num_ctx_tokens > 0)", "sum({})"),
    Agg("max_single_prefill", "maxIf(num_ctx_tokens, num_ctx_requests = 1)", "max({})"),
    Agg("max_step_tokens", "max(num_ctx_tokens + num_generation_tokens)", "max({})"),
    Agg("waiting_max", "max(waiting)", "max({})"),
    Agg("kv_max", "max(kv_cache_usage)", "max({})"),
    Agg("steps_kv_over_95pct", "countIf(kv_cache_usage >= 0.95)", "sum({})"),
    Agg("preempted", "sum(preempted)", "sum({})"),
    Agg("first", "min(ts)", "min({})"),
    Agg("last", "max(ts)", "max({})"),
)


def window_summary(reader: Reads, window: Window) -> dict[str, dict[str, Any]]:
    """engine -> counts and extremes of its steps in the window (the names in _SUMMARY), for every engine that
    stepped in it: exact, and read from the projections when the window is long."""
    sql, bounds = rolled(_SUMMARY, EACH_ENGINE, window.start, window.end)
    return {str(r.engine): {a.alias: getattr(r, a.alias) for a in _SUMMARY}
            for r in Query(sql, engine=window.engine, **bounds).rows(reader)}


def engine_configs(reader: Reads, window: Window) -> dict[str, dict[str, str]]:
    """Each engine's newest engine_config event up to the window's end; the plugin reports it once at start-up,
    so it may predate the window (or, for a replay, follow it): the newest one wins."""
    rows = Query(
        f"SELECT engine, argMax(attributes, (ts <= {moment('end')}, ts)) AS config FROM events "
        f"WHERE kind = 'engine_config' AND {EACH_ENGINE} GROUP BY engine",
        engine=window.engine, end=window.end).rows(reader)
    return {str(r.engine): {str(k): str(v) for k, v in r.config.items()} for r in rows}


def config_int(config: dict[str, str], key: str) -> int | None:
    """An integer setting, or None when absent or not an integer (e.g. 'None')."""
    try:
        return int(config[key])
    except (KeyError, ValueError):
        return None


def clip(text: str, width: int = 76) -> str:
    """Titles stay within one 80-column line."""
    return text if len(text) <= width else text[: width - 1] + "…"


def hms(moment: datetime) -> str:
    return f"{utc(moment):%H:%M:%S}"
