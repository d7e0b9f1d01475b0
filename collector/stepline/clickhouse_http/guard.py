"""The read-only guard: one statement, read-only, reaching nothing outside the store, split as ClickHouse's lexer
splits it.

Settings are not the guard's: the engine's `stepline_query` profile decides which a query may set, wherever and
however it spells them (`stepline.store.query_profile`). The guard stops what that profile cannot: statements
other than reads, chDB's functions that read files, URLs and the host process (the engine runs those under
readonly=2), INTO OUTFILE, and the system tables that show other clients' SQL.

Public: `read_only_statement` and the `Statement` it returns; `tokens`, the lexer it reads with; `settings_named`,
the names a query's SETTINGS clauses set, read from the text ClickHouse's parser prints back.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterator
from dataclasses import dataclass

from stepline.clickhouse_http.errors import SYNTAX_ERROR, SqlRefused, read_only

_ALLOWED_LEADING = frozenset({"SELECT", "WITH", "SHOW", "DESCRIBE", "DESC", "EXISTS", "EXPLAIN"})
# Statements ClickHouse parses but a read-only user may not run (READONLY); any other first word is a syntax
# error there (SYNTAX_ERROR, HTTP 400), and is answered as one here.
_WRITING_LEADING = frozenset({
    "INSERT", "CREATE", "ALTER", "DROP", "DETACH", "ATTACH", "RENAME", "EXCHANGE", "TRUNCATE", "OPTIMIZE", "SYSTEM",
    "SET", "USE", "KILL", "GRANT", "REVOKE", "CHECK", "DELETE", "UPDATE", "UNDROP", "BACKUP", "RESTORE", "MOVE",
    "WATCH", "BEGIN", "COMMIT", "ROLLBACK", "START", "EXECUTE", "REPLACE", "UPSERT", "COPY",
})
# Functions that reach files, the network or other processes. The sessions run with readonly=2, under which the
# engine runs table functions, and it never refuses the scalar file() nor INTO OUTFILE: the guard stops those.
_DENIED_FUNCTIONS = frozenset({
    "file", "filecluster", "url", "urlcluster", "gcs", "oss", "cosn", "cluster", "clusterallreplicas",
    "redis", "sqlite", "odbc", "jdbc", "input", "mongodb", "dictionary", "catboostevaluate",
    "merge",  # every table whose name matches a pattern, in any database: system's too (below)
})
_DENIED_PREFIXES = (
    "s3", "hdfs", "azureblob", "iceberg", "deltalake", "hudi", "paimon", "remote", "mysql", "postgresql",
    "executable", "ytsaurus", "arrowflight", "kafka", "bigquery",
    # chDB's own: python() and arrowstream() read objects of the process that hosts the engine (the collector),
    # filesystem() lists its files. The sessions run with readonly=2, which lets table functions run: only
    # the guard stands between these and a client.
    "python", "arrowstream", "filesystem", "eval",
)
# Tables that show what other clients run (their SQL, bound values) or the engine's logs: every client of the
# endpoint is the same ClickHouse user, so the engine cannot tell whose rows are whose. Refused as system.NAME in
# any quoting, and by name alone when the request reads from the system database.
_DENIED_TABLES = frozenset({
    "processes", "query_log", "query_thread_log", "query_views_log", "session_log", "text_log",
    "processors_profile_log", "asynchronous_insert_log", "opentelemetry_span_log", "query_metric_log",
})


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
    """One read-only statement: its text without trailing `;` and its FORMAT clause if it has one."""

    sql: str
    format: str | None
    leading: str = "SELECT"  # its first keyword: SELECT, WITH, SHOW, DESCRIBE, DESC, EXISTS or EXPLAIN


def _function_name(tok: Token) -> str | None:
    if tok.kind == "word":
        return tok.text.lower()
    if tok.kind == "ident":
        body = tok.text[1:-1]
        if "\\" in body:  # escapes could spell a denied name; no real query needs them here
            raise read_only("an escaped name")
        return body.replace(tok.text[0] * 2, tok.text[0]).lower()
    return None


def read_only_statement(sql: str, database: str = "") -> Statement:
    """Check that `sql` is one read-only statement and return it; raise SqlRefused otherwise. `database` is the one
    its unqualified table names read from."""
    toks: list[Token] = []
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
        qualified = k >= 2 and toks[k - 1].text == "." and _function_name(toks[k - 2]) == "system"
        if (name := _function_name(tok)) in _DENIED_TABLES and (qualified or database.lower() == "system"):
            raise read_only(f"reading system.{name}")
        if nxt is not None and nxt.text == "(" and name is not None and (
            name in _DENIED_FUNCTIONS or name.startswith(_DENIED_PREFIXES)
        ):
            raise read_only(f"{name}()")
        depth += {"(": 1, ")": -1}.get(tok.text, 0) if tok.kind == "punct" else 0
        if upper == "FORMAT" and depth == 0 and nxt is not None and nxt.kind == "word":
            after = toks[k + 2] if k + 2 < len(toks) else None
            if after is None or (after.kind == "word" and after.text.upper() == "SETTINGS"):
                fmt = nxt.text
    return Statement(sql[: toks[-1].end], fmt, leading)


def settings_named(canonical: str) -> list[tuple[str, str]]:
    """(name, value as written) of every SETTINGS clause of a query, at any depth, from its canonical text (the
    query as ClickHouse's formatQuerySingleLine prints it: `SETTINGS name = value, name = value`). A name set twice
    in one clause is given once, with its last value: the one the engine applies (`SETTINGS x = 0, x = 1` runs as 1)."""
    toks = list(tokens(canonical))
    found: list[tuple[str, str]] = []
    for k, tok in enumerate(toks):
        if tok.kind != "word" or tok.text.upper() != "SETTINGS":
            continue
        clause: dict[str, str] = {}
        while k + 2 < len(toks) and toks[k + 1].kind in ("word", "ident") and toks[k + 2].text == "=":
            name = toks[k + 1].text if toks[k + 1].kind == "word" else toks[k + 1].text[1:-1]
            k, start, depth = k + 3, k + 3, 0  # a value of several tokens (-1, [1, 2]) ends at the next comma
            while k < len(toks) and not (depth == 0 and toks[k].text == ","):
                if toks[k].kind == "punct" and toks[k].text in "([{":
                    depth += 1
                elif toks[k].kind == "punct" and toks[k].text in ")]}":
                    if depth == 0:
                        break
                    depth -= 1
                k += 1
            clause.pop(name, None)
            clause[name] = "".join(t.text for t in toks[start:k])
            if k >= len(toks) or toks[k].text != ",":
                break
        found.extend(clause.items())
    return found
