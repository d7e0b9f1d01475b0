"""`stepline docs build [--out docs] [--check]`: regenerate the reference pages under docs/reference/ from the code
(cli.reference) and the headline figures of docs/development.md from benchmarks/RESULTS.md (cli.headline), or say
which ones drifted."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from stepline.cli import headline
from stepline.core.usageerror import UsageError

HELP = "generate the reference pages under docs/reference/"
DESCRIPTION = ("`stepline docs build` regenerates docs/reference/ from the code: the command line, the settings, "
               "the schema, the self-metrics, the alerts and the diagnosis findings; and copies the headline "
               "figures of benchmarks/RESULTS.md into docs/development.md.")


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
    written = []
    for path, text in _generated(out, parser).items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


def drifted(out: Path, parser: argparse.ArgumentParser) -> list[Path]:
    """The pages under `out` that are missing or differ from what the code generates."""
    return [path for path, text in _generated(out, parser).items()
            if not path.is_file() or path.read_text(encoding="utf-8") != text]


def _generated(out: Path, parser: argparse.ArgumentParser) -> dict[Path, str]:
    """Each page's path under `out` and what it should hold: the reference pages, and docs/development.md where `out`
    is a checkout's docs folder (benchmarks/RESULTS.md beside it)."""
    from stepline.cli.reference import pages

    generated = {out / rel: text for rel, text in pages(parser).items()}
    development = headline.page_text(out)
    if development is not None:
        generated[out / headline.PAGE] = development
    return generated


def run(args: argparse.Namespace) -> int:
    """Lists the pages written (0), or with --check the pages that drifted (1 if any)."""
    out, parser = Path(args.out), args.whole_parser()
    try:
        stale = drifted(out, parser) if args.check else []
        written = [] if args.check else build(out, parser)
    except headline.HeadlineError as exc:
        raise UsageError(str(exc)) from None
    if args.check:
        for path in stale:
            print(f"{path}: differs from the code; run `stepline docs build`", file=sys.stderr)
        return 1 if stale else 0
    for path in written:
        print(path)
    return 0
