"""What every detector shares: bound SQL that also renders with literals, engines, time and configuration."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from stepline.diagnosis.findings import Finding, Window
from stepline.summary import Reads

Detector = Callable[[Reads, Window], list[Finding]]

_PLACEHOLDER = re.compile(r"\{(\w+):([^{}]+)\}")


class Query:
    """One SQL text with {name:Type} placeholders: run bound, shown with literals (for `stepline query`)."""

    def __init__(self, sql: str, **parameters: Any) -> None:
        self.sql = sql.strip()
        self.parameters = parameters

    def rows(self, reader: Reads) -> list[tuple[Any, ...]]:
        # Moments travel as integer microseconds: a bound DateTime64 string would depend on the session's zone.
        sql = _PLACEHOLDER.sub(lambda m: (f"fromUnixTimestamp64Micro({{{m.group(1)}:Int64}}, 'UTC')"
                                          if isinstance(self.parameters[m.group(1)], datetime) else m.group(0)),
                               self.sql)
        bound = {k: round(v.timestamp() * 1_000_000) if isinstance(v, datetime) else v
                 for k, v in self.parameters.items()}
        return [tuple(r) for r in reader.query(sql, parameters=bound).result_rows]

    def literal(self) -> str:
        """The same query with every placeholder replaced by its value, quoted for ClickHouse."""
        return _PLACEHOLDER.sub(lambda m: _literal(self.parameters[m.group(1)]), self.sql)


def _literal(value: Any) -> str:
    if isinstance(value, datetime):
        return f"toDateTime64('{value.astimezone(UTC):%Y-%m-%d %H:%M:%S.%f}', 6, 'UTC')"
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int | float):
        return repr(value)
    return "'" + str(value).replace("\\", "\\\\").replace("'", "\\'") + "'"


def utc(moment: datetime) -> datetime:
    """chDB may hand back DateTime64('UTC') without its zone: the store only holds UTC."""
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def number(value: Any, default: float = 0.0) -> float:
    """A float from a query cell; None and NaN become `default`."""
    if value is None:
        return default
    result = float(value)
    return default if math.isnan(result) else result


def engines(reader: Reads, window: Window) -> list[str]:
    """The engines with steps, requests or engine samples in the window (or only the window's engine)."""
    if window.engine:
        return [window.engine]
    rows = Query(
        "SELECT DISTINCT engine FROM (SELECT engine FROM steps WHERE ts >= {start:DateTime64(6)} AND ts <= "
        "{end:DateTime64(6)} UNION ALL SELECT engine FROM requests WHERE ts >= {start:DateTime64(6)} AND ts <= "
        "{end:DateTime64(6)} UNION ALL SELECT engine FROM engine_samples WHERE ts >= {start:DateTime64(6)} AND "
        "ts <= {end:DateTime64(6)}) WHERE engine != '' ORDER BY engine",
        start=window.start, end=window.end).rows(reader)
    return [str(r[0]) for r in rows]


def engine_config(reader: Reads, engine: str, window: Window) -> dict[str, str]:
    """The engine's newest engine_config event up to the window's end; the plugin reports it once at start-up,
    so it may predate the window (or, for a replay, follow it): the newest one wins."""
    rows = Query(
        "SELECT attributes FROM events WHERE kind = 'engine_config' AND engine = {engine:String} "
        "ORDER BY ts <= {end:DateTime64(6)} DESC, ts DESC LIMIT 1", engine=engine, end=window.end).rows(reader)
    return {str(k): str(v) for k, v in rows[0][0].items()} if rows else {}


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
