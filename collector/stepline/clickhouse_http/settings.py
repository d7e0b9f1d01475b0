"""The settings a request's URL parameters (or form fields) ask for, apart from those that steer the transport.

Whether a client may set them is the engine's call, not this module's: the sessions run under the `stepline_query`
profile, whose constraints refuse anything outside its allow-list with ClickHouse's own error
(`stepline.store.query_profile`). Here only what is not a setting is set aside, a name is checked to be a name
(it is spliced into a SET statement). A limit a URL asks for goes to the engine as it is: within the profile's
ceiling it holds, past it (or 0, "no limit") the engine refuses it.

Public: `query_settings`, and `NAME` (a setting's or a format's name).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from stepline.clickhouse_http.errors import UNKNOWN_SETTING, SqlRefused

# URL parameters that steer the HTTP transport, not the query; ClickHouse does not treat them as settings.
_TRANSPORT_PARAMS = frozenset({
    "query", "database", "default_format", "user", "password", "quota_key", "query_id", "session_id",
    "session_timeout", "session_check", "compress", "decompress", "wait_end_of_query", "buffer_size",
    "client_protocol_version", "role", "stacktrace", "send_progress_in_http_headers", "enable_http_compression",
    "cancel_http_readonly_queries_on_client_close", "add_http_cors_header",
})
# readonly=1 or 2 asks for no more than the sessions are (2, with every other setting the profile's to decide):
# JDBC drivers send it. Any other value is left for the engine to refuse.
_NO_OP_READONLY = (("readonly", "1"), ("readonly", "2"))
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def query_settings(params: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The settings among URL parameters, sorted (a session key), for the engine to accept or refuse."""
    chosen: dict[str, str] = {}
    for key, value in params.items():
        if key in _TRANSPORT_PARAMS or key.startswith("param_") or (key, value) in _NO_OP_READONLY:
            continue
        if not NAME.match(key):
            raise SqlRefused(f"Unknown setting {key[:64]!r}", UNKNOWN_SETTING, "UNKNOWN_SETTING")
        chosen[key] = value
    return tuple(sorted(chosen.items()))
