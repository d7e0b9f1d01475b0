"""`stepline report [--since 30m | --from T --to T] [--engine E] --out FILE`: diagnose a window, write the page."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from stepline.cli.diagnose import add_window_arguments, window_of

if TYPE_CHECKING:
    from stepline.diagnosis.findings import Finding, Window
    from stepline.store.reads import Reads

HELP = "write a self-contained HTML incident report (findings and plots on one time axis)"
DESCRIPTION = ("Diagnose a window and write one HTML file that opens anywhere without a network: the findings, then "
               "step time, ITL, queue, KV, prefix-cache and GPU plots on one time axis with the findings' windows "
               "marked.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The report command's options: the diagnose window, and where to write the page."""
    add_window_arguments(parser)
    parser.add_argument("--out", required=True, metavar="FILE", help="the HTML file to write (self-contained)")
    parser.add_argument("--no-whatif", dest="whatif", action="store_false",
                        help="leave out what each lever would buy (the window replayed under each: seconds more)")


def run(args: argparse.Namespace) -> int:
    """Diagnose the window, write the report, print where it went and how many findings it holds."""
    from stepline.diagnosis.detectors import diagnose
    from stepline.diagnosis.report import write_report
    from stepline.store.reader import open_located

    window = window_of(args)
    reader = open_located(args.store)[0]
    try:
        findings = diagnose(reader.client, window)
        appendix = ""
        if args.whatif:
            findings, appendix = _with_whatif(reader.client, window, findings)
        # The page fits its plots to the data; it says how the window was asked for beside what it shows.
        asked = "" if args.from_ or args.to else f"the last {args.since}"
        path = write_report(reader.client, window, findings, args.out, database=reader.database, asked=asked,
                            appendix=appendix)
    finally:
        reader.close()
    print(f"{path}: {len(findings)} finding(s)")
    return 0


def _with_whatif(reader: Reads, window: Window, findings: list[Finding]) -> tuple[list[Finding], str]:
    """The findings with what their levers would buy, and the whatif section of the page."""
    from stepline.whatif.core import WhatIfError
    from stepline.whatif.offer import annotate, price_window
    from stepline.whatif.render import html_section

    try:
        result = price_window(reader, window)
    except WhatIfError as exc:
        return findings, html_section(None, str(exc))
    return annotate(findings, result), html_section(result)
