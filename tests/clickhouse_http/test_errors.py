"""ClickHouse's errors as the endpoints answer them: the refusal type, HTTP statuses, the exception line."""

from __future__ import annotations

import pytest

from stepline.clickhouse_http.errors import (
    AUTHENTICATION_FAILED,
    NOT_IMPLEMENTED,
    QUERY_IS_TOO_LARGE,
    READONLY,
    SYNTAX_ERROR,
    SqlRefused,
    exception_text,
    http_status,
    read_only,
)

UNKNOWN_TABLE = "Code: 60. DB::Exception: Unknown table expression identifier 'x'. (UNKNOWN_TABLE)"


def test_a_refusal_is_readonly_unless_told_otherwise() -> None:
    refused = read_only("INSERT")
    assert str(refused) == "stepline's query endpoint is read-only: INSERT is not allowed"
    assert (refused.code, refused.name, refused.status) == (READONLY, "READONLY", None)
    other = SqlRefused("no", SYNTAX_ERROR, "SYNTAX_ERROR", status=418)
    assert (other.code, other.name, other.status) == (62, "SYNTAX_ERROR", 418)


@pytest.mark.parametrize(("code", "status"), [
    (SYNTAX_ERROR, 400), (36, 400), (194, 401), (AUTHENTICATION_FAILED, 403), (60, 404), (115, 404), (159, 408),
    (QUERY_IS_TOO_LARGE, 413), (NOT_IMPLEMENTED, 501), (202, 503),
    (READONLY, 500), (1001, 500), (0, 500),  # ClickHouse maps neither READONLY nor most codes: 500
])
def test_http_status_follows_clickhouse(code: int, status: int) -> None:
    assert http_status(code) == status


def test_an_exception_line_is_one_line_without_a_doubled_dot() -> None:
    assert exception_text(READONLY, "READONLY", "no writes.") == "Code: 164. DB::Exception: no writes. (READONLY)\n"
    assert exception_text(SYNTAX_ERROR, "SYNTAX_ERROR", "Syntax error:\n  at\tline 1") == (
        "Code: 62. DB::Exception: Syntax error: at line 1. (SYNTAX_ERROR)\n")


@pytest.mark.parametrize("message", [
    UNKNOWN_TABLE,
    f"Code: 60. DB::Exception: {UNKNOWN_TABLE} (version 25.4.1.1). (UNKNOWN_TABLE)",
    f"Code: 60. DB::Exception: Code: 60. DB::Exception: {UNKNOWN_TABLE}. (UNKNOWN_TABLE). (UNKNOWN_TABLE)",
])
def test_an_engine_exception_passes_through_unwrapped(message: str) -> None:
    # The code and name given are not used: the engine's own line already carries them.
    assert exception_text(1000, "UNKNOWN_EXCEPTION", message) == UNKNOWN_TABLE + "\n"


def test_a_different_code_inside_is_not_unwrapped() -> None:
    wrapped = f"Code: 1000. DB::Exception: {UNKNOWN_TABLE}. (UNKNOWN_EXCEPTION)"
    assert exception_text(1000, "UNKNOWN_EXCEPTION", wrapped) == wrapped + "\n"
