"""`stepline status`: which store, the collector's sources up or down, rows per table and the newest row's age."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from stepline.cli.options import READ_STORE_HELP

if TYPE_CHECKING:
    from stepline.store.discovery import LocatedStore

HELP = "sources up, rows per table, age of the newest row"
DESCRIPTION = "A one-screen health summary of the timeline and its collector."
ERROR_WIDTH = 200  # the reason is the whole point of a DOWN line: it gets a wider cell than query output


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The store to look at."""
    parser.add_argument("--store", help=READ_STORE_HELP)


def run(args: argparse.Namespace) -> int:
    """Print the summary; 0."""
    from stepline.core.texttable import render_table
    from stepline.store.reader import open_located, table_status

    reader, located = open_located(args.store)
    try:
        found = f" (found in {located.runtime_file})" if located.runtime_file else ""
        print(f"timeline: {reader.via}{found}")
        _print_sources(reader.collector.metrics_url if reader.collector else _announced_metrics(located))
        tables = table_status(reader.client)
        print(render_table(("table", "rows", "newest row"),
                           [(t.table, t.rows, age(t.newest_age_s)) for t in tables]))
    finally:
        reader.close()
    return 0


def _announced_metrics(located: LocatedStore) -> str:
    """The /metrics of the running collector that writes the located store (a server store has no file beside it)."""
    from stepline.store.discovery import collector_for, store_without_password
    from stepline.store.url import parse_store_url

    if located.collector is not None:
        return located.collector.metrics_url
    running = collector_for(store_without_password(parse_store_url(located.url)))
    return running.metrics_url if running is not None else ""


def _print_sources(metrics_url: str) -> None:
    from stepline.core.texttable import render_table
    from stepline.store.reader import source_health

    if not metrics_url:
        print("collector: not running")
        return
    try:
        health = source_health(metrics_url)
    except OSError as exc:
        print(f"sources: cannot read {metrics_url}: {exc}")
        return
    rows = [(name, "up" if h.up else "DOWN", h.error) for name, h in sorted(health.items())]
    print(render_table(("source", "state", "last error"), rows, ERROR_WIDTH) if rows else "sources: none configured")


def age(seconds: float | None) -> str:
    """How long ago, in the largest unit it reaches: "42.0s ago", "1.5m ago", "2.0d ago"; "-" for never."""
    if seconds is None:
        return "-"
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= span:
            return f"{seconds / span:.1f}{unit} ago"
    return f"{seconds:.1f}s ago"
