"""Time to truth: a cause injected live, and when each thing an operator meets first says so.

One run serves a live case (`generator.live_case`) in real time beside a collector as `stepline collect` runs it
(scrapes every 5 s, the plugin, OTLP, the GPU source over the simulated GPUs), with the generated alert rules in a
real Prometheus and Alertmanager (`stepline.testing.alertstack`), and polls, every `poll_s`:
- `diagnose` over the last 3 minutes, every engine (what `stepline diagnose --since 3m` prints), timed;
- the collector's /metrics: the watchdog's state and top finding for the engine;
and keeps every page Alertmanager sends. The result says, from the cause's onset: when the top finding first named
the cause (and the watchdog's), when the first page naming it arrived, what wrong findings were shown before, and
for a run with nothing injected, every warning or critical finding and page (false alarms).
"""

from __future__ import annotations

import os
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from stepline.alerting.config import AlertConfig
from stepline.app.collector import Collector
from stepline.config.settings import Settings
from stepline.diagnosis.detectors import diagnose
from stepline.diagnosis.findings import Window
from stepline.drills.generator import live_case
from stepline.drills.live import LiveEngine
from stepline.queries.window import ENGINE
from stepline.store.reads import scalar
from stepline.testing.alertstack import AlertStack, Webhook

POLL_WINDOW = timedelta(minutes=3)
# The alert that is itself the cause's name: its page names the cause whatever its text says.
CAUSE_ALERTS = {"gpu_xid": "GpuXidError", "kv_pressure": "KVCachePressure", "gpu_throttling": "GpuThrottling",
                "prefix_cache_collapse": "PrefixCacheCollapse", "head_of_line_blocking": "HeadOfLineBlocking",
                "wedged_engine": "EngineWedgedWithQueue"}
ALARMING = ("warning", "critical")
# Prometheus scrapes the collector and evaluates the rules this often in the run (1 s, as the alert tests do).
RULE_INTERVAL_S = 1.0


@dataclass
class Poll:
    """One poll: when, what diagnose ranked first (severity, kind, engine, title), how long it took, and what
    the watchdog exported for the engine (state, 'severity kind: title' of its top finding)."""

    at: float
    top: tuple[str, str, str, str] | None
    diagnose_s: float
    state: str
    watchdog_finding: str | None


@dataclass
class LiveResult:
    cause: str
    description: str
    truth_kind: str | None
    engine: str
    onset: float | None  # wall-clock time of the onset (None: nothing injected)
    polls: list[Poll] = field(default_factory=list)
    pages: list[dict[str, Any]] = field(default_factory=list)  # Alertmanager's alerts, as sent
    request_finished: float | None = None  # the injected request's finish (a monster's), wall clock
    last_step: float | None = None

    def since_onset(self, t: float | None) -> float | None:
        return None if t is None or self.onset is None else t - self.onset

    def _right(self, top: tuple[str, str, str, str] | None) -> bool:
        return top is not None and top[1] == self.truth_kind and top[2] == self.engine

    def first_correct(self) -> float | None:
        """When diagnose first ranked the cause first (at or after the onset), wall clock."""
        return next((p.at for p in self.polls if self.onset is not None and p.at >= self.onset
                     and self._right(p.top)), None)

    def first_watchdog(self) -> float | None:
        """When the watchdog's exported top finding first named the cause."""
        want = f" {self.truth_kind}: "
        return next((p.at for p in self.polls if self.onset is not None and p.at >= self.onset
                     and p.watchdog_finding is not None and want in f" {p.watchdog_finding}"), None)

    def wrong_before(self) -> list[str]:
        """Distinct warning/critical top findings shown before the first correct one (or ever, if none)."""
        until = self.first_correct() or float("inf")
        seen: list[str] = []
        for p in self.polls:
            if p.at >= until:
                break
            if p.top is not None and p.top[0] in ALARMING and not self._right(p.top):
                label = f"{p.top[0]} {p.top[1]}@{p.top[2]}"
                if label not in seen:
                    seen.append(label)
        return seen

    def firing(self) -> list[dict[str, Any]]:
        """Firing alerts of this engine that page or ticket (warning or critical), first arrival of each."""
        out: dict[tuple[str, str], dict[str, Any]] = {}
        for a in self.pages:
            labels = a["labels"]
            if a["status"] == "firing" and labels.get("engine") == self.engine and labels.get("severity") in ALARMING:
                out.setdefault((labels["alertname"], labels["severity"]), a)
        return sorted(out.values(), key=lambda a: a["received"])

    def names_cause(self, alert: dict[str, Any]) -> bool:
        """Whether a page names the cause: its top finding says so, or it is the cause's own alert."""
        return (f" {self.truth_kind}: " in alert["annotations"].get("description", "")
                or CAUSE_ALERTS.get(self.truth_kind or "") == alert["labels"]["alertname"])

    def first_page(self) -> dict[str, Any] | None:
        """The first page (critical alert) or ticket that names the cause."""
        return next((a for a in self.firing() if self.names_cause(a)), None)

    def false_findings(self) -> list[str]:
        """For a run with nothing injected: every distinct warning/critical top finding."""
        if self.truth_kind is not None:
            return []
        return sorted({f"{p.top[0]} {p.top[1]}@{p.top[2]}" for p in self.polls
                       if p.top is not None and p.top[0] in ALARMING})

    def diagnose_seconds(self) -> list[float]:
        return [p.diagnose_s for p in self.polls]


def _watchdog(metrics_url: str, engine: str) -> tuple[str, str | None]:
    with urllib.request.urlopen(metrics_url, timeout=5) as response:
        text = response.read().decode()
    state, finding = "", None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("engine") != engine or sample.value != 1:
                continue
            if sample.name == "stepline_engine_state":
                state = sample.labels["state"]
            elif sample.name == "stepline_engine_top_finding_info":
                finding = f"{sample.labels['severity']} {sample.labels['kind']}: {sample.labels['title']}"
    return state, finding


def run_live(cause: str, *, seed: int = 0, duration_s: float = 75.0, poll_s: float = 2.0, tail_s: float = 10.0,
             workdir: Path | None = None, store_url: str | None = None,
             stop_when: Callable[[LiveResult], bool] | None = None, async_scheduling: bool = False) -> LiveResult:
    """Serve `cause` live for `duration_s` (and its drain, unless `stop_when(result)` says enough), polling every
    `poll_s`, into `store_url` (default: an embedded store in a temporary directory; chDB hosts one path per
    process, so a process that has one passes a database of it). Needs Prometheus and Alertmanager on PATH.
    `async_scheduling`: the engine schedules as vLLM 0.33 does on GPUs (generator.scheduled_async)."""
    case, onset_s = live_case(cause, seed, duration_s, async_scheduling)
    name, scenario = case.engines[0]
    with tempfile.TemporaryDirectory(prefix="stepline-ttt-") as tmp:
        work = workdir or Path(tmp)
        hook = Webhook()
        cfg = replace(AlertConfig(), webhook_url=f"{hook.url}/stepline", heartbeat_url=f"{hook.url}/heartbeat",
                      evaluation_interval=f"{RULE_INTERVAL_S:g}s")
        engine = LiveEngine(name, scenario)
        result = LiveResult(cause, case.description, case.truth_kind, name,
                            None if onset_s is None else engine.at(onset_s))
        settings = Settings.from_env({}, store=store_url or f"chdb://{tmp}/store", engines=(f"{name}={engine.url}",),
                                     metrics_port=0, query_port=0, otlp_port=0,
                                     plugin_socket=os.path.join(tmp, "plugin.sock"),
                                     disabled_sources=frozenset({"gpu"}))
        collector = Collector(settings, extra=lambda ctx: [engine.gpu_source(ctx)])
        stack: AlertStack | None = None
        try:
            collector.start()
            engine.attach(collector)
            assert collector.metrics_server is not None and collector.store is not None
            metrics_url = f"http://127.0.0.1:{collector.metrics_server.port}/metrics"
            stack = AlertStack(cfg, hook, collector.metrics_server.port, work, scrape_s=RULE_INTERVAL_S)
            reader = collector.store.reader()
            total = duration_s + scenario.workload.drain_s
            done_at: float | None = None
            while time.time() < engine.at(total) + tail_s:
                started = time.monotonic()
                now = time.time()
                end = datetime.fromtimestamp(now, UTC)
                findings = diagnose(reader, Window(end - POLL_WINDOW, end, ""))
                took = time.monotonic() - started
                top = findings[0] if findings else None
                state, finding = _watchdog(metrics_url, name)
                result.polls.append(Poll(now, None if top is None else (top.severity, top.kind, top.engine,
                                                                        top.title), took, state, finding))
                result.pages = hook.snapshot()
                if done_at is None and (engine.done() or (stop_when is not None and stop_when(result))):
                    done_at = time.time()
                if done_at is not None and time.time() >= done_at + tail_s:
                    break
                time.sleep(max(0.0, poll_s - (time.monotonic() - started)))
            result.pages = hook.snapshot()
            store = collector.store
            # The earliest report's ts is the merged one (requests merge ts by min): no merged read needed.
            finished = scalar(store.query(f"SELECT toFloat64(min(ts)) FROM requests WHERE {ENGINE} AND "
                                          "(request_id LIKE '%-monster-%' OR request_id LIKE '%-long-%')",
                                          parameters={"engine": name}))
            result.request_finished = float(finished) if finished else None
            last = scalar(store.query(f"SELECT toFloat64(max(ts)) FROM steps WHERE {ENGINE}",
                                      parameters={"engine": name}))
            result.last_step = float(last) if last else None
            if cause == "wedge" and result.last_step is not None:
                result.onset = result.last_step  # the wedge begins when progress stops: the engine's last step
            close = getattr(reader, "close", None)
            if close is not None:
                close()
        finally:
            if stack is not None:
                stack.stop()
            engine.stop()
            collector.stop()
            hook.close()
    return result
