"""What every reader of the timeline needs from a store: a query that answers rows."""

from __future__ import annotations

from typing import Any, Protocol


class Reads(Protocol):
    """Anything that answers a query with rows: a clickhouse-connect client or the Store."""

    def query(self, sql: str, parameters: dict[str, Any] | None = None) -> Any: ...
