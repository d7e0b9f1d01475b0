"""What every detector shares: one read per distinct query in a diagnosis, per-engine rows read once, and the small
conversions of query cells."""

from __future__ import annotations

import math
from datetime import UTC, datetime

from stepline.diagnosis.common import (
    EXACT_MAX_QUERY_STEPS,
    EXACT_MAX_STEPS,
    Memo,
    clip,
    config_int,
    exact_and_approximate,
    hms,
    number,
    rows_by_engine,
    utc,
)
from stepline.store.store import Store
from tests.queries.test_query import Recorder


def test_a_memo_reads_each_distinct_query_once(store: Store) -> None:
    reader = Recorder(store)
    memo = Memo(reader)
    first = memo.query("SELECT {x:Int64} + 1", parameters={"x": 1}).result_rows
    assert memo.query("SELECT {x:Int64} + 1", parameters={"x": 1}).result_rows == first == [(2,)]
    assert memo.query("SELECT {x:Int64} + 1", parameters={"x": 2}).result_rows == [(3,)]
    assert len(reader.asked) == 2


def test_rows_by_engine_asks_only_for_the_engines_not_read_yet(store: Store) -> None:
    sql = "SELECT e AS engine, length(e) AS n FROM (SELECT arrayJoin({engines:Array(String)}) AS e) WHERE e != 'gone'"
    reader = Recorder(store)
    memo = Memo(reader)
    assert rows_by_engine(memo, sql, ["a", "bb"]) == {"a": ("a", 1), "bb": ("bb", 2)}
    # "bb" is known, "gone" has no row: only "ccc" and "gone" are asked for, and "gone" is left out of the answer.
    assert rows_by_engine(memo, sql, ["bb", "ccc", "gone"]) == {"bb": ("bb", 2), "ccc": ("ccc", 3)}
    assert [p["engines"] for _, p in reader.asked if p] == [["a", "bb"], ["ccc", "gone"]]
    assert rows_by_engine(memo, sql, ["gone"]) == {} and len(reader.asked) == 2  # known to have none


def test_quantiles_are_exact_up_to_the_bounds_then_from_the_projection() -> None:
    few = {"a": 10, "b": EXACT_MAX_STEPS + 1}
    assert exact_and_approximate(few, whole_minutes=True) == (["a"], ["b"])
    assert exact_and_approximate(few, whole_minutes=False) == (["a", "b"], [])  # no whole minutes to project
    many = {f"e{i}": EXACT_MAX_STEPS for i in range(EXACT_MAX_QUERY_STEPS // EXACT_MAX_STEPS + 2)}
    exact, approximate = exact_and_approximate(many, whole_minutes=True)
    assert len(exact) == EXACT_MAX_QUERY_STEPS // EXACT_MAX_STEPS and len(approximate) == 2


def test_cells_and_settings_convert_without_raising() -> None:
    assert number(None, 7.0) == 7.0 and number(math.nan) == 0.0 and number("2.5") == 2.5
    assert config_int({"max_num_seqs": "256"}, "max_num_seqs") == 256
    assert config_int({"max_num_seqs": "None"}, "max_num_seqs") is None and config_int({}, "x") is None


def test_moments_are_utc_and_titles_fit_a_line() -> None:
    naive = datetime(2026, 12, 6, 14, 0, 5)
    assert utc(naive).tzinfo is UTC
    assert hms(naive) == hms(naive.replace(tzinfo=UTC)) == "14:00:05"
    assert clip("x" * 80) == "x" * 75 + "…" and len(clip("x" * 80)) == 76 and clip("short") == "short"
