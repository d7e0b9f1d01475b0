"""grafana-clickhouse-datasource's macros and Grafana's template variables, expanded as the datasource does.

Read from grafana/clickhouse-datasource 4.x (`pkg/macros/macros.go` for the time macros, the frontend's
`applyConditionalAll` for `$__conditionalAll`); deploy/ pins grafana-clickhouse-datasource@4.20.0.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

ALL = "$__all"
"""The value Grafana gives a variable when "All" is selected."""

_VARIABLE = re.compile(r"\$\{(\w+)(?::(\w+))?\}|\$(?!__)(\w+)")
_ONE_ARG = re.compile(r"\$__(timeFilter_ms|timeFilter|timeInterval_ms|timeInterval)\(([^()]*)\)")


@dataclass(frozen=True)
class QueryContext:
    """The time range, interval and variable values a query is expanded for."""

    from_ms: int
    to_ms: int
    interval_ms: int = 1000
    variables: Mapping[str, str | Sequence[str]] = field(default_factory=dict)

    @property
    def interval_s(self) -> int:
        """`$__interval_s` and `$__timeInterval`'s step: whole seconds, at least 1 (the plugin's `max(s, 1)`)."""
        return max(1, self.interval_ms // 1000)


def expand(query: str, ctx: QueryContext) -> str:
    """The SQL the datasource would send for `query`; raises ValueError on an unknown macro or variable."""
    text = _conditional_all(query, ctx)
    text = _ONE_ARG.sub(lambda m: _one_arg(m.group(1), m.group(2).strip(), ctx), text)
    text = (text.replace("$__fromTime_ms", f"fromUnixTimestamp64Milli({ctx.from_ms})")
                .replace("$__toTime_ms", f"fromUnixTimestamp64Milli({ctx.to_ms})")
                .replace("$__fromTime", f"toDateTime({ctx.from_ms // 1000})")
                .replace("$__toTime", f"toDateTime({ctx.to_ms // 1000})")
                .replace("$__interval_s", str(ctx.interval_s))
                .replace("$__interval_ms", str(ctx.interval_ms)))  # Grafana's own variable, set before the macros
    if "$__" in text:
        raise ValueError(f"unexpanded macro in: {text}")
    return _VARIABLE.sub(lambda m: _variable(m.group(1) or m.group(3), m.group(2) or "", ctx), text)


def _one_arg(name: str, column: str, ctx: QueryContext) -> str:
    if not column or "," in column:
        raise ValueError(f"$__{name} takes 1 argument: ({column})")
    if name == "timeFilter":
        return f"{column} >= toDateTime({ctx.from_ms // 1000}) AND {column} <= toDateTime({ctx.to_ms // 1000})"
    if name == "timeFilter_ms":
        return (f"{column} >= fromUnixTimestamp64Milli({ctx.from_ms}) "
                f"AND {column} <= fromUnixTimestamp64Milli({ctx.to_ms})")
    if name == "timeInterval":
        return f"toStartOfInterval(toDateTime({column}), INTERVAL {ctx.interval_s} second)"
    # The plugin's floor (pkg/macros/macros.go TimeIntervalMs: max(interval ms, 1)).
    return f"toStartOfInterval(toDateTime64({column}, 3), INTERVAL {max(1, ctx.interval_ms)} millisecond)"


def _conditional_all(text: str, ctx: QueryContext) -> str:
    """`$__conditionalAll(cond, $v)`: cond, or `1=1` when $v is All or empty, as the plugin's frontend does it
    (grafana/clickhouse-datasource `src/data/CHDatasource.ts`, `applyConditionalAll`/`getMacroArgs`): the last
    macro first; arguments split at every comma directly inside the macro's parentheses (quotes do not protect
    one), so a condition with a top-level comma is not two arguments and the plugin leaves the macro unexpanded."""
    start = "$__conditionalAll("
    while (i := text.rfind(start)) >= 0:
        args, depth, j, arg_start = [], 1, i + len(start), i + len(start)
        while depth:
            if j >= len(text):
                raise ValueError(f"unbalanced $__conditionalAll in: {text}")
            depth += {"(": 1, ")": -1}.get(text[j], 0)
            if (text[j] == "," and depth == 1) or depth == 0:
                args.append(text[arg_start:j])
                arg_start = j + 1
            j += 1
        if len(args) != 2:
            raise ValueError(f"$__conditionalAll takes 2 arguments, got {len(args)} (a top-level comma in the "
                             f"condition? wrap it in parentheses); the plugin leaves it unexpanded: {text}")
        condition, var = args
        m = _VARIABLE.search(var.strip())
        if m is None:
            raise ValueError(f"$__conditionalAll's second argument names no variable: {var!r}")
        chosen = _values(m.group(1) or m.group(3), ctx)
        # The plugin compares `current.value.toString()` with '' and '$__all': [] and [''] are All too.
        is_all = ",".join(chosen) in ("", ALL)
        text = text[:i] + ("1=1" if is_all else condition) + text[j:]
    return text


def _values(name: str, ctx: QueryContext) -> list[str]:
    if name not in ctx.variables:
        raise ValueError(f"no value for variable ${name}")
    value = ctx.variables[name]
    return [value] if isinstance(value, str) else list(value)


def _variable(name: str, fmt: str, ctx: QueryContext) -> str:
    values = _values(name, ctx)
    if values == [ALL]:
        raise ValueError(f"${name} is All outside $__conditionalAll")
    if fmt == "singlequote":
        return ",".join("'" + v.replace("'", "\\'") + "'" for v in values)
    if fmt in ("", "raw"):
        return values[0] if len(values) == 1 else "{" + ",".join(values) + "}"
    raise ValueError(f"unsupported variable format ${{{name}:{fmt}}}")
