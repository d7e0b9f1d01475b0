"""The query endpoint's read-only chDB sessions: pooled by settings, one streaming query at a time each, a fair
share of them per client, and a query killed when its client has gone."""

from __future__ import annotations

import queue
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, cast

import chdb

from stepline.clickhouse_http.errors import SqlRefused
from stepline.store.query_profile import PROFILE, changeable

Settings = tuple[tuple[str, str], ...]

# The SQL of stepline's own reads (diagnose, report, the CLI) binds its values as parameters, so the same text
# comes again and again: the parser's answer is kept for it. At most 256 texts of up to 64 KiB each.
_PARSED_ENTRIES, _PARSED_MAX_CHARS = 256, 64 << 10
_SESSION_WAIT_S = 10.0  # then ClickHouse's own 202: a client retries sooner than a dashboard times out
_PREFETCH_BLOCKS = 4  # blocks of up to ~1 MiB each (max_block_size rows) computed ahead of the wire
_ESCAPED = str.maketrans({"\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r", "\0": "\\0"})
_CODE = re.compile(r"Code: (\d+)\. DB::Exception: ")
_NAME = re.compile(r"\(([A-Z][A-Z0-9_]+)\)(?: \(version [^()]*\))?\.?\s*\Z")


class EngineError(Exception):
    """An error the engine raised for a query: its ClickHouse code, name and message."""

    def __init__(self, message: str, code: int, name: str) -> None:
        super().__init__(message)
        self.code, self.name = code, name

    @classmethod
    def of(cls, ex: Exception) -> EngineError:
        # chDB raises ChdbError/RuntimeError with ClickHouse's own text, at times behind "Streaming query failed: ".
        text = str(ex)
        code = _CODE.search(text)
        name = _NAME.search(text)
        message = text[code.start():] if code else text
        return cls(message, int(code.group(1)) if code else 1000, name.group(1) if name else "UNKNOWN_EXCEPTION")


@dataclass
class Progress:
    """What the engine reports of a query so far: rows and bytes read from storage."""

    read_rows: int = 0
    read_bytes: int = 0


class ProfileMissing(RuntimeError):
    """The engine was started without stepline's query profile, or the profile leaves settings changeable."""


def _quote(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _ident(name: str) -> str:
    """`name` backquoted as ClickHouse's lexer reads it: a backslash escapes, so it is escaped too."""
    return "`" + name.replace("\\", "\\\\").replace("`", "\\`") + "`"


class Session:
    """One chDB connection under the `stepline_query` profile (`stepline.store.query_profile`).

    The endpoint's own settings (`preset`: readonly=2, the limits it starts queries with) are set first; then the
    profile, whose constraints the engine applies to everything after it: the client's settings (`chosen`), and
    every SETTINGS clause of every query, in any spelling. A setting outside the profile's allow-list is refused
    by ClickHouse (SETTING_CONSTRAINT_VIOLATION, 452), a limit past its ceiling too, `readonly` and the profile
    cannot change.
    """

    def __init__(self, path: str, preset: Settings, chosen: Settings) -> None:
        self.conn: Any = cast(Any, chdb).connect(path)  # untyped: chDB ships no annotations
        self._database: str | None = None
        try:
            for key, value in (("readonly", "2"), *preset):
                self.conn.query(f"SET {key} = {_quote(value)}")
            self._enter_profile()
            for key, value in chosen:
                self.conn.query(f"SET {key} = {_quote(value)}")
        except ProfileMissing:
            self.conn.close()
            raise
        except Exception as ex:
            self.conn.close()
            raise EngineError.of(ex) from None

    def _enter_profile(self) -> None:
        try:
            self.conn.query(f"SET profile = '{PROFILE}'")
        except Exception as ex:
            if "THERE_IS_NO_PROFILE" in str(ex):
                raise ProfileMissing(
                    f"the embedded store was opened without stepline's {PROFILE!r} profile: the first client of the "
                    "process must open it with stepline.store.chdb.open_client") from None
            raise

    def verify(self) -> None:
        """Refuse to serve when the engine lets a client change a setting the profile does not allow."""
        rows = self.conn.query("SELECT name, readonly FROM system.settings", "TSV").bytes().decode().splitlines()
        loose = changeable([(name, int(readonly)) for name, readonly in (row.split("\t") for row in rows)])
        if loose:
            raise ProfileMissing(f"chDB lets a read-only session change {len(loose)} settings that stepline's "
                                 f"{PROFILE!r} profile does not list ({', '.join(loose[:5])}...): run "
                                 "`python -m stepline.store.query_profile` with this chDB and commit the list")

    def stream(self, database: str, sql: str, fmt: str, params: Mapping[str, str],
               progress: Progress) -> Iterator[bytes]:
        """The result in `fmt`, block by block as chDB encodes them (each block a whole document of `fmt`).

        Streaming, never chDB's buffered query(): a query that fails there after its first block leaves that
        output in the connection, in front of the next query's result (chDB 4.4). chDB computes a block only
        when asked for it, so blocks are pulled a few ahead on a thread of their own: the engine works while
        the previous block is on the wire (memory stays bounded by that depth).
        """
        return _prefetched(self._blocks(database, sql, fmt, params, progress), _PREFETCH_BLOCKS)

    def _blocks(self, database: str, sql: str, fmt: str, params: Mapping[str, str],
                progress: Progress) -> Iterator[bytes]:
        try:
            self._use(database)
            result = self.conn.send_query(sql, fmt, params=dict(params))
        except Exception as ex:
            raise EngineError.of(ex) from None
        try:
            while True:
                try:
                    chunk = next(result)
                except StopIteration:
                    return
                except Exception as ex:
                    raise EngineError.of(ex) from None
                progress.read_rows += chunk.rows_read()
                progress.read_bytes += chunk.bytes_read()
                if data := chunk.bytes():
                    yield data
        finally:
            result.close()

    def whole(self, database: str, sql: str, fmt: str, params: Mapping[str, str], progress: Progress) -> bytes:
        """The result as one document, for formats that cannot be joined from blocks (XML, Pretty, Parquet...).

        chDB buffers it (bounded by max_result_bytes); after a failure here the session must not be reused.
        """
        try:
            self._use(database)
            result = self.conn.query(sql, fmt, params=dict(params))
        except Exception as ex:
            raise EngineError.of(ex) from None
        progress.read_rows += result.rows_read()
        progress.read_bytes += result.bytes_read()
        return bytes(result.bytes() or b"")

    def _use(self, database: str) -> None:
        if database != self._database:
            self.conn.query(f"USE {_ident(database)}")
            self._database = database

    def close(self) -> None:
        self.conn.close()


def _prefetched(blocks: Iterator[bytes], depth: int) -> Iterator[bytes]:
    """`blocks`, pulled up to `depth` ahead by a thread that alone touches them (and closes them when the reader
    stops early); an error there is raised here, in its turn."""
    ready: queue.Queue[tuple[bytes | None, BaseException | None]] = queue.Queue(depth)
    stop = threading.Event()

    def put(item: tuple[bytes | None, BaseException | None]) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def pull() -> None:
        try:
            for block in blocks:
                if not put((block, None)):
                    return
            put((None, None))
        except BaseException as ex:  # handed to the reader, which raises it
            put((None, ex))
        finally:
            close = getattr(blocks, "close", None)
            if close is not None:
                close()

    puller = threading.Thread(target=pull, name="stepline-query-blocks", daemon=True)
    puller.start()
    try:
        while True:
            block, error = ready.get()
            if error is not None:
                raise error
            if block is None:
                return
            yield block
    finally:
        stop.set()
        puller.join()  # the session's connection is free again only once the puller has let go of it


class Sessions:
    """Read-only chDB sessions on the store's path, pooled by the client's settings; each runs one query at a time.

    Every session starts with `preset` (the endpoint's own settings) under the `stepline_query` profile. One client
    holds at most `per_client` sessions at once, so one that sends long queries cannot starve the others; a
    request that finds no session within the wait is refused with ClickHouse's 202. A session whose query failed,
    or whose result was abandoned part way, is closed rather than reused.
    """

    def __init__(self, path: str, max_sessions: int, preset: Settings = (), per_client: int | None = None,
                 wait_s: float | None = None) -> None:
        self._path = path
        self._max = max_sessions
        self._preset = preset
        self._per_client = per_client or max(1, (max_sessions + 1) // 2)
        self._wait_s = _SESSION_WAIT_S if wait_s is None else wait_s
        self._idle: dict[Settings, list[Session]] = {}
        self._count = 0
        self._holding: dict[str, int] = {}
        self._closed = False
        self._cond = threading.Condition()
        self._admin: Any = None  # a connection of the default profile, for KILL QUERY
        self._admin_lock = threading.Lock()
        self._parser: Session | None = None
        self._parser_lock = threading.Lock()
        self._parsed: OrderedDict[str, str] = OrderedDict()  # the parser's answers for texts that come again

    def verify(self) -> None:
        """Open one session and check the engine's profile covers every setting (ProfileMissing if not)."""
        session = Session(self._path, self._preset, ())
        try:
            session.verify()
        finally:
            session.close()

    def run(self, settings: Settings, database: str, sql: str, fmt: str, params: Mapping[str, str],
            progress: Progress, *, whole: bool = False, client: str = "") -> Iterator[bytes]:
        """The result's blocks (or, `whole`, the one document); the session is held until the iterator ends."""
        session = self._acquire(settings, client)
        finished = False
        try:
            if whole:
                yield session.whole(database, sql, fmt, params, progress)
            else:
                yield from session.stream(database, sql, fmt, params, progress)
            finished = True
        finally:
            self._release(settings, session, keep=finished, client=client)

    def canonical(self, sql: str) -> str:
        """`sql` as ClickHouse's own parser prints it back (formatQuerySingleLine): no comments, no quoting that is
        not needed, one spelling per name; an EngineError where it does not parse."""
        with self._parser_lock:
            if (known := self._parsed.get(sql)) is not None:
                self._parsed.move_to_end(sql)
                return known
        escaped = sql.translate(_ESCAPED)  # a bound String is read in TabSeparated's escaping
        try:
            with self._parser_lock:
                if self._parser is None:  # read-only like the others: it only ever parses
                    self._parser = Session(self._path, self._preset, ())
                result = self._parser.conn.query("SELECT formatQuerySingleLine({q:String})", "TSVRaw",
                                                 params={"q": escaped})
        except Exception as ex:
            raise EngineError.of(ex) from None
        canonical = bytes(result.bytes()).decode().rstrip("\n")
        if len(sql) <= _PARSED_MAX_CHARS:
            with self._parser_lock:
                self._parsed[sql] = canonical
                while len(self._parsed) > _PARSED_ENTRIES:
                    self._parsed.popitem(last=False)
        return canonical

    def _admin_connection(self) -> Any:
        if self._admin is None:
            self._admin = cast(Any, chdb).connect(self._path)
        return self._admin

    def kill(self, tag: str) -> None:
        """Cancel the running query whose text carries `tag` (ClickHouse's KILL QUERY, from outside its session)."""
        if not tag.isalnum():
            raise ValueError(f"a query tag is letters and digits, not {tag[:40]!r}")
        with self._admin_lock:
            self._admin_connection().query(f"KILL QUERY WHERE query LIKE '%{tag}%' AND query NOT LIKE 'KILL%' ASYNC")

    def _acquire(self, key: Settings, client: str) -> Session:
        deadline = time.monotonic() + self._wait_s
        with self._cond:
            while True:
                if self._closed:
                    raise SqlRefused("the query endpoint is stopping", 202, "TOO_MANY_SIMULTANEOUS_QUERIES")
                mine = self._holding.get(client, 0) < self._per_client
                if mine and self._idle.get(key):
                    self._holding[client] = self._holding.get(client, 0) + 1
                    return self._idle[key].pop()
                spare = next((k for k, v in self._idle.items() if v), None)
                if mine and self._count >= self._max and spare is not None:
                    self._idle[spare].pop().close()  # idle, so closing it cannot block
                    self._count -= 1
                if mine and self._count < self._max:
                    self._count += 1
                    self._holding[client] = self._holding.get(client, 0) + 1
                    break
                if not self._cond.wait(max(0.0, deadline - time.monotonic())):
                    why = (f"all {self._max} query sessions are busy" if self._count >= self._max else
                           f"this client already runs {self._per_client} of the {self._max} query sessions")
                    raise SqlRefused(why, 202, "TOO_MANY_SIMULTANEOUS_QUERIES")
        try:
            return Session(self._path, self._preset, key)
        except BaseException:
            self._release(key, None, keep=False, client=client)
            raise

    def _release(self, key: Settings, session: Session | None, keep: bool, client: str) -> None:
        with self._cond:
            self._cond.notify_all()
            if (held := self._holding.get(client, 0) - 1) > 0:
                self._holding[client] = held
            else:
                self._holding.pop(client, None)
            if keep and session is not None and not self._closed:
                self._idle.setdefault(key, []).append(session)
                return
            self._count -= 1
        if session is not None:
            session.close()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            idle = [s for sessions in self._idle.values() for s in sessions]
            self._idle.clear()
            self._count -= len(idle)
            self._cond.notify_all()
        for session in idle:
            session.close()
        with self._admin_lock:
            if self._admin is not None:
                self._admin.close()
                self._admin = None
        with self._parser_lock:
            if self._parser is not None:
                self._parser.close()
                self._parser = None
