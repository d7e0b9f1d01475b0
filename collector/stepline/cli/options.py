"""What several commands say the same way: where the store they read is found, and the objectives they read."""

from __future__ import annotations

import argparse
import os

from stepline.config.slo import Slo, load_slo
from stepline.core.usageerror import UsageError
from stepline.store.discovery import RUNTIME_DIR_HELP

READ_STORE_HELP = ("store URL: chdb:///path (embedded ClickHouse) or http(s)://user:pass@host:8123/db (default: "
                   "$STEPLINE_STORE, else ./stepline-data when it exists, else the store of the running collector, "
                   f"found in its runtime file in {RUNTIME_DIR_HELP})")

OBJECTIVES_HELP = ("a TOML file of the service-level objectives, one [[objective]] table each (name, sli, target, "
                   "scope, threshold_seconds, window_days); give the collector, `alerts build`, `dashboards build` "
                   "and `slo` the same one (default: $STEPLINE_OBJECTIVES_FILE, else the built-in objectives)")


def add_objectives(parser: argparse.ArgumentParser) -> None:
    """`--objectives FILE`."""
    parser.add_argument("--objectives", default=None, metavar="FILE", help=OBJECTIVES_HELP)


def chosen_slo(path: str | None) -> Slo:
    """The objectives of `path`, else of $STEPLINE_OBJECTIVES_FILE, else the built-in ones; UsageError naming the
    file and what is wrong."""
    try:
        return load_slo(path or os.environ.get("STEPLINE_OBJECTIVES_FILE"))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
