"""ClickHouse's HTTP protocol, server side: read-only SQL guard, request decoding, Native framing, errors."""

from __future__ import annotations

import bisect
import importlib
import re
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from email import policy
from email.message import Message
from email.parser import BytesParser
from io import BufferedIOBase

from stepline.clickhouse_http.native import (
    BLOCK_INFO as BLOCK_INFO,  # re-exported: clients of this module frame with it
)
from stepline.clickhouse_http.native import UnsupportedColumn, reframe

READONLY = 164
SYNTAX_ERROR = 62
NOT_IMPLEMENTED = 48
QUERY_IS_TOO_LARGE = 229
AUTHENTICATION_FAILED = 516

_ALLOWED_LEADING = frozenset({"SELECT", "WITH", "SHOW", "DESCRIBE", "DESC", "EXISTS", "EXPLAIN"})
# Statements ClickHouse parses but a read-only user may not run (READONLY); any other first word is a syntax
# error there (SYNTAX_ERROR, HTTP 400), and is answered as one here.
_WRITING_LEADING = frozenset({
    "INSERT", "CREATE", "ALTER", "DROP", "DETACH", "ATTACH", "RENAME", "EXCHANGE", "TRUNCATE", "OPTIMIZE", "SYSTEM",
    "SET", "USE", "KILL", "GRANT", "REVOKE", "CHECK", "DELETE", "UPDATE", "UNDROP", "BACKUP", "RESTORE", "MOVE",
    "WATCH", "BEGIN", "COMMIT", "ROLLBACK", "START", "EXECUTE", "REPLACE", "UPSERT", "COPY",
})
SETTING_CONSTRAINT_VIOLATION = 452
# Functions that reach files, the network or other processes. The sessions run with readonly=2, under which the
# engine runs table functions, and it never refuses the scalar file() nor INTO OUTFILE: the guard stops those.
_DENIED_FUNCTIONS = frozenset({
    "file", "filecluster", "url", "urlcluster", "gcs", "oss", "cosn", "cluster", "clusterallreplicas",
    "redis", "sqlite", "odbc", "jdbc", "input", "mongodb", "dictionary", "catboostevaluate",
})
_DENIED_PREFIXES = (
    "s3", "hdfs", "azureblob", "iceberg", "deltalake", "hudi", "paimon", "remote", "mysql", "postgresql",
    "executable", "ytsaurus", "arrowflight", "kafka", "bigquery",
    # chDB's own: python() and arrowstream() read objects of the process that hosts the engine (the collector),
    # filesystem() lists its files. The sessions run with readonly=2, which lets table functions run: only
    # the guard stands between these and a client.
    "python", "arrowstream", "filesystem", "eval",
)


class SqlRefused(Exception):
    """A query the read-only endpoint will not run; carries a ClickHouse error code and name."""

    def __init__(self, message: str, code: int = READONLY, name: str = "READONLY", status: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.name = name
        self.status = status  # overrides the usual HTTP status for `code`


def read_only(kind: str) -> SqlRefused:
    return SqlRefused(f"stepline's query endpoint is read-only: {kind} is not allowed")


@dataclass(frozen=True)
class Token:
    """One significant lexeme: kind is word, ident (quoted identifier), string, or punct; end is its offset."""

    kind: str
    text: str
    end: int


_QUOTED = r"'(?:[^'\\]|\\.|'')*'|\"(?:[^\"\\]|\\.|\"\")*\"|`(?:[^`\\]|\\.|``)*`"  # backslash escapes, doubled quote
# ClickHouse's lexer, as far as the guard needs it: what is code, a literal, a quoted identifier or a comment.
_LEXEME = re.compile(
    r"(?P<skip>[ \t\n\r\f\v]+|[^\x00-\x7f]+|--[^\n]*|#[ !][^\n]*)"  # it skips Unicode spaces: `file\u200b(` calls
    r"|(?P<open>/\*|\$[A-Za-z0-9_]*\$)"  # a block comment (they nest) or a heredoc: ends found by hand
    rf"|(?P<quoted>{_QUOTED})|(?P<word>[A-Za-z0-9_$]+)|(?P<punct>.)",
    re.S,
)
_COMMENT_MARK = re.compile(r"/\*|\*/")
_WORD = re.compile(r"[A-Za-z0-9_$]+")
_TAG = re.compile(r"(?=(\$[A-Za-z0-9_]*\$))")


def tokens(sql: str) -> Iterator[Token]:
    """Significant tokens of `sql`, split where ClickHouse's lexer splits comments, quotes and heredocs."""
    pos, tags = 0, None if "$" in sql else dict[str, list[int]]()  # None: heredoc places not indexed yet
    while (m := _LEXEME.match(sql, pos)) is not None:
        kind, start, pos, text = m.lastgroup, m.start(), m.end(), m.group()
        if text == "/*" and kind == "open":
            depth = 1
            while depth:
                if (mark := _COMMENT_MARK.search(sql, pos)) is None:
                    raise SqlRefused(f"unterminated comment at position {start}", SYNTAX_ERROR, "SYNTAX_ERROR")
                depth, pos = depth + (1 if mark.group() == "/*" else -1), mark.end()
        elif kind == "open":
            if tags is None:  # where every $tag$ occurs, so that many unclosed tags cost one pass, not one each
                tags = {}
                for t in _TAG.finditer(sql):
                    tags.setdefault(t.group(1), []).append(t.start())
            places = tags[text]
            if (k := bisect.bisect_left(places, pos)) < len(places):
                pos = places[k] + len(text)
                yield Token("string", sql[start:pos], pos)
            else:  # no closing tag: not a heredoc, a bareword as ClickHouse reads it
                word = _WORD.match(sql, start)
                pos = word.end() if word else start + 1
                yield Token("word", sql[start:pos], pos)
        elif kind == "quoted":
            yield Token("string" if text[0] == "'" else "ident", text, pos)
        elif kind == "punct" and text in "'\"`":
            raise SqlRefused(f"unterminated quoted literal at {start}", SYNTAX_ERROR, "SYNTAX_ERROR")
        elif kind != "skip":
            yield Token(str(kind), text, pos)


@dataclass(frozen=True)
class Statement:
    """One read-only statement: its text without trailing `;`, its FORMAT clause if it has one, and every
    `name = value` of its SETTINGS clauses (value as written)."""

    sql: str
    format: str | None
    settings: tuple[tuple[str, str], ...] = ()
    leading: str = "SELECT"  # its first keyword: SELECT, WITH, SHOW, DESCRIBE, DESC, EXISTS or EXPLAIN


def _function_name(tok: Token) -> str | None:
    if tok.kind == "word":
        return tok.text.lower()
    if tok.kind == "ident":
        body = tok.text[1:-1]
        if "\\" in body:  # escapes could spell a denied name; no real query needs them here
            raise read_only("an escaped function name")
        return body.replace(tok.text[0] * 2, tok.text[0]).lower()
    return None


def read_only_statement(sql: str) -> Statement:
    """Check that `sql` is one read-only statement and return it; raise SqlRefused otherwise."""
    toks: list[Token] = []
    settings: list[tuple[str, str]] = []
    leading: str | None = None
    it = tokens(sql)
    for tok in it:
        if tok.kind == "punct" and tok.text == ";":
            if any(not (rest.kind == "punct" and rest.text == ";") for rest in it):
                raise read_only("a second statement")
            break
        if leading is None and not (tok.kind == "punct" and tok.text == "("):
            leading = tok.text.upper() if tok.kind == "word" else "this statement"
            if leading not in _ALLOWED_LEADING:
                if leading in _WRITING_LEADING:
                    raise read_only(leading)
                raise SqlRefused(f"Syntax error: failed at position {tok.end - len(tok.text) + 1} ({tok.text[:40]}): "
                                 f"{sql[tok.end - len(tok.text):][:60]}. Expected one of: "
                                 f"{', '.join(sorted(_ALLOWED_LEADING))}", SYNTAX_ERROR, "SYNTAX_ERROR")
        toks.append(tok)
    if leading is None:
        raise SqlRefused("Empty query", SYNTAX_ERROR, "SYNTAX_ERROR")
    depth, fmt = 0, None
    for k, tok in enumerate(toks):
        nxt = toks[k + 1] if k + 1 < len(toks) else None
        upper = tok.text.upper() if tok.kind == "word" else ""
        if upper in ("OUTFILE", "INFILE"):
            raise read_only(f"INTO {upper}" if upper == "OUTFILE" else "FROM INFILE")
        if upper == "READONLY" and nxt is not None and nxt.text == "=":
            raise read_only("changing readonly")
        if nxt is not None and nxt.text == "(" and (name := _function_name(tok)) is not None and (
            name in _DENIED_FUNCTIONS or name.startswith(_DENIED_PREFIXES)
        ):
            raise read_only(f"{name}()")
        depth += {"(": 1, ")": -1}.get(tok.text, 0) if tok.kind == "punct" else 0
        if upper == "FORMAT" and depth == 0 and nxt is not None and nxt.kind == "word":
            after = toks[k + 2] if k + 2 < len(toks) else None
            if after is None or (after.kind == "word" and after.text.upper() == "SETTINGS"):
                fmt = nxt.text
        if upper == "SETTINGS":
            settings.extend(_settings_clause(toks, k + 1))
    for key, value in settings:
        if (key, value) not in _NO_OP_READONLY:
            _check_setting(key)
    return Statement(sql[: toks[-1].end], fmt, tuple(settings), leading)


def _settings_clause(toks: list[Token], k: int) -> Iterator[tuple[str, str]]:
    """`name = value, ...` from toks[k]: each value as written (a signed number, a string, a word)."""
    while k + 2 < len(toks) and toks[k].kind == "word" and toks[k + 1].text == "=":
        name, value, k = toks[k].text, toks[k + 2].text, k + 3
        if value in ("-", "+") and k < len(toks):
            value, k = value + toks[k].text, k + 1
        yield name, value
        if k >= len(toks) or toks[k].text != ",":
            return
        k += 1


# ---- request decoding and settings policy ----------------------------------------------------------------

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


def too_large(size: int, limit: int) -> SqlRefused:
    """The refusal for a request body over the endpoint's limit."""
    message = f"request body of {size} bytes exceeds the query endpoint's limit of {limit} bytes"
    return SqlRefused(message, QUERY_IS_TOO_LARGE, "QUERY_IS_TOO_LARGE")


_LENGTH = re.compile(rb"[0-9]{1,18}\Z")
_CHUNK_SIZE = re.compile(rb"([0-9A-Fa-f]{1,15})[ \t]*(?:;[^\r\n]*)?\r?\n\Z")
_MAX_TRAILERS = 64


class BodyTooLarge(Exception):
    """A request body over the limit: `size` so far, `declared` bytes still worth draining before closing."""

    def __init__(self, size: int, declared: int) -> None:
        super().__init__(size)
        self.size, self.declared = size, declared


def read_body(rfile: BufferedIOBase, headers: Message, limit: int, *, drain_cap: int) -> bytes:
    """An HTTP/1.1 request body, chunked or by Content-Length, strictly framed.

    ValueError for broken framing, OSError when the client goes away mid-body (a truncated body is never
    returned), BodyTooLarge past `limit` bytes.
    """
    if "chunked" in headers.get("Transfer-Encoding", "").lower():  # clickhouse-connect's inserts
        parts: list[bytes] = []
        total = 0
        while True:
            line = rfile.readline(1024)
            if (size_line := _CHUNK_SIZE.match(line)) is None:
                raise ValueError(f"bad chunk size line {line[:40]!r}")
            if not (size := int(size_line.group(1), 16)):
                break
            total += size
            if total > limit:  # how much is still coming is unknown: drain up to the cap before closing
                raise BodyTooLarge(total, drain_cap)
            parts.append(_read_exactly(rfile, size))
            if rfile.readline(8) not in (b"\r\n", b"\n"):
                raise ValueError("a chunk is not followed by CRLF")
        for _ in range(_MAX_TRAILERS):
            if not rfile.readline(1024).strip():
                return b"".join(parts)
        raise ValueError(f"more than {_MAX_TRAILERS} trailer lines")
    lengths = {value.strip() for value in headers.get_all("Content-Length", [])}
    if len(lengths) > 1 or not all(_LENGTH.match(value.encode()) for value in lengths):
        raise ValueError(f"Content-Length {', '.join(sorted(lengths))[:60]!r} is not one byte count")
    declared = int(lengths.pop()) if lengths else 0
    if declared > limit:
        raise BodyTooLarge(declared, declared)
    return _read_exactly(rfile, declared)


def _read_exactly(rfile: BufferedIOBase, size: int) -> bytes:
    data = rfile.read(size)
    if len(data) < size:  # the client closed or stalled past the timeout: never run a truncated query
        raise OSError(f"the body ended after {len(data)} of {size} bytes")
    return data


def decompress(encoding: str, body: bytes, limit: int) -> bytes:
    """Undo a request Content-Encoding, refusing output beyond `limit` bytes (a zip bomb is a large body)."""
    if encoding in ("", "identity"):
        return body
    modules = {"lz4": "lz4.frame", "zstd": "backports.zstd"}  # clickhouse-connect's dependencies
    if encoding not in modules and encoding not in ("gzip", "x-gzip", "deflate"):
        raise SqlRefused(f"Unknown Content-Encoding of HTTP request: {encoding[:40]}", 48, "NOT_IMPLEMENTED")
    try:
        if encoding in modules:
            module = importlib.import_module(modules[encoding])
            stream = module.LZ4FrameDecompressor() if encoding == "lz4" else module.ZstdDecompressor()
            out: bytes = stream.decompress(body, limit + 1)
        else:  # 32+: zlib or gzip framing, whichever the header says
            out = zlib.decompressobj(32 + zlib.MAX_WBITS).decompress(body, limit + 1)
    except Exception as ex:  # untrusted bytes: every decompressor failure (zlib.error, ZstdError, ...) is the body's
        detail = " ".join(str(ex).split())[:160] or type(ex).__name__
        raise SqlRefused(f"cannot decompress the {encoding} request body: {detail}", 271, "CANNOT_DECOMPRESS") from None
    if len(out) > limit:
        raise too_large(len(out), limit)
    return out


def form_fields(content_type: str, body: bytes) -> dict[str, str]:
    """Fields of a multipart/form-data body (clickhouse-connect sends long bind parameters that way)."""
    fields: dict[str, str] = {}
    try:
        head = f"Content-Type: {content_type}\r\n\r\n".encode("utf-8", errors="replace")
        parts = list(BytesParser(policy=policy.HTTP).parsebytes(head + body).iter_parts())
        for part in parts:
            name = part.get_param("name", header="content-disposition")
            if part.get_filename() is not None or not isinstance(name, str):
                raise SqlRefused("external data tables are not supported", NOT_IMPLEMENTED, "NOT_IMPLEMENTED")
            payload = part.get_payload(decode=True)
            fields[name] = payload.decode() if isinstance(payload, bytes) else ""
    except SqlRefused:
        raise
    except Exception as ex:  # untrusted bytes: the email parser's failures and undecodable fields are the body's
        detail = " ".join(str(ex).split())[:160] or type(ex).__name__
        raise SqlRefused(f"cannot read the multipart/form-data body: {detail}", 36, "BAD_ARGUMENTS") from None
    return fields


def _check_setting(key: str) -> None:
    if key.lower() == "readonly":
        raise read_only("changing readonly")
    if not NAME.match(key):
        raise SqlRefused(f"Unknown setting {key!r}", 115, "UNKNOWN_SETTING")
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
        _check_setting(key)
        chosen[key] = value
    for key, cap in caps.items():
        chosen[key] = chosen.get(key, str(cap)) if _within(chosen.get(key, str(cap)), cap) else str(cap)
    return chosen


def check_statement_settings(statement: Statement, caps: Mapping[str, int]) -> None:
    """A query's own SETTINGS clauses obey what URL settings do; a cap cannot be lifted there either.

    The sessions run with readonly=2 (ClickHouse's "read, and change settings"), so these reach the engine.
    """
    for key, value in statement.settings:  # their names were checked by read_only_statement()
        if key in caps and not _within(value, caps[key]):
            raise SqlRefused(f"Setting {key} should be between 1 and {caps[key]} on stepline's query endpoint, "
                             f"got {value[:40]}", SETTING_CONSTRAINT_VIOLATION, "SETTING_CONSTRAINT_VIOLATION")


# ---- Native format: the framing that client_protocol_version asks for (stepline.clickhouse_http.native) ----


def native_for_revision(data: bytes, revision: int) -> bytes:
    """Re-frame revision-0 Native blocks (what chDB writes) as ClickHouse does for `client_protocol_version`."""
    try:
        return reframe(data, revision)
    except UnsupportedColumn as ex:
        raise SqlRefused(str(ex), NOT_IMPLEMENTED, "NOT_IMPLEMENTED") from None


# ---- errors and content types ---------------------------------------------------------------------------

_HTTP_STATUS = {code: status for status, codes in (
    (400, (6, 27, 36, 53, 62, 117, 321, 456, 457)), (401, (194,)), (403, (192, 193, 497, 516)), (408, (159,)),
    (404, (46, 47, 50, 56, 60, 63, 73, 81, 115)), (413, (229,)), (501, (48,)), (503, (202,)),
) for code in codes}
_CONTENT_TYPES = (
    (("json",), "application/json"), (("tabseparated", "tsv"), "text/tab-separated-values"), (("csv",), "text/csv"),
    (("xml",), "application/xml"), (("pretty", "vertical", "markdown", "values", "prometheus"), "text/plain"),
)


# `Code: N. DB::Exception: <the same exception again>. (NAME)`, as the driver re-wraps an engine error.
_NESTED = re.compile(r"Code: (\d+)\. DB::Exception: (Code: \1\. DB::Exception: .*?)(?: \(version [^()]*\))?\. "
                     r"\([A-Z0-9_]+\)\Z")


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


def content_type(fmt: str) -> str:
    """Content-Type ClickHouse sends for an output format."""
    f = fmt.lower()
    for prefixes, mime in _CONTENT_TYPES:
        if f.startswith(prefixes):
            return f"{mime}; charset=UTF-8"
    return "application/octet-stream"
