"""Settings a read-only session may set, and the caps no request can lift."""

from __future__ import annotations

import re

import pytest

from stepline.clickhouse_http.errors import READONLY, SETTING_CONSTRAINT_VIOLATION, UNKNOWN_SETTING, SqlRefused
from stepline.clickhouse_http.settings import NAME, check_setting, check_statement_settings, query_settings

CAPS = {"max_execution_time": 60, "max_result_rows": 1000}


def test_url_settings_apply_over_the_base_and_transport_parameters_do_not() -> None:
    params = {"max_threads": "3", "query": "SELECT 1", "session_id": "s", "compress": "1", "http_headers_progress": "1",
              "param_x": "7", "readonly": "2", "use_query_cache": "1"}
    chosen = query_settings(params, {"use_query_cache": "0", "join_algorithm": "hash"}, {})
    assert chosen == {"use_query_cache": "1", "join_algorithm": "hash", "max_threads": "3"}


@pytest.mark.parametrize(("given", "kept"), [
    ({}, "60"), ({"max_execution_time": "30"}, "30"), ({"max_execution_time": "'30'"}, "'30'"),
    ({"max_execution_time": "0"}, "60"),  # 0 means no limit to ClickHouse
    ({"max_execution_time": "61"}, "60"), ({"max_execution_time": "-1"}, "60"), ({"max_execution_time": "x"}, "60"),
])
def test_a_cap_is_the_ceiling_and_the_default(given: dict[str, str], kept: str) -> None:
    chosen = query_settings(given, {}, CAPS)
    assert (chosen["max_execution_time"], chosen["max_result_rows"]) == (kept, "1000")


@pytest.mark.parametrize(("key", "value", "message", "code"), [
    ("readonly", "0", "read-only: changing readonly is not allowed", READONLY),
    ("ReadOnly", "1", "read-only: changing readonly is not allowed", READONLY),  # only the exact no-op passes
    ("format_schema", "/etc/passwd:x", "read-only: setting format_schema is not allowed", READONLY),
    ("user_files_path", "/", "read-only: setting user_files_path is not allowed", READONLY),
    ("allow_introspection_functions", "1", "setting allow_introspection_functions", READONLY),
    ("max threads", "1", "Unknown setting 'max threads'", UNKNOWN_SETTING),
])
def test_risky_or_malformed_settings_are_refused(key: str, value: str, message: str, code: int) -> None:
    for refuse in (lambda: check_setting(key, value), lambda: query_settings({key: value}, {}, {})):
        with pytest.raises(SqlRefused, match=re.escape(message)) as err:
            refuse()
        assert err.value.code == code


def test_asking_for_the_readonly_the_endpoint_enforces_changes_nothing() -> None:
    check_setting("readonly", "1")
    check_setting("readonly", "2")
    assert query_settings({"readonly": "1"}, {"readonly": "2"}, {}) == {"readonly": "2"}


def test_a_settings_clause_cannot_lift_a_cap() -> None:
    check_statement_settings([("max_execution_time", "60"), ("max_threads", "999")], CAPS)
    for value in ("61", "0", "-5", "'x'"):
        with pytest.raises(SqlRefused) as err:
            check_statement_settings([("max_threads", "2"), ("max_execution_time", value)], CAPS)
        assert (err.value.code, err.value.name) == (SETTING_CONSTRAINT_VIOLATION, "SETTING_CONSTRAINT_VIOLATION")
        assert str(err.value) == (f"Setting max_execution_time should be between 1 and 60 on stepline's query "
                                  f"endpoint, got {value}")


def test_a_name_is_an_identifier() -> None:
    assert [bool(NAME.match(name)) for name in ("JSONEachRow", "_x1", "1x", "JSON;", "a-b", "")] == [
        True, True, False, False, False, False]
