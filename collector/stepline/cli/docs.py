"""`stepline docs build [--out docs] [--check]`: regenerate the reference pages under docs/reference/ from the code
(cli.reference), or say which ones drifted from it."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HELP = "generate the reference pages under docs/reference/"
DESCRIPTION = ("`stepline docs build` regenerates docs/reference/ from the code: the command line, the settings, "
               "the schema, the self-metrics, the alerts and the diagnosis findings.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `build` action: where the pages go, or only compare them."""
    sub = parser.add_subparsers(dest="docs_command", required=True, metavar="ACTION")
    b = sub.add_parser("build", help="write the reference pages (docs/reference/*.md)")
    b.add_argument("--out", default="docs", help="the docs folder; pages go under OUT/reference/ (default: docs)")
    b.add_argument("--check", action="store_true",
                   help="write nothing: list the pages that differ from what the code generates, exit 1 if any")


def build(out: Path, parser: argparse.ArgumentParser) -> list[Path]:
    """Write every page under `out` (`parser`: the whole command line); their paths, in order. A page the generator
    no longer makes is left alone."""
    from stepline.cli.reference import pages

    written = []
    for rel, text in pages(parser).items():
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


def drifted(out: Path, parser: argparse.ArgumentParser) -> list[Path]:
    """The pages under `out` that are missing or differ from what the code generates."""
    from stepline.cli.reference import pages

    return [out / rel for rel, text in pages(parser).items()
            if not (out / rel).is_file() or (out / rel).read_text(encoding="utf-8") != text]


def run(args: argparse.Namespace) -> int:
    """Lists the pages written (0), or with --check the pages that drifted (1 if any)."""
    out, parser = Path(args.out), args.whole_parser()
    if args.check:
        stale = drifted(out, parser)
        for path in stale:
            print(f"{path}: differs from the code; run `stepline docs build`", file=sys.stderr)
        return 1 if stale else 0
    for path in build(out, parser):
        print(path)
    return 0
