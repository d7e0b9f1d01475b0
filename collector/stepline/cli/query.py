"""`stepline query`: read-only SQL against the timeline, printed as a table or in a ClickHouse format."""

from __future__ import annotations

import argparse
import sys

from stepline.cli.options import READ_STORE_HELP

HELP = "run read-only SQL against the timeline"
DESCRIPTION = ("Through the running collector's endpoint when one holds the embedded store, else straight from the "
               "store.")
TABLE_WIDTH = 60  # characters of one value in the table
FORMATS = {"csv": "CSVWithNames", "tsv": "TabSeparatedWithNames", "json": "JSONEachRow"}  # short names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The query, the store and the output format."""
    parser.add_argument("sql", help="the query, e.g. \"SELECT kind, count() FROM events GROUP BY kind\"")
    parser.add_argument("--store", help=READ_STORE_HELP)
    parser.add_argument("--format", default="table",
                        help="table (default), csv, tsv, json (one object per line), or any ClickHouse format name")


def run(args: argparse.Namespace) -> int:
    """0 with the result printed; 1 when the query is refused (not read-only) or fails."""
    from clickhouse_connect.driver.exceptions import ClickHouseError

    from stepline.clickhouse_http.errors import SqlRefused
    from stepline.clickhouse_http.guard import read_only_statement
    from stepline.core.texttable import render_table
    from stepline.store.chdb import SafeChdbClient
    from stepline.store.query_profile import PROFILE
    from stepline.store.reader import open_located

    try:  # read-only whichever way the store is reached (an embedded store opened directly is writable)
        read_only_statement(args.sql)
    except SqlRefused as exc:
        print(f"stepline: query refused: {exc}", file=sys.stderr)
        return 1
    reader = open_located(args.store)[0]
    try:
        if isinstance(reader.client, SafeChdbClient):  # the store itself, opened here: the endpoint's profile too
            for statement in ("SET readonly = 2", f"SET profile = '{PROFILE}'"):
                reader.client.command(statement)
        fmt = args.format.lower()
        if fmt == "table":
            result = reader.client.query(args.sql)
            print(render_table(result.column_names, result.result_rows, TABLE_WIDTH,
                               f"(some values cut at {TABLE_WIDTH} characters; --format tsv or json shows them whole)"))
            print(f"({len(result.result_rows)} rows, via {reader.via})", file=sys.stderr)
            return 0
        sys.stdout.write(reader.client.raw_query(args.sql, fmt=FORMATS.get(fmt, args.format)).decode("utf-8"))
        return 0
    except ClickHouseError as exc:
        print(f"stepline: query failed: {' '.join(str(exc).split())[:500]}", file=sys.stderr)
        return 1
    finally:
        reader.close()
