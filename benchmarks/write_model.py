#!/usr/bin/env python3
"""The fleet write model: the parts and Keeper writes a fleet's collectors make on a 3-shard x 2-replica cluster.

Measured, in this process: one StoreServer (stepline.testing.storeserver, over a temporary chDB directory) and
`--collectors` simulated collectors, each one node of `--engines` engines and GPUs written by one `stepline collect` (as
soak.py runs it), plus `--k8s-nodes` nodes laid out as deploy/kubernetes does (a sidecar per engine, its gpu source
off, and the node role's collector for the GPUs and the host). Each collector is a real `Writers` (one TableWriter per
table, memory spool) over a real `Store` on the server's URL. The rows are built once, shaped as the sources make them
(the real GpuSource, HostSource and /metrics scraper over fakes; steps and requests as the plugin's receiver decodes
them), and a feeder hands each collector its node's rows at the node's rates: the point is the insert cadence, not
the collectors' CPU. Run twice: today's path (flush every 1 s, each INSERT carrying only its deduplication token) and
the new one (REMOTE_FLUSH_S, and remote_insert_settings for a cluster of shards x replicas servers). The server counts,
per table, the INSERTs, their rows and Native bytes and how many sharding keys (host, engine) each held; the first
INSERT of each table also goes into chDB with its settings, to show which the engine takes.

A node's rates (`NodeShape`): steps 45/s and finished requests 3/s per engine (scale_data.py's Shape, "31M steps,
2M requests per node and day"); /metrics every 5 s per engine (settings.scrape_interval_s), 355 rows a scrape (the
scraper over the simulator's vLLM exposition; soak.py measured 568 rows/s for 8 engines: the same 355); NVML every
0.1 s, a row per GPU (settings.gpu_interval_s); psutil every 1 s, a host row and a row per engine process
(settings.host_interval_s; soak.py measured 9.0 rows/s with 8 engines); events: 1 per node a minute (an assumption:
soak.py stored 34 at start-up and none in its 300 s window).

Modelled, for `--nodes` nodes on `--shards` x `--replicas` servers, clients spread evenly over the servers:
- today: each sidecar INSERT into the Distributed table becomes one INSERT per shard its rows reach (sharding key
  cityHash64(host, engine); k keys reach S(1 - (1 - 1/S)^k) shards on average); each is a part on that shard
  (the Distributed table's background sends go one INSERT at a time unless distributed_background_insert_batch).
- new: each server gathers its sidecars' INSERTs of a table into one buffer and flushes it when the busy timeout
  T = 1 s per server (at most 30 s) has passed since the buffer's first INSERT, or at ASYNC_MAX_BYTES (256 MiB), or at
  ASYNC_MAX_QUERIES (10,000) INSERTs
  (https://clickhouse.com/docs/optimize/asynchronous-inserts); each flush goes through the Distributed table as one
  INSERT per shard it reaches (distributed_foreground_insert).
- Keeper: "For each INSERT query, approximately ten entries are added to ZooKeeper through several transactions"
  (https://clickhouse.com/docs/engines/table-engines/mergetree-family/replication); an asynchronous INSERT's part
  also creates one async_blocks node per deduplication token it carries (ClickHouse's
  src/Storages/MergeTree/ReplicatedMergeTreeSink.cpp), counted here as if the sidecars' tokens reached the shards
  through the Distributed table, which ClickHouse does not document (https://github.com/ClickHouse/ClickHouse/issues/
  76405, open). The deduplication window lasts DEDUP_INSERTS blocks (tokens, on the new path) per shard and table.
- Guidance (https://clickhouse.com/docs/optimize/bulk-inserts): batches of at least 1,000 rows, ideally 10,000 to
  100,000, and "keeping the number of insert queries around one insert query per second" per table: here at most
  1 part/s per shard and table, and at least 1,000 rows a part where the shard's row rate allows it (>= 1,000 rows/s).
Prints figures and exits 0; prints TARGET MISSED when, at 1,000 nodes, a table of the new path breaks the guidance.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import platform
import random
import shutil
import tempfile
import threading
import time
from array import array
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from clickhouse_connect.driver.client import Client
from clickhouse_connect.driver.exceptions import DatabaseError
from prometheus_client import CollectorRegistry

from stepline.config.settings import REMOTE_FLUSH_S, Settings
from stepline.core import gctune
from stepline.core.clock import SystemClock
from stepline.core.oneline import one_line
from stepline.ingest.metrics import IngestMetrics
from stepline.ingest.writer import Writers
from stepline.model.rows import Event, GpuSample, HostSample, Request, Row, Step
from stepline.model.schema import DEDUP_INSERTS, DEDUP_SECONDS, TABLES
from stepline.sim.config import EngineConfig
from stepline.sim.metrics import VllmMetrics
from stepline.sources.base import SourceContext
from stepline.sources.gpu.source import GpuSource
from stepline.sources.host import HostSource
from stepline.sources.vllm_metrics import VllmMetricsSource
from stepline.store import batches
from stepline.store.store import Store, remote_insert_settings
from stepline.store.url import StoreUrl
from stepline.testing.fake_nvml import FakeGpuState, FakeNvml
from stepline.testing.fake_psutil import FakePsutil
from stepline.testing.storeserver import StoreServer

GUIDANCE_URL = "https://clickhouse.com/docs/optimize/bulk-inserts"
MAX_PARTS_PER_S = 1.0  # "around one insert query per second", per table: here per shard
MIN_ROWS_PER_PART = 1_000  # "at least 1,000 rows at a time, and ideally between 10,000 to 100,000"
KEEPER_ENTRIES_PER_INSERT = 10  # "approximately ten entries", per inserted block (replication docs)
PARTS_TO_DELAY_INSERT, PARTS_TO_THROW_INSERT = 1_000, 3_000  # per partition, defaults since 23.6 (merge-tree-settings)
FLEET = (8, 64, 1_000, 10_000)
TARGET_NODES = 1_000
LAYOUTS = {"node": "one collector per node", "k8s": "Kubernetes: a sidecar per engine + the node role"}
DATABASE = "fleet"
RUNNING = 64  # requests in a step: 63 decoding (one ITL each) and one first token (TTFT) now and then
HOST_CORES = 224  # a DGX H100's 2 x 56 cores, 2 threads each: the host row's per-core CPU array
TICK_S = 0.05
TIMELINE = frozenset(table.name for table in TABLES)


@dataclass(frozen=True)
class NodeShape:
    """What one node writes (sources in the module's docstring)."""

    engines: int = 8
    steps_per_s: float = 45.0  # per engine
    requests_per_s: float = 3.0  # per engine
    scrape_s: float = field(default_factory=lambda: Settings().scrape_interval_s)
    gpu_interval_s: float = field(default_factory=lambda: Settings().gpu_interval_s)
    host_interval_s: float = field(default_factory=lambda: Settings().host_interval_s)
    events_per_min: float = 1.0  # per node


@dataclass(frozen=True)
class WritePath:
    """How a collector writes: its writers' flush interval and the settings every INSERT carries."""

    name: str
    flush_s: float
    settings: Mapping[str, Any]


def paths(servers: int) -> tuple[WritePath, WritePath]:
    """Today's path (flush 1 s, only the deduplication token) and the new one, for a cluster of `servers`."""
    return WritePath("today", 1.0, {}), WritePath("new", REMOTE_FLUSH_S, remote_insert_settings(servers, cluster=True))


# -- the rows, built once -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pools:
    steps: list[Row]
    requests: list[Row]
    scrape: list[Row]  # one engine's /metrics scrape
    gpu: list[Row]  # one poll of every GPU, GPU i being engine i's
    host: HostSample
    event: Row


def build_pools(shape: NodeShape, seed: int = 7) -> Pools:
    """Rows of each table as the sources make them, for host "" and engine "" (relabelled per collector)."""
    rng = random.Random(seed)
    ctx = SourceContext("", SystemClock())
    now = time.time()
    stamp = round(now * 1e6)
    steps: list[Row] = []
    for i in range(100):
        chunk = rng.random() < 0.1  # a prefill chunk now and then, as scale_data.py's steps
        steps.append(Step(stamp, "", "", 0, EngineConfig().model, i, rng.uniform(10.0, 40.0), int(chunk),
                          8192 if chunk else 0, RUNNING - 1, RUNNING - 1, RUNNING, rng.randint(0, 12), 0,
                          rng.uniform(0.3, 0.95), 8192 if chunk else 0, rng.choice((0, 2048, 4096)) if chunk else 0,
                          0, 0, 0, 0, array("f", [rng.uniform(0.05, 0.8)] if chunk else []),
                          array("f", [rng.uniform(0.008, 0.06) for _ in range(RUNNING - 1)]), False))
    requests: list[Row] = []
    for _ in range(50):
        queue, prefill, decode = rng.uniform(0, 2), rng.uniform(0.05, 1.5), rng.uniform(0.5, 30)
        generated = rng.randint(16, 2048)
        requests.append(Request(stamp, "", "", 0, EngineConfig().model, "", "plugin", "stop",
                                stamp - round((queue + prefill + decode) * 1e6), queue, prefill, decode,
                                prefill + decode, queue + prefill + decode, queue + prefill, decode / generated,
                                rng.randint(200, 12_000), rng.choice((0, 2048, 4096)), generated, 4096, 0))
    scraper, metrics = VllmMetricsSource("http://engine/metrics", ctx, engine=""), VllmMetrics(EngineConfig())
    gpus, psutil = GpuSource(ctx, FakeNvml([FakeGpuState() for _ in range(shape.engines)])), FakePsutil(HOST_CORES)
    hosts = HostSource(ctx, ps=psutil)
    for poll in range(2):  # the second of each: counters have a previous value, as in a running collector
        scrape: list[Row] = []
        scraper.ingest(metrics.render(), now + poll * shape.scrape_s, scrape.extend)
        gpu: list[Row] = []
        gpus.poll(gpu.extend)
        host: list[Row] = []
        hosts.poll(host.extend)
    event = Event(stamp, "", "", "vllm_metrics", "metrics_down", "warning", "engine unreachable at /metrics", {})
    [host_row] = [row for row in host if isinstance(row, HostSample)]
    pools = Pools(steps, requests, scrape, [row for row in gpu if isinstance(row, GpuSample)], host_row, event)
    for name, rows in (("steps", pools.steps), ("requests", pools.requests), ("engine_samples", pools.scrape),
                       ("gpu_samples", pools.gpu), ("host_samples", [pools.host]), ("events", [pools.event])):
        if batches.encode_valid(name, rows)[1] != len(rows):
            raise SystemExit(f"the prebuilt {name} rows do not fit the table")
    return pools


# -- collectors -----------------------------------------------------------------------------------------------------


@dataclass
class Stream:
    """Rows of one table, `burst` at a time every `period_s` (from a random phase), cycling through `rows`."""

    table: str
    rows: list[Row]
    burst: int
    period_s: float
    due: float
    fresh: Callable[[Row], Row] | None = None  # applied to each row as it goes (requests need ids of their own)
    _cycle: Iterator[Row] = field(init=False)

    def __post_init__(self) -> None:
        self._cycle = itertools.cycle(self.rows)

    def take(self, now: float, out: list[Row]) -> int:
        taken = 0
        while self.due <= now:
            rows = list(itertools.islice(self._cycle, self.burst))
            out.extend(rows if self.fresh is None else map(self.fresh, rows))
            taken += self.burst
            self.due += self.period_s
        return taken


@dataclass
class Collector:
    host: str
    layout: str
    streams: list[Stream]
    writers: Writers | None = None
    metrics: IngestMetrics | None = None
    store: Store | None = None
    offered: Counter[str] = field(default_factory=Counter)
    started: bool = False

    def start(self, at: float) -> None:
        """Start the writers (their flush timer runs from now) and feed the streams from `at` on."""
        for stream in self.streams:
            stream.due += at
        if self.writers is not None:
            self.writers.start()
        self.started = True


def _label(rows: Sequence[Row], host: str, engine: str) -> list[Row]:
    return [row._replace(host=host, engine=engine) for row in rows]


def collectors_of_node(layout: str, node: int, pools: Pools, shape: NodeShape, rng: random.Random) -> list[Collector]:
    """One node's collectors: one for everything (layout "node"), or a sidecar per engine and the node role ("k8s");
    their streams due from a random phase after 0 (Collector.start moves them to the collector's start)."""
    host = f"{layout}-{node}"
    engines = [f"{host}:{8000 + e}" for e in range(shape.engines)]
    counter = itertools.count()

    def phase(period: float) -> float:
        return rng.uniform(0.0, period)

    def fresh(row: Row) -> Row:
        assert isinstance(row, Request)
        return row._replace(ts=round(time.time() * 1e6), request_id=f"cmpl-{host}-{next(counter)}")

    def engine_streams(engine: str) -> list[Stream]:
        return [Stream("steps", _label(pools.steps, host, engine), 1, 1 / shape.steps_per_s, phase(0.1)),
                Stream("requests", _label(pools.requests, host, engine), 1, 1 / shape.requests_per_s, phase(1.0),
                       fresh),
                Stream("engine_samples", _label(pools.scrape, host, engine), len(pools.scrape), shape.scrape_s,
                       phase(shape.scrape_s))]

    gpu = [row._replace(host=host, engine=engines[i]) for i, row in enumerate(pools.gpu)]
    host_row = pools.host._replace(host=host)
    processes = [host_row._replace(engine=e, scope="process", pid=1000 + i, cpu_per_core_pct=[])
                 for i, e in enumerate(engines)]
    if layout == "node":
        every = 60.0 / shape.events_per_min
        streams = [s for e in engines for s in engine_streams(e)]
        streams += [Stream("gpu_samples", gpu, len(gpu), shape.gpu_interval_s, phase(shape.gpu_interval_s)),
                    Stream("host_samples", [host_row, *processes], 1 + len(processes), shape.host_interval_s,
                           phase(shape.host_interval_s)),
                    Stream("events", _label([pools.event], host, ""), 1, every, phase(every))]
        return [Collector(host, layout, streams)]
    every = 60.0 / shape.events_per_min * (shape.engines + 1)  # the node's events, shared by its collectors
    sidecars = [Collector(host, layout, [*engine_streams(e),
                                         Stream("host_samples", [host_row, processes[i]], 2, shape.host_interval_s,
                                                phase(shape.host_interval_s)),
                                         Stream("events", _label([pools.event], host, e), 1, every, phase(every))])
                for i, e in enumerate(engines)]
    role = Collector(host, layout, [
        Stream("gpu_samples", gpu, len(gpu), shape.gpu_interval_s, phase(shape.gpu_interval_s)),
        Stream("host_samples", [host_row], 1, shape.host_interval_s, phase(shape.host_interval_s)),
        Stream("events", _label([pools.event], host, ""), 1, every, phase(every))])
    return [*sidecars, role]


def open_store(url: str, settings: Mapping[str, Any]) -> Store:
    """A Store on `url` whose every INSERT carries `settings` (and its deduplication token): the path measured."""

    class PathStore(Store):
        def __init__(self, parsed: StoreUrl, client: Client) -> None:
            super().__init__(parsed, client)
            self._insert_settings = dict(settings)

    return PathStore.open(url)


# -- the server, counting -------------------------------------------------------------------------------------------


@dataclass
class Tally:
    """One table's INSERTs from one layout: rows, Native bytes, distinct sharding keys per INSERT (keys -> INSERTs)."""

    inserts: int = 0
    rows: int = 0
    bytes: int = 0
    keys: Counter[int] = field(default_factory=Counter)


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def varint(self) -> int:
        value = shift = 0
        while True:
            byte = self.data[self.pos]
            self.pos += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                return value

    def string(self) -> bytes:
        size = self.varint()
        self.pos += size
        return self.data[self.pos - size:self.pos]


def sharding_keys(data: bytes) -> set[tuple[bytes, bytes]]:
    """The distinct (host, engine) of one Native block whose first columns are ts, host, engine."""
    reader = _Reader(data)
    _columns, rows = reader.varint(), reader.varint()
    values: dict[bytes, list[bytes]] = {}
    for _ in range(3):
        name, type_ = reader.string(), reader.string()
        if name == b"ts" and b"DateTime64(" in type_:  # requests' is SimpleAggregateFunction(min, DateTime64(...))
            reader.pos += 8 * rows
        elif name in (b"host", b"engine") and type_ == b"String":
            values[name] = [reader.string() for _ in range(rows)]
        else:  # not the layout the writers encode: read it the slow way
            names, decoded = batches.decode(data)
            host, engine = names.index("host"), names.index("engine")
            return {(str(row[host]).encode(), str(row[engine]).encode()) for row in decoded}
    return set(zip(values[b"host"], values[b"engine"], strict=True))


class CountingServer(StoreServer):
    """A StoreServer that counts INSERTs while `tally` is set; the first of each table per run also goes to chDB."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.tally: dict[tuple[str, str], Tally] | None = None
        self.engine_answers: dict[str, float | str] = {}  # table -> seconds chDB took its first INSERT, or its refusal
        self.settings_seen: set[str] = set()
        self._lock = threading.Lock()

    def _insert(self, match: Any, data: bytes, settings: dict[str, Any]) -> tuple[int, bytes, dict[str, str]]:
        table = match.group("table").split(".")[-1].strip("`")
        if table not in TIMELINE:  # the schema's own bookkeeping (schema_version)
            return super()._insert(match, data, settings)
        if table not in self.engine_answers:
            started = time.perf_counter()
            try:
                super()._insert(match, data, settings)
                self.engine_answers[table] = time.perf_counter() - started
            except DatabaseError as exc:
                self.engine_answers[table] = "REFUSED: " + one_line(exc, 160)
        keys = sharding_keys(data)
        layout = next(iter(keys))[0].decode().split("-")[0]
        with self._lock:
            self.settings_seen.update(settings)
            if self.tally is not None:
                tally = self.tally.setdefault((layout, table), Tally())
                tally.inserts += 1
                tally.rows += batches.first_block_rows(data)
                tally.bytes += len(data)
                tally.keys[len(keys)] += 1
        return 200, b"", {}


# -- the measurement ------------------------------------------------------------------------------------------------


@dataclass
class Measured:
    path: WritePath
    seconds: float
    nodes: dict[str, int]
    collectors: Counter[tuple[str, str]]  # (layout, table) -> collectors writing that table
    tallies: dict[tuple[str, str], Tally]
    offered: Counter[tuple[str, str]]
    dropped: float
    cpu_pct: float
    late_s: float  # the feeder's worst lateness: > a tick means the machine did not keep up
    load1: float  # the machine's 1-minute load average at the end
    engine_answers: dict[str, float | str]
    settings_seen: set[str]

    def loads(self, layout: str) -> list[TableLoad]:
        nodes = self.nodes[layout]
        return [TableLoad(table, t.inserts / nodes / self.seconds, t.rows / nodes / self.seconds,
                          t.bytes / t.rows if t.rows else 0.0, dict(t.keys))
                for (lay, table), t in sorted(self.tallies.items()) if lay == layout]


def measure(server: CountingServer, path: WritePath, shape: NodeShape, pools: Pools, *, nodes: int, k8s_nodes: int,
            seconds: float, warmup_s: float = 2.0, seed: int = 1) -> Measured:
    """Collectors of `nodes` + `k8s_nodes` nodes writing through `path`, counted over `seconds`. They start one after
    the other over one flush interval, as a fleet's sidecars flush at phases of their own; counting begins
    `warmup_s` after the last started."""
    rng = random.Random(seed)
    fleet = [c for layout, count in (("node", nodes), ("k8s", k8s_nodes)) for n in range(count)
             for c in collectors_of_node(layout, n, pools, shape, rng)]
    rng.shuffle(fleet)
    server.engine_answers, server.settings_seen = {}, set()
    defaults = Settings()
    tallies: dict[tuple[str, str], Tally] = {}
    late, cpu = 0.0, 0.0
    try:
        for c in fleet:
            c.store = open_store(server.store_url(DATABASE), path.settings)
            c.metrics = IngestMetrics(CollectorRegistry())
            c.writers = Writers(c.store, c.metrics, max_rows=defaults.writer_max_rows,
                                batch_rows=defaults.writer_batch_rows, flush_interval_s=path.flush_s)
            c.writers.placement.remember([], whole_window=True)  # as `stepline collect` does before writing
        began = time.monotonic()
        starts = [began + path.flush_s * i / len(fleet) for i in range(len(fleet))]
        window = (began + path.flush_s + warmup_s, began + path.flush_s + warmup_s + seconds)
        tick, counted, cpu0 = began, False, 0.0
        while (now := time.monotonic()) < window[1]:
            if not counted and now >= window[0]:
                server.tally, cpu0, counted = tallies, time.process_time(), True
            for c, at in zip(fleet, starts, strict=True):
                if not c.started:
                    if at > now:
                        continue
                    c.start(at)
                rows: list[Row] = []
                for stream in c.streams:
                    taken = stream.take(now, rows)
                    if counted and taken:
                        c.offered[stream.table] += taken
                if rows and c.writers is not None:
                    c.writers.write(rows)
            if counted:
                late = max(late, time.monotonic() - tick - TICK_S)
            tick += TICK_S
            time.sleep(max(0.0, tick - time.monotonic()))
        cpu = time.process_time() - cpu0
        server.tally = None
    finally:  # every collector drains at once, as a fleet stopping would
        stopping = [threading.Thread(target=c.writers.stop, args=(5.0,)) for c in fleet if c.writers is not None]
        for thread in stopping:
            thread.start()
        for thread in stopping:
            thread.join()
        for c in fleet:
            if c.store is not None:
                c.store.close()
    dropped = sum(sample.value for c in fleet if c.metrics is not None
                  for metric in c.metrics.drops.counter.collect() for sample in metric.samples
                  if sample.name.endswith("_total"))
    offered: Counter[tuple[str, str]] = Counter()
    for c in fleet:
        for table, count in c.offered.items():
            offered[(c.layout, table)] += count
    writing = Counter((c.layout, table) for c in fleet for table in {stream.table for stream in c.streams})
    return Measured(path, seconds, {"node": nodes, "k8s": k8s_nodes}, writing, tallies, offered, dropped,
                    100 * cpu / seconds, late, os.getloadavg()[0], dict(server.engine_answers),
                    set(server.settings_seen))


# -- the model ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TableLoad:
    """One table's writes from one node: sidecar INSERTs/s, rows/s, Native bytes a row, keys per INSERT -> INSERTs."""

    table: str
    inserts_per_s: float
    rows_per_s: float
    bytes_per_row: float
    keys: Mapping[int, int]


@dataclass(frozen=True)
class Outcome:
    """One table on each shard: new parts/s, rows/s, rows a part, Keeper writes/s, how long the dedup window lasts."""

    parts_per_s: float
    rows_per_s: float
    keeper_writes_per_s: float
    dedup_window_s: float
    bound: str  # what sets the parts' rate

    @property
    def rows_per_part(self) -> float:
        return self.rows_per_s / self.parts_per_s if self.parts_per_s else 0.0

    @property
    def within_guidance(self) -> bool:
        """<= 1 part/s, and >= 1,000 rows a part where the row rate allows (>= 1,000 rows/s at one part a second)."""
        big_enough = self.rows_per_s < MIN_ROWS_PER_PART * MAX_PARTS_PER_S or self.rows_per_part >= MIN_ROWS_PER_PART
        return self.parts_per_s <= MAX_PARTS_PER_S + 1e-9 and big_enough


def shards_reached(keys: float, shards: int) -> float:
    """Expected distinct shards of `keys` sharding keys hashed uniformly over `shards`."""
    return float(shards * (1.0 - (1.0 - 1.0 / shards) ** keys))


def mean_shards_reached(keys: Mapping[int, int], shards: int) -> float:
    """shards_reached averaged over INSERTs holding k keys (keys: k -> INSERTs)."""
    total = sum(keys.values())
    return sum(n * shards_reached(k, shards) for k, n in keys.items()) / total if total else 0.0


def _dedup_window_s(tokens_per_s: float) -> float:
    """How long the replicated deduplication window (DEDUP_INSERTS blocks, DEDUP_SECONDS at most) lasts."""
    return min(float(DEDUP_SECONDS), DEDUP_INSERTS / tokens_per_s) if tokens_per_s else float(DEDUP_SECONDS)


def today(load: TableLoad, nodes: int, shards: int, replicas: int = 2) -> Outcome:
    """Each sidecar INSERT: one part on every shard its rows reach."""
    parts = nodes * load.inserts_per_s * mean_shards_reached(load.keys, shards) / shards
    return Outcome(parts, nodes * load.rows_per_s / shards, KEEPER_ENTRIES_PER_INSERT * parts, _dedup_window_s(parts),
                   "sidecar INSERTs")


def new(load: TableLoad, nodes: int, shards: int, replicas: int = 2) -> Outcome:
    """Each server's buffer of the table flushed at the busy timeout, its size or INSERT limit; a part per shard a
    flush reaches; one async_blocks node in Keeper per sidecar INSERT (its token) a part holds."""
    servers = shards * replicas
    settings = remote_insert_settings(servers, cluster=True)
    busy_s = settings["async_insert_busy_timeout_max_ms"] / 1000
    arrivals = nodes * load.inserts_per_s / servers  # sidecar INSERTs a server takes each second
    rows = nodes * load.rows_per_s / shards
    if not arrivals:
        return Outcome(0.0, rows, 0.0, float(DEDUP_SECONDS), "no rows")
    bounds = {"busy timeout": 1.0 / (busy_s + 1.0 / arrivals),  # the timer starts at a buffer's first INSERT
              f"{settings['async_insert_max_data_size'] >> 20} MiB":
                  nodes * load.rows_per_s / servers * load.bytes_per_row / settings["async_insert_max_data_size"],
              "10,000 INSERTs": arrivals / settings["async_insert_max_query_number"]}
    bound = max(bounds, key=lambda name: bounds[name])
    flushes = bounds[bound]
    keys = sum(k * n for k, n in load.keys.items()) / max(1, sum(load.keys.values()))
    per_flush = shards_reached(max(1.0, arrivals / flushes) * keys, shards)
    parts = servers * flushes * per_flush / shards
    tokens = nodes * load.inserts_per_s * mean_shards_reached(load.keys, shards) / shards
    return Outcome(parts, rows, KEEPER_ENTRIES_PER_INSERT * parts + tokens, _dedup_window_s(tokens), bound)


Path = Callable[[TableLoad, int, int, int], Outcome]


def shards_needed(path: Path, loads: Sequence[TableLoad], nodes: int, replicas: int = 2,
                  limit: int = 1 << 24) -> int | None:
    """The fewest shards that keep every table at <= 1 part/s per shard; None beyond `limit` or when the rate does
    not fall with more shards (the new path's size and INSERT-count bounds: every flush reaches every shard)."""

    def fits(shards: int) -> bool:
        return all(path(load, nodes, shards, replicas).parts_per_s <= MAX_PARTS_PER_S + 1e-9 for load in loads)

    for shards in range(1, 257):
        if fits(shards):
            return shards
    if path is new:  # past 15 shards the busy timeout is at its 30 s cap: more shards only add parts
        return None
    low, high = 256, 512  # today's parts per shard only fall with more shards: double, then bisect
    while not fits(high):
        low, high = high, high * 2
        if high > limit:
            return None
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if fits(middle) else (middle, high)
    return high


def buffer_per_timeout(loads: Sequence[TableLoad], nodes: int, shards: int, replicas: int = 2) -> tuple[float, int]:
    """The most bytes and INSERTs one server's buffer of one table gathers in a busy timeout: the least
    async_insert_max_data_size and async_insert_max_query_number that leave the timer to set every table's pace."""
    servers = shards * replicas
    busy_s = remote_insert_settings(servers, cluster=True)["async_insert_busy_timeout_max_ms"] / 1000
    data = max((nodes * load.rows_per_s * load.bytes_per_row / servers * busy_s for load in loads), default=0.0)
    queries = max((nodes * load.inserts_per_s / servers * busy_s for load in loads), default=0.0)
    return data, math.ceil(queries)


# -- printing -------------------------------------------------------------------------------------------------------


def num(x: float) -> str:
    if x == 0:
        return "0"
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def duration(seconds: float) -> str:
    for unit, size in (("d", 86_400), ("h", 3_600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.1f} s"


def print_measured(runs: Sequence[Measured], shards: int) -> None:
    first = runs[0]
    print(f"measured: {first.nodes['node']} node collectors and {first.nodes['k8s']} Kubernetes nodes "
          f"({first.collectors[('k8s', 'host_samples')]} collectors), started over one flush interval, counted over "
          f"{first.seconds:.0f} s per path from 2 s after the last started")
    print(f"{'':<29} {'INSERTs/s, per':^18}")
    print(f"{'path':<6} {'layout':<6} {'table':<15} {'collector':>9} {'node':>8} {'rows/INSERT':>11} "
          f"{'bytes/row':>9} {'keys/INSERT':>11} {f'shards/INSERT ({shards})':>19} {'rows in/offered':>17}")
    for run in runs:
        for layout in ("node", "k8s"):
            if not run.nodes[layout]:
                continue
            for load in run.loads(layout):
                tally = run.tallies[(layout, load.table)]
                keys = sum(k * n for k, n in load.keys.items()) / tally.inserts
                per_collector = tally.inserts / run.collectors[(layout, load.table)] / run.seconds
                offered = run.offered[(layout, load.table)]
                print(f"{run.path.name:<6} {layout:<6} {load.table:<15} {per_collector:>9.2f} "
                      f"{load.inserts_per_s:>8.2f} {tally.rows / tally.inserts:>11,.0f} {load.bytes_per_row:>9.0f} "
                      f"{keys:>11.2f} {mean_shards_reached(load.keys, shards):>19.2f} "
                      f"{tally.rows / offered if offered else 0:>16.2f}x")
    for run in runs:
        print(f"{run.path.name}: flush every {run.path.flush_s:g} s; settings the server received: "
              f"{', '.join(sorted(run.settings_seen)) or '-'}")
        answers = sorted(run.engine_answers.items())
        print("  chDB, the first INSERT of each table with them: " + "; ".join(
            f"{table} {f'ok in {answer * 1e3:.0f} ms' if isinstance(answer, float) else answer}"
            for table, answer in answers))
        busy_ms = run.path.settings.get("async_insert_busy_timeout_max_ms")
        if busy_ms and all(isinstance(a, float) and a * 1e3 < busy_ms for _, a in answers):
            print(f"  (each answered within the {busy_ms / 1e3:g} s busy timeout that wait_for_async_insert waits for: "
                  "chDB inserted at once, so the server's batching is modelled, not measured)")
        print(f"  this process: {run.cpu_pct:.0f}% of a core over the window (load average {run.load1:.2f} at its "
              f"end); the feeder's worst lateness {run.late_s * 1e3:.0f} ms (tick {TICK_S * 1e3:.0f} ms); rows dropped "
              f"by the writers {run.dropped:.0f}")


def print_fleet(runs: Mapping[str, Measured], layout: str, nodes: int, shards: int, replicas: int) -> list[str]:
    """One fleet size's table, today's path beside the new one; returns the tables outside the guidance (new)."""
    loads = {name: {load.table: load for load in run.loads(layout)} for name, run in runs.items()}
    busy = remote_insert_settings(shards * replicas, cluster=True)["async_insert_busy_timeout_max_ms"] / 1000
    print(f"\n{nodes:,} nodes, {LAYOUTS[layout]}: {shards} shards x {replicas} replicas, busy timeout {busy:g} s")
    print(f"{'':<15} {'':>9} | {'today':^44} | {'new':^60}")
    print(f"{'table':<15} {'rows/s':>9} | {'parts/s':>8} {'rows/part':>9} {'Keeper/s':>8} {'dedup':>8} {'ok':>4} | "
          f"{'parts/s':>8} {'rows/part':>9} {'set by':>14} {'Keeper/s':>8} {'dedup':>8} {'ok':>4}")
    missed: list[str] = []
    totals = {"today": [0.0, 0.0, 0.0], "new": [0.0, 0.0, 0.0]}
    for table in loads["today"]:
        old, fresh = today(loads["today"][table], nodes, shards, replicas), new(loads["new"][table], nodes, shards,
                                                                                 replicas)
        for name, outcome in (("today", old), ("new", fresh)):
            totals[name][0] += outcome.parts_per_s
            totals[name][1] += outcome.keeper_writes_per_s
            totals[name][2] = max(totals[name][2], outcome.parts_per_s)
        if not fresh.within_guidance:
            missed.append(table)
        print(f"{table:<15} {num(old.rows_per_s):>9} | {num(old.parts_per_s):>8} {num(old.rows_per_part):>9} "
              f"{num(old.keeper_writes_per_s):>8} {duration(old.dedup_window_s):>8} "
              f"{'yes' if old.within_guidance else 'NO':>4} | {num(fresh.parts_per_s):>8} "
              f"{num(fresh.rows_per_part):>9} {fresh.bound:>14} {num(fresh.keeper_writes_per_s):>8} "
              f"{duration(fresh.dedup_window_s):>8} {'yes' if fresh.within_guidance else 'NO':>4}")
    for name, path in (("today", today), ("new", new)):
        parts, keeper, busiest = totals[name]
        needed = shards_needed(path, list(loads[name].values()), nodes, replicas)
        print(f"  {name + ':':<6} per shard {num(parts)} parts/s and {num(keeper)} Keeper writes/s, all tables; "
              f"cluster {num(parts * shards)} INSERTs/s into Replicated tables, {num(keeper * shards)} Keeper writes/s")
        fits = (f"with {needed:,} shard{'s' if needed > 1 else ''}" if needed else
                "with no shard count (each server's flush reaches every shard)")
        stall = (f"{duration(PARTS_TO_DELAY_INSERT / busiest)} to parts_to_delay_insert ({PARTS_TO_DELAY_INSERT:,}), "
                 f"{duration(PARTS_TO_THROW_INSERT / busiest)} to parts_to_throw_insert ({PARTS_TO_THROW_INSERT:,})"
                 if busiest else "-")
        print(f"  {'':<6} merges stalled, the busiest table's partition takes {stall}; every table <= "
              f"{MAX_PARTS_PER_S:g} part/s per shard {fits}")
    data, queries = buffer_per_timeout(list(loads["new"].values()), nodes, shards, replicas)
    settings = remote_insert_settings(shards * replicas, cluster=True)
    print(f"  {'':<6} a server's fullest buffer gathers {data / 2**20:,.0f} MiB and {queries:,.0f} INSERTs in a busy "
          f"timeout (limits {settings['async_insert_max_data_size'] / 2**20:g} MiB, "
          f"{settings['async_insert_max_query_number']:,})")
    return missed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--collectors", type=int, default=64, help="nodes of one collector each (default 64)")
    parser.add_argument("--k8s-nodes", type=int, default=2, help="nodes laid out as deploy/kubernetes (default 2)")
    parser.add_argument("--seconds", type=float, default=30.0, help="measured window per path (default 30)")
    parser.add_argument("--engines", type=int, default=8, help="engines (and GPUs) a node (default 8)")
    parser.add_argument("--shards", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--nodes", default=",".join(map(str, FLEET)), help="fleet sizes to model")
    args = parser.parse_args(argv)
    shape = NodeShape(engines=args.engines)
    fleet = [int(n) for n in args.nodes.split(",")]
    print(f"machine: {platform.platform()}; python {platform.python_version()}; cpu_count={os.cpu_count()}; "
          f"load average before {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"node: {shape}; guidance: {GUIDANCE_URL} (<= {MAX_PARTS_PER_S:g} part/s per shard and table, >= "
          f"{MIN_ROWS_PER_PART:,} rows a part where the shard gets >= {MIN_ROWS_PER_PART:,} rows/s); Keeper: "
          f"{KEEPER_ENTRIES_PER_INSERT} writes a part (+1 a deduplication token on the new path)")
    tmp = tempfile.mkdtemp(prefix="stepline-write-model-")
    server = CountingServer(tmp)
    server.start()
    try:
        setup = Store.open(server.store_url(DATABASE))
        setup.ensure_schema(30)
        setup.close()
        pools = build_pools(shape)
        gctune.tune()  # as `stepline collect` does once started: 80 collectors' rows in one process
        runs = [measure(server, path, shape, pools, nodes=args.collectors, k8s_nodes=args.k8s_nodes,
                        seconds=args.seconds) for path in paths(args.shards * args.replicas)]
    finally:
        server.close()
        shutil.rmtree(tmp, ignore_errors=True)
    print_measured(runs, args.shards)
    by_name = {run.path.name: run for run in runs}
    print(f"\nper shard and table: rows/s; parts/s, new parts; rows/part; Keeper/s, Keeper writes; dedup, how long the "
          f"deduplication window ({DEDUP_INSERTS:,} blocks, {duration(DEDUP_SECONDS)} at most) lasts; ok, within the "
          f"guidance; set by, what sets the new path's flushes")
    verdicts: list[str] = []
    for layout in ("node", "k8s"):
        if not runs[0].nodes[layout]:
            continue
        for nodes in fleet:
            missed = print_fleet(by_name, layout, nodes, args.shards, args.replicas)
            if nodes == TARGET_NODES:
                what = f"{nodes:,} nodes, new path, {LAYOUTS[layout]}: every table within the guidance on each shard"
                verdicts.append(f"{'TARGET MISSED' if missed else 'ok':<14} {what}"
                                + (f" (outside: {', '.join(missed)})" if missed else ""))
    print()
    for line in verdicts:
        print(line)
    if not math.isclose(runs[0].dropped + runs[-1].dropped, 0.0):
        print("note: the writers dropped rows; the cadence measured is not the collectors' own")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
