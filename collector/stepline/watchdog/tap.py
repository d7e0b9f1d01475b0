"""The progress watchdog: taps the rows flowing to the writers, judges each engine every second.

The model (budgets and states) is in `budget`. Here: the tap (`observe`, on the ingest
path, so it only files rows), the timer thread that assesses each engine, exports the figures on
the collector's /metrics, puts an `engine_state` event on the timeline at each change, and keeps
each engine's top finding (the diagnosis of its last few minutes) fresh: at once when its state
changes, every few seconds while it has work in flight, and now and then while idle, until the
finding has aged out of the window. A page that fires names the cause it has at that moment. It also tells when a
scraped engine works while its plugin sends nothing (`silence`): a `plugin_silent` event and
`stepline_engine_plugin_silent_seconds`. And it counts each finished request against the service-level objectives
(`slo`): the SLIs the burn-rate alerts read.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

from stepline.config.slo import Slo
from stepline.core.clock import Clock, SystemClock
from stepline.core.oneline import one_line
from stepline.core.ratelimit import RateLimitedLog
from stepline.diagnosis.gateway import IN_FLIGHT_METRICS
from stepline.model.rows import (
    EngineSample,
    Event,
    GatewayDecision,
    GatewaySample,
    GpuSample,
    Request,
    Row,
    Step,
    micros,
)
from stepline.store.reads import Reads
from stepline.watchdog.budget import PROGRESS_COUNTERS, STATES, Assessment, EngineModel, Policy
from stepline.watchdog.metrics import WatchdogMetrics
from stepline.watchdog.silence import PluginSilence, resumed_event, silent_event
from stepline.watchdog.slo import SliCounters

log = logging.getLogger(__name__)

SEVERITY = {"idle": "info", "progressing": "info", "slow": "warning", "stalled": "critical", "down": "critical"}
# Exported for every GPU, 0 when unset, so a rule can tell "not throttled" from "no data".
CLOCK_REASONS = ("sw_power_cap", "hw_slowdown", "hw_thermal_slowdown", "sw_thermal_slowdown",
                 "hw_power_brake_slowdown")
GPU_PRESENT_WINDOW_S = 60.0
# A gateway's in-flight count is exported while its latest reading is this recent: a decision's count is true when it
# was made, and a lane that stopped deciding says nothing about its slots now.
GATEWAY_FRESH_S = 60.0
_IN_FLIGHT_METRICS = frozenset(IN_FLIGHT_METRICS)

Emit = Callable[[Sequence[Row]], object]
Label = tuple[str, str, str]  # kind, severity, title
Diagnose = Callable[[Reads, Sequence[str], float], dict[str, Label | None]]
# The window the watchdog diagnoses: long enough for an engine's own baseline, short enough to poll.
DIAGNOSE_WINDOW_S = 300.0
# Findings that name a cause; info notes ("legitimately slow", "cache cold") are not what a page should say.
CAUSE_SEVERITIES = ("critical", "warning")


def top_findings(reader: Reads, engines: Sequence[str], now: float) -> dict[str, Label | None]:
    """engine -> (kind, severity, title) of its top warning or critical finding over the last DIAGNOSE_WINDOW_S,
    or None; one diagnosis for all `engines` (over every engine when there are several)."""
    from stepline.diagnosis.detectors import diagnose
    from stepline.diagnosis.findings import Window  # the detectors are heavy: imported once, when first needed

    end = datetime.fromtimestamp(now, UTC)
    window = Window(end - timedelta(seconds=DIAGNOSE_WINDOW_S), end, engines[0] if len(engines) == 1 else "")
    found: dict[str, Label | None] = dict.fromkeys(engines)
    for f in diagnose(reader, window):  # ranked: the first per engine is its top finding
        if f.engine in found and found[f.engine] is None and f.severity in CAUSE_SEVERITIES:
            found[f.engine] = (f.kind, f.severity, f.title)
    return found


class Watchdog:
    """Per-engine progress watchdog; `observe` is the runner's tap, `evaluate` runs on a timer."""

    def __init__(self, metrics: WatchdogMetrics, emit: Emit, *, host: str = "", clock: Clock | None = None,
                 policy: Policy | None = None, interval_s: float = 1.0,
                 reader_factory: Callable[[], Reads] | None = None, diagnose: Diagnose = top_findings,
                 diagnose_every_s: float = 5.0, diagnose_idle_every_s: float = 60.0, dwell_s: float = 10.0,
                 lane_budgets: dict[str, float] | None = None, expect_plugin: bool = False,
                 slo: Slo | None = None) -> None:
        """`lane_budgets`: lane -> the least stall budget (seconds) of the engines a gateway sends that lane to; a
        lane that is slow by design (monsters pinned to it) gets room, while its crashes and refusals (EngineGone)
        page as on any lane. `expect_plugin`: the collector receives plugin steps, so a scraped engine whose counters
        move without them has a silent plugin (`silence.py`). `slo`: the objectives whose SLIs it counts."""
        self._metrics = metrics
        self._emit = emit
        self._host = host
        self._clock = clock or SystemClock()
        self._policy = policy or Policy()
        self._interval_s = interval_s
        self._reader_factory = reader_factory
        self._reader: Reads | None = None
        self._diagnose = diagnose
        self._diagnose_every_s = diagnose_every_s
        self._diagnose_idle_every_s = diagnose_idle_every_s
        self._dwell_s = dwell_s
        self._lock = threading.Lock()
        self._engines: dict[str, EngineModel] = {}
        self._gpus: dict[tuple[str, int], GpuSample] = {}
        self._gone: dict[str, str] = {}  # GPU index -> the engine its "still gone" series names
        self._last_gpu_ts = 0.0
        self._states: dict[str, tuple[str, float]] = {}  # engine -> (state, since)
        # engine -> (when diagnosed, the state it was in then, its top finding)
        self._findings: dict[str, tuple[float, str, Label | None]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._errors = RateLimitedLog(log, interval_s=60.0)
        self._lane_budgets = dict(lane_budgets or {})
        self._lanes: dict[str, tuple[str, str]] = {}  # engine -> (gateway, lane) of its latest decision
        self._in_flight: dict[tuple[str, str, str], tuple[float, float]] = {}  # (gateway, engine, source) -> ts, n
        self._expect_plugin = expect_plugin
        self._silence = PluginSilence(self._policy.plugin_silent_after_s, self._policy.plugin_delivery_s)
        self._silent: dict[str, float] = {}  # engine -> since when its plugin has been silent
        self._slis = SliCounters(metrics.slo, slo)
        metrics.gpu_present.set(0)

    # --- the tap: on the ingest path, so it files rows and nothing more ---

    def observe(self, rows: Iterable[Row]) -> None:
        """File a batch of rows the sources emitted; never raises."""
        try:
            arrived = self._clock.time()  # a step's arrival, on the clock the scrapes are stamped by
            with self._lock:
                for row in rows:
                    # Exact type checks: the cheapest dispatch, and rows are never subclassed.
                    if type(row) is EngineSample:
                        if row.engine:
                            model = self._model(row.engine, row.ts)
                            model.sample(row)
                            if row.delta > 0 and row.metric in PROGRESS_COUNTERS and model.previous_scrape is not None:
                                self._silence.moved(row.engine, model.previous_scrape, row.ts / 1e6)
                    elif type(row) is Step:
                        if row.engine:
                            self._model(row.engine, row.ts).step(row)
                            self._silence.heard(row.engine, arrived)
                    elif type(row) is GpuSample:
                        self._gpu(row)
                    elif type(row) is Event:
                        self._event(row)
                    elif type(row) is Request:
                        self._request(row)
                    elif type(row) is GatewayDecision:
                        self._decision(row)
                    elif type(row) is GatewaySample and row.engine and row.metric in _IN_FLIGHT_METRICS:
                        self._held(row.gateway, row.engine, row.metric, row.ts, row.value)
        except Exception as exc:  # the watchdog must never cost the timeline a row
            self._errors.warning("observe", "watchdog could not file rows: %s: %s", type(exc).__name__, exc)

    def _model(self, engine: str, ts: int) -> EngineModel:
        model = self._engines.get(engine)
        if model is None:
            model = self._engines[engine] = EngineModel(engine, ts / 1e6, self._policy)
        return model

    def _request(self, r: Request) -> None:
        # The lane of the engine's latest decision: a request's report does not say which lane sent it.
        self._slis.request(r, self._lanes.get(r.engine, ("", ""))[1])
        if r.engine:
            self._model(r.engine, r.ts).request(r)

    def _decision(self, d: GatewayDecision) -> None:
        self._metrics.gateway_decisions.labels(d.gateway, d.lane, _outcome(d)).inc()
        self._slis.decision(d)
        if not d.engine:
            return
        if d.in_flight is not None:
            self._held(d.gateway, d.engine, "decisions", d.ts, float(d.in_flight))
        lane = (d.gateway, d.lane)
        if self._lanes.get(d.engine) != lane:
            old = self._lanes.get(d.engine)
            if old is not None:
                _remove(self._metrics.lane_info, d.engine, *old)
            self._lanes[d.engine] = lane
            self._metrics.lane_info.labels(d.engine, *lane).set(1)
            model = self._model(d.engine, d.ts)
            floor = self._lane_budgets.get(d.lane)
            model.policy = replace(self._policy, floor_s=max(self._policy.floor_s, floor)) if floor else self._policy

    def _held(self, gateway: str, engine: str, source: str, ts: int, value: float) -> None:
        key = (gateway, engine, source)
        seconds = ts / 1e6
        if seconds >= self._in_flight.get(key, (0.0, 0.0))[0]:
            self._in_flight[key] = (seconds, value)

    def _gpu(self, g: GpuSample) -> None:
        self._gpus[(g.engine, g.gpu_index)] = g
        if self._gone:
            self._back(str(g.gpu_index))
        self._last_gpu_ts = max(self._last_gpu_ts, g.ts / 1e6)
        if g.engine:
            self._model(g.engine, g.ts).gpu(g)

    def _event(self, e: Event) -> None:
        if e.kind == "gpu_xid":
            a = e.attributes
            self._metrics.gpu_xid_errors.labels(e.engine, a.get("gpu", ""), a.get("xid", "")).inc()
        elif e.kind == "gpu_lost":
            gpu = e.attributes.get("gpu", "")
            self._metrics.gpu_lost.labels(e.engine, gpu).inc()
            self._back(gpu)  # one series per GPU, under the engine the latest loss named
            self._gone[gpu] = e.engine
            self._metrics.gpu_gone.labels(e.engine, gpu).set(1)
        elif e.engine and e.kind in ("engine_down", "engine_up", "engine_restart"):
            self._model(e.engine, e.ts).event(e)
            if e.kind != "engine_up":  # counters that moved before say nothing of the plugin of what comes next
                self._silence.forget(e.engine)

    def _back(self, gpu: str) -> None:
        """Drop the GPU's "still gone" series: it was sampled again (the source samples only GPUs in rotation), or is
        lost anew, perhaps under another engine."""
        engine = self._gone.pop(gpu, None)
        if engine is not None:
            self._metrics.gpu_gone.remove(engine, gpu)

    # --- the timer ---

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the timer (idempotent); a diagnosis in flight may take up to timeout_s to notice."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        if self._reader is not None:
            close = getattr(self._reader, "close", None)
            if close is not None:
                close()
            self._reader = None

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.evaluate()
                self.refresh_findings()
            except Exception:  # a watchdog bug must not end the watchdog
                log.exception("watchdog evaluation failed")

    def evaluate(self) -> list[Assessment]:
        """Assess every engine now: export the figures, emit an event for each state change."""
        now = self._clock.time()
        events: list[Row] = []
        with self._lock:
            assessments = []
            for name, model in self._engines.items():
                if self._expect_plugin:  # first: a silent plugin's engine is judged as one seen through /metrics
                    self._judge_plugin(name, now, events)
                previous, since = self._states.get(name, (None, now))
                a = model.assess(now, previous, since, self._dwell_s)
                assessments.append(a)
                if a.state != previous:
                    self._states[name] = (a.state, now)
                    # The first benign verdict is no news; a first bad one is.
                    if previous is not None or a.state not in ("idle", "progressing"):
                        events.append(self._state_event(now, a, previous))
                self._export(a, model)
            self._export_gpus(now)
            self._export_gateways(now)
        if events:
            self._emit(events)
        return assessments

    def _state_event(self, now: float, a: Assessment, previous: str | None) -> Event:
        work = f"{a.waiting} waiting, {a.running} running, {a.inflight_prefill_tokens} prefill tokens in flight"
        if a.longest_context_tokens:
            work += f", longest context {a.longest_context_tokens} tokens"
        gpu = "" if a.gpu_utilization is None else f", GPUs {a.gpu_utilization:.0%} busy"
        message = (f"engine {a.engine} {previous or 'unknown'} -> {a.state}: no progress for {a.age_s:.1f}s "
                   f"(budget {a.budget_s:.1f}s); {work}{gpu}; {a.reason}")
        attributes = {"state": a.state, "previous": previous or "", "age_s": f"{a.age_s:.3f}",
                      "budget_s": f"{a.budget_s:.3f}", "expected_step_s": f"{a.expected_step_s:.4f}",
                      "waiting": str(a.waiting), "running": str(a.running),
                      "inflight_prefill_tokens": str(a.inflight_prefill_tokens),
                      "decoding_requests": str(a.decoding_requests),
                      "longest_context_tokens": str(a.longest_context_tokens), "reason": a.reason}
        if a.gpu_utilization is not None:
            attributes["gpu_utilization"] = f"{a.gpu_utilization:.3f}"
        return Event(micros(now), self._host, a.engine, "watchdog", "engine_state", SEVERITY[a.state],
                     message[:500], attributes)

    def _export(self, a: Assessment, model: EngineModel) -> None:
        m, e = self._metrics, a.engine
        m.progress_age.labels(e).set(a.age_s)
        m.progress_budget.labels(e).set(a.budget_s)
        for state in STATES:
            m.engine_state.labels(e, state).set(1 if state == a.state else 0)
        m.waiting_requests.labels(e).set(a.waiting)
        m.running_requests.labels(e).set(a.running)
        m.inflight_prefill.labels(e).set(a.inflight_prefill_tokens)
        m.longest_context.labels(e).set(a.longest_context_tokens)
        m.queued_behind_prefill.labels(e).set(a.queued_behind_prefill)
        m.preemptions.labels(e).inc(model.pending_preemptions)
        model.pending_preemptions = 0
        for gauge, value in ((m.gpu_utilization, a.gpu_utilization), (m.itl_p99, a.itl_p99_s),
                             (m.prefill_step_share, a.prefill_step_share),
                             (m.prefix_cache_hit_ratio, a.prefix_cache_hit_ratio),
                             (m.kv_cache_usage, a.kv_cache_usage)):
            if value is None:
                _remove(gauge, e)  # absent, not 0: "no data" must not read as "idle GPU" or "no hits"
            else:
                gauge.labels(e).set(value)

    def _judge_plugin(self, engine: str, now: float, events: list[Row]) -> None:
        """Export how long the engine's plugin has been silent; an event when it falls silent and when it is back."""
        silent = self._silence.silent_s(engine, now)
        self._metrics.plugin_silent.labels(engine).set(silent or 0.0)
        self._engines[engine].plugin_silent = silent is not None
        since = self._silent.get(engine)
        if silent is not None and since is None:
            self._silent[engine] = now - silent
            unscraped = sorted(e for e, m in self._engines.items() if m.has_steps and m.last_scrape is None)
            events.append(silent_event(self._host, engine, now, silent, self._silence.heard_at(engine), unscraped))
        elif silent is None and since is not None:
            del self._silent[engine]
            heard = self._silence.heard_at(engine)
            if heard is not None and heard >= since:  # not when it was forgotten (the engine went down)
                events.append(resumed_event(self._host, engine, now, heard - since))

    def _export_gpus(self, now: float) -> None:
        m = self._metrics
        m.gpu_present.set(1 if now - self._last_gpu_ts <= GPU_PRESENT_WINDOW_S else 0)
        for (engine, index), g in self._gpus.items():
            gpu = str(index)
            if g.sm_clock_mhz == g.sm_clock_mhz:
                m.gpu_sm_clock.labels(engine, gpu).set(g.sm_clock_mhz)
            flags = set(g.clock_event_flags)
            for reason in sorted(flags.union(CLOCK_REASONS)):
                m.gpu_clock_event_active.labels(engine, gpu, reason).set(1 if reason in flags else 0)
            for state, value in (("pending", g.remapped_rows_pending), ("failed", g.remapped_rows_failure)):
                if value is not None:  # None: the GPU has no row remapper, or the reading failed
                    m.gpu_row_remap.labels(engine, gpu, state).set(1 if value else 0)

    def _export_gateways(self, now: float) -> None:
        for key, (ts, value) in list(self._in_flight.items()):
            if now - ts <= GATEWAY_FRESH_S:
                self._metrics.gateway_in_flight.labels(*key).set(value)
            else:
                del self._in_flight[key]
                _remove(self._metrics.gateway_in_flight, *key)

    # --- each engine's top finding ---

    def _due(self, now: float) -> list[str]:
        """Engines to diagnose now: a state changed since the last diagnosis, work in flight and diagnose_every_s
        passed, or idle with a finding still shown and diagnose_idle_every_s passed (so that it ages out)."""
        due = []
        for engine, (state, _) in self._states.items():
            at, diagnosed_in, found = self._findings.get(engine, (-1e18, "", None))
            busy = state not in ("idle", "down")  # every other state has requests waiting or running
            if (state != diagnosed_in and state != "idle") or (busy and now - at >= self._diagnose_every_s) or (
                    found is not None and now - at >= self._diagnose_idle_every_s):
                due.append(engine)
        return due

    def refresh_findings(self) -> None:
        """Diagnose the engines that are due (in the timer's thread), all in one diagnosis."""
        if self._reader_factory is None:
            return
        now = self._clock.time()
        with self._lock:
            due = self._due(now)
            states = {e: self._states[e][0] for e in due}
        if not due:
            return
        try:
            if self._reader is None:
                self._reader = self._reader_factory()
            found = self._diagnose(self._reader, due, now)
        except Exception as exc:  # a store hiccup costs the finding, not the watchdog
            self._errors.warning("diagnose", "watchdog diagnosis of %s failed: %s: %s", ", ".join(due),
                                 type(exc).__name__, one_line(exc, 200))
            with self._lock:
                for engine in due:  # kept as it was, tried again when next due
                    _, _, old = self._findings.get(engine, (0.0, "", None))
                    self._findings[engine] = (now, states[engine], old)
            return
        with self._lock:
            for engine in due:
                self._set_finding(engine, found.get(engine), now, states[engine])

    def _set_finding(self, engine: str, found: Label | None, at: float, state: str) -> None:
        old = self._findings.get(engine, (0.0, "", None))[2]
        if old is not None and old != found:
            _remove(self._metrics.top_finding, engine, *old)
        if found is not None:
            self._metrics.top_finding.labels(engine, *found).set(1)
        self._findings[engine] = (at, state, found)


def _outcome(d: GatewayDecision) -> str:
    """What became of a decision, for the gateway_decisions counter."""
    # Unmeasured counts only against a bar in force: a gateway that does not route by size measures nothing.
    unmeasured = d.size_chars is None and d.size_bytes is None and d.size_tokens is None
    if d.swallowed_exception or (unmeasured and d.threshold is not None):
        return "failed_open"
    if d.client_disconnected:
        return "disconnected"
    if d.status in (429, 503):
        return "refused"
    if d.status >= 400 or d.error_type:
        return "error"
    return "answered"


def _remove(gauge: Any, *labels: str) -> None:
    with contextlib.suppress(KeyError):  # never set: nothing to remove
        gauge.remove(*labels)
