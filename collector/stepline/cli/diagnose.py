"""`stepline diagnose`: run the detectors over a window of the timeline and print what they find."""

from __future__ import annotations

import argparse
import sys
import time
from datetime import datetime
from typing import TYPE_CHECKING

from stepline.cli.options import READ_STORE_HELP

if TYPE_CHECKING:
    from stepline.diagnosis.findings import Finding, Window
    from stepline.store.reads import Reads

HELP = "say what is wrong: ranked findings with evidence, SQL and the lever to pull"
DESCRIPTION = ("Run every detector over a window of the timeline: prefill interference, head-of-line blocking, "
               "scheduler vs hardware, prefix-cache collapse, KV pressure, a wedged engine, configuration not in "
               "effect, GPU throttling and XIDs, speculative-decoding shifts. Exit code 1 when a finding is critical.")


def add_window_arguments(parser: argparse.ArgumentParser) -> None:
    """--since / --from / --to / --engine / --store, shared by diagnose, report and whatif."""
    parser.add_argument("--since", default="30m", help="look back this far (90s, 30m, 2h, 1d); default 30m")
    parser.add_argument("--from", dest="from_", metavar="T", help="window start (ISO 8601, epoch, HH:MM[:SS] UTC)")
    parser.add_argument("--to", metavar="T", help="window end (default now)")
    parser.add_argument("--engine", default="", help="only this engine (default: every engine)")
    parser.add_argument("--store", default=None, help=READ_STORE_HELP)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The window, and how to print the findings."""
    add_window_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")
    parser.add_argument("--whatif", action="store_true",
                        help="also replay the window under each lever (`stepline whatif`, seconds more) and say "
                             "in each finding's lever what its best lever would buy")


def window_of(args: argparse.Namespace, now: datetime | None = None) -> Window:
    """The window the arguments of add_window_arguments name; UsageError when they contradict each other."""
    from stepline.analysis.window import window_from

    return window_from(args.since, args.from_, args.to, args.engine, now)


def with_whatif(reader: Reads, window: Window, findings: list[Finding]) -> list[Finding]:
    """`findings` with what their levers would buy; unchanged (and one line on stderr) when the window cannot be
    replayed."""
    from stepline.whatif.core import WhatIfError
    from stepline.whatif.offer import annotate, price_window

    try:
        result = price_window(reader, window)
    except WhatIfError as exc:
        print(f"stepline diagnose: whatif: {exc}", file=sys.stderr)
        return findings
    return annotate(findings, result)


def run(args: argparse.Namespace) -> int:
    """1 when a finding is critical, 0 otherwise; bad arguments raise UsageError (exit 2)."""
    from stepline.diagnosis.detectors import as_json, diagnose, render
    from stepline.store.reader import open_located

    window = window_of(args)
    reader = open_located(args.store)[0]
    started = time.monotonic()
    try:
        findings = diagnose(reader.client, window)
        if args.whatif:
            findings = with_whatif(reader.client, window, findings)
    finally:
        reader.close()
    print(as_json(findings) if args.json else render(findings))
    if not args.json:
        print(f"\n({len(findings)} findings for {window.start:%H:%M:%S}..{window.end:%H:%M:%S} UTC in "
              f"{time.monotonic() - started:.1f}s, via {reader.via})")
    return 1 if any(f.severity == "critical" for f in findings) else 0
