"""`stepline schema`: the DDL stepline runs (one node or a cluster), or the column reference as Markdown."""

from __future__ import annotations

import argparse
import sys

from stepline.core.usageerror import UsageError

HELP = "print the DDL of the timeline, or apply it to a cluster"
DESCRIPTION = ("Print the CREATE statements stepline runs, for one node or a cluster; with --apply, create or migrate "
               "a cluster's schema ON CLUSTER (the one job that changes a cluster's tables: collectors never do).")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Cluster, database and retention of the DDL; or the column reference instead."""
    parser.add_argument("--cluster", metavar="NAME",
                        help="render ON CLUSTER: ReplicatedMergeTree local tables and Distributed tables over them")
    parser.add_argument("--database", default="stepline", help="database name (default stepline)")
    parser.add_argument("--retention", type=int, default=30, dest="retention_days", metavar="DAYS",
                        help="days of data to keep (default 30)")
    parser.add_argument("--apply", metavar="URL",
                        help="run the --cluster DDL ON CLUSTER through this server (a store URL, its password from "
                             "STEPLINE_STORE_PASSWORD(_FILE) as collectors read it), wait for every server, record "
                             "the schema version; exit 0 when done")
    parser.add_argument("--markdown", action="store_true",
                        help="print the column reference (each table's columns, types and comments) as Markdown; "
                             "docs/reference/schema.md holds it, written by `stepline docs build`")


def run(args: argparse.Namespace) -> int:
    """Print the DDL or the column reference, or apply the DDL to a cluster; 0."""
    from stepline.model import schema, schemadoc

    if args.markdown:
        sys.stdout.write(schemadoc.markdown())
        return 0
    if args.apply:
        return _apply(args)
    for statement in schema.ddl(args.database, args.retention_days, cluster=args.cluster):
        print(statement + ";\n")
    return 0


def _apply(args: argparse.Namespace) -> int:
    """Apply the cluster schema through the server at --apply; StoreError (exit 1) with one line when it fails."""
    from stepline.config.settings import store_url_with_password
    from stepline.store.cluster import ClusterSchema
    from stepline.store.store import Store
    from stepline.store.url import StoreUrlError, parse_store_url

    if not args.cluster:
        raise UsageError("--apply needs --cluster NAME: the cluster whose servers get the schema")
    try:
        url = parse_store_url(store_url_with_password(args.apply))
    except StoreUrlError as exc:
        raise UsageError(str(exc)) from None
    if url.cluster and url.cluster != args.cluster:
        raise UsageError(f"--apply names cluster {url.cluster!r} in its URL and --cluster says {args.cluster!r}")
    store = Store.open(url)
    try:
        statements = ClusterSchema(store.client, url.database, args.cluster).apply(args.retention_days,
                                                                                   url.redacted())
    finally:
        store.close()
    print(f"{url.redacted()}: schema version {schema_version()} on cluster {args.cluster} "
          f"({len(statements)} statements, every server)")
    return 0


def schema_version() -> int:
    from stepline.model import schema

    return schema.SCHEMA_VERSION
