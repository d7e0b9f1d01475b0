"""The read-only SQL guard: on its own, then behind the query endpoint, which cannot write or reach outside the
store; the CLI binds what users type.

tests/endpoints/test_query.py refuses the common writes over HTTP (INSERT, DROP, CREATE, ALTER, TRUNCATE, SYSTEM,
KILL, SET, a SETTINGS clause, file(), url(), remoteSecure(), INTO OUTFILE, a second statement); this completes the
list. After every attempt the store must be exactly as before: rows, tables, databases, and no file written.
"""

from __future__ import annotations

import re
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import clickhouse_connect
import pytest

from stepline.cli.main import main
from stepline.clickhouse_http.errors import READONLY, SYNTAX_ERROR, SqlRefused
from stepline.clickhouse_http.guard import Statement, Token, read_only_statement, settings_named, tokens
from stepline.endpoints.query import QueryEndpoint
from stepline.model import schema
from stepline.model.rows import GpuSample, Request, Step, micros
from stepline.store.chdb import open_client
from stepline.store.store import Store

MARKER = Path(tempfile.gettempdir()) / f"stepline-sec-{uuid.uuid4().hex}"
MARKED = "MARKER_PATH"  # where a statement names MARKER: the tests' ids stay the same in every process
URL = "http://127.0.0.1:1/x"


# ---- the guard on its own -----------------------------------------------------------------------------------


def test_tokens_split_where_clickhouses_lexer_splits() -> None:
    sql = "SELECT /* a /* b */ */ `x`, 'it''s', $t$ ; $t$ -- c\n# d\n;"
    assert list(tokens(sql)) == [
        Token("word", "SELECT", 6), Token("ident", "`x`", 26), Token("punct", ",", 27), Token("string", "'it''s'", 35),
        Token("punct", ",", 36), Token("string", "$t$ ; $t$", 46), Token("punct", ";", 57),
    ]
    assert [t.text for t in tokens("SELECT $open 1")] == ["SELECT", "$open", "1"]  # no closing tag: a bareword


@pytest.mark.parametrize(("sql", "statement", "fmt"), [
    ("SELECT 1", "SELECT 1", None),
    (" (SELECT 1) UNION ALL (SELECT 2) ;; -- trailing", " (SELECT 1) UNION ALL (SELECT 2)", None),
    ("SELECT 1 AS x FORMAT JSON", "SELECT 1 AS x FORMAT JSON", "JSON"),
    ("SELECT format FROM t", "SELECT format FROM t", None),
    ("SELECT 'a;b', $x$; DROP$x$ /* ; /* nested */ */", "SELECT 'a;b', $x$; DROP$x$", None),
])
def test_guard_accepts_one_read_only_statement(sql: str, statement: str, fmt: str | None) -> None:
    assert read_only_statement(sql) == Statement(statement, fmt)


def test_guard_reads_the_format_and_the_leading_keyword_and_leaves_settings_to_the_engine() -> None:
    sql = "SELECT 1 FROM (SELECT 2 SETTINGS max_threads = 1) FORMAT TSV SETTINGS `output_format_schema`='/x'"
    assert read_only_statement(sql) == Statement(sql, "TSV", "SELECT")
    assert read_only_statement("show tables").leading == "SHOW"


def test_other_clients_queries_are_not_read_from_the_system_database_but_a_column_so_named_is() -> None:
    with pytest.raises(SqlRefused, match=r"reading system\.query_log"):
        read_only_statement("SELECT query FROM query_log", database="system")
    assert read_only_statement("SELECT processes FROM gpu_samples", database="stepline").leading == "SELECT"


@pytest.mark.parametrize(("sql", "kind"), [
    ("INSERT INTO t VALUES (1)", "INSERT"),
    ("select 1; select 2", "a second statement"),
    ("SELECT $ a $; DROP TABLE t; $ a $", "a second statement"),  # not a heredoc to ClickHouse either
    ("SELECT 1 # x\n; DROP TABLE t", "a second statement"),
    ("SELECT \"file\"('x')", "file()"),
    ("SELECT `File`(1)", "file()"),
    ("SELECT * FROM s3Cluster('c', 'u')", "s3cluster()"),
    ("SELECT `fi\\x6ce`('x')", "an escaped name"),
    ("SELECT query FROM system.processes", "reading system.processes"),
    ("SELECT * FROM `system`.\"PROCESSES\"", "reading system.processes"),
    ("SELECT * FROM merge('system', '^proc')", "merge()"),
])
def test_guard_refuses(sql: str, kind: str) -> None:
    with pytest.raises(SqlRefused, match=re.escape(f"read-only: {kind} is not allowed")) as err:
        read_only_statement(sql)
    assert (err.value.code, err.value.name) == (READONLY, "READONLY")


def test_guard_reports_syntax_errors() -> None:
    # An unknown first word is ClickHouse's SYNTAX_ERROR (HTTP 400), not READONLY: nothing was refused.
    for sql in ("", " -- nothing", "SELECT 'open", "SELECT /* open", "SELEC 1", "* FROM t"):
        with pytest.raises(SqlRefused) as err:
            read_only_statement(sql)
        assert err.value.code == SYNTAX_ERROR


# ---- behind the query endpoint ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def db(chdb_dir: Path) -> Iterator[str]:
    name = f"ro_{uuid.uuid4().hex[:10]}"
    client = clickhouse_connect.get_client(dsn=f"chdb://{chdb_dir}")
    client.command(f"CREATE DATABASE `{name}`")
    client.command(f"CREATE TABLE `{name}`.t (a UInt8) ENGINE = MergeTree ORDER BY a")
    client.command(f"INSERT INTO `{name}`.t VALUES (1), (2)")
    yield name
    client.command(f"DROP DATABASE IF EXISTS `{name}`")
    client.close()


@pytest.fixture(scope="module")
def endpoint(chdb_dir: Path, db: str) -> Iterator[QueryEndpoint]:
    ep = QueryEndpoint(open_client(str(chdb_dir)), port=0, database=db)
    ep.start()
    yield ep
    ep.stop()


def state(chdb_dir: Path, db: str) -> tuple[object, ...]:
    """The rows, the tables, the databases, the user functions and dictionaries, and the marker file."""
    client = clickhouse_connect.get_client(dsn=f"chdb://{chdb_dir}")
    try:
        row = client.query(
            "SELECT (SELECT groupArray(a) FROM (SELECT a FROM {db:Identifier}.t ORDER BY a)), "
            "(SELECT groupArray(name) FROM system.tables WHERE database = {db:String}), "
            "(SELECT groupArray(name) FROM system.databases), "
            "(SELECT count() FROM system.functions WHERE origin != 'System'), "
            "(SELECT count() FROM system.dictionaries)", parameters={"db": db}).result_rows[0]
        return (*row, MARKER.exists())
    finally:
        client.close()


def post(ep: QueryEndpoint, sql: str, **params: str) -> tuple[int, str, bytes]:
    """(status, exception code, body) of one query over HTTP."""
    url = f"{ep.url}/?{urllib.parse.urlencode(params)}" if params else f"{ep.url}/"
    request = urllib.request.Request(url, data=sql.encode())
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, "", response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get("X-ClickHouse-Exception-Code", ""), err.read()


WRITES = [
    "RENAME TABLE t TO u", "EXCHANGE TABLES t AND t", "OPTIMIZE TABLE t FINAL", "GRANT ALL ON *.* TO default",
    "REVOKE SELECT ON *.* FROM default", "CREATE USER eve IDENTIFIED BY 'x'", "DETACH TABLE t", "ATTACH TABLE t",
    "UNDROP TABLE t", "BACKUP TABLE t TO File('b')", "DELETE FROM t WHERE 1", "ALTER TABLE t UPDATE a = 9 WHERE 1",
    "INSERT INTO t SELECT 5", f"INSERT INTO FUNCTION file('{MARKED}') SELECT 1", "CREATE TEMPORARY TABLE x (a UInt8)",
    "CREATE DICTIONARY d (a UInt8) PRIMARY KEY a SOURCE(FILE(path '/etc/hostname' format 'TSV')) LAYOUT(FLAT()) "
    "LIFETIME(0)", "CREATE FUNCTION f AS x -> x", "CREATE VIEW v AS SELECT 1", "SYSTEM SHUTDOWN",
    "SYSTEM RELOAD CONFIG", "KILL MUTATION WHERE 1", "SET allow_ddl = 1", "SET readonly = 0; DROP TABLE t",
    "SELECT 1; INSERT INTO t VALUES (7)",
    "drop table t", "/* hidden */ DROP TABLE t", "(DROP TABLE t)", "CHECK TABLE t", "USE system", "MOVE USER eve TO x",
    f"SELECT 1 INTO OUTFILE '{MARKED}' APPEND", "INSERT INTO t FROM INFILE '/etc/hostname'",
    "EXPLAIN PIPELINE INSERT INTO t SELECT 1",
]
OUTSIDE = [  # table functions and functions that read files, URLs, other processes or servers
    f"s3('{URL}', 'CSV')", "remote('127.0.0.1', system.one)", "executable('cat /etc/hostname', 'TSV', 'x String')",
    "executablePool('x', 'TSV', 'x String')", "input('x String')", "mysql('127.0.0.1:1', 'd', 't', 'u', 'p')",
    "postgresql('127.0.0.1:1', 'd', 't', 'u', 'p')", "hdfs('hdfs://127.0.0.1:1/x', 'TSV', 'x String')",
    "azureBlobStorage('http://127.0.0.1:1', 'c', 'b')", "sqlite('/etc/hostname', 't')", "odbc('d', 't')",
    "jdbc('d', 't')", "mongodb('127.0.0.1:1', 'd', 'c', 'u', 'p', 'x String')", "redis('127.0.0.1:1', 'k', 'k String')",
    f"urlCluster('c', '{URL}')", "fileCluster('c', '/etc/hostname')", f"s3Cluster('c', '{URL}')",
    "cluster('c', system.one)", "clusterAllReplicas('c', system.one)", f"gcs('{URL}')", f"iceberg('{URL}')",
    "icebergLocal('/etc')", f"deltaLake('{URL}')", f"hudi('{URL}')", "dictionary('d')", f"URL('{URL}', 'CSV')",
    f"\"url\"('{URL}', 'CSV')", "file /* spaced */ ('/etc/hostname')", "loop(file('/etc/hostname'))",
    "hdfsCluster('c', 'x')", "arrowFlight('x')", "ytsaurus('x')", "bigquery('p', 'd', 't')",
    # chDB's own table functions: the process's Python objects and files (the sessions run readonly=2).
    "Python(secrets)", "python('x')", "arrowstream(reader)", "filesystem('/etc')", "eval('1')",
]


@pytest.mark.parametrize("sql", WRITES + [f"SELECT * FROM {f}" for f in OUTSIDE] + [
    "DESCRIBE TABLE file('/etc/hostname')", "SELECT file('/etc/hostname')"])
def test_writes_settings_and_reaching_outside_are_refused(endpoint: QueryEndpoint, chdb_dir: Path, db: str,
                                                          sql: str) -> None:
    before = state(chdb_dir, db)
    status, code, body = post(endpoint, sql.replace(MARKED, str(MARKER)))
    assert status >= 400 and code == "164", (status, body[:200])  # READONLY: the guard's or the engine's
    assert state(chdb_dir, db) == before


@pytest.mark.parametrize(("sql", "params"), [
    ("SELECT getSetting('readonly')", {"readonly": "0"}),
    ("CREATE TABLE u (a UInt8) ENGINE = Memory", {"allow_ddl": "1"}),
    ("SELECT * FROM file('/etc/hostname')", {"user_files_path": "/"}),
    ("SELECT 1", {"allow_introspection_functions": "1"}),
    ("SELECT 1", {"format_schema_path": "/etc"}),
    ("SELECT 1", {"readonly": "0", "query": "SELECT 2"}),
])
def test_settings_in_the_url_cannot_lift_readonly_or_reach_files(endpoint: QueryEndpoint, chdb_dir: Path, db: str,
                                                                 sql: str, params: dict[str, str]) -> None:
    before = state(chdb_dir, db)
    status, code, _ = post(endpoint, sql, **params)
    # The engine's: READONLY, SETTING_CONSTRAINT_VIOLATION (the profile's const), or UNKNOWN_SETTING (a server
    # path such as format_schema_path is no setting at all)
    assert status >= 400 and code in ("164", "452", "115")
    assert state(chdb_dir, db) == before


def test_a_form_field_cannot_lift_readonly(endpoint: QueryEndpoint, chdb_dir: Path, db: str) -> None:
    before = state(chdb_dir, db)
    body = (b'--B\r\nContent-Disposition: form-data; name="readonly"\r\n\r\n0\r\n'
            b'--B\r\nContent-Disposition: form-data; name="query"\r\n\r\nDROP TABLE t\r\n--B--\r\n')
    request = urllib.request.Request(f"{endpoint.url}/", data=body,
                                     headers={"Content-Type": "multipart/form-data; boundary=B"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.headers["X-ClickHouse-Exception-Code"] == "164"
    assert state(chdb_dir, db) == before


def test_explaining_a_write_runs_nothing(endpoint: QueryEndpoint, chdb_dir: Path, db: str) -> None:
    before = state(chdb_dir, db)
    for sql in ("EXPLAIN SYNTAX INSERT INTO t VALUES (9)", "EXPLAIN AST DROP TABLE t"):
        assert post(endpoint, sql)[0] == 200
    assert state(chdb_dir, db) == before


# ---- the CLI binds what users type --------------------------------------------------------------------------

HOSTILE = ["x' OR 1=1 --", "a' OR engine != '", "a\\' OR 1=1 --", "a'; DROP TABLE requests; --",
           "{engine:String}", "' UNION ALL SELECT * FROM requests --", "a\\", "`a`"]


@pytest.fixture
def two_engines(store: Store, store_url: str) -> str:
    """A store holding requests, steps and GPU samples of engines `a` and `b`, a minute ago."""
    now = micros(time.time()) - 60_000_000
    requests = [Request(now + i, "h", engine, 0, "m", f"{engine}-req-{i}", "plugin", "stop", now - 5_000_000, 0.1, 1.0,
                        2.0, 3.0, 3.1, 1.1, 0.05, 100, 0, 40, 40, 0) for engine in ("a", "b") for i in range(3)]
    steps = [Step(now + i * 100_000, "h", engine, 0, "m", i, 25.0, 0, 0, 4, 4, 4, 0, 0, 0.3, 0, 0, 0, 0, 0, 0, [],
                  [0.025] * 4, False) for engine in ("a", "b") for i in range(5)]
    gpus = [GpuSample(now - 200_000 + i * 100_000, "h", engine, 0, "uuid", "H100", 1980.0, 2619.0, 500.0, 0, 60.0,
                      70.0, 90.0, 10.0, 1, 2, 0.0, 0.0, 0, 0.0, 0.0, 0, [], 50.0, 40.0, 30.0, {})
            for engine in ("a", "b") for i in range(5)]
    for table, rows in (("requests", requests), ("steps", steps), ("gpu_samples", gpus)):
        store.insert(table, rows, schema.TABLE_BY_NAME[table].column_names)
    return store_url


def test_hostile_engine_names_and_times_are_bound_never_spliced(two_engines: str, capsys: pytest.CaptureFixture[str]
                                                                ) -> None:
    def run(*args: str) -> tuple[int, str, str]:
        code = main(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    code, out, _ = run("requests", "--store", two_engines, "--engine", "a", "--since", "1h")
    assert code == 0 and "a-req-" in out and "b-req-" not in out  # the filter works: a hostile value could fail it
    around = datetime.fromtimestamp(time.time() - 60, UTC).isoformat()
    code, out, _ = run("timeline", "--store", two_engines, "--around", around, "--engine", "a", "--bucket", "0")
    assert code == 0 and re.search(r"\sa\s", out) and " b " not in out
    for hostile in HOSTILE:
        code, out, err = run("requests", "--store", two_engines, "--engine", hostile, "--since", "1h")
        assert (code, err) == (0, "") and "no finished requests" in out and "-req-" not in out, (hostile, out, err)
        code, out, err = run("timeline", "--store", two_engines, "--around", around, "--engine", hostile)
        assert (code, err) == (0, "") and out.startswith("no engine steps"), (hostile, out, err)
    for args in (("requests", "--since", "1h' OR 1=1 --"), ("requests", "--since", "inf"),
                 ("timeline", "--around", "x' OR 1=1 --"), ("timeline", "--around", "1e20"),
                 ("timeline", "--around", around, "--window", "nan")):
        code, out, err = run(*args[:1], "--store", two_engines, *args[1:])
        assert code == 2 and err.startswith("stepline: ") and err.count("\n") == 1, (args, err)
    for count in ("-1", "0", "5000000000", "1; DROP"):
        with pytest.raises(SystemExit) as usage:
            main(["requests", "--store", two_engines, "--slowest", count])
        assert usage.value.code == 2
    assert state_rows(two_engines) == (6, 10)


def state_rows(store_url: str) -> tuple[int, int]:
    store = Store.open(store_url)
    try:
        row = store.query("SELECT (SELECT count() FROM requests), (SELECT count() FROM steps)").result_rows[0]
        return int(row[0]), int(row[1])
    finally:
        store.close()


def test_a_setting_given_twice_in_one_clause_is_judged_by_its_last_value() -> None:
    # The engine applies a clause's assignments in order: `max_result_bytes = 0, max_result_bytes = 1` runs as 1
    # (found by tests/e2e/test_query_attacks.py's property test); another clause keeps its own.
    assert settings_named("SELECT 1 SETTINGS max_result_bytes = 0, max_threads = 2, max_result_bytes = 1") == [
        ("max_threads", "2"), ("max_result_bytes", "1")]
    assert settings_named("SELECT * FROM (SELECT 1 SETTINGS max_threads = 0) SETTINGS max_threads = 3") == [
        ("max_threads", "0"), ("max_threads", "3")]
