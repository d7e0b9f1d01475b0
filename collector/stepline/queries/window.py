"""The conditions reads pick rows by: which engines, and which span of time, as bound {name:Type} parameters."""

from __future__ import annotations

from stepline.queries.query import moment, param


def one_engine(name: str = "engine") -> str:
    """The engine bound as `name`."""
    return f"engine = {param(name, 'String')}"


def between(start: str = "start", end: str = "end", column: str = "ts") -> str:
    """`column` in [start, end], the bounds moments bound as those names (queries.query.moment)."""
    return f"{column} >= {moment(start)} AND {column} <= {moment(end)}"


ENGINE = one_engine()
ENGINES = "engine IN {engines:Array(String)}"
# Every engine, or only the window's: the filter of a query that answers for all engines at once.
EACH_ENGINE = "({engine:String} = '' OR engine = {engine:String})"
# Every host, or one collector's: what a collector's own reads of its host's engines add (the usage rollup).
EACH_HOST = "({host:String} = '' OR host = {host:String})"
IN_WINDOW = between()
# From `since` on: its callers, which hold seconds, bind its epoch microseconds themselves.
SINCE = f"ts >= {moment('since')}"
