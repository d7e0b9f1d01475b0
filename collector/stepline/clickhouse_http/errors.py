"""ClickHouse's errors on its HTTP interface: the codes stepline answers with, their HTTP status, the exception line.

Public: `SqlRefused` (what every refusal in this package raises), `read_only`, `http_status`, `exception_text`, the
error codes below and `DATA_ERRORS`, the codes that condemn an insert's data.
"""

from __future__ import annotations

import re

# The codes of ClickHouse's src/Common/ErrorCodes.cpp that stepline's own refusals carry.
BAD_ARGUMENTS = 36
CHECKSUM_DOESNT_MATCH = 40
NOT_IMPLEMENTED = 48
SYNTAX_ERROR = 62
UNKNOWN_COMPRESSION_METHOD = 89
UNKNOWN_SETTING = 115
READONLY = 164
QUERY_IS_TOO_LARGE = 229
CANNOT_DECOMPRESS = 271
SETTING_CONSTRAINT_VIOLATION = 452
AUTHENTICATION_FAILED = 516

# The codes of the same file with which the engine refuses an insert for its data (its bytes, its values): the writers
# drop such a batch, since a retry cannot succeed (stepline.ingest.writer).
CANNOT_PARSE_TEXT = 6
CANNOT_PARSE_INPUT_ASSERTION_FAILED = 27
ATTEMPT_TO_READ_AFTER_EOF = 32
CANNOT_READ_ALL_DATA = 33
CANNOT_PARSE_DATE = 38
CANNOT_PARSE_DATETIME = 41
TYPE_MISMATCH = 53
ARGUMENT_OUT_OF_BOUND = 69
CANNOT_CONVERT_TYPE = 70
INCORRECT_DATA = 117
TOO_LARGE_STRING_SIZE = 131
VALUE_IS_OUT_OF_RANGE_OF_DATA_TYPE = 321
CANNOT_INSERT_NULL_IN_ORDINARY_COLUMN = 349
DATA_ERRORS = frozenset({
    CANNOT_PARSE_TEXT, CANNOT_PARSE_INPUT_ASSERTION_FAILED, ATTEMPT_TO_READ_AFTER_EOF, CANNOT_READ_ALL_DATA,
    CANNOT_PARSE_DATE, CANNOT_PARSE_DATETIME, TYPE_MISMATCH, ARGUMENT_OUT_OF_BOUND, CANNOT_CONVERT_TYPE,
    INCORRECT_DATA, TOO_LARGE_STRING_SIZE, VALUE_IS_OUT_OF_RANGE_OF_DATA_TYPE, CANNOT_INSERT_NULL_IN_ORDINARY_COLUMN,
})

# ClickHouse's exceptionCodeToHTTPStatus (src/Server/HTTP/exceptionCodeToHTTPStatus.cpp), for the codes it maps.
_HTTP_STATUS = {code: status for status, codes in (
    (400, (6, 27, 36, 53, 62, 117, 321, 456, 457)), (401, (194,)), (403, (192, 193, 497, 516)), (408, (159,)),
    (404, (46, 47, 50, 56, 60, 63, 73, 81, 115)), (413, (229,)), (501, (48,)), (503, (202,)),
) for code in codes}
# `Code: N. DB::Exception: <the same exception again>. (NAME)`, as the driver re-wraps an engine error.
_NESTED = re.compile(r"Code: (\d+)\. DB::Exception: (Code: \1\. DB::Exception: .*?)(?: \(version [^()]*\))?\. "
                     r"\([A-Z0-9_]+\)\Z")


class SqlRefused(Exception):
    """A query the read-only endpoint will not run; carries a ClickHouse error code and name."""

    def __init__(self, message: str, code: int = READONLY, name: str = "READONLY", status: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.name = name
        self.status = status  # overrides the usual HTTP status for `code`


def read_only(kind: str) -> SqlRefused:
    """The refusal of something a read-only session may not do (a write, a setting, a function reaching out)."""
    return SqlRefused(f"stepline's query endpoint is read-only: {kind} is not allowed")


def http_status(code: int) -> int:
    """The HTTP status ClickHouse answers an exception code with (500 for most)."""
    return _HTTP_STATUS.get(code, 500)


def exception_text(code: int, name: str, message: str) -> str:
    """A ClickHouse-style exception line: `Code: N. DB::Exception: message. (NAME)`."""
    text = " ".join(message.split())  # one line: the engine's messages can quote a multi-line query
    if text.startswith("Code: "):
        # Already ClickHouse-formatted (chDB passes the engine's text through), at times wrapped in itself again.
        while (nested := _NESTED.match(text)) is not None:
            text = nested.group(2)
        return text + "\n"
    return f"Code: {code}. DB::Exception: {text.rstrip('.')}. ({name})\n"
