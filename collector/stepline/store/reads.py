"""What every reader of the timeline needs from a store: a query that answers rows (stepline.queries.query.Reads,
defined beside `Query`, its first consumer, in the layer below the store)."""

from __future__ import annotations

from stepline.queries.query import Reads

__all__ = ["Reads"]
