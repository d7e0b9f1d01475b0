"""What every reader of the timeline needs from a store: a query that answers rows (stepline.queries.query.Reads,
defined beside `Query`, its first consumer, in the layer below the store), and those rows read by name
(stepline.queries.rows: `Row`, `named` and the helpers that read one row or one value)."""

from __future__ import annotations

from stepline.queries.query import Reads
from stepline.queries.rows import Result, Row, first_or_none, named, only, row_type, rows_of, scalar

__all__ = ["Reads", "Result", "Row", "first_or_none", "named", "only", "row_type", "rows_of", "scalar"]
