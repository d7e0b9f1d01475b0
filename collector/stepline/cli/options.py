"""What several commands say the same way: where the store they read is found."""

from __future__ import annotations

from stepline.store.discovery import RUNTIME_DIR_HELP

READ_STORE_HELP = ("store URL: chdb:///path (embedded ClickHouse) or http(s)://user:pass@host:8123/db (default: "
                   "$STEPLINE_STORE, else ./stepline-data when it exists, else the store of the running collector, "
                   f"found in its runtime file in {RUNTIME_DIR_HELP})")
