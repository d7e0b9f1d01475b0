"""Every metric the collector exports about itself, composed: each subsystem declares its own beside its code, and
the collector builds them all on one registry, the one its /metrics serves.

    ingest    the runner's sources, the writers and the spool, request placement (`stepline.ingest.metrics`)
    watchdog  each engine, its GPUs, the gateways in front of it, the SLIs (`stepline.watchdog.metrics`)
    queries   the read-only query endpoint (`stepline.endpoints.query.QueryMetrics`)
    listeners every HTTP listener's refused connections, read when scraped (`stepline.core.selfmetrics`)
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from stepline.core.selfmetrics import ListenerCounts
from stepline.endpoints.query import QueryMetrics
from stepline.ingest.metrics import IngestMetrics
from stepline.watchdog.metrics import WatchdogMetrics


class SelfMetrics:
    """The collector's metrics, each subsystem's on one registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.ingest = IngestMetrics(self.registry)
        self.watchdog = WatchdogMetrics(self.registry)
        self.queries = QueryMetrics(self.registry)
        self.listeners = ListenerCounts()
        self.registry.register(self.listeners)

    def label_names(self) -> dict[str, tuple[str, ...]]:
        """Every metric's name (without `_total`) -> its label names."""
        owners = (self.ingest.sources, self.ingest.drops, self.ingest.writer, self.ingest.requests, self.watchdog,
                  self.watchdog.slo, self.queries)
        names = {metric._name: tuple(metric._labelnames) for owner in owners for metric in vars(owner).values()
                 if isinstance(metric, MetricWrapperBase)}
        names[ListenerCounts.NAME] = ListenerCounts.LABELS
        return names
