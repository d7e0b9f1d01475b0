"""The collector: store, writers, sources, self-metrics and the query endpoint, wired and run."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType

from clickhouse_connect.driver.exceptions import ClickHouseError

from stepline.analysis.usage_rollup import UsageRollup
from stepline.app.selfmetrics import SelfMetrics
from stepline.config.settings import Settings
from stepline.core.clock import Clock, SystemClock
from stepline.core.listener import Address
from stepline.core.oneline import one_line
from stepline.core.selfmetrics import MetricsServer
from stepline.endpoints.events import EventsIngest
from stepline.endpoints.query import QueryEndpoint
from stepline.ingest.merge import RecentRequests
from stepline.ingest.runner import Runner, Scheduled
from stepline.ingest.writer import MEMORY_SPOOL_BYTES, Writers
from stepline.model.rows import Event, Request, micros
from stepline.sources import registry as source_registry
from stepline.sources.addresses import EngineAddresses
from stepline.sources.base import EngineModels, Source, SourceContext
from stepline.sources.plugin_receiver import PluginReceiver
from stepline.store import discovery
from stepline.store.errors import StoreUnreachable
from stepline.store.reads import scalar
from stepline.store.store import LazyStore, Store
from stepline.store.url import StoreUrl, parse_store_url
from stepline.watchdog.tap import Watchdog

log = logging.getLogger(__name__)

USAGE_ROLLUP_INTERVAL_S = 60.0  # the rollup's poll: one minute closes a minute


class Collector:
    """Everything the sidecar runs, started and stopped in the right order."""

    def __init__(self, settings: Settings, *, clock: Clock | None = None,
                 extra: Callable[[SourceContext], list[Scheduled]] | None = None,
                 runtime_dir: Path | None = None) -> None:
        """`extra` adds sources the registry does not make (the demo's simulated GPUs); the runtime file, by which
        the CLI finds this collector from any directory, goes into `runtime_dir` (default discovery.runtime_dir())."""
        self.settings = settings
        self._runtime_dir = runtime_dir
        self.runtime_file: Path | None = None
        self.clock = clock or SystemClock()
        self._extra = extra
        self.metrics = SelfMetrics()
        self.store: Store | None = None
        self.writers: Writers | None = None
        self.runner: Runner | None = None
        self.metrics_server: MetricsServer | None = None
        self.query_endpoint: QueryEndpoint | None = None
        self.events_ingest: EventsIngest | None = None
        self.watchdog: Watchdog | None = None
        self.sources: list[Source] = []
        self._plugin_receivers: list[PluginReceiver] = []
        self._engine_models = EngineModels()  # the sources' shared view of which engine serves which model
        self._stopped = threading.Event()

    def start(self) -> None:
        """Open the store and start everything; raises StoreError/SettingsError/OSError with one clear line."""
        s = self.settings
        self.metrics.watchdog.gpu_expected.set(1 if s.expect_gpus else 0)
        ctx = SourceContext(host=s.host_name, clock=self.clock, engine_models=self._engine_models,
                            engine_addresses=EngineAddresses(s.engines, s.backend_map()))
        specs = source_registry.enabled(s)
        scheduled = [Scheduled(src, spec.interval_s(s)) for spec in specs for src in spec.build(s, ctx)]
        if self._extra is not None:
            scheduled += self._extra(ctx)
        self._plugin_receivers = [item.source for item in scheduled if isinstance(item.source, PluginReceiver)]
        url = parse_store_url(s.store)
        sink: Store | LazyStore
        if url.embedded:
            sink = self.store = Store.open(url)
        else:  # a server: if it is down now, collect into the spool until it answers
            sink = LazyStore(url, s.retention_days, self._store_opened)
            try:
                sink.get()
            except StoreUnreachable as exc:
                log.warning("%s: collecting into the spool until it answers", exc)
        if s.usage_rollup:  # it reads what the writers wrote, through a client of its own
            scheduled.append(Scheduled(UsageRollup(s.host_name, self.clock, sink.reader), USAGE_ROLLUP_INTERVAL_S))
        try:
            if isinstance(sink, Store):
                sink.ensure_schema(s.retention_days)
            spool_dir = s.spool_path() if s.spool_max_bytes else None
            self.writers = Writers(sink, self.metrics.ingest, spool_dir=spool_dir,
                                   spool_max_bytes=s.spool_max_bytes or MEMORY_SPOOL_BYTES,
                                   max_rows=s.writer_max_rows, batch_rows=s.writer_batch_rows,
                                   flush_interval_s=s.flush_interval(), lookup=self._look_up_requests)
            if self.store is not None:
                self._remember_written_requests(self.store)
                self._remember_engine_models(self.store)
            self.writers.start()
            self.watchdog = Watchdog(self.metrics.watchdog, self.writers.write, host=s.host_name, clock=self.clock,
                                     reader_factory=sink.reader, lane_budgets=s.lane_budget_map(),
                                     expect_plugin=bool(self._plugin_receivers), slo=s.slo())
            self.watchdog.start()
            self.metrics_server = MetricsServer(self.metrics.registry, s.listen, s.metrics_port)
            self.metrics_server.start()
            metrics_url = self.metrics_server.url
            # The CLI's events (matrix runs) reach the store through here while this process holds it.
            self.events_ingest = EventsIngest(self.writers.write, s.listen, s.events_port, extra_token=s.otlp_token)
            self.events_ingest.start()
            if isinstance(sink, Store):
                self.query_endpoint = QueryEndpoint(sink.reader(), host=s.listen, port=s.query_port,
                                                    password=s.query_password, database=sink.database,
                                                    metrics=self.metrics.queries)
                self.query_endpoint.start()
                discovery.announce_beside_store(url.path, self.query_endpoint.url, metrics_url,
                                                  s.query_password is not None)
        except BaseException:
            self._close()
            raise
        self._count_listeners(scheduled)
        self.sources = [item.source for item in scheduled]
        self.runner = Runner(scheduled, self.writers, self.metrics.ingest, s.host_name, observer=self.watchdog.observe,
                             retention_days=s.retention_days, clock=self.clock)
        self.event("collector_started", "info", f"collecting from {len(scheduled)} source(s) into "
                   f"{url.redacted()}", {"sources": ",".join(x.source.name for x in scheduled),
                                                "retention_days": str(s.retention_days)})
        for lane, tokens in s.lane_bar_map().items():  # for every reader of the store, as the plugin's engine_config
            self.event("lane_bar", "info", f"lane {lane} takes prompts of {tokens:,} tokens or more (declared)",
                       {"lane": lane, "threshold": str(tokens), "threshold_unit": "tokens"})
        self.runner.start()
        self._announce(url, metrics_url)
        log.info("collecting from %d source(s) into %s; self-metrics on %s%s", len(scheduled), url.redacted(),
                 metrics_url, f"; SQL on {self.query_endpoint.url}" if self.query_endpoint else "")

    def _count_listeners(self, scheduled: list[Scheduled]) -> None:
        counts = self.metrics.listeners
        for item in scheduled:
            if isinstance(item.source, Address):
                counts.add(item.source.name, item.source.refused_connections)
        if self.metrics_server is not None:
            counts.add("metrics", self.metrics_server.refused_connections)
        if self.events_ingest is not None:
            counts.add("events", self.events_ingest.refused_connections)
        if self.query_endpoint is not None:
            counts.add("query", self.query_endpoint.refused_connections)

    def _announce(self, url: StoreUrl, metrics_url: str) -> None:
        try:
            ingest = self.events_ingest
            self.runtime_file = discovery.announce(
                discovery.store_without_password(url), self.query_endpoint.url if self.query_endpoint else "",
                metrics_url, self._runtime_dir, events_url=ingest.url if ingest else "",
                events_token=ingest.token if ingest else "")
        except OSError as exc:  # a convenience for the CLI: collecting goes on without it
            log.warning("cannot write the runtime file in %s (`stepline query` and `status` find this collector "
                        "only with --store): %s", self._runtime_dir or discovery.runtime_dir(), exc)

    def _store_opened(self, store: Store) -> None:
        """The store answered (at start, or later for a store that was down): remember what it holds."""
        self.store = store
        if self.writers is not None:
            self._remember_written_requests(store)
        self._remember_engine_models(store)

    def _look_up_requests(self, keys: Sequence[tuple[str, str]]) -> list[Request]:
        if self.store is None:
            raise StoreUnreachable("the store has not answered since this collector started")
        return self.store.requests_of(self.settings.host_name, keys)

    def _remember_written_requests(self, store: Store) -> None:
        # A report whose request was written before a restart joins it (stepline.ingest.merge).
        assert self.writers is not None
        try:
            self.writers.placement.remember(store.recent_requests(self.settings.host_name, RecentRequests.WINDOW_S),
                                           whole_window=True)
        except ClickHouseError as exc:
            log.warning("cannot read the requests written before this start (a restart may write some twice): %s",
                        one_line(exc, 200))

    def _remember_engine_models(self, store: Store) -> None:
        # A running engine announces its model once, at its start: a restarted collector reads it back, for the
        # plugin's rows and for the requests only a span reported.
        try:
            models = store.engine_models(self.settings.host_name)
        except ClickHouseError as exc:
            log.warning("cannot read the engines' model names from the store (steps and requests of engines "
                        "that started before this collector carry none until they restart): %s",
                        one_line(exc, 200))
            return
        self._engine_models.remember(models)

    def event(self, kind: str, severity: str, message: str, attributes: dict[str, str] | None = None) -> None:
        """Put one of the collector's own events on the timeline."""
        if self.writers is not None:
            self.writers.write([Event(micros(self.clock.time()), self.settings.host_name, "", "collector", kind,
                                      severity, message, attributes or {})])

    def stop(self) -> None:
        """Stop polling, drain every queued row into the store, then close."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self.runner is not None:
            self.runner.stop()
        self.event("collector_stopped", "info", "collector stopped cleanly")
        self._close()

    def _close(self) -> None:
        if self.events_ingest is not None:  # it writes through the writers: it stops before them
            self.events_ingest.stop()
        if self.watchdog is not None:  # its events go through the writers: it stops first
            self.watchdog.stop()
        if self.writers is not None:
            self.writers.stop()
        if self.query_endpoint is not None:
            self.query_endpoint.stop()
        if self.metrics_server is not None:
            self.metrics_server.stop()
        if self.runtime_file is not None:
            discovery.withdraw(self.runtime_file)
            self.runtime_file = None
        if self.store is not None:
            if self.store.url.embedded:
                discovery.withdraw_beside_store(self.store.url.path)
            self.store.close()

    def run_until_signalled(self) -> None:
        """Run until SIGTERM or SIGINT, then stop cleanly (nothing accepted is lost)."""
        done = threading.Event()

        def on_signal(signum: int, _frame: FrameType | None) -> None:
            log.info("received %s: draining and stopping", signal.Signals(signum).name)
            done.set()

        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            while not done.wait(1.0):
                pass
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.stop()

    def wait_for_rows(self, table: str, at_least: int, timeout_s: float) -> int:
        """Block until `table` holds at least `at_least` rows (for the demo and tests)."""
        assert self.store is not None
        deadline = time.monotonic() + timeout_s
        count = 0
        while time.monotonic() < deadline:
            count = int(scalar(self.store.query(f"SELECT count() FROM `{table}`")))
            if count >= at_least:
                break
            time.sleep(0.2)
        return count
