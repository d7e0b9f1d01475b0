"""`stepline doctor`: whether an engine and its collector are wired as stepline needs them, one check a line.

A check is OK, FAIL with what to do, or SKIP: not asked for (the line names the flag to give), or not checkable
because what it reads failed (that has its own FAIL line). The run holds when no check FAILs: a SKIP never fails it.

The doctor writes nothing but one probe: a 2-token completion (X-Request-Id `stepline-doctor-…`), so that an idle
engine makes steps and a span to look for (`probe=False` waits for traffic instead). What each check reads:
- engine: GET the engine's /metrics (a vLLM exposition: `vllm:` families), /v1/models, the probe's answer.
- collector: the running collector's runtime file (else the file beside its embedded store), its /metrics:
  `stepline_source_up{source="vllm_metrics:NAME"}` and that source's last error.
- plugin: the engine's steps in the store since the doctor began (through the collector's SQL endpoint for an
  embedded store), their elapsed_ms (NaN without iteration details), other engines' steps (a name mismatch),
  `stepline_source_counts_total{source="plugin",counter="unauthorized"}`, and with no steps, whether the engine's
  token counters moved meanwhile (its /metrics read again) and `stepline_engine_plugin_silent_seconds`: a silent
  plugin, the watchdog's `plugin_silent`.
- otlp: `stepline_source_counts_total{source="otlp",counter="spans_accepted"}` rising while the doctor waits; requests
  only spans reported, under another engine's name.
- model: /metrics' model_name, /v1/models, the steps' model_name (the plugin's engine_config), spans' model names
  (vLLM's llm_request span names none).
- gpu: `stepline_gpu_expected` (STEPLINE_EXPECT_GPUS), `stepline_source_up{source="gpu"}` and its error, the GPUs
  in gpu_samples over the last minute by engine.
- store: `stepline_spool_bytes`, `stepline_writer_write_errors_total` and `..._rows_written_total` while it waits.
- clock: the engine's HTTP Date against the collector's, `stepline_source_clock_skew_max_seconds` of the plugin
  and OTLP, rows dropped as ts_out_of_range while it waits.
- prometheus: `up{SELECTOR}` of the collector's /metrics target; alertmanager: /-/ready and /api/v2/status.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from email.message import Message
from email.utils import parsedate_to_datetime
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from stepline.alerting.config import AlertConfig
from stepline.config.settings import Settings, split_named_url, url_host_port
from stepline.core.listener import url as url_of
from stepline.core.oneline import one_line
from stepline.core.usageerror import UsageError
from stepline.queries.query import param
from stepline.queries.window import ENGINE, SINCE
from stepline.sources.vllm_metrics import ExpositionError, ParsedSample, parse_exposition
from stepline.store.discovery import (
    RunningCollector,
    collector_for,
    is_alive,
    locate_store,
    read_beside_store,
    runtime_dir,
    store_without_password,
)
from stepline.store.errors import StoreError, error_line
from stepline.store.reader import TimelineReader, open_reader
from stepline.store.reads import named, only
from stepline.store.url import StoreUrlError, parse_store_url
from stepline.watchdog.budget import PROGRESS_COUNTERS

OK, FAIL, SKIP = "OK", "FAIL", "SKIP"
CHECKS = ("engine", "collector", "plugin", "otlp", "model", "gpu", "store", "clock", "prometheus", "alertmanager")
POLL_S = 0.5
SETTLE_S = 1.5  # the collector writes what it takes within its flush interval (1 s by default)
PROBE_LOOKBACK_S = 1.0  # a probe's steps are stamped by the engine's clock: this much before the doctor's start
CLOCK_TOLERANCE_S = 2.0  # HTTP Date has whole seconds: two readings of one clock differ by up to one and the trip
AHEAD_TOLERANCE_S = 1.0  # a row is stamped before it reaches the collector: ahead by more is another clock
GPU_WINDOW_S = 60.0
MAX_BODY_BYTES = 16 << 20


@dataclass(frozen=True)
class Check:
    """One line of the doctor's answer."""

    name: str
    status: str  # OK, FAIL or SKIP
    message: str

    def line(self) -> str:
        return f"{self.status:<4} {self.name}: {self.message}"


@dataclass(frozen=True)
class Options:
    """What the doctor is pointed at; the empty defaults come from the collector's environment (Settings)."""

    engine: str = ""  # [NAME=]URL; "": $STEPLINE_ENGINES' first, else the one engine the collector scrapes
    store: str | None = None  # else found as `stepline status` finds it
    prometheus: str = ""
    prometheus_selector: str = AlertConfig().selector
    alertmanager: str = ""
    wait_s: float = 30.0
    probe: bool = True
    host: str = ""  # the collector's host name on the timeline; "": $STEPLINE_HOST_NAME, else this machine's
    timeout_s: float = 5.0
    runtime_dir: Path | None = None


@dataclass(frozen=True)
class Reply:
    """One HTTP answer, whatever its status, and when (local clock) it was asked and answered."""

    status: int
    headers: Message
    body: bytes
    sent: float
    received: float

    def date_offset_s(self) -> float | None:
        """The answering host's clock less ours, from its Date header (whole seconds: +0.5 centres it)."""
        try:
            stamp = parsedate_to_datetime(str(self.headers.get("Date", ""))).timestamp()
        except (TypeError, ValueError):
            return None
        return stamp + 0.5 - (self.sent + self.received) / 2


Fetch = Callable[[str, float, bytes | None, dict[str, str]], Reply]


def fetch(url: str, timeout_s: float, body: bytes | None = None, headers: dict[str, str] | None = None) -> Reply:
    """GET (POST with `body`) `url`; an HTTP error status is a Reply, a transport failure raises OSError."""
    request = urllib.request.Request(url, data=body, headers=headers or {})
    sent = time.time()
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return Reply(response.status, response.headers, response.read(MAX_BODY_BYTES), sent, time.time())
    except urllib.error.HTTPError as exc:
        return Reply(exc.code, exc.headers, exc.read(MAX_BODY_BYTES), sent, time.time())


def why(exc: BaseException) -> str:
    """A transport failure in a few words."""
    reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    return one_line(reason, 200) or type(exc).__name__


class Samples:
    """A collector's /metrics by sample name (counters with their `_total`)."""

    def __init__(self, text: str) -> None:
        self._series: dict[str, list[tuple[dict[str, str], float]]] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                self._series.setdefault(s.name, []).append((dict(s.labels), float(s.value)))

    def matching(self, name: str, **labels: str) -> list[tuple[dict[str, str], float]]:
        return [(have, v) for have, v in self._series.get(name, []) if all(have.get(k) == x for k, x in labels.items())]

    def value(self, name: str, **labels: str) -> float | None:
        found = self.matching(name, **labels)
        return found[0][1] if found else None

    def total(self, name: str, **labels: str) -> float:
        return sum(v for _, v in self.matching(name, **labels))


@dataclass
class Evidence:
    """What the doctor saw, for the judges below."""

    name: str = ""
    url: str = ""  # the engine's /metrics
    engine_error: str = ""
    engine_reply: Reply | None = None
    families: int = 0
    metrics_model: str = ""
    progress_before: float | None = None  # the engine's progress counters (_progress) when first read
    progress_after: float | None = None  # and when read again after the wait, steps having not arrived
    served: tuple[str, ...] = ()
    probe_error: str = ""
    store: str = ""
    collector: RunningCollector | None = None
    collector_error: str = ""
    collector_reply: Reply | None = None
    before: Samples | None = None
    after: Samples | None = None
    sql_error: str = ""
    scraped: dict[str, str] = field(default_factory=dict)  # engine -> the /metrics URL the collector scrapes
    steps: int = 0
    detailed_steps: int = 0
    steps_model: str = ""
    batch_queued_steps: int = 0  # steps whose elapsed_ms is the batch-queued core's cadence or wait, not vLLM's own
    other_steps: dict[str, int] = field(default_factory=dict)
    span_requests: dict[str, tuple[int, str]] = field(default_factory=dict)  # engine -> (requests, model)
    gpus: dict[str, int] = field(default_factory=dict)  # engine -> GPUs sampled in the last minute
    waited_s: float = 0.0
    probed: bool = False
    otlp_hint: str = "http://127.0.0.1:4318/v1/traces"

    def rise(self, name: str, **labels: str) -> float:
        if self.before is None or self.after is None:
            return 0.0
        return self.after.total(name, **labels) - self.before.total(name, **labels)


class Doctor:
    """Gathers the evidence (`run`), then judges each check in CHECKS order."""

    def __init__(self, options: Options, *, fetch: Fetch = fetch, clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.options = options
        self._fetch = fetch
        self._clock = clock
        self._sleep = sleep
        self._env = Settings.from_env()
        self._engine = options.engine or (self._env.engines[0] if self._env.engines else "")
        if self._engine and not split_named_url(self._engine)[1].startswith(("http://", "https://")):
            raise UsageError(f"--engine {self._engine!r} must be [NAME=]http(s)://host:port")

    def get(self, url: str, body: bytes | None = None, headers: dict[str, str] | None = None) -> Reply:
        return self._fetch(url, self.options.timeout_s, body, headers or {})

    def run(self) -> list[Check]:
        """Every check, in CHECKS order."""
        o, ev = self.options, Evidence()
        host = o.host or self._env.host_name
        listen = "127.0.0.1" if self._env.listen in ("0.0.0.0", "::") else self._env.listen  # what vLLM dials
        ev.otlp_hint = f"{url_of(listen, self._env.otlp_port)}/v1/traces"
        ev.name, url = split_named_url(self._engine)
        reader = self._find_collector(ev, host)
        try:
            if url and not ev.name:  # the collector's name for it, else the one it would give it
                ev.name = next((n for n, u in ev.scraped.items() if u == _metrics_url(url)), "")
                ev.name = ev.name or "{}:{}".format(*url_host_port(url))
            elif not url and len(ev.scraped) == 1:
                ev.name, url = next(iter(ev.scraped.items()))
            self._look_at_engine(ev, url)
            start = self._clock()
            probe = self._probe(ev, url) if o.probe and not ev.engine_error else None
            since = start - (PROBE_LOOKBACK_S if probe is not None else o.wait_s)
            self._wait(ev, reader, host, since, start + o.wait_s, probe)
            ev.waited_s = self._clock() - start
            if not ev.steps and ev.progress_before is not None:
                self._count_progress(ev)
            if probe is not None and probe.is_alive():
                ev.probe_error = f"no answer in {o.wait_s:.0f} s"
            if reader is not None and not ev.sql_error:
                self._read_store(ev, reader, host, since)
        finally:
            if reader is not None:
                reader.close()
        checks = [judge(ev) for judge in (_engine, _collector, _plugin, _otlp, _model, _gpu, _store, _clock)]
        collector_metrics = ev.collector.metrics_url if ev.collector is not None else ""
        checks.append(prometheus_check(self.get, o.prometheus, o.prometheus_selector, collector_metrics)
                      if o.prometheus else
                      Check("prometheus", SKIP, "give --prometheus URL to check that it scrapes the collector"))
        checks.append(alertmanager_check(self.get, o.alertmanager) if o.alertmanager else
                      Check("alertmanager", SKIP, "give --alertmanager URL to check that it is ready"))
        return checks

    # ---- gathering ----------------------------------------------------------------------------------------

    def _find_collector(self, ev: Evidence, host: str) -> TimelineReader | None:
        """The running collector, its /metrics, and a reader of its store (None when any of them fails)."""
        directory = self.options.runtime_dir or runtime_dir()
        try:
            located = locate_store(self.options.store, directory=directory)
            url = parse_store_url(located.url)
        except StoreUrlError as exc:
            ev.collector_error = str(exc)
            return None
        ev.store = url.redacted()
        info = located.collector or collector_for(store_without_password(url), directory)
        if info is None and url.embedded:
            beside = read_beside_store(url.path)
            info = beside if beside is not None and is_alive(beside.pid, "") else None
        if info is None:
            ev.collector_error = f"none running for {ev.store} (no runtime file in {directory})"
            return None
        ev.collector = info
        try:
            ev.collector_reply = self.get(info.metrics_url)
            ev.before = Samples(ev.collector_reply.body.decode("utf-8", errors="replace"))
        except (OSError, ValueError) as exc:
            ev.collector_error = f"pid {info.pid}: its /metrics {info.metrics_url} does not answer: {why(exc)}"
            return None
        try:
            reader = open_reader(located.url)
        except StoreError as exc:
            ev.sql_error = str(exc)
            return None
        try:
            rows = named(reader.client.query(
                f"SELECT engine, argMax(attributes['url'], ts) AS url FROM `{reader.database}`.events WHERE host = "
                "{host:String} AND source = 'vllm_metrics' AND kind IN ('engine_up', 'engine_down') GROUP BY engine",
                parameters={"host": host}))
        except Exception as exc:  # a read refused or cut: the store check says so, the others go on
            ev.sql_error = error_line(exc)
            return reader
        scraping = {labels["source"].partition(":")[2] for labels, _ in ev.before.matching("stepline_source_up")
                    if labels["source"].startswith("vllm_metrics:")}
        ev.scraped = {str(r.engine): str(r.url) for r in rows if r.engine in scraping}
        return reader

    def _look_at_engine(self, ev: Evidence, url: str) -> None:
        if not url:
            ev.engine_error = "no engine to check — give --engine [NAME=]URL (or set STEPLINE_ENGINES)"
            return
        ev.url = _metrics_url(url)
        try:
            reply = self.get(ev.url, headers={"Accept": "text/plain;version=0.0.4"})
        except OSError as exc:
            ev.engine_error = f"{ev.url} unreachable: {why(exc)} — is vLLM serving there? check --engine"
            return
        ev.engine_reply = reply
        if reply.status != 200:
            ev.engine_error = f"{ev.url} answered HTTP {reply.status} — point --engine at vLLM's HTTP port"
            return
        try:
            samples, _ = parse_exposition(reply.body.decode("utf-8", errors="replace"))
        except ExpositionError as exc:
            ev.engine_error = f"{ev.url}: {exc} — point --engine at vLLM's HTTP port"
            return
        ev.families = len({s.metric.removesuffix(f"_{s.kind}") for s in samples})
        ev.progress_before = _progress(samples)
        ev.metrics_model = next((s.labels["model_name"] for s in samples if s.labels.get("model_name")), "")
        try:
            models = json.loads(self.get(f"{_base(url)}/v1/models").body)
            ev.served = tuple(str(m["id"]) for m in models.get("data", []))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            ev.served = ()  # the probe names the model from /metrics then

    def _count_progress(self, ev: Evidence) -> None:
        """Read the engine's /metrics again: how far its progress counters moved while no step arrived."""
        try:
            reply = self.get(ev.url, headers={"Accept": "text/plain;version=0.0.4"})
            samples, _ = parse_exposition(reply.body.decode("utf-8", errors="replace"))
        except (OSError, ExpositionError):
            return  # the engine line tells its own failures; this one only adds to the plugin line
        ev.progress_after = _progress(samples)

    def _probe(self, ev: Evidence, url: str) -> threading.Thread:
        """Send the probe on a thread of its own (a busy engine may take long to answer); a failure lands in ev."""
        model = ev.served[0] if ev.served else ev.metrics_model
        body = json.dumps({"model": model, "prompt": "stepline doctor", "max_tokens": 2, "temperature": 0}).encode()
        headers = {"Content-Type": "application/json", "X-Request-Id": f"stepline-doctor-{uuid.uuid4().hex[:12]}"}
        ev.probed = True

        def send() -> None:
            try:
                reply = self._fetch(f"{_base(url)}/v1/completions", self.options.wait_s, body, headers)
            except OSError as exc:
                ev.probe_error = why(exc)
                return
            if reply.status != 200:
                ev.probe_error = f"HTTP {reply.status} {' '.join(reply.body.decode(errors='replace').split())[:120]}"

        thread = threading.Thread(target=send, name="stepline-doctor-probe", daemon=True)
        thread.start()
        return thread

    def _wait(self, ev: Evidence, reader: TimelineReader | None, host: str, since: float, deadline: float,
              probe: threading.Thread | None) -> None:
        """Until the engine's steps and a span have arrived (and the probe answered), then SETTLE_S more for the
        collector to write what it took; or until the deadline."""
        if ev.collector is None or ev.before is None:
            if probe is not None:
                probe.join(max(0.0, deadline - self._clock()))
            return
        spans = ev.before.total("stepline_source_counts_total", source="otlp", counter="spans_accepted")
        arrived_at: float | None = None
        while True:
            try:
                reply = self.get(ev.collector.metrics_url)
                ev.collector_reply, ev.after = reply, Samples(reply.body.decode("utf-8", errors="replace"))
            except (OSError, ValueError) as exc:
                ev.collector_error = f"pid {ev.collector.pid}: its /metrics stopped answering: {why(exc)}"
                ev.after = None
                return
            if reader is not None and not ev.sql_error and ev.name:
                self._read_steps(ev, reader, host, since)
            now = self._clock()
            # An engine that answers the doctor but whose last scrape failed (it came up after the collector's
            # latest scrape, as when the sidecar starts first) is waited for too: the next scrape says.
            scraped = bool(ev.engine_error) or ev.after.value("stepline_source_up",
                                                               source=f"vllm_metrics:{ev.name}") != 0
            if arrived_at is None and ev.steps > 0 and scraped and (probe is None or not probe.is_alive()) and \
                    ev.after.total("stepline_source_counts_total", source="otlp", counter="spans_accepted") > spans:
                arrived_at = now
            if now >= deadline or (arrived_at is not None and now >= arrived_at + SETTLE_S):
                return
            self._sleep(POLL_S)

    def _read_steps(self, ev: Evidence, reader: TimelineReader, host: str, since: float) -> None:
        try:
            steps = only(reader.client.query(
                f"SELECT count() AS steps, countIf(NOT isNaN(elapsed_ms)) AS detailed, argMax(model_name, ts) AS "
                f"model, countIf(step_time IN ('cadence', 'wait')) AS batch_queued FROM `{reader.database}`.steps "
                f"WHERE host = {param('host', 'String')} AND {ENGINE} AND {SINCE}",
                parameters={"host": host, "engine": ev.name, "since": round(since * 1e6)}))
        except Exception as exc:  # as in _find_collector
            ev.sql_error = error_line(exc)
            return
        ev.steps, ev.detailed_steps, ev.steps_model = int(steps.steps), int(steps.detailed), str(steps.model)
        ev.batch_queued_steps = int(steps.batch_queued)

    def _read_store(self, ev: Evidence, reader: TimelineReader, host: str, since: float) -> None:
        """Other engines' steps and spans since `since` (a name mismatch), and the GPUs of the last minute."""
        window, db, query = {"host": host, "since": round(since * 1e6)}, reader.database, reader.client.query
        try:
            steps = named(query(f"SELECT engine, count() AS steps FROM `{db}`.steps WHERE host = "
                                f"{param('host', 'String')} AND {SINCE} GROUP BY engine ORDER BY count() DESC LIMIT 5",
                                parameters=window))
            spans = named(query(f"SELECT engine, count() AS requests, argMax(model_name, ts) AS model FROM "
                                f"`{db}`.requests WHERE host = {param('host', 'String')} AND {SINCE} AND "
                                "source = 'otlp' GROUP BY engine", parameters=window))
            gpus = named(query(f"SELECT engine, uniqExact(gpu_uuid) AS gpus FROM `{db}`.gpu_samples "
                               f"WHERE host = {param('host', 'String')} AND {SINCE} GROUP BY engine",
                               parameters={**window, "since": round((self._clock() - GPU_WINDOW_S) * 1e6)}))
        except Exception as exc:  # as in _find_collector
            ev.sql_error = error_line(exc)
            return
        ev.other_steps = {str(r.engine): int(r.steps) for r in steps if r.engine != ev.name}
        ev.span_requests = {str(r.engine): (int(r.requests), str(r.model)) for r in spans}
        ev.gpus = {str(r.engine): int(r.gpus) for r in gpus}

def prometheus_check(get: Callable[[str], Reply], base: str, selector: str, collector_metrics: str) -> Check:
    """Whether the Prometheus at `base` scrapes the collector whose /metrics is `collector_metrics` ("": any
    target): `up{selector}` of its target is 1."""
    base, query = base.rstrip("/"), f"up{{{selector}}}"
    try:
        answer = json.loads(get(f"{base}/api/v1/query?{urllib.parse.urlencode({'query': query})}").body)
        # A vector's sample is [time, "value"] (https://prometheus.io/docs/prometheus/latest/querying/api/).
        series = [(r["metric"].get("instance", ""), float(value)) for r in answer["data"]["result"]
                  for _time, value in (r["value"],)]
    except OSError as exc:
        return Check("prometheus", FAIL, f"{base} unreachable: {why(exc)} — check --prometheus")
    except (ValueError, KeyError, TypeError, IndexError):
        return Check("prometheus", FAIL, f"{base} did not answer {query} as Prometheus does — check --prometheus")
    target = urllib.parse.urlsplit(collector_metrics).netloc
    port = target.rpartition(":")[2]
    ours = [(i, v) for i, v in series if not target or i == target or i.rpartition(":")[2] == port]
    if not series:
        return Check("prometheus", FAIL, f"no target has {query} — scrape the collector's /metrics "
                     f"({target or 'port 9465'}) in that job (deploy/prometheus/prometheus.yml)")
    if not ours:
        return Check("prometheus", FAIL, f"{query} is of {', '.join(i for i, _ in series)}, not this collector "
                     f"({target}) — add it to the job's targets")
    instance, up = ours[0]
    if up != 1:
        return Check("prometheus", FAIL, f"{query} is 0 for {instance}: Prometheus cannot scrape the collector "
                     "— its --listen and --metrics-port must be reachable from Prometheus")
    return Check("prometheus", OK, f"scrapes the collector: up{{{selector}, instance={instance!r}}} = 1")


def alertmanager_check(get: Callable[[str], Reply], base: str) -> Check:
    """Whether the Alertmanager at `base` is ready: /-/ready, then its version from /api/v2/status."""
    base = base.rstrip("/")
    try:
        ready = get(f"{base}/-/ready")
        status = get(f"{base}/api/v2/status") if ready.status == 200 else None
    except OSError as exc:
        return Check("alertmanager", FAIL, f"{base} unreachable: {why(exc)} — check --alertmanager")
    if status is None:
        return Check("alertmanager", FAIL, f"{base}/-/ready answered HTTP {ready.status}: not ready — see its log")
    try:
        answer = json.loads(status.body)
        version, cluster = answer["versionInfo"]["version"], answer["cluster"]["status"]
    except (ValueError, KeyError, TypeError):
        return Check("alertmanager", FAIL, f"{base}/api/v2/status is no Alertmanager's — check --alertmanager")
    return Check("alertmanager", OK, f"{base} ready (version {version}, cluster {cluster})")


def _progress(samples: list[ParsedSample]) -> float:
    """The sum of an engine's progress counters (generated and prompt tokens, iterations): vLLM moves them only in
    the steps it runs, each of which a loaded plugin reports."""
    return sum(s.value for s in samples if s.metric in PROGRESS_COUNTERS)


def _metrics_url(url: str) -> str:
    """An engine's /metrics URL as the collector scrapes it (a bare host:port gets /metrics)."""
    return url.rstrip("/") + "/metrics" if urllib.parse.urlsplit(url).path in ("", "/") else url


def _base(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def _needs(ev: Evidence, name: str, sql: bool = True) -> Check | None:
    """A SKIP when what the check reads is missing (the collector, its /metrics, its store)."""
    if ev.collector is None or ev.after is None:
        return Check(name, SKIP, "needs the collector (see collector)")
    if sql and ev.sql_error:
        return Check(name, SKIP, "needs the store (see store)")
    return None


def _engine(ev: Evidence) -> Check:
    if ev.engine_error:
        theirs = ev.scraped.get(ev.name, "")
        also = f" (the collector scrapes {ev.name} at {theirs})" if theirs and theirs != ev.url else ""
        return Check("engine", FAIL, ev.engine_error + also)
    if ev.probe_error:
        return Check("engine", FAIL, f"{ev.url} answers, but a 2-token completion failed: {ev.probe_error} — see "
                     "vLLM's log (--no-probe skips the probe)")
    return Check("engine", OK, f"{ev.url} answers: {ev.families} vllm: families, model {ev.metrics_model or '?'}"
                 + ("; probe sent" if ev.probed else ""))


def _collector(ev: Evidence) -> Check:
    c, latest = ev.collector, ev.after or ev.before  # the latest: its first scrape may come while the doctor waits
    if c is None or latest is None or ev.collector_error:
        return Check("collector", FAIL, f"{ev.collector_error} — start `stepline collect --engine "
                     f"{ev.name or 'NAME'}={_base(ev.url) if ev.url else 'URL'}`")
    up = latest.value("stepline_source_up", source=f"vllm_metrics:{ev.name}")
    if up is None:
        others = ", ".join(sorted(ev.scraped)) or "none"
        return Check("collector", FAIL, f"pid {c.pid} does not scrape engine {ev.name or '?'} (it scrapes {others}) "
                     f"— give it --engine {ev.name or 'NAME'}={_base(ev.url) if ev.url else 'URL'}")
    theirs = ev.scraped.get(ev.name, "")
    if not up:
        error = next((labels.get("error", "") for labels, v in latest.matching(
            "stepline_source_last_error_info", source=f"vllm_metrics:{ev.name}") if v), "its scrape fails")
        return Check("collector", FAIL, f"pid {c.pid} cannot scrape {ev.name}: {error} — fix its --engine "
                     f"{ev.name}=URL" + (f" (the engine answers at {_base(ev.url)})" if not ev.engine_error else ""))
    where = f" at {theirs}" if theirs and theirs != ev.url else ""
    return Check("collector", OK, f"pid {c.pid} scrapes {ev.name}{where}" +
                 (f"; SQL at {c.query_url}" if c.query_url else f"; store {ev.store}"))


def _plugin(ev: Evidence) -> Check:
    if (skip := _needs(ev, "plugin")) is not None:
        return skip
    assert ev.after is not None
    if ev.after.value("stepline_source_up", source="plugin") is None:
        return Check("plugin", FAIL, "the collector's plugin source is off — drop its --disable-source plugin")
    if ev.steps and not ev.detailed_steps:
        return Check("plugin", FAIL, f"{ev.steps} steps from {ev.name}, none with iteration details — start vLLM "
                     "with --enable-logging-iteration-details")
    if ev.steps:
        return Check("plugin", OK, f"{ev.steps} step{'s' * (ev.steps != 1)} from {ev.name}, iteration details on; "
                     + _scheduling(ev))
    waited = f"no steps from engine {ev.name} in {ev.waited_s:.0f} s"
    if ev.rise("stepline_source_counts_total", source="plugin", counter="unauthorized"):
        return Check("plugin", FAIL, f"{waited}: the collector rejects the plugin's datagrams — give vLLM the "
                     "collector's STEPLINE_PLUGIN_TOKEN")
    if ev.other_steps:
        other = next(iter(ev.other_steps))
        return Check("plugin", FAIL, f"{waited}; steps arrive as engine {other!r} — set STEPLINE_ENGINE={ev.name} "
                     f"in vLLM's environment (or name it {other} in the collector: --engine {other}=URL)")
    silent_s = ev.after.value("stepline_engine_plugin_silent_seconds", engine=ev.name) or 0.0
    moved = 0.0
    if ev.progress_before is not None and ev.progress_after is not None:
        moved = ev.progress_after - ev.progress_before
    if moved > 0 or silent_s > 0:
        seen = f" while its /metrics counters moved by {moved:.0f}" if moved > 0 else ""
        told = f" (the collector has seen it so for {silent_s:.0f} s: a plugin_silent event)" if silent_s else ""
        return Check("plugin", FAIL, f"{waited}{seen}: its plugin is silent{told} — install stepline's plugin "
                     "(pip install stepline) in vLLM's environment, named in VLLM_PLUGINS if that is set, its "
                     "STEPLINE_PLUGIN_SOCKET the collector's; a vLLM that scaled up with elastic EP has dropped it: "
                     "restart vLLM")
    return Check("plugin", FAIL, f"{waited} — start vLLM with --enable-logging-iteration-details and install "
                 "stepline's plugin (pip install stepline) in its environment, its STEPLINE_PLUGIN_SOCKET the "
                 "collector's" + ("" if ev.probed else "; or drop --no-probe (no traffic?)"))


def _scheduling(ev: Evidence) -> str:
    """How the engine core steps, as its steps say: what a step's time means on it (model.schema, steps.step_time)."""
    if ev.batch_queued_steps:
        return ("its core steps through a batch queue (async scheduling, vLLM 0.33's default on GPUs, or pipeline "
                "parallelism): a step's time is the cadence of step ends, vLLM's own elapsed_ms only a wait")
    return "its core steps synchronously: a step's time is vLLM's own elapsed_ms"


def _otlp(ev: Evidence) -> Check:
    if (skip := _needs(ev, "otlp", sql=False)) is not None:
        return skip
    assert ev.after is not None
    if ev.after.value("stepline_source_up", source="otlp") is None:
        return Check("otlp", FAIL, "the collector's otlp source is off — drop its --disable-source otlp")
    spans = ev.rise("stepline_source_counts_total", source="otlp", counter="spans_accepted")
    elsewhere = sorted(e for e in ev.span_requests if e != ev.name)
    if elsewhere and ev.name not in ev.span_requests:
        return Check("otlp", FAIL, f"spans arrive as engine {elsewhere[0]!r}, not {ev.name!r} — set "
                     f"OTEL_SERVICE_NAME={ev.name} in vLLM's environment")
    if spans > 0:
        return Check("otlp", OK, f"{spans:.0f} span{'s' * (spans != 1)} accepted in {ev.waited_s:.1f} s")
    waited = f"no spans in {ev.waited_s:.0f} s"
    if ev.rise("stepline_source_counts_total", source="otlp", counter="requests_unauthorized"):
        return Check("otlp", FAIL, f"{waited}: the collector refuses vLLM's exports (token) — set "
                     "OTEL_EXPORTER_OTLP_TRACES_HEADERS='Authorization=Bearer%20<STEPLINE_OTLP_TOKEN>' for vLLM")
    return Check("otlp", FAIL, f"{waited} — start vLLM with --otlp-traces-endpoint {ev.otlp_hint} and "
                 "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf, opentelemetry-exporter-otlp in its environment"
                 + ("" if ev.probed else "; or drop --no-probe (no traffic?)"))


def _model(ev: Evidence) -> Check:
    served = ev.metrics_model if ev.metrics_model in ev.served else ev.served[0] if ev.served else ""
    named = [(where, model) for where, model in (
        ("/metrics", ev.metrics_model), ("/v1/models", served), ("the plugin", ev.steps_model),
        ("spans", ev.span_requests.get(ev.name, (0, ""))[1])) if model]
    if ev.steps and not ev.steps_model:
        return Check("model", FAIL, f"steps of {ev.name} carry no model name: the collector missed the plugin's "
                     "engine_config (vLLM started first, into an empty store) — restart vLLM")
    if not named:
        return Check("model", SKIP, "nothing names the model (no /metrics, no steps)")
    first_where, first = named[0]
    other = next(((w, m) for w, m in named if m != first), None)
    if other is not None:
        fix = ("give each vLLM its own OTEL_SERVICE_NAME" if other[0] == "spans" else
               "--served-model-name names it in both" if other[0] == "/v1/models" else
               "these steps come from another vLLM: give each its own STEPLINE_ENGINE, and --engine NAME=URL")
        return Check("model", FAIL, f"{first_where} says {first!r}, {other[0]} {other[1]!r} — {fix}")
    return Check("model", OK, f"{first} ({', '.join(w for w, _ in named)}" + (" agree)" if len(named) > 1 else ")"))


def _gpu(ev: Evidence) -> Check:
    if (skip := _needs(ev, "gpu")) is not None:
        return skip
    assert ev.after is not None
    expected = bool(ev.after.value("stepline_gpu_expected"))
    up = ev.after.value("stepline_source_up", source="gpu")
    total, ours = sum(ev.gpus.values()), ev.gpus.get(ev.name, 0)
    if ours:
        return Check("gpu", OK, f"{total} GPUs sampled, {ours} tied to {ev.name}")
    if total:
        owners = ", ".join(repr(e) for e in sorted(ev.gpus) if e) or "no engine"
        return Check("gpu", FAIL, f"{total} GPUs sampled, none tied to {ev.name} ({owners}) — give the collector "
                     f"--engine-process {ev.name}=PID, or STEPLINE_ENGINE_GPUS='{ev.name}=GPU-uuid,...'")
    if up is None:
        return (Check("gpu", FAIL, "the collector's gpu source is off and no GPU was sampled, though GPUs are expected "
                      "(STEPLINE_EXPECT_GPUS) — drop --disable-source gpu, or run the node role")
                if expected else Check("gpu", OK, "the gpu source is off here, and no GPUs are expected"))
    error = next((labels.get("error", "") for labels, v in ev.after.matching(
        "stepline_source_last_error_info", source="gpu") if v), "no GPU sampled")
    if expected:
        return Check("gpu", FAIL, f"{error}, though GPUs are expected (STEPLINE_EXPECT_GPUS) — give the collector "
                     "the GPUs and libnvidia-ml (NVIDIA container runtime, nvidia.com/gpu)")
    return Check("gpu", OK, f"none here ({error}), none expected (STEPLINE_EXPECT_GPUS unset)")


def _store(ev: Evidence) -> Check:
    if ev.collector is None or ev.after is None:
        return Check("store", SKIP, "needs the collector (see collector)")
    if ev.sql_error:
        return Check("store", FAIL, f"cannot read {ev.store}: {ev.sql_error}")
    spool = ev.after.value("stepline_spool_bytes") or 0.0
    errors = ev.rise("stepline_writer_write_errors_total")
    written = ev.rise("stepline_writer_rows_written_total")
    # A segment waits in the spool until its insert returns, so a busy collector's spool is seldom empty at the
    # instant it is read: it is stuck only when inserts fail, or it holds rows while none get written.
    if errors or (spool and not written):
        return Check("store", FAIL, f"{spool / 2**20:.1f} MiB wait in the spool, {errors:.0f} inserts failed in "
                     f"{ev.waited_s:.0f} s — check the store {ev.store}: reachable, disk, parts")
    waiting = f"spool {spool / 2**20:.1f} MiB, draining" if spool else "spool empty"
    return Check("store", OK, f"{ev.store} writable ({written:.0f} rows written in {ev.waited_s:.1f} s), {waiting}")


def _clock(ev: Evidence) -> Check:
    engine = ev.engine_reply.date_offset_s() if ev.engine_reply is not None else None
    local = ev.collector_reply.date_offset_s() if ev.collector_reply is not None else None
    ahead = {source: ev.after.value("stepline_source_clock_skew_max_seconds", source=source)
             for source in ("plugin", "otlp")} if ev.after is not None else {}
    said: list[str] = []
    if engine is not None:
        offset = engine - (local or 0.0)
        if abs(offset) > CLOCK_TOLERANCE_S:
            return Check("clock", FAIL, f"the engine's clock is {offset:+.0f} s off the collector's (HTTP Date) — sync "
                         "both hosts with NTP (chrony)")
        said.append(f"engine and collector agree (HTTP Date, {round(offset):+d} s)")
    for source, skew in ahead.items():
        if skew is not None and skew > AHEAD_TOLERANCE_S:
            return Check("clock", FAIL, f"{source} rows are stamped {skew:+.1f} s ahead of the collector's clock — "
                         "sync the engine's host with NTP")
        if skew is not None:
            said.append(f"{source} rows reach it {-skew:.2f} s after their ts")
    dropped = ev.rise("stepline_writer_rows_dropped_total", reason="ts_out_of_range")
    if dropped:
        return Check("clock", FAIL, f"{dropped:.0f} rows dropped as stamped over 300 s ahead — sync the engine's "
                     "host with NTP")
    return Check("clock", OK, "; ".join(said)) if said else Check("clock", SKIP, "nothing to compare (no engine "
                                                                              "Date, no rows)")


def exit_code(checks: list[Check]) -> int:
    """0 when no check FAILed (a SKIP does not count), else 1."""
    return 1 if any(c.status == FAIL for c in checks) else 0


def as_json(checks: list[Check]) -> str:
    return json.dumps({"ok": exit_code(checks) == 0, "checks": [
        {"check": c.name, "status": c.status, "message": c.message} for c in checks]}, indent=2, sort_keys=True)

