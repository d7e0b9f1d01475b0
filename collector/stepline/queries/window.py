"""The conditions reads pick rows by: which engines, and which span of time, as bound {name:Type} parameters."""

from __future__ import annotations


def one_engine(name: str = "engine") -> str:
    """The engine bound as `name`."""
    return f"engine = {{{name}:String}}"


def between(start: str = "start", end: str = "end", column: str = "ts") -> str:
    """`column` in [start, end], the bounds bound as DateTime64(6) parameters of those names (the columns' type)."""
    return f"{column} >= {{{start}:DateTime64(6)}} AND {column} <= {{{end}:DateTime64(6)}}"


ENGINE = one_engine()
ENGINES = "engine IN {engines:Array(String)}"
# Every engine, or only the window's: the filter of a query that answers for all engines at once.
EACH_ENGINE = "({engine:String} = '' OR engine = {engine:String})"
# Every host, or one collector's: what a collector's own reads of its host's engines add (the usage rollup).
EACH_HOST = "({host:String} = '' OR host = {host:String})"
IN_WINDOW = between()
# From `since` on, bound as epoch microseconds: a bound DateTime64 string would depend on the session's zone.
SINCE = "ts >= fromUnixTimestamp64Micro({since:Int64}, 'UTC')"
