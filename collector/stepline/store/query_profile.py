"""`stepline_query`: the embedded engine's settings profile the query endpoint's sessions run under.

ClickHouse enforces it, not stepline. Every setting the engine knows is a constraint of the profile: `const`
(no client may change it, in any spelling or place the engine reads settings from) except a short allow-list of
settings a read client needs (output formats that touch no file, progress headers, compression), and the limits,
which a client may lower but not lift past their ceilings (`min`/`max`). The `default` profile, the one the
collector's own writers use, sets `readonly` to 0: a session of this profile asking for `profile='default'`
is refused, because `readonly` is const here (ClickHouse checks a profile's settings against the current
constraints before it switches: src/Access/SettingsConstraints.cpp, `checkImpl`, the "profile" case).

chDB reads profiles only from the users configuration its engine starts with (clickhouse-local's `setupUsers`:
`users_config` of the file given as `config-file`), so `engine_options()` is what every embedded store is opened
with. The names come from `chdb_settings.txt` (the pinned chDB's `system.settings`); a setting the engine knows
and the list does not would be changeable, so the query endpoint asks the engine which settings it may change
before it serves, and refuses to start when any is outside the allow-list (`changeable`).

Public: PROFILE, ALLOWED, CEILINGS, engine_options, changeable, refusal, settings_names.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import sys
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

PROFILE = "stepline_query"

# What a read client sends: what clickhouse-connect 1.12 and @clickhouse/client 1.x send in tests/clients (progress,
# compression, the JSON and Arrow string options, the JSON type), and `max_execution_time`, which Grafana's
# ClickHouse datasource sets for each query through clickhouse-go (grafana/clickhouse-datasource
# docs/sources/configure.md: a read-only user must be allowed to change it); JDBC drivers' readonly=1|2 is a no-op
# (clickhouse_http/settings.py). Then the output options of the formats the endpoint serves. None names a file, a
# path, a schema, a template, a URL, an identity or a cache that persists.
ALLOWED = frozenset({
    # progress and compression on the HTTP interface
    "send_progress_in_http_headers", "http_headers_progress_interval_ms", "enable_http_compression",
    "http_zlib_compression_level", "network_compression_method", "cancel_http_readonly_queries_on_client_close",
    "http_wait_end_of_query",
    # how results are read and shaped; `database` is what USE changes (the engine checks USE as a setting)
    "database", "session_timezone", "date_time_output_format", "max_block_size", "extremes", "limit", "offset",
    "join_use_nulls", "result_overflow_mode", "max_result_rows", "max_rows_to_read", "max_bytes_to_read",
    "read_overflow_mode", "timeout_overflow_mode", "output_format_decimal_trailing_zeros",
    "output_format_write_statistics", "output_format_json_quote_64bit_integers",
    "output_format_json_quote_64bit_floats", "output_format_json_quote_decimals", "output_format_json_quote_denormals",
    "output_format_json_named_tuples_as_objects", "output_format_json_array_of_rows",
    "output_format_json_validate_utf8", "output_format_json_escape_forward_slashes",
    "output_format_json_pretty_print", "output_format_json_map_as_array_of_tuples",
    "output_format_json_skip_null_value_in_named_tuples", "output_format_arrow_string_as_string",
    "output_format_arrow_low_cardinality_as_dictionary", "output_format_parquet_string_as_string",
    "output_format_native_encode_types_in_binary_format", "output_format_native_write_json_as_string",
    "output_format_binary_write_json_as_string", "output_format_binary_encode_types_in_binary_format",
    "output_format_tsv_crlf_end_of_line", "output_format_csv_crlf_end_of_line", "output_format_pretty_color",
    "output_format_pretty_max_rows", "output_format_pretty_max_value_width", "output_format_pretty_row_numbers",
    "output_format_pretty_grid_charset", "output_format_pretty_display_footer_column_names",
    # stepline's own reads (queries/requests.py: requests merged within each day's partition)
    "do_not_merge_across_partitions_select_final",
    # types a client may ask to read
    "allow_experimental_json_type", "enable_json_type", "allow_experimental_dynamic_type",
    "allow_experimental_variant_type",
})

# Limits no query may lift: (least, ceiling). The endpoint's own values start each session (at most these); a
# query may lower them, or raise them up to the ceiling. 1 GiB a query, times the endpoint's sessions (4 by
# default), bounds the queries' memory at 4 GiB beside ingest's few hundred MiB on a 2-core, 24 GiB collector.
CEILINGS: dict[str, tuple[int, int]] = {
    "max_execution_time": (1, 600),
    "max_result_bytes": (1, 8 << 30),
    "max_memory_usage": (1 << 20, 1 << 30),
    "max_query_size": (1, 1 << 20),  # the endpoint's body limit is 1 MiB
    "max_threads": (1, 64),  # not 0: the engine reads a MaxThreads 0 as "auto", its count of cores, as the least
}


def settings_names() -> list[str]:
    """Every setting the pinned chDB knows, from the list beside this module."""
    text = resources.files("stepline.store").joinpath("chdb_settings.txt").read_text()
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def _constraint(name: str) -> str:
    if name in CEILINGS:
        least, most = CEILINGS[name]
        return f"<{name}><min>{least}</min><max>{most}</max></{name}>"
    return "" if name in ALLOWED else f"<{name}><const/></{name}>"


def users_xml(names: list[str]) -> str:
    """The users configuration: the `default` user and profile as clickhouse-local has them, and `stepline_query`."""
    constraints = "".join(_constraint(escape(name)) for name in names)
    return (
        "<clickhouse>\n"
        "  <profiles>\n    <default><readonly>0</readonly></default>\n"
        f"    <{PROFILE}><readonly>2</readonly><constraints>{constraints}</constraints></{PROFILE}>\n  </profiles>\n"
        "  <users><default><password></password><networks><ip>::/0</ip></networks><profile>default</profile>"
        "<quota>default</quota></default></users>\n"
        "  <quotas><default></default></quotas>\n"
        "</clickhouse>\n"
    )


# More of the engine's configuration, for processes that start it (tests/store/cluster_run.py: clusters whose servers
# are this process). Read once, when the first store of the process opens.
_extra_config: list[str] = []


def add_engine_config(fragment: str) -> None:
    """Add XML elements to the configuration the embedded engine starts with; before any store is opened."""
    if _config_file.cache_info().currsize:
        raise RuntimeError("the embedded engine has started: its configuration is read once, at the first open")
    _extra_config.append(fragment)


@functools.cache
def _config_file() -> str:
    # A private directory (mode 0700, a name nobody can guess): whoever could write this file would choose the
    # endpoint's profile. chDB needs absolute paths here (it resolves users_config against its working directory).
    folder = Path(tempfile.mkdtemp(prefix="stepline-chdb-"))
    atexit.register(shutil.rmtree, folder, True)
    users = folder / "users.xml"
    users.write_text(users_xml(settings_names()))
    config = folder / "config.xml"
    config.write_text(f"<clickhouse><users_config>{escape(str(users))}</users_config>{''.join(_extra_config)}"
                      "</clickhouse>\n")
    return str(config)


def engine_options() -> dict[str, str]:
    """chDB connection options that start an embedded engine with the `stepline_query` profile."""
    return {"config-file": _config_file()}


def changeable(names_and_readonly: list[tuple[str, int]]) -> list[str]:
    """Of (name, readonly) rows of system.settings read in a `stepline_query` session: those a client could change
    that the profile does not allow (empty when the profile covers the engine)."""
    allowed = ALLOWED | set(CEILINGS)
    return sorted(name for name, readonly in names_and_readonly if not readonly and name not in allowed)


def refusal(name: str, value: str) -> str | None:
    """Why the profile refuses `name = value` (value as written), or None: a setting outside the allow-list, or a
    limit past its ceiling. A value that is no number is left for the engine to judge."""
    if name in CEILINGS:
        least, most = CEILINGS[name]
        try:
            number = float(value.strip("'"))
        except ValueError:
            return None
        auto = name == "max_threads" and number == 0  # what the engine reads as its count of cores: allowed
        return None if auto or least <= number <= most else f"should be within {least}-{most}, not {value[:20]}"
    return None if name in ALLOWED else "should not be changed"


def _write_names() -> None:
    import chdb  # the pinned engine, in a process that opens no store

    engine: Any = chdb
    out = Path(__file__).with_name("chdb_settings.txt")
    names = engine.query("SELECT name FROM system.settings ORDER BY name", "TSV").bytes().decode().split()
    out.write_text(f"# Every setting chDB {chdb.__version__} knows (SELECT name FROM system.settings): "
                   "python -m stepline.store.query_profile rewrites it.\n" + "\n".join(names) + "\n")
    print(f"{out}: {len(names)} settings", file=sys.stderr)


if __name__ == "__main__":
    _write_names()
