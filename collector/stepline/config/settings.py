"""Collector settings: one dataclass, environment-variable defaults, validated at start-up."""

from __future__ import annotations

import ipaddress
import math
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

from stepline.config.slo import Slo, load_slo
from stepline.core.usageerror import UsageError
from stepline.store import url as url_module
from stepline.store.url import StoreUrlError, default_store_url, parse_store_url

ROLES = ("sidecar", "node")


# A sidecar's batches to a ClickHouse server: five seconds of rows per table and insert (the server batches further,
# stepline.store.store.remote_insert_settings).
REMOTE_FLUSH_S = 5.0


class SettingsError(UsageError):
    """A setting has a value stepline cannot run with; the message names it."""


@dataclass(frozen=True)
class Settings:
    """Everything the collector is configured with."""

    store: str = field(default_factory=default_store_url, repr=False)  # a server URL may carry a password
    retention_days: int = 30
    role: str = "sidecar"
    """sidecar: beside one engine (every source); node: one per node, GPUs and host only."""
    pod_resources_socket: str = "/var/lib/kubelet/pod-resources/kubelet.sock"
    """The kubelet's pod-resources socket: the node role's GPU -> pod map."""
    engines: tuple[str, ...] = ()
    gateways: tuple[str, ...] = ()
    """[NAME=]URL of each gateway (LiteLLM proxy, vllm-router) whose /metrics to scrape."""
    host_name: str = field(default_factory=socket.gethostname)
    listen: str = "127.0.0.1"
    metrics_port: int = 9465
    query_port: int = 8124
    query_password: str | None = field(default=None, repr=False)
    """The password the read-only query endpoint asks for; None: it asks for none."""
    query_open: bool = False
    """Serve the query endpoint with no password on a non-loopback address (refused unless set)."""
    scrape_interval_s: float = 5.0
    scrape_timeout_s: float | None = None
    """Seconds one scrape may take; None: 3 s, or the interval when shorter."""
    disabled_sources: frozenset[str] = frozenset()
    engine_processes: tuple[str, ...] = ()
    """NAME=PID or NAME=cmdline:TEXT: engine processes to sample, beside what --engine ports find."""
    engine_gpus: tuple[str, ...] = ()
    """NAME=GPU-uuid,GPU-uuid: GPUs no PID or engine environment ties to an engine."""
    expect_gpus: bool = False
    """GPUs are expected here: a gpu source that never reaches NVML alerts."""
    host_interval_s: float = 1.0
    """Seconds between samples of the host and of the engines' processes."""
    gpu_interval_s: float = 0.1
    """Seconds between NVML samples of every GPU."""
    plugin_socket: str = "/tmp/stepline-plugin.sock"
    otlp_port: int = 4318
    events_port: int = 0
    """The CLI's write path (matrix runs); 0: a free port, announced in the runtime file."""
    otlp_token: str | None = field(default=None, repr=False)
    """The Bearer token the OTLP receiver requires (the events endpoint takes it too); None: none."""
    plugin_token: str | None = field(default=None, repr=False)
    """The credential the plugin's datagrams must carry (its STEPLINE_PLUGIN_TOKEN); None: every datagram is read."""
    gateway_token: str | None = field(default=None, repr=False)
    """Sent as a Bearer token to each gateway's /metrics."""
    lane_budgets: tuple[str, ...] = ()
    """LANE=SECONDS: the least stall budget of the engines a gateway sends that lane to (a lane slow by design)."""
    lane_bars: tuple[str, ...] = ()
    """LANE=TOKENS: what a router that cannot say its bar routes by, declared once by its operator (lane_bar_map)."""
    backends: tuple[str, ...] = ()
    """ADDRESS=ENGINE: an engine that stands behind a gateway's backend address the collector does not reach it at
    (a Kubernetes service in front of replicas, a pod's address), one entry per engine (backend_map)."""
    writer_max_rows: int = 200_000
    """Rows each table's writer holds in memory; beyond them rows are dropped, counted (queue_full)."""
    writer_batch_rows: int = 20_000
    """Rows of one insert at most; a queue this long is written without waiting for the flush interval."""
    flush_interval_s: float | None = None
    """Seconds between batches cut, spooled and inserted; also the spool's sync interval: what a kill -9 can lose.
    None: 1 s on the embedded store, REMOTE_FLUSH_S on a server (see flush_interval)."""
    spool_dir: str | None = None
    """Where rows wait on disk until the store takes them; None: beside the store (see spool_path)."""
    spool_max_bytes: int = 1 << 30
    """The spool's bound, past which the oldest batches go, counted; 0: no spool (rows wait in memory only)."""
    objectives_file: str | None = None
    """A TOML file of the service-level objectives whose SLIs the collector counts (`config.objectives`); None: the
    built-in ones. `stepline alerts build` and `dashboards build` must be given the same file."""
    usage_rollup: bool = True
    """Roll each closed minute's usage of this host's engines into usage_minutes (the Usage dashboard reads it)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Defaults from STEPLINE_* variables, then explicit overrides (from the command line)."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name, var, convert in _ENV:
            raw = env.get(var)
            if raw is None or raw == "":
                continue
            try:
                values[name] = convert(raw)
            except ValueError:
                raise SettingsError(f"{var}={raw!r} is not a valid {convert.__name__}") from None
        for name, var in _SECRETS:
            secret_file = env.get(f"{var}_FILE")
            if secret_file and name not in values:
                values[name] = _read_secret(f"{var}_FILE", secret_file)
        values.update({k: v for k, v in overrides.items() if v is not None})
        values["store"] = store_url_with_password(values.get("store") or default_store_url(), env)
        return cls(**values).validated()

    def validated(self) -> Settings:
        """Return self, or raise SettingsError naming the first bad value."""
        try:
            embedded = parse_store_url(self.store).embedded
        except StoreUrlError as exc:
            raise SettingsError(str(exc)) from None
        if self.retention_days < 1:
            raise SettingsError(f"retention must be at least 1 day, got {self.retention_days}")
        for name in ("metrics_port", "query_port", "otlp_port", "events_port"):
            port = getattr(self, name)
            if not 0 <= port <= 65535:
                raise SettingsError(f"{name.replace('_', '-')} {port} is not a TCP port (0-65535)")
        try:
            loopback = ipaddress.ip_address(self.listen).is_loopback
        except ValueError:
            if self.listen != "localhost":
                raise SettingsError(f"listen address {self.listen!r} is not an IP address") from None
            loopback = True
        if not loopback and self.query_password is None and not self.query_open and embedded:
            # As ClickHouse's own images keep the password-less default user to localhost.
            raise SettingsError(f"--listen {self.listen} would serve the store's SQL with no password: set "
                                "STEPLINE_QUERY_PASSWORD (or _FILE), or STEPLINE_QUERY_OPEN=1 to serve it open")
        for name in ("scrape_interval_s", "scrape_timeout_s", "flush_interval_s", "host_interval_s", "gpu_interval_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise SettingsError(f"{name} must be positive, got {value}")
        if self.scrape_timeout > self.scrape_interval_s:
            raise SettingsError(
                f"scrape timeout {self.scrape_timeout} s exceeds the scrape interval {self.scrape_interval_s} s"
            )
        if self.spool_max_bytes < 0:
            raise SettingsError(f"spool size must be 0 (no spool) or more bytes, got {self.spool_max_bytes}")
        for name, _ in _SECRETS:
            if getattr(self, name) == "":
                raise SettingsError(f"{name.replace('_', '-')} is empty: leave it unset, or give a value")
        if not 1 <= self.writer_batch_rows <= self.writer_max_rows:
            raise SettingsError(
                f"writer batch ({self.writer_batch_rows} rows) must be between 1 and the queue size "
                f"({self.writer_max_rows} rows)"
            )
        for what, specs in (("engine", self.engines), ("gateway", self.gateways)):
            for spec in specs:
                if not split_named_url(spec)[1].startswith(("http://", "https://")):
                    raise SettingsError(f"{what} {spec!r} must be http(s)://host:port or NAME=http(s)://host:port")
        for spec in self.engine_processes:
            name, sep, how = spec.partition("=")
            if not (name and sep and (how.isdigit() or (how.startswith("cmdline:") and len(how) > 8))):
                raise SettingsError(f"engine process {spec!r} must be NAME=PID or NAME=cmdline:TEXT")
        self.engine_gpu_map()
        self.lane_budget_map()
        self.lane_bar_map()
        self.backend_map()
        if self.role not in ROLES:
            raise SettingsError(f"role {self.role!r} must be one of {', '.join(ROLES)}")
        if self.role == "node" and self.engines:
            raise SettingsError(f"role node scrapes no engine: engine {self.engines[0]!r} belongs to the sidecar "
                                f"role beside it")
        if self.role == "node" and not self.pod_resources_socket:
            raise SettingsError("role node needs a pod-resources socket (STEPLINE_POD_RESOURCES_SOCKET)")
        self.slo()  # a bad objectives file stops the collector before it starts anything
        return self

    def slo(self) -> Slo:
        """The objectives of objectives_file, else the built-in ones; raises SettingsError naming what is wrong."""
        try:
            return load_slo(self.objectives_file)
        except ValueError as exc:
            raise SettingsError(str(exc)) from None

    def lane_budget_map(self) -> dict[str, float]:
        """lane -> least stall budget in seconds, from lane_budgets; raises SettingsError naming a bad entry."""
        budgets: dict[str, float] = {}
        for spec in self.lane_budgets:
            lane, sep, seconds = spec.partition("=")
            try:
                value = float(seconds)
            except ValueError:
                value = math.nan
            if not (lane.strip() and sep and math.isfinite(value) and value > 0):
                raise SettingsError(f"lane budget {spec!r} must be LANE=SECONDS, seconds positive (e.g. heavy=300)")
            budgets[lane.strip()] = value
        return budgets

    def lane_bar_map(self) -> dict[str, int]:
        """lane -> the least prompt, in tokens as the engine counts them, that belongs on it (a router's bar its
        operator declares, `heavy=100000` or `heavy=100000tokens`); raises SettingsError naming a bad entry."""
        bars: dict[str, int] = {}
        for spec in self.lane_bars:
            lane, sep, tokens = spec.partition("=")
            digits = tokens.strip().removesuffix("tokens").strip()
            if not (lane.strip() and sep and digits.isascii() and digits.isdigit() and int(digits) > 0):
                raise SettingsError(f"lane bar {spec!r} must be LANE=TOKENS, a positive whole number of tokens "
                                    "(e.g. heavy=100000)")
            bars[lane.strip()] = int(digits)
        return bars

    def backend_map(self) -> dict[tuple[str, int], tuple[str, ...]]:
        """(host, port) of a gateway's backend -> the engines behind it, as declared (`vllm.svc:8000=vllm-0`, or
        the address as a URL); raises SettingsError naming a bad entry."""
        behind: dict[tuple[str, int], tuple[str, ...]] = {}
        for spec in self.backends:
            address, sep, engine = spec.rpartition("=")
            try:
                host, port = url_host_port(address if "://" in address else f"http://{address}", "backend")
            except ValueError:
                host, port = "", 0
            if not (sep and engine.strip() and host and (address.count(":") or "://" in address)):
                raise SettingsError(f"backend {spec!r} must be ADDRESS=ENGINE, the address as the gateway names it "
                                    "(host:port or a URL), e.g. vllm.default.svc:8000=vllm-0")
            names = behind.get((host, port), ())
            behind[(host, port)] = (*names, engine.strip()) if engine.strip() not in names else names
        return behind

    def engine_gpu_map(self) -> dict[str, str]:
        """GPU UUID -> engine from engine_gpus; raises SettingsError naming a bad or twice-given entry."""
        owners: dict[str, str] = {}
        for spec in self.engine_gpus:
            name, sep, uuids = spec.partition("=")
            gpus = [u.strip() for u in uuids.split(",")]
            if not (name.strip() and sep and all(u.startswith("GPU-") and len(u) > 4 for u in gpus)):
                raise SettingsError(f"engine GPUs {spec!r} must be NAME=GPU-uuid[,GPU-uuid...] (nvidia-smi -L)")
            for uuid in gpus:
                if owners.setdefault(uuid, name.strip()) != name.strip():
                    raise SettingsError(f"engine GPUs: {uuid} is given to both {owners[uuid]} and {name.strip()}")
        return owners

    @property
    def scrape_timeout(self) -> float:
        """Seconds one scrape may take: never more than the interval, so scrapes cannot pile up."""
        return self.scrape_timeout_s if self.scrape_timeout_s is not None else min(3.0, self.scrape_interval_s)

    def flush_interval(self) -> float:
        """Seconds between batches: as set, else 1 s on the embedded store and REMOTE_FLUSH_S on a server, whose
        inserts ClickHouse asks to be few (a fleet's sidecars share its parts: benchmarks/write_model.py)."""
        if self.flush_interval_s is not None:
            return self.flush_interval_s
        return 1.0 if parse_store_url(self.store).embedded else REMOTE_FLUSH_S

    def spool_path(self) -> str:
        """Where rows wait on disk for the store: --spool-dir, else beside the embedded store or in ./stepline-spool."""
        if self.spool_dir:
            return self.spool_dir
        url = parse_store_url(self.store)
        if url.embedded:
            return os.path.join(f"{url.path.rstrip('/')}-spool", url.database)
        return os.path.join("stepline-spool", f"{url.host}_{url.port}_{url.database}")

    def with_(self, **changes: Any) -> Settings:
        return replace(self, **changes).validated()


def split_named_url(spec: str) -> tuple[str, str]:
    """An `--engine`/`--gateway` spec, `NAME=URL` or `URL`, as (NAME or "", URL): the part before "=" names only
    when it is no URL itself (a URL's query may hold "=")."""
    name, sep, url = spec.partition("=")
    return (name, url) if sep and "://" not in name else ("", spec)


def url_host_port(url: str, what: str = "engine") -> tuple[str, int]:
    """A http(s) URL's host and port (80/443 when it names none); ValueError naming `what` otherwise. An engine
    or gateway given by URL alone is named `host:port` from these."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{what} URL {url!r} must be http(s)://host:port")
    return parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)


def _csv(raw: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in raw.split(",") if part.strip())


def _names(raw: str) -> frozenset[str]:
    return frozenset(_csv(raw))


def _semicolons(raw: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in raw.split(";") if part.strip())


def boolean(raw: str) -> bool:
    """1/0, true/false, yes/no, on/off."""
    value = raw.strip().lower()
    if value not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
        raise ValueError(raw)
    return value in ("1", "true", "yes", "on")


_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def size(raw: str) -> int:
    """A byte count: 1073741824, 512M, 2G (powers of 1024)."""
    text = raw.strip().upper().removesuffix("IB").removesuffix("B")
    unit = text[-1:] if text[-1:] in _SIZE_UNITS else ""
    number = text[: len(text) - len(unit)]
    if not number.isdigit():
        raise ValueError(f"{raw!r} is not a size such as 1073741824, 512M or 2G")
    return int(number) * _SIZE_UNITS[unit]


def _read_secret(var: str, path: str) -> str:
    """A secret from a file (a mounted Kubernetes secret, say): its content without the trailing newline."""
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read().strip()
    except OSError as exc:
        raise SettingsError(f"{var}={path!r}: {exc.strerror}") from None


STORE_PASSWORD_VARS = url_module.STORE_PASSWORD_VARS


def store_url_with_password(url: str, env: Mapping[str, str] | None = None) -> str:
    """`url` given the ClickHouse password alone, from STEPLINE_STORE_PASSWORD or the file STEPLINE_STORE_PASSWORD_FILE
    names (store.url.with_store_password); `url` as it is when neither is set. SettingsError when they clash."""
    try:
        return url_module.with_store_password(url, env)
    except StoreUrlError as exc:
        raise SettingsError(str(exc)) from None

# Secrets: from VAR or from the file VAR_FILE names; never printed (repr=False), never logged.
_SECRETS = (
    ("store", "STEPLINE_STORE"),  # a server URL carries the ClickHouse password
    ("query_password", "STEPLINE_QUERY_PASSWORD"),
    ("otlp_token", "STEPLINE_OTLP_TOKEN"),
    ("plugin_token", "STEPLINE_PLUGIN_TOKEN"),
    ("gateway_token", "STEPLINE_GATEWAY_TOKEN"),
)


_ENV: tuple[tuple[str, str, Any], ...] = (
    ("store", "STEPLINE_STORE", str),
    ("retention_days", "STEPLINE_RETENTION_DAYS", int),
    ("role", "STEPLINE_ROLE", str),
    ("pod_resources_socket", "STEPLINE_POD_RESOURCES_SOCKET", str),
    ("engines", "STEPLINE_ENGINES", _csv),
    ("gateways", "STEPLINE_GATEWAYS", _csv),
    ("lane_budgets", "STEPLINE_LANE_BUDGETS", _csv),
    ("lane_bars", "STEPLINE_LANE_BARS", _csv),
    ("backends", "STEPLINE_BACKENDS", _csv),
    ("host_name", "STEPLINE_HOST_NAME", str),
    ("listen", "STEPLINE_LISTEN", str),
    ("metrics_port", "STEPLINE_METRICS_PORT", int),
    ("query_port", "STEPLINE_QUERY_PORT", int),
    ("query_password", "STEPLINE_QUERY_PASSWORD", str),
    ("query_open", "STEPLINE_QUERY_OPEN", boolean),
    ("scrape_interval_s", "STEPLINE_SCRAPE_INTERVAL", float),
    ("scrape_timeout_s", "STEPLINE_SCRAPE_TIMEOUT", float),
    ("disabled_sources", "STEPLINE_DISABLED_SOURCES", _names),
    ("plugin_socket", "STEPLINE_PLUGIN_SOCKET", str),
    ("host_interval_s", "STEPLINE_HOST_INTERVAL", float),
    ("engine_processes", "STEPLINE_ENGINE_PROCESSES", _csv),
    ("engine_gpus", "STEPLINE_ENGINE_GPUS", _semicolons),
    ("expect_gpus", "STEPLINE_EXPECT_GPUS", boolean),
    ("gpu_interval_s", "STEPLINE_GPU_INTERVAL", float),
    ("otlp_port", "STEPLINE_OTLP_PORT", int),
    ("events_port", "STEPLINE_EVENTS_PORT", int),
    ("otlp_token", "STEPLINE_OTLP_TOKEN", str),
    ("plugin_token", "STEPLINE_PLUGIN_TOKEN", str),
    ("gateway_token", "STEPLINE_GATEWAY_TOKEN", str),
    ("flush_interval_s", "STEPLINE_FLUSH_INTERVAL", float),
    ("spool_dir", "STEPLINE_SPOOL_DIR", str),
    ("spool_max_bytes", "STEPLINE_SPOOL_MAX_BYTES", size),
    ("objectives_file", "STEPLINE_OBJECTIVES_FILE", str),
    ("usage_rollup", "STEPLINE_USAGE_ROLLUP", boolean),
)
