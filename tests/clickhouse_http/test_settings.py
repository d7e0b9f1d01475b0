"""URL parameters as settings: transport parameters set aside, names checked to be names; whether a setting may be
set at all is the engine's profile's call (tests/store/test_query_profile.py)."""

from __future__ import annotations

import pytest

from stepline.clickhouse_http.errors import SqlRefused
from stepline.clickhouse_http.settings import NAME, query_settings


def test_transport_parameters_are_not_settings() -> None:
    params = {"query": "SELECT 1", "database": "d", "compress": "1", "param_x": "1",
              "query_id": "q", "session_id": "s", "max_threads": "2"}
    assert query_settings(params) == (("max_threads", "2"),)


def test_readonly_one_or_two_asks_for_nothing_more_and_other_values_go_to_the_engine() -> None:
    assert query_settings({"readonly": "1"}) == ()
    assert query_settings({"readonly": "2"}) == ()
    assert query_settings({"readonly": "0"}) == (("readonly", "0"),)  # for the engine to refuse


@pytest.mark.parametrize("name", ["max threads", "a;b", "`x`", "x=1", "", "1x", "é"])
def test_a_name_that_is_not_a_name_is_refused_before_it_reaches_a_set_statement(name: str) -> None:
    with pytest.raises(SqlRefused) as refused:
        query_settings({name: "1"})
    assert refused.value.code == 115


def test_limits_go_to_the_engine_as_asked() -> None:
    got = dict(query_settings({"max_execution_time": "0", "max_result_bytes": "100"}))
    assert got == {"max_execution_time": "0", "max_result_bytes": "100"}  # the profile's min/max judge them


def test_settings_come_sorted_so_that_equal_requests_share_a_session() -> None:
    assert query_settings({"b_x": "1", "a_x": "2"}) == (("a_x", "2"), ("b_x", "1"))
    assert NAME.match("output_format_json_quote_64bit_integers")
