"""Source: a vLLM engine's /metrics, every `vllm:` sample into `engine_samples`; `Scraper`, the part any
Prometheus endpoint's scrape shares (reset-safe deltas, up/down/restart events), which gateways reuse."""

from __future__ import annotations

import errno
import http.client
import math
import socket
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn
from urllib.parse import urlsplit

from prometheus_client.parser import text_string_to_metric_families

from stepline.config.settings import split_named_url, url_host_port
from stepline.core.oneline import one_line
from stepline.model.rows import EngineSample, Event, micros
from stepline.sources.base import Emit, SourceContext, SourceError

PREFIX = "vllm:"
MAX_EXPOSITION_BYTES = 16 << 20
# Labels every vLLM series carries; they get columns of their own, the rest go to `labels`.
IDENTITY_LABELS = ("model_name", "engine")
COUNTER_KINDS = frozenset({"counter", "bucket", "sum", "count"})

Fetch = Callable[[str, float], tuple[str, bytes]]
SeriesKey = tuple[str, tuple[tuple[str, str], ...]]


class ExpositionError(ValueError):
    """The text is not a Prometheus exposition of a vLLM engine."""


def http_fetch(url: str, timeout_s: float, token: str | None = None) -> tuple[str, bytes]:
    """GET url (with a Bearer `token` when given); returns (content type, body), refusing bodies over
    MAX_EXPOSITION_BYTES."""
    headers = {"Accept": "text/plain;version=0.0.4"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        body = response.read(MAX_EXPOSITION_BYTES + 1)
        if len(body) > MAX_EXPOSITION_BYTES:
            raise SourceError(f"{url} answered with more than {MAX_EXPOSITION_BYTES >> 20} MiB", "invalid")
        return str(response.headers.get("Content-Type", "")), body


@dataclass(frozen=True)
class ParsedSample:
    """One sample of the exposition, classified."""

    metric: str
    kind: str
    labels: dict[str, str]
    value: float


def parse_exposition(text: str, prefixes: tuple[str, ...] = (PREFIX,), serving: str = "a vLLM server"
                     ) -> tuple[list[ParsedSample], float | None]:
    """The samples of an exposition whose names start with one of `prefixes`, and the process start time when
    it is exported.

    `_created` samples are dropped: they restate when a series was born and carry no load.
    """
    samples: list[ParsedSample] = []
    start_time: float | None = None
    families = 0
    try:
        for family in text_string_to_metric_families(text):
            families += 1
            # NaN != NaN: a non-finite start time would read as a restart on every scrape.
            if family.name == "process_start_time_seconds" and family.samples and math.isfinite(
                    started := _float(family.samples[0].value)):
                start_time = started
            if not family.name.startswith(prefixes):
                continue
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                samples.append(ParsedSample(sample.name, _kind(family.type, sample.name), dict(sample.labels),
                                            _float(sample.value)))
    except ValueError as exc:
        raise ExpositionError(f"not a Prometheus exposition ({one_line(exc, 120)})") from None
    if not samples:
        raise ExpositionError(
            f"no {' or '.join(prefixes)} metrics among {families} families: is this {serving}'s /metrics?"
        )
    return samples, start_time


def _float(value: float) -> float:
    """The sample's value as a float: the parser keeps integers exact, and one past 1e308 is infinite, not an error."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def _kind(family_type: str, sample_name: str) -> str:
    if family_type == "histogram":
        for suffix in ("bucket", "sum", "count"):
            if sample_name.endswith(f"_{suffix}"):
                return suffix
    if family_type == "counter":
        return "counter"
    if family_type == "info" or sample_name.endswith("_info"):
        return "info"
    return "gauge"


@dataclass
class _State:
    last: dict[SeriesKey, float] = field(default_factory=dict)
    start_time: float | None = None
    up: bool | None = None


class Scraper:
    """Scrapes one Prometheus endpoint of a `subject` (engine, gateway) named `name`: the samples of `prefixes`
    become rows (`_row`), counters reset-safe deltas, and up/down/restart events of the subject's kind."""

    subject = "engine"
    source = "vllm_metrics"
    prefixes: tuple[str, ...] = (PREFIX,)
    serving = "a vLLM server"

    def __init__(self, url: str, ctx: SourceContext, *, name: str | None = None, timeout_s: float = 3.0,
                 fetch: Fetch = http_fetch) -> None:
        hostname, port = url_host_port(url, self.subject)
        if urlsplit(url).path in ("", "/"):
            url = url.rstrip("/") + "/metrics"
        self.url = url
        self.target = name or f"{hostname}:{port}"
        self._ctx = ctx
        self._timeout_s = timeout_s
        self._fetch = fetch
        self._state = _State()

    @property
    def name(self) -> str:
        return f"{self.source}:{self.target}"

    def poll(self, emit: Emit) -> None:
        """Scrape once."""
        try:
            content_type, body = self._fetch(self.url, self._timeout_s)
        except SourceError as exc:
            self._down(emit, f"{self.subject} {self.target} unreachable at {self.url}: {exc}", exc.reason)
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            self._down(emit, f"{self.subject} {self.target} unreachable at {self.url}: {_reason(exc)}",
                       failure_kind(exc))
        else:
            self.ingest(body, self._ctx.clock.time(), emit, content_type)

    def ingest(self, body: bytes, ts: float, emit: Emit, content_type: str = "text/plain") -> None:
        """Turn one exposition taken at `ts` into rows (also the entry point of fast replay)."""
        if "html" in content_type.lower():
            self._down(emit, f"{self.subject} {self.target} answered {self.url} with {content_type}, not "
                             "Prometheus text", "invalid")
        try:
            samples, start_time = parse_exposition(body.decode("utf-8", errors="replace"), self.prefixes,
                                                   self.serving)
        except ExpositionError as exc:
            self._down(emit, f"{self.subject} {self.target} at {self.url}: {exc}", "invalid")
        rows = self._rows(samples, start_time, ts, emit)
        if self._state.up is not True:
            self._state.up = True
            emit([self._event(ts, f"{self.subject}_up", "info",
                              f"{self.subject} {self.target} answers at {self.url}")])
        emit(rows)

    def _rows(self, samples: list[ParsedSample], start_time: float | None, ts: float, emit: Emit) -> list[Any]:
        state = self._state
        last = state.last
        restarted = start_time is not None and state.start_time is not None and start_time != state.start_time
        if not restarted and last:
            restarted = any(
                s.kind in COUNTER_KINDS and math.isfinite(s.value) and s.value < last.get(_key(s), -math.inf)
                for s in samples
            )
        if restarted:
            emit([self._event(ts, f"{self.subject}_restart", "warning",
                              f"{self.subject} {self.target} restarted: its counters started again from zero")])
        # A series first seen after an earlier scrape was born between the two scrapes: all of its value is new.
        # On the collector's first scrape nothing is known of the past.
        born_between = bool(last)
        current: dict[SeriesKey, float] = {}
        rows: list[Any] = []
        context = self._context(samples)
        stamp = micros(ts)
        for s in samples:
            key = _key(s)
            current[key] = s.value
            delta = 0.0
            # A NaN or infinite counter (or one following such a sample) has no meaningful increase: 0, so that sums
            # over deltas stay finite.
            if s.kind in COUNTER_KINDS and math.isfinite(s.value):
                previous = None if restarted else last.get(key)
                if previous is None:
                    delta = s.value if (born_between or restarted) else 0.0
                elif math.isfinite(previous):
                    delta = s.value - previous if s.value >= previous else s.value
            rows.append(self._row(stamp, s, delta, context))
        state.last = current
        state.start_time = start_time
        return rows

    def _context(self, samples: list[ParsedSample]) -> str:
        """What every row of one scrape shares (the engine's model name)."""
        # A few families (cache_config_info, admission_rejections) lack model_name: one server serves one model.
        return next((s.labels["model_name"] for s in samples if "model_name" in s.labels), "")

    def _row(self, stamp: int, s: ParsedSample, delta: float, context: str) -> Any:
        labels = {k: v for k, v in s.labels.items() if k not in IDENTITY_LABELS}
        return EngineSample(stamp, self._ctx.host, self.target, s.labels.get("engine", ""),
                            s.labels.get("model_name", context), s.metric, s.kind, labels, s.value, delta)

    def _down(self, emit: Emit, message: str, reason: str) -> NoReturn:
        if self._state.up is not False:
            self._state.up = False
            emit([self._event(self._ctx.clock.time(), f"{self.subject}_down", "critical", message)])
        raise SourceError(message, reason)

    def _event(self, ts: float, kind: str, severity: str, message: str) -> Event:
        engine, named = self._event_subject()
        return Event(micros(ts), self._ctx.host, engine, self.source, kind, severity, message,
                     {"url": self.url, **named})

    def _event_subject(self) -> tuple[str, dict[str, str]]:
        """The event's engine column, and attributes that name the subject beside the URL."""
        return self.target, {}


class VllmMetricsSource(Scraper):
    """Scrapes one engine; counters become reset-safe deltas, up/down/restart become events."""

    def __init__(self, url: str, ctx: SourceContext, *, engine: str | None = None, timeout_s: float = 3.0,
                 fetch: Fetch = http_fetch) -> None:
        super().__init__(url, ctx, name=engine, timeout_s=timeout_s, fetch=fetch)

    @property
    def engine(self) -> str:
        return self.target

    def _context(self, samples: list[ParsedSample]) -> str:
        model = super()._context(samples)
        if model:  # the served name, as the plugin's engine_config gives it: for requests only a span reported
            self._ctx.engine_models.announce(self.target, model)
        return model


def _key(sample: ParsedSample) -> SeriesKey:
    return sample.metric, tuple(sorted(sample.labels.items()))


def failure_kind(exc: BaseException) -> str:
    """A failed fetch's kind (SourceError.reason): `refused` and `gone` say the process is not there to answer, a
    `timeout` that it may be there and busy, or hung."""
    if isinstance(exc, urllib.error.HTTPError):
        return "http"
    cause = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    if isinstance(cause, ConnectionRefusedError):
        return "refused"
    # Closed without an answer (RemoteDisconnected is a ConnectionResetError), or cut off in the body.
    if isinstance(cause, (ConnectionResetError, ConnectionAbortedError, BrokenPipeError, http.client.IncompleteRead)):
        return "gone"
    if isinstance(cause, TimeoutError):  # socket.timeout is TimeoutError
        return "timeout"
    if isinstance(cause, socket.gaierror) or (isinstance(cause, OSError) and cause.errno in (
            errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EADDRNOTAVAIL)):
        return "unreachable"
    return "error"


def _reason(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code} {exc.reason}"
    if isinstance(exc, urllib.error.URLError):
        return str(exc.reason)
    return one_line(exc) or type(exc).__name__


def build(ctx: SourceContext, engines: tuple[str, ...], timeout_s: float) -> list[VllmMetricsSource]:
    """One source per `--engine`, each `URL` or `NAME=URL`."""
    return [VllmMetricsSource(url, ctx, engine=name or None, timeout_s=timeout_s)
            for name, url in map(split_named_url, engines)]
