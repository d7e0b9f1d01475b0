"""The SLIs as counters: each finished request judged once per objective (`stepline.config.objectives`), counted in
`stepline_slo_requests_total` and, when good, `stepline_slo_good_requests_total`; the burn-rate rules divide them.

A request may be reported twice (the plugin, and OTLP milliseconds to seconds later), each report knowing some of its
fields. An objective counts a request once, from the first report that knows what its SLI reads; the two reports
are told to be of one request as the writer tells them (same engine and id, arrivals within
`ingest.merge.arrival_tolerance_us`). The memory of reports is bounded in count, and so is the number of label sets:
past it a request is not counted, `stepline_slo_requests_dropped_total` says how many, and a log line (once a minute)
which.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

from prometheus_client import CollectorRegistry, Counter

from stepline.config.objectives import GATEWAY_SLIS, judge_decision, judge_request
from stepline.config.slo import Slo
from stepline.core.ratelimit import RateLimitedLog
from stepline.ingest.merge import arrival_tolerance_us
from stepline.model.rows import GatewayDecision, Request

log = logging.getLogger(__name__)

MAX_SERIES = 2000
"""Label sets (objective, engine, model, lane, tenant) the counters may hold: a fleet's models, lanes and tenants fit
many times over; a client sending a new model name with every request does not."""
MAX_REMEMBERED = 100_000
"""Requests remembered to tell a second report from a new request: minutes of a busy fleet's traffic, far more than
the seconds between a request's two reports."""

Labels = tuple[str, str, str, str, str]  # objective, engine, model, lane, tenant ('' unless the objective's scope)


class SloMetrics:
    """The SLIs of the objectives (`stepline.config.objectives`) as good/total counters, what the burn-rate rules
    divide."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        labels = ["objective", "engine", "model", "lane", "tenant"]
        self.slo_requests = Counter(
            "stepline_slo_requests", "Requests the objective's SLI judged (those whose reports tell it: a TTFT, a "
            "mean TPOT, a finish reason, a gateway's status or first byte), each once; lane: the gateway lane of the "
            "engine's latest decision ('' without a gateway); model '' for a gateway's decisions; tenant: who sent "
            "it as the gateway says, for a tenant's objective only ('' otherwise).", labels, registry=r)
        self.slo_good_requests = Counter(
            "stepline_slo_good_requests", "Of stepline_slo_requests_total, those good by the objective's SLI.", labels,
            registry=r)
        self.slo_dropped = Counter(
            "stepline_slo_requests_dropped", "Requests an objective's SLI did not count because their label set "
            "would have passed the collector's bound on SLI series.", ["objective"], registry=r)


class SliCounters:
    """Judges each request once per objective and counts it under its labels; `request` and `decision` are called
    from the watchdog's tap, under its lock."""

    def __init__(self, metrics: SloMetrics, slo: Slo | None = None, *, max_series: int = MAX_SERIES,
                 max_remembered: int = MAX_REMEMBERED) -> None:
        self._metrics = metrics
        self._slo = slo or Slo()
        self._requests = [(o.name, o.sli, self._slo.threshold(o)) for o in self._slo.objectives
                          if o.sli != "gateway_availability"]
        self._decisions = [(o.name, o.sli, self._slo.threshold(o), o.scope == "tenant")
                           for o in self._slo.objectives if o.sli in GATEWAY_SLIS]
        self._max_series = max_series
        self._max_remembered = max_remembered
        self._series: set[Labels] = set()
        # (engine, request id) -> [(arrival µs, names of the objectives that counted it)], oldest first.
        self._seen: OrderedDict[tuple[str, str], list[tuple[int, set[str]]]] = OrderedDict()
        self._dropped_log = RateLimitedLog(log, interval_s=60.0)

    def request(self, r: Request, lane: str) -> None:
        """Count a report of a finished request for each objective it tells and no earlier report of it did."""
        counted = self._counted(r)
        for name, sli, threshold in self._requests:
            if name in counted:
                continue
            good = judge_request(sli, threshold, r)
            if good is not None:
                counted.add(name)
                self._count((name, r.engine, r.model_name, lane, ""), good)

    def decision(self, d: GatewayDecision) -> None:
        """Count a gateway's routing decision for each gateway objective it tells (each attempt: a retry is a
        decision too); a tenant's objective under the tenant the decision names ('' where it names none)."""
        for name, sli, threshold, by_tenant in self._decisions:
            good = judge_decision(sli, threshold, d)
            if good is not None:
                self._count((name, d.engine, "", d.lane, d.tenant if by_tenant else ""), good)

    def _counted(self, r: Request) -> set[str]:
        """The objectives that already counted the request this report is of (a set to add to)."""
        key = (r.engine, r.request_id)
        known = self._seen.get(key)
        if known is None:
            known = self._seen[key] = []
            if len(self._seen) > self._max_remembered:
                self._seen.popitem(last=False)
        tolerance = arrival_tolerance_us(r)
        for arrival, counted in known:
            if abs(arrival - r.arrival_ts) <= tolerance:
                return counted
        fresh: set[str] = set()
        known.append((r.arrival_ts, fresh))
        return fresh

    def _count(self, labels: Labels, good: bool) -> None:
        if labels not in self._series:
            if len(self._series) >= self._max_series:
                self._metrics.slo_dropped.labels(labels[0]).inc()
                self._dropped_log.warning(
                    "series", "SLI of objective %s not counted for engine %r, model %r, lane %r, tenant %r: the SLI "
                    "counters "
                    "hold %d label sets already (stepline_slo_requests_dropped_total counts what is left out)",
                    *labels, self._max_series)
                return
            self._series.add(labels)
            self._metrics.slo_good_requests.labels(*labels)  # 0 from the first request: a ratio needs both series
        self._metrics.slo_requests.labels(*labels).inc()
        if good:
            self._metrics.slo_good_requests.labels(*labels).inc()
