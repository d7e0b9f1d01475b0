"""One SQL text with ClickHouse's server-side {name:Type} placeholders: run bound, shown with literals.

The one form of parameter every read writes: `param(name, type)` (the placeholder ClickHouse binds,
https://clickhouse.com/docs/interfaces/cli#cli-queries-with-parameters), and `moment(name)` for a point in time,
bound as its Int64 microseconds since the epoch and read back as DateTime64(6, 'UTC') in the SQL text itself (a
bound DateTime64 string would be read in the session's time zone). `Query` runs its text as written, the moments
bound as their microseconds; `Query.literal()` is that same text with each placeholder replaced by its value: what
a finding shows as its SQL (`stepline diagnose`, the report), for a reader to run again with `stepline query`.

`which_span` gives the fragments that test a step against many (engine, from, to) spans at once. `Query.rows` answers
rows read by name (stepline.queries.rows.Row).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from stepline.model.rows import micros
from stepline.queries.rows import Result, Row, named

_PLACEHOLDER = re.compile(r"\{(\w+):([^{}]+)\}")


class Reads(Protocol):
    """Anything that answers a query with rows: a clickhouse-connect client or the Store."""

    def query(self, sql: str, parameters: dict[str, Any] | None = None) -> Result: ...


def param(name: str, type_: str) -> str:
    """The placeholder ClickHouse binds the parameter `name` to, as `type_`: {name:type_}."""
    return "{" + name + ":" + type_ + "}"


def moment(name: str) -> str:
    """The moment bound as `name`, its Int64 microseconds since the epoch (Query binds a datetime so; a reader that
    binds its own parameters binds that integer), as DateTime64(6, 'UTC'), the type of every time column."""
    return f"fromUnixTimestamp64Micro({param(name, 'Int64')}, 'UTC')"


class Query:
    """One SQL text with {name:Type} placeholders: run bound, shown with literals (for a finding's SQL).

    A datetime parameter binds as its epoch microseconds, so its placeholder is an Int64 (`moment`); any other
    type for one is refused, as is a placeholder with no parameter."""

    def __init__(self, sql: str, **parameters: Any) -> None:
        self.sql = sql.strip()
        self.parameters = parameters
        for name, type_ in _PLACEHOLDER.findall(self.sql):
            if name not in parameters:
                raise ValueError(f"the query's placeholder {{{name}:{type_}}} has no parameter")
            if _has_moment(parameters[name]) and type_ not in ("Int64", "Array(Int64)"):
                raise ValueError(f"{{{name}:{type_}}} is bound to a moment: write it as moment({name!r}), an Int64")

    def bound(self) -> dict[str, Any]:
        """The parameters as ClickHouse binds them: moments as their epoch microseconds."""
        return {name: _bound(value) for name, value in self.parameters.items()}

    def rows(self, reader: Reads) -> list[Row]:
        """The query's rows, each read by its column names."""
        return named(reader.query(self.sql, parameters=self.bound()))

    def literal(self) -> str:
        """The text that runs, each placeholder replaced by its value quoted for ClickHouse."""
        return _PLACEHOLDER.sub(lambda m: _literal(self.parameters[m.group(1)]), self.sql)


def _has_moment(value: Any) -> bool:
    return isinstance(value, datetime) or (isinstance(value, list | tuple) and any(map(_has_moment, value)))


def _bound(value: Any) -> Any:
    if isinstance(value, datetime):
        return micros(value.timestamp())
    if isinstance(value, list | tuple) and any(map(_has_moment, value)):
        return [_bound(v) for v in value]
    return value


def _literal(value: Any) -> str:
    if isinstance(value, datetime):
        # The microseconds that bind, and the moment they are for a reader (a comment: the server skips it).
        return f"{micros(value.timestamp())} /* {value.astimezone(UTC):%Y-%m-%d %H:%M:%S.%f} UTC */"
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_literal(v) for v in value) + "]"
    return "'" + str(value).replace("\\", "\\\\").replace("'", "\\'") + "'"


# A step's span is looked up among its own engine's spans only (indexOf on the LowCardinality engine runs once per
# distinct engine, not per row); the bounds are integer microseconds, inclusive at both ends.
_OWN_SPANS = (f"{param('span_lo', 'Array(Int64)')}[i] <= toUnixTimestamp64Micro(ts) AND toUnixTimestamp64Micro(ts) "
              f"<= {param('span_hi', 'Array(Int64)')}[i], "
              f"{param('span_ks', 'Array(Array(UInt32))')}[indexOf({param('span_engines', 'Array(String)')}, engine)]")
# The coarse keys that prune: the steps' primary key is (host, engine, engine_index, ts, ...), and ClickHouse
# analyses `(engine, toUnixTimestamp(toStartOfMinute(ts))) IN <constant set>` against it (a monotonic function of
# a key column, checked with EXPLAIN indexes = 1: a day of 64 engines reads 474 of 30,505 granules for 320 spans
# of a few seconds). Minutes, or hours or days where the spans are long, so that the set stays small enough for
# an HTTP request's parameters.
_UNITS = ((60, "toStartOfMinute"), (3600, "toStartOfHour"), (86400, "toStartOfDay"))
MAX_SPAN_KEYS = 4096


def _span_keys(spans: Sequence[tuple[str, int, int]], max_keys: int) -> tuple[str, list[tuple[str, int]]]:
    """The function that floors a step's time to the finest of _UNITS giving at most `max_keys` keys (days,
    however many, when none does), and the (engine, floored Unix time) keys the spans touch."""
    def floored(unit_s: int) -> list[tuple[str, int]]:
        return sorted({(engine, t) for engine, lo, hi in spans
                       for t in range(lo // 1_000_000 // unit_s * unit_s, hi // 1_000_000 + 1, unit_s)})

    for unit_s, function in _UNITS[:-1]:
        keys = floored(unit_s)
        if len(keys) <= max_keys:
            return function, keys
    unit_s, function = _UNITS[-1]
    return function, floored(unit_s)


@dataclass(frozen=True)
class Spans:
    """The fragments that test a step of `steps` against a few (engine, from, to) spans, numbered from 0, and the
    parameters they bind: a few arrays, whatever the number of spans (one OR and one multiIf case per span made a
    query of 100 KB that took seconds to analyse).

    `inside`: a step of any span (the (engine, minute) keys the spans touch, which the steps' primary key prunes
    by, so a day's table is read only where the spans are, then the exact test: write it in a PREWHERE, so only
    those rows' other columns are read); `which`: a step's first span, -1 for none; `every`: an array of every span
    a step lies in, for spans that overlap."""

    inside: str
    which: str
    every: str
    parameters: dict[str, Any]


def which_span(spans: Sequence[tuple[str, datetime, datetime]], max_keys: int = MAX_SPAN_KEYS) -> Spans:
    """The fragments over the steps of `spans` (engine, from, to), the keys that prune them at most `max_keys`."""
    engines = sorted({engine for engine, _, _ in spans})
    own: dict[str, list[int]] = {engine: [] for engine in engines}
    for i, (engine, _, _) in enumerate(spans):
        own[engine].append(i + 1)
    lo = [micros(start.timestamp()) for _, start, _ in spans]
    hi = [micros(end.timestamp()) for _, _, end in spans]
    function, keys = _span_keys([(engine, a, b) for (engine, _, _), a, b in zip(spans, lo, hi, strict=True)],
                                max_keys)
    inside = (f"(engine, toUnixTimestamp({function}(ts))) IN arrayZip({param('span_key_engines', 'Array(String)')}, "
              f"{param('span_key_times', 'Array(UInt32)')}) AND arrayExists(i -> {_OWN_SPANS})")
    # The bounds bind as moments (their microseconds), so that a finding's SQL shows them as times too.
    return Spans(inside, f"toInt64(arrayFirst(i -> {_OWN_SPANS})) - 1",
                 f"arrayMap(i -> toInt64(i) - 1, arrayFilter(i -> {_OWN_SPANS}))",
                 {"span_engines": engines, "span_ks": [own[e] for e in engines],
                  "span_lo": [start for _, start, _ in spans], "span_hi": [end for _, _, end in spans],
                  "span_key_engines": [e for e, _ in keys], "span_key_times": [t for _, t in keys]})
