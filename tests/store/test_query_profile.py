"""The embedded engine's `stepline_query` profile: the engine, not stepline, refuses what a client may not set."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import chdb
import pytest

from stepline.store import query_profile
from stepline.store.query_profile import ALLOWED, CEILINGS, PROFILE, changeable, refusal, settings_names, users_xml


@pytest.fixture
def session(chdb_dir: Path) -> Iterator[Any]:
    """A raw connection in the profile, as the query endpoint's sessions enter it."""
    conn: Any = cast(Any, chdb).connect(str(chdb_dir))
    for statement in ("SET readonly = 2", "SET max_execution_time = 60", f"SET profile = '{PROFILE}'"):
        conn.query(statement)
    yield conn
    conn.close()


def _refusal(conn: Any, sql: str) -> str:
    try:
        conn.query(sql, "TSV")
    except Exception as ex:
        return str(ex)
    return ""


def test_the_list_is_every_setting_the_pinned_engine_knows(chdb_dir: Path) -> None:
    conn: Any = cast(Any, chdb).connect(str(chdb_dir))
    try:
        live = conn.query("SELECT name FROM system.settings ORDER BY name", "TSV").bytes().decode().split()
    finally:
        conn.close()
    assert settings_names() == live, "python -m stepline.store.query_profile rewrites chdb_settings.txt"


def test_every_allowed_or_capped_name_is_a_setting() -> None:
    assert ALLOWED | set(CEILINGS) <= set(settings_names())


def test_the_profile_constrains_every_other_setting() -> None:
    xml = users_xml(["a_file_path", "max_threads", "max_execution_time", "output_format_json_quote_decimals"])
    assert "<a_file_path><const/></a_file_path>" in xml
    assert "<max_execution_time><min>1</min><max>600</max></max_execution_time>" in xml
    assert "output_format_json_quote_decimals" not in xml  # allowed: no constraint
    assert "<default><readonly>0</readonly></default>" in xml  # the way back to it is closed (readonly is const)


def test_a_session_of_the_profile_can_change_only_what_it_allows(session: Any) -> None:
    rows = session.query("SELECT name, readonly FROM system.settings", "TSV").bytes().decode().splitlines()
    loose = [(name, int(flag)) for name, flag in (row.split("\t") for row in rows)]
    assert changeable(loose) == []
    assert {name for name, flag in loose if not flag} <= ALLOWED | set(CEILINGS)
    assert changeable([("output_format_schema", 0), ("max_threads", 0)]) == ["output_format_schema"]


@pytest.mark.parametrize(("sql", "code"), [
    ("SELECT 1 SETTINGS output_format_schema = '/tmp/x.proto'", "452"),
    ("SELECT 1 SETTINGS `format_template_row` = '/etc/passwd'", "452"),
    ("SELECT 1 SETTINGS \"max_execution_time\" = 0", "452"),
    ("SELECT 1 SETTINGS max_execution_time = 601", "452"),
    ("SELECT 1 SETTINGS readonly = 0", "164"),
    ("SELECT 1 SETTINGS profile = 'default'", "164"),  # the default profile's readonly=0 meets the const
    ("SELECT 1 SETTINGS profile = 'default', max_execution_time = 0", "452"),
    ("SET output_format_schema = '/tmp/x.proto'", "452"),
    ("SELECT 1 SETTINGS MAX_EXECUTION_TIME = 0", "115"),  # setting names are case-sensitive to ClickHouse
])
def test_the_engine_refuses_what_the_profile_does_not_allow(session: Any, sql: str, code: str) -> None:
    assert f"Code: {code}." in _refusal(session, sql)
    assert session.query("SELECT getSetting('max_execution_time')", "TSV").bytes() == b"60\n"  # nothing moved


def test_what_the_profile_allows_passes(session: Any) -> None:
    for sql in ("SELECT 1 SETTINGS max_threads = 2, output_format_json_quote_64bit_integers = 0",
                "SELECT 1 SETTINGS max_execution_time = 30", "SELECT 1 SETTINGS `max_block_size` = 1000"):
        assert _refusal(session, sql) == ""


def test_an_engine_started_without_the_profile_is_never_served(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import clickhouse_connect
        from stepline.endpoints.sessions import ProfileMissing
        from stepline.endpoints.query import QueryEndpoint
        endpoint = QueryEndpoint(clickhouse_connect.get_client(dsn="chdb://{tmp_path}"), port=0)
        try:
            endpoint.start()
        except ProfileMissing as ex:
            print("refused:", ex)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "refused: the embedded store was opened without stepline's 'stepline_query' profile" in out.stdout, out


def test_the_configuration_is_private_to_the_collector() -> None:
    config = Path(query_profile.engine_options()["config-file"])
    assert config.parent.stat().st_mode & 0o077 == 0  # nobody else may write the profile the endpoint trusts
    assert f"<users_config>{config.parent / 'users.xml'}</users_config>" in config.read_text()


@pytest.mark.parametrize(("name", "value", "why"), [
    ("max_threads", "2", None), ("max_threads", "1", None), ("max_threads", "0", None),
    ("max_threads", "65", "should be within 1-64, not 65"), ("output_format_json_quote_decimals", "1", None),
    ("output_format_schema", "'/tmp/x'", "should not be changed"), ("readonly", "0", "should not be changed"),
    ("max_execution_time", "0", "should be within 1-600, not 0"), ("max_execution_time", "'30'", None),
    ("max_memory_usage", "4000000000", "should be within 1048576-1073741824, not 4000000000"),
    ("max_execution_time", "x", None),  # no number: the engine's to judge
])
def test_refusal_says_why_the_profile_refuses_a_clause(name: str, value: str, why: str | None) -> None:
    assert refusal(name, value) == why


def test_a_client_may_ask_for_one_thread_or_auto_on_any_machine(session: Any) -> None:
    # A MaxThreads minimum of 0 is read by the engine as "auto" (its count of cores): max_threads = 1 was refused
    # on a 2-core machine and anything under the core count on a larger one.
    for value in ("0", "1", "64"):
        assert _refusal(session, f"SELECT 1 SETTINGS max_threads = {value}") == ""
    assert "Code: 452." in _refusal(session, "SELECT 1 SETTINGS max_threads = 65")
