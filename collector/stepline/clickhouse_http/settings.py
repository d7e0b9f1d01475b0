"""Settings a read-only session may set, and the caps (max_execution_time, ...) that no request can lift.

Public: `check_setting`, `query_settings`, `check_statement_settings`, and `NAME` (a setting's or a format's name).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from stepline.clickhouse_http.errors import (
    SETTING_CONSTRAINT_VIOLATION,
    UNKNOWN_SETTING,
    SqlRefused,
    read_only,
)

# URL parameters that steer the HTTP transport, not the query; ClickHouse does not treat them as settings.
_TRANSPORT_PARAMS = frozenset({
    "query", "database", "default_format", "user", "password", "quota_key", "query_id", "session_id",
    "session_timeout", "session_check", "compress", "decompress", "wait_end_of_query", "buffer_size",
    "client_protocol_version", "role", "stacktrace", "send_progress_in_http_headers", "enable_http_compression",
    "cancel_http_readonly_queries_on_client_close", "add_http_cors_header",
})
# Settings that name files, schemas, hosts or identities. A session's settings are applied before readonly, so
# anything that could reach outside the store is refused rather than trusted to the engine.
_DENIED_SETTING_PARTS = ("schema", "template", "regexp", "path", "file", "directory", "url", "s3", "azure", "hdfs",
                         "kafka", "password", "introspection")
_NO_OP_READONLY = (("readonly", "1"), ("readonly", "2"))  # asks for no more than the endpoint enforces
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def check_setting(key: str, value: str) -> None:
    """Refuse `key = value` unless a read-only session may set it; asking for readonly=1 or 2 changes nothing."""
    if (key, value) in _NO_OP_READONLY:
        return
    if key.lower() == "readonly":
        raise read_only("changing readonly")
    if not NAME.match(key):
        raise SqlRefused(f"Unknown setting {key!r}", UNKNOWN_SETTING, "UNKNOWN_SETTING")
    if any(part in key.lower() for part in _DENIED_SETTING_PARTS):
        raise read_only(f"setting {key}")


def _within(value: str, cap: int) -> bool:
    try:
        return 0 < float(value.strip("'")) <= cap
    except ValueError:
        return False


def query_settings(params: Mapping[str, str], base: Mapping[str, str], caps: Mapping[str, int]) -> dict[str, str]:
    """Settings from URL parameters over `base`: transport ones dropped, risky ones refused, `caps` enforced."""
    chosen = dict(base)
    for key, value in params.items():
        if key in _TRANSPORT_PARAMS or key.startswith(("http_", "param_")) or (key, value) in _NO_OP_READONLY:
            continue
        check_setting(key, value)
        chosen[key] = value
    for key, cap in caps.items():
        chosen[key] = chosen.get(key, str(cap)) if _within(chosen.get(key, str(cap)), cap) else str(cap)
    return chosen


def check_statement_settings(settings: Iterable[tuple[str, str]], caps: Mapping[str, int]) -> None:
    """A query's own SETTINGS clauses (`name = value` as written) obey what URL settings do: no cap is lifted there.

    The sessions run with readonly=2 (ClickHouse's "read, and change settings"), so these reach the engine.
    """
    for key, value in settings:  # their names were checked by the guard, with check_setting()
        if key in caps and not _within(value, caps[key]):
            raise SqlRefused(f"Setting {key} should be between 1 and {caps[key]} on stepline's query endpoint, "
                             f"got {value[:40]}", SETTING_CONSTRAINT_VIOLATION, "SETTING_CONSTRAINT_VIOLATION")
