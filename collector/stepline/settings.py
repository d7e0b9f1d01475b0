"""Collector settings: one dataclass, environment-variable defaults, validated at start-up."""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from stepline.storeurl import StoreUrlError, default_store_url, parse_store_url


class SettingsError(ValueError):
    """A setting has a value stepline cannot run with; the message names it."""


@dataclass(frozen=True)
class Settings:
    """Everything the collector is configured with."""

    store: str = field(default_factory=default_store_url)
    retention_days: int = 30
    engines: tuple[str, ...] = ()
    host_name: str = field(default_factory=socket.gethostname)
    listen: str = "127.0.0.1"
    metrics_port: int = 9465
    query_port: int = 8124
    query_password: str | None = field(default=None, repr=False)
    scrape_interval_s: float = 5.0
    scrape_timeout_s: float | None = None  # default: 3 s, or the interval when shorter
    disabled_sources: frozenset[str] = frozenset()
    engine_processes: tuple[str, ...] = ()  # NAME=PID or NAME=cmdline:TEXT, beside what --engine ports find
    host_interval_s: float = 1.0
    gpu_interval_s: float = 0.1
    plugin_socket: str = "/tmp/stepline-plugin.sock"
    otlp_port: int = 4318
    otlp_token: str | None = field(default=None, repr=False)
    writer_max_rows: int = 200_000
    writer_batch_rows: int = 20_000
    flush_interval_s: float = 1.0

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
        password_file = env.get("STEPLINE_QUERY_PASSWORD_FILE")
        if password_file and "query_password" not in values:
            try:
                with open(password_file, encoding="utf-8") as fh:
                    values["query_password"] = fh.read().strip()
            except OSError as exc:
                raise SettingsError(f"STEPLINE_QUERY_PASSWORD_FILE={password_file!r}: {exc.strerror}") from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values).validated()

    def validated(self) -> Settings:
        """Return self, or raise SettingsError naming the first bad value."""
        try:
            parse_store_url(self.store)
        except StoreUrlError as exc:
            raise SettingsError(str(exc)) from None
        if self.retention_days < 1:
            raise SettingsError(f"retention must be at least 1 day, got {self.retention_days}")
        for name in ("metrics_port", "query_port", "otlp_port"):
            port = getattr(self, name)
            if not 0 <= port <= 65535:
                raise SettingsError(f"{name.replace('_', '-')} {port} is not a TCP port (0-65535)")
        try:
            ipaddress.ip_address(self.listen)
        except ValueError:
            if self.listen != "localhost":
                raise SettingsError(f"listen address {self.listen!r} is not an IP address") from None
        for name in ("scrape_interval_s", "scrape_timeout_s", "flush_interval_s", "host_interval_s", "gpu_interval_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise SettingsError(f"{name} must be positive, got {value}")
        if self.scrape_timeout > self.scrape_interval_s:
            raise SettingsError(
                f"scrape timeout {self.scrape_timeout} s exceeds the scrape interval {self.scrape_interval_s} s"
            )
        if not 1 <= self.writer_batch_rows <= self.writer_max_rows:
            raise SettingsError(
                f"writer batch ({self.writer_batch_rows} rows) must be between 1 and the queue size "
                f"({self.writer_max_rows} rows)"
            )
        for spec in self.engines:
            url = spec.partition("=")[2] if "=" in spec and "://" not in spec.partition("=")[0] else spec
            if not url.startswith(("http://", "https://")):
                raise SettingsError(f"engine {spec!r} must be http(s)://host:port or NAME=http(s)://host:port")
        for spec in self.engine_processes:
            name, sep, how = spec.partition("=")
            if not (name and sep and (how.isdigit() or (how.startswith("cmdline:") and len(how) > 8))):
                raise SettingsError(f"engine process {spec!r} must be NAME=PID or NAME=cmdline:TEXT")
        return self

    @property
    def scrape_timeout(self) -> float:
        """Seconds one scrape may take: never more than the interval, so scrapes cannot pile up."""
        return self.scrape_timeout_s if self.scrape_timeout_s is not None else min(3.0, self.scrape_interval_s)

    def with_(self, **changes: Any) -> Settings:
        return replace(self, **changes).validated()


def _csv(raw: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in raw.split(",") if part.strip())


def _names(raw: str) -> frozenset[str]:
    return frozenset(_csv(raw))


_ENV: tuple[tuple[str, str, Any], ...] = (
    ("store", "STEPLINE_STORE", str),
    ("retention_days", "STEPLINE_RETENTION_DAYS", int),
    ("engines", "STEPLINE_ENGINES", _csv),
    ("host_name", "STEPLINE_HOST_NAME", str),
    ("listen", "STEPLINE_LISTEN", str),
    ("metrics_port", "STEPLINE_METRICS_PORT", int),
    ("query_port", "STEPLINE_QUERY_PORT", int),
    ("query_password", "STEPLINE_QUERY_PASSWORD", str),
    ("scrape_interval_s", "STEPLINE_SCRAPE_INTERVAL", float),
    ("scrape_timeout_s", "STEPLINE_SCRAPE_TIMEOUT", float),
    ("disabled_sources", "STEPLINE_DISABLED_SOURCES", _names),
    ("plugin_socket", "STEPLINE_PLUGIN_SOCKET", str),
    ("host_interval_s", "STEPLINE_HOST_INTERVAL", float),
    ("engine_processes", "STEPLINE_ENGINE_PROCESSES", _csv),
    ("gpu_interval_s", "STEPLINE_GPU_INTERVAL", float),
    ("otlp_port", "STEPLINE_OTLP_PORT", int),
    ("otlp_token", "STEPLINE_OTLP_TOKEN", str),
)
