"""grafana-clickhouse-datasource's macros and Grafana's variables, expanded as the datasource does (the dashboards'
queries expanded and run on a store: test_generate.py)."""

from __future__ import annotations

import pytest

from stepline.dashboards.macros import ALL, QueryContext, expand


def test_macros_expand_as_the_datasource_does() -> None:
    ctx = QueryContext(1_700_000_000_123, 1_700_000_060_456, 2500, {"engine": ["a", "b"], "host": ALL})
    assert expand("$__timeFilter(ts)", ctx) == "ts >= toDateTime(1700000000) AND ts <= toDateTime(1700000060)"
    assert expand("$__timeFilter_ms(ts)", ctx) == (
        "ts >= fromUnixTimestamp64Milli(1700000000123) AND ts <= fromUnixTimestamp64Milli(1700000060456)")
    assert expand("$__fromTime $__toTime", ctx) == "toDateTime(1700000000) toDateTime(1700000060)"
    assert expand("$__timeInterval(ts)", ctx) == "toStartOfInterval(toDateTime(ts), INTERVAL 2 second)"
    assert expand("$__timeInterval_ms(ts)", ctx) == (
        "toStartOfInterval(toDateTime64(ts, 3), INTERVAL 2500 millisecond)")
    assert expand("$__interval_s", ctx) == "2"
    assert expand("$__interval_ms", ctx) == "2500"
    assert expand("$__conditionalAll(engine IN (${engine:singlequote}), $engine)", ctx) == "engine IN ('a','b')"
    assert expand("$__conditionalAll(host IN (${host:singlequote}), $host) AND 1", ctx) == "1=1 AND 1"
    assert expand("x = '$engine'", QueryContext(0, 0, 1000, {"engine": "e"})) == "x = 'e'"
    with pytest.raises(ValueError):
        expand("$__unknown(ts)", ctx)
    with pytest.raises(ValueError):
        expand("host IN (${host:singlequote})", ctx)


def test_macro_edge_cases_as_the_plugin_has_them() -> None:
    ctx = QueryContext(1_700_000_000_123, 1_700_000_060_456, 0, {"engine": ["a"], "empty": "", "none": []})
    # A comma directly inside the macro makes a third argument: the plugin leaves the macro unexpanded.
    with pytest.raises(ValueError, match="2 arguments"):
        expand("$__conditionalAll(engine = 'a', 1, $engine)", ctx)
    with pytest.raises(ValueError, match="2 arguments"):
        expand("$__conditionalAll(engine = ',', $engine)", ctx)  # quotes do not protect a comma
    assert expand("$__conditionalAll((engine = 'a' OR x IN (1, 2)), $engine)", ctx) == "(engine = 'a' OR x IN (1, 2))"
    # An empty selection is All.
    assert expand("$__conditionalAll(engine IN (${empty:singlequote}), $empty)", ctx) == "1=1"
    assert expand("$__conditionalAll(engine IN (${none:singlequote}), ${none})", ctx) == "1=1"
    # Nested: the last macro first, as the plugin does.
    assert expand("$__conditionalAll(a AND $__conditionalAll(b, $empty), $engine)", ctx) == "a AND 1=1"
    # A zero interval: 1 ms and 1 s floors.
    assert expand("$__timeInterval_ms(ts)", ctx) == "toStartOfInterval(toDateTime64(ts, 3), INTERVAL 1 millisecond)"
    assert expand("$__timeInterval(ts) $__interval_s", ctx) == "toStartOfInterval(toDateTime(ts), INTERVAL 1 second) 1"
    assert expand("$__fromTime_ms $__toTime_ms", ctx) == (
        "fromUnixTimestamp64Milli(1700000000123) fromUnixTimestamp64Milli(1700000060456)")
    with pytest.raises(ValueError):
        expand("$__timeFilter(a, b)", ctx)



def test_a_variable_is_raw_or_single_quoted_with_its_quotes_escaped() -> None:
    ctx = QueryContext(0, 0, variables={"engine": ["it's", "b"], "one": "x"})
    assert expand("${engine:singlequote}", ctx) == "'it\\'s','b'"
    assert expand("$one ${one:raw} ${engine}", ctx) == "x x {it's,b}"
    with pytest.raises(ValueError, match="unsupported variable format"):
        expand("${one:csv}", ctx)
    with pytest.raises(ValueError, match="no value for variable \\$missing"):
        expand("$missing", ctx)
