"""The `stepline` command line: `main`, and the table of commands, each a module of this package."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from typing import Protocol, cast

from stepline.core.usageerror import UsageError
from stepline.store.errors import StoreError
from stepline.store.url import StoreUrlError

# Each command's module, imported by name for its help line. A module's top imports only what is cheap; what its
# options need loads in add_arguments and the rest in run, so the simulator, the collector, OpenTelemetry and the
# dashboards (about a second on two busy cores) load only for the command that needs them.
COMMANDS = {
    "collect": "stepline.cli.collect",
    "query": "stepline.cli.query",
    "requests": "stepline.cli.requests",
    "usage": "stepline.cli.usage",
    "slo": "stepline.cli.slo",
    "timeline": "stepline.cli.timeline",
    "status": "stepline.cli.status",
    "doctor": "stepline.cli.doctor",
    "schema": "stepline.cli.schema",
    "diagnose": "stepline.cli.diagnose",
    "report": "stepline.cli.report",
    "whatif": "stepline.cli.whatif",
    "matrix": "stepline.cli.matrix",
    "replay": "stepline.cli.replay",
    "alerts": "stepline.cli.alerts",
    "prometheus-config": "stepline.cli.prometheus_config",
    "dashboards": "stepline.cli.dashboards",
    "docs": "stepline.cli.docs",
    "grafana-provisioning": "stepline.cli.grafana_provisioning",
    "sim": "stepline.cli.sim",
    "demo": "stepline.cli.demo",
}
# chDB's client logs every engine-level query at INFO, urllib3 narrates its retries (the store error that follows
# says what matters, in one line): neither is the operator's business.
QUIETED = ("clickhouse_connect", "urllib3")


class Command(Protocol):
    """What a command's module holds."""

    HELP: str  # its line in `stepline --help`
    DESCRIPTION: str  # the paragraph atop `stepline COMMAND --help`

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `stepline` console script."""
    args = build_parser(_command_named(sys.argv[1:] if argv is None else argv)).parse_args(argv)
    handler = logging.StreamHandler()
    handler.addFilter(_not_quieted)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", handlers=[handler])
    try:
        return int(args.func(args))
    except (UsageError, StoreError, StoreUrlError) as exc:
        print(f"stepline: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _not_quieted(record: logging.LogRecord) -> bool:
    """Whether a log record reaches the operator: below ERROR, none from QUIETED. A filter rather than the loggers'
    levels: clickhouse-connect sets urllib3's to WARNING when a command first imports it (1.12,
    clickhouse_connect/driver/httputil.py)."""
    return record.levelno >= logging.ERROR or record.name.partition(".")[0] not in QUIETED


def _command_named(argv: Sequence[str]) -> str | None:
    """The subcommand of a command line (its first word not an option), or None (`stepline --help`)."""
    return next((word for word in argv if not word.startswith("-")), None)


def version() -> str:
    """"stepline 0.1.0 (timeline schema 7)": the installed package's version (importlib.metadata, from pyproject.toml)
    and the schema version its collector writes and its readers expect."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    from stepline.model.schema import SCHEMA_VERSION

    try:
        number = installed("stepline")
    except PackageNotFoundError:
        number = "(not installed: pip install -e .)"
    return f"stepline {number} (timeline schema {SCHEMA_VERSION})"


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; with `command`, only that command's options (the other commands keep their help line)."""
    parser = argparse.ArgumentParser(
        prog="stepline",
        description="One ClickHouse timeline for vLLM engines: every step, every request, every GPU counter.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    parser.add_argument("--version", action="version", version=version(),
                        help="print stepline's version and the timeline schema it writes, and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
        handler = cast(Command, importlib.import_module(module))
        command_parser = sub.add_parser(name, help=handler.HELP, description=handler.DESCRIPTION)
        if command is None or command == name:
            handler.add_arguments(command_parser)
            # `whole_parser`: every command's options, for the command that documents them (`stepline docs`).
            command_parser.set_defaults(func=handler.run, whole_parser=build_parser)
    return parser
