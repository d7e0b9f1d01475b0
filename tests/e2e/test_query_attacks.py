"""The query endpoint under attack, as someone on the collector's host would try it (issue: "read-only beyond doubt").

A generated corpus: every setting that takes a string (a file, a path, a schema, a template, a URL, an identity)
and every limit, in every spelling ClickHouse's lexer takes and some it does not (bare, backquoted, double-quoted,
upper case, padded, escaped, Unicode, comments, newlines), in every place a setting can be given (the query's
SETTINGS clause, after FORMAT, in a subquery, in a WITH, a URL parameter, a form field, a reused session_id).
Each attempt must be refused; afterwards no file has appeared, no canary's content has come back, no limit moved.
A property test then draws SETTINGS clauses and checks the endpoint's decision against the engine's own reading.
"""

from __future__ import annotations

import concurrent.futures
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import chdb
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepline.clickhouse_http.guard import settings_named
from stepline.endpoints.query import QueryEndpoint
from stepline.store.chdb import open_client
from stepline.store.query_profile import ALLOWED, CEILINGS

SECRET = f"canary-{uuid.uuid4().hex}"
# Limits and switches, each with a value that would lift it, or reach the disk or another identity.
LIMITS = {  # each value differs from the engine's default: asking for what a setting already is changes nothing
    "max_execution_time": "0", "max_result_bytes": "0", "max_memory_usage": "0", "max_query_size": "0",
    "max_threads": "100000", "readonly": "0", "allow_ddl": "1", "allow_introspection_functions": "1",
    "max_bytes_before_external_group_by": "1", "max_bytes_before_external_sort": "1",
    "max_temporary_data_on_disk_size_for_query": "1000000000000", "max_memory_usage_for_user": "1000000000000",
    "profile": "'default'", "max_concurrent_queries_for_user": "1000", "use_query_cache": "1",
    "enable_writes_to_query_cache": "0", "dialect": "'prql'", "allow_experimental_analyzer": "0", "log_queries": "0",
}


@dataclass(frozen=True)
class Attempt:
    """One attack: how it is sent, and what it asks for."""

    name: str
    sql: str
    params: tuple[tuple[str, str], ...] = ()
    form: bool = False


def _spellings(name: str) -> dict[str, str]:
    escaped = name.replace("_", "\\x5f", 1) if "_" in name else f"\\x{ord(name[0]):02x}{name[1:]}"
    wide = chr(ord(name[0]) - ord("a") + 0xFF41) + name[1:] if name[0].islower() else name
    return {"bare": name, "backquoted": f"`{name}`", "double-quoted": f'"{name}"', "upper": name.upper(),
            "padded": f"`{name} `", "escaped": f"`{escaped}`", "escaped-double": f'"{escaped}"',
            "fullwidth": wide, "zero-width": f"\u200b{name}", "comments": f"/**/{name}/**/",
            "newlines": f"\n{name}\n"}


def _positions(spelled: str, value: str, probe: str) -> dict[str, str]:
    return {"clause": f"SELECT {probe} SETTINGS {spelled} = {value}",
            "after-format": f"SELECT {probe} FORMAT TSV SETTINGS {spelled} = {value}",
            "subquery": f"SELECT * FROM (SELECT {probe} SETTINGS {spelled} = {value})",
            "with": f"WITH (SELECT 1 SETTINGS {spelled} = {value}) AS w SELECT w, {probe}"}


def corpus(names: dict[str, str]) -> list[Attempt]:
    """Every name x spelling x place: all spellings in the top-level clauses, the parser's forms in nested ones."""
    attempts = []
    for name, value in names.items():
        probe = "1" if name == "profile" else f"getSetting('{name}')"
        for kind, spelled in _spellings(name).items():
            for place, sql in _positions(spelled, value, probe).items():
                if place in ("clause", "after-format") or kind in ("bare", "backquoted", "double-quoted", "escaped"):
                    attempts.append(Attempt(name, sql))
        attempts.append(Attempt(name, f"SELECT {probe}", ((name, value.strip("'")),)))
        attempts.append(Attempt(name, f"SELECT {probe}", ((name, value.strip("'")),), form=True))
    return attempts


@pytest.fixture(scope="module")
def canary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("canary")
    (folder / "secret.txt").write_text(f"{SECRET}\n{SECRET}\t{SECRET}\n")
    return folder


@pytest.fixture(scope="module")
def endpoint(chdb_dir: Path) -> Iterator[QueryEndpoint]:
    # As `stepline collect` serves it (the README's defaults), with room for the corpus's four threads.
    ep = QueryEndpoint(open_client(str(chdb_dir)), port=0, database="system", max_sessions=8)
    ep.start()
    yield ep
    ep.stop()


def send(ep: QueryEndpoint, attempt: Attempt, agent: str = "attack") -> tuple[int, str, bytes]:
    params = dict(attempt.params)
    url, data, headers = f"{ep.url}/", attempt.sql.encode(), {"User-Agent": agent}
    if attempt.form:
        fields = [*params.items(), ("query", attempt.sql)]
        data = b"".join(b'--B\r\nContent-Disposition: form-data; name="%s"\r\n\r\n%s\r\n' % (k.encode(), v.encode())
                        for k, v in fields) + b"--B--\r\n"
        headers["Content-Type"] = "multipart/form-data; boundary=B"
    elif params:
        url += "?" + urllib.parse.urlencode(params)
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=60) as response:
            return response.status, "", response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get("X-ClickHouse-Exception-Code", ""), err.read()


def _string_settings(chdb_dir: Path) -> list[str]:
    conn: Any = cast(Any, chdb).connect(str(chdb_dir))
    try:
        sql = "SELECT name FROM system.settings WHERE type IN ('String', 'URI', 'Map') ORDER BY name"
        return [n for n in conn.query(sql, "TSV").bytes().decode().split() if n not in ALLOWED]
    finally:
        conn.close()


def _caps(ep: QueryEndpoint) -> bytes:
    sql = ("SELECT getSetting('max_execution_time'), getSetting('max_result_bytes'), getSetting('max_memory_usage'), "
           "getSetting('readonly'), getSetting('allow_ddl'), getSetting('output_format_schema')")
    status, _, body = send(ep, Attempt("", sql))
    assert status == 200, body
    return body


def test_every_setting_that_could_reach_out_or_lift_a_limit_is_refused_everywhere(
        endpoint: QueryEndpoint, chdb_dir: Path, canary: Path) -> None:
    names = {name: f"'{canary / 'secret.txt'}'" for name in _string_settings(chdb_dir)} | LIMITS
    attempts = corpus(names)
    assert len(attempts) > 3000  # the closing note quotes the size
    caps, before = _caps(endpoint), sorted(canary.iterdir())
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda a: (a, send(endpoint, a, f"attack-{hash(a) % 4}")), attempts))
    accepted = [(a.sql, a.params, status) for a, (status, _, _) in results if status < 400]
    assert accepted == []
    leaked = [a.sql for a, (_, _, body) in results if SECRET.encode() in body]
    assert leaked == []
    assert sorted(canary.iterdir()) == before and (canary / "secret.txt").read_text().startswith(SECRET)
    assert _caps(endpoint) == caps
    internal = [(a.sql, body[:120]) for a, (_, code, body) in results if code in ("", "1000", "1001")]
    assert internal == []  # every refusal is a ClickHouse error with its code, never the endpoint's own failure


@pytest.mark.parametrize("sql", [
    "SELECT 1 AS x FORMAT Protobuf SETTINGS `output_format_schema`='{dir}/x.proto'",
    "SELECT 1 AS x FORMAT CapnProto SETTINGS \"format_schema\"='{dir}/x.capnp:M'",
    "SELECT 1 FORMAT Template SETTINGS `format_template_row`='{dir}/secret.txt'",
    "SELECT 1 FORMAT Template SETTINGS `format_template_resultset` ='{dir}/secret.txt'",
    "SELECT 1 FORMAT Regexp SETTINGS format_regexp='(.*)', `input_format_record_errors_file_path`='{dir}/e'",
    "SELECT * FROM (SELECT 1 AS x SETTINGS output_format_schema='{dir}/y.proto') FORMAT Protobuf",
    "SELECT getSetting('max_execution_time') SETTINGS `max_execution_time`=0, `max_result_bytes`=0",
])
@pytest.mark.parametrize("method", ["POST", "GET"])
def test_the_reproductions_from_the_report_are_refused(endpoint: QueryEndpoint, canary: Path, sql: str,
                                                       method: str) -> None:
    text = sql.replace("{dir}", str(canary))
    before = sorted(canary.iterdir())
    url = f"{endpoint.url}/" if method == "POST" else f"{endpoint.url}/?{urllib.parse.urlencode({'query': text})}"
    request = urllib.request.Request(url, data=text.encode() if method == "POST" else None)
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.headers["X-ClickHouse-Exception-Code"] in ("452", "164")
    assert SECRET.encode() not in refused.value.read()
    assert sorted(canary.iterdir()) == before


def test_a_reused_session_id_carries_nothing_to_the_next_request(endpoint: QueryEndpoint) -> None:
    session = uuid.uuid4().hex
    asked = Attempt("", "SELECT 1", (("session_id", session), ("max_execution_time", "0"), ("readonly", "0")))
    assert send(endpoint, asked)[1] in ("164", "452")
    probe = Attempt("", "SELECT getSetting('max_execution_time'), getSetting('readonly')", (("session_id", session),))
    assert send(endpoint, probe) == (200, "", b"60\t2\n")


# The property: the endpoint refuses a SETTINGS clause exactly when the engine reads in it a setting the profile
# does not let clients change (or a limit past its ceiling); whatever the engine would run and the profile allows,
# the endpoint runs.
_ALL = sorted(ALLOWED | set(CEILINGS))
_NAMES = st.sampled_from(_ALL) | st.sampled_from(["output_format_schema", "format_template_row", "readonly",
                                                    "max_bytes_before_external_sort", "log_comment", "select",
                                                    "additional_table_filters", "Max_threads", "max_threads "])
_VALUES = st.sampled_from(["0", "1", "2", "30", "1000", "100000000000", "'UTC'", "'x'", "-1", "'/etc/passwd'"])
_SPELL = st.sampled_from(["{}", "`{}`", '"{}"', "/**/{}", "`{} `"])
_PLACE = st.sampled_from(["SELECT 1 SETTINGS {}", "SELECT * FROM (SELECT 1 SETTINGS {})"])


def _engine_reads(conn: Any, sql: str) -> tuple[list[str], bool]:
    """The setting names ClickHouse's parser reads in `sql`, and whether an unconstrained read-only session runs
    it (readonly=2 alone, no profile: the engine's own judgement of the clause)."""
    try:
        canonical = conn.query("SELECT formatQuerySingleLine({q:String})", "TSVRaw",
                               params={"q": sql.replace("\\", "\\\\")}).bytes().decode()
    except Exception:
        return [], False
    try:
        conn.query(sql, "TSV")
        return [name for name, _ in settings_named(canonical)], True
    except Exception:
        return [name for name, _ in settings_named(canonical)], False


def _within(name: str, value: str) -> bool:
    if name not in CEILINGS:
        return True
    least, most = CEILINGS[name]
    try:
        return least <= float(value.strip("'")) <= most or (name == "max_threads" and value == "0")
    except ValueError:
        return False


@given(st.lists(st.tuples(_NAMES, _SPELL, _VALUES), min_size=1, max_size=3), _PLACE)
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_the_endpoint_decides_as_the_engine_reads(endpoint: QueryEndpoint, chdb_dir: Path,
                                                  clause: list[tuple[str, str, str]], place: str) -> None:
    sql = place.format(", ".join(f"{spell.format(name)} = {value}" for name, spell, value in clause))
    conn: Any = cast(Any, chdb).connect(str(chdb_dir))
    try:
        conn.query("SET readonly = 2")
        names, runs = _engine_reads(conn, sql)
    finally:
        conn.close()
    status, code, body = send(endpoint, Attempt("", sql), "property")
    read = dict(zip(names, (v for _, _, v in clause), strict=False))
    allowed = all(n in ALLOWED or n in CEILINGS for n in names)
    if status == 200:
        assert allowed, (sql, names)
    elif runs and allowed and all(_within(n, v) for n, v in read.items()):
        # (A subquery's limits are held to the ceilings as well, though the engine ignores them there.)
        pytest.fail(f"{sql!r}: the engine runs it and the profile allows it, the endpoint said {code}: {body[:200]!r}")
