"""`stepline schema`: the DDL stepline runs (one node or a cluster), or the column reference as Markdown."""

from __future__ import annotations

import argparse
import sys

from stepline.core.usage import UsageError

HELP = "print the DDL of the timeline"
DESCRIPTION = "Print the CREATE statements stepline runs, for one node or a cluster."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Cluster, database and retention of the DDL; or the column reference instead."""
    parser.add_argument("--cluster", metavar="NAME",
                        help="render ON CLUSTER: ReplicatedMergeTree local tables and Distributed tables over them")
    parser.add_argument("--database", default="stepline", help="database name (default stepline)")
    parser.add_argument("--retention", type=int, default=30, dest="retention_days", metavar="DAYS",
                        help="days of data to keep (default 30)")
    parser.add_argument("--markdown", action="store_true",
                        help="print the column reference (each table's columns, types and comments) as Markdown")
    parser.add_argument("--readme", metavar="PATH",
                        help="rewrite the column reference between the markers in this README")


def run(args: argparse.Namespace) -> int:
    """Print (or write into the README); 0. A README without the markers raises UsageError (exit 2)."""
    from pathlib import Path

    from stepline.model import schema, schemadoc

    if args.readme:
        try:
            changed = schemadoc.update_readme(Path(args.readme))
        except (OSError, ValueError) as exc:
            raise UsageError(f"cannot update {args.readme}: {exc}") from None
        print(f"{args.readme}: column reference {'updated' if changed else 'already current'}")
        return 0
    if args.markdown:
        sys.stdout.write(schemadoc.markdown())
        return 0
    for statement in schema.ddl(args.database, args.retention_days, cluster=args.cluster):
        print(statement + ";\n")
    return 0
