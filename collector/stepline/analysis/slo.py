"""The objectives (`Slo.objectives`) over a window, from the store: per objective and scope, how many requests its SLI
judged, how many were good, and how much of the error budget that spent. `stepline slo` prints it.

Each SLI reads what the collector's counters read (`config.objectives.judge_request`, `judge_decision`), from the
merged requests (a request's two reports as one row) and the gateway's decisions; a lane-scoped request objective
takes the lane from the gateway's decision for that request (the counters, seeing one report at a time, take the
engine's latest).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from stepline.config.objectives import FAILED_FINISH_REASONS, GATEWAY_SLIS, Objective
from stepline.config.slo import Slo
from stepline.core.texttable import render_table
from stepline.model.rows import UNKNOWN_FINISH_REASON
from stepline.queries.gateway import TENANT
from stepline.queries.query import param
from stepline.queries.requests import MERGED
from stepline.queries.window import SINCE
from stepline.store.reads import Reads, named

_FAILED = ", ".join(f"'{r}'" for r in FAILED_FINISH_REASONS)
# What each request SLI reads, and when a request counts and is good (as `judge_request`), given the placeholder its
# threshold is bound to.
_REQUEST_SLI: dict[str, tuple[str, str, Callable[[str], str]]] = {
    "ttft": ("ttft_seconds", "NOT isNaN(ttft_seconds)", lambda threshold: f"ttft_seconds <= {threshold}"),
    "tpot": ("mean_tpot_seconds", "NOT isNaN(mean_tpot_seconds)", lambda bound: f"mean_tpot_seconds <= {bound}"),
    "availability": ("finish_reason", f"finish_reason NOT IN ('', '{UNKNOWN_FINISH_REASON}')",
                     lambda _: f"finish_reason NOT IN ({_FAILED})"),
}
_SCOPE_COLUMN = {"model": "model_name", "engine": "engine", "lane": "lane"}
# The lane of each request a gateway routed: its latest decision's (a retry may change lanes).
_LANES = ("(SELECT engine, request_id, argMax(lane, ts) AS lane FROM gateway_decisions WHERE "
          f"{SINCE} GROUP BY engine, request_id)")


@dataclass(frozen=True)
class SloStatus:
    """One objective in one scope over the window."""

    objective: str
    sli: str
    scope: str  # "model=...", "lane=...", "engine=...", "tenant=..."
    total: int
    good: int
    target: float

    @property
    def ratio(self) -> float:
        """The SLI: the share of requests good (NaN without any)."""
        return self.good / self.total if self.total else math.nan

    @property
    def budget_used(self) -> float:
        """The share of the error budget spent: bad requests over those the target allows (above 1: overspent)."""
        return (self.total - self.good) / (self.total * (1 - self.target)) if self.total else 0.0

    def as_dict(self) -> dict[str, object]:
        ratio = None if math.isnan(self.ratio) else self.ratio
        return {**asdict(self), "sli_ratio": ratio, "budget_used": self.budget_used,
                "budget_left": 1 - self.budget_used}


def _requests_sql(objectives: Sequence[Objective]) -> str:
    """One pass over the merged requests for every request objective (the i-th's counts total_i and good_i, its
    threshold bound as threshold_i): per model, engine and lane, how many requests each objective's SLI judged and
    how many were good. Reading the requests merged is most of the cost, so it is done once, not once per objective."""
    by_lane = any(o.scope == "lane" for o in objectives)
    columns = ("engine", *(("request_id",) if by_lane else ()), "model_name",
               *dict.fromkeys(_REQUEST_SLI[o.sli][0] for o in objectives))
    # The merged read (queries.requests.MERGED, partition by partition) streams the sorted parts; grouping the
    # reports by their key instead (queries.requests.merged_matching) built a hash table of every request: 56 s for a
    # week of an 8-GPU node (14.5M requests) against 1-3 s (benchmarks/RESULTS.md, "Usage and SLO at scale").
    source = f"(SELECT {', '.join(columns)} FROM {MERGED} WHERE {SINCE})"
    lane = "''"
    if by_lane:
        source = f"(SELECT r.*, l.lane AS lane FROM {source} AS r LEFT JOIN {_LANES} AS l USING (engine, request_id))"
        lane = "lane"
    counts = []
    for i, o in enumerate(objectives):
        _, known, good = _REQUEST_SLI[o.sli]
        counts.append(f"countIf({known}) AS total_{i}, "
                      f"countIf(({known}) AND ({good(param(f'threshold_{i}', 'Float64'))})) AS good_{i}")
    return (f"SELECT toString(model_name) AS model, toString(engine) AS engine, toString({lane}) AS lane, "
            f"{', '.join(counts)} FROM {source} GROUP BY model, engine, lane")


# What each gateway SLI reads, as `judge_decision`: when a decision counts, and when it is good.
_DECISION_SLI = {
    "gateway_availability": ("1", "(status > 0 AND status < 500) OR client_disconnected"),
    "gateway_first_byte": ("first_byte_ts IS NOT NULL OR NOT client_disconnected",
                           "first_byte_ts IS NOT NULL AND "
                           f"dateDiff('microsecond', ts, first_byte_ts) <= {param('threshold', 'Float64')} * 1000000"),
}


def _decision_sql(o: Objective) -> str:
    known, good = _DECISION_SLI[o.sli]
    scope = TENANT if o.scope == "tenant" else _SCOPE_COLUMN[o.scope]
    return (f"SELECT toString({scope}) AS scope, count() AS total, countIf({good}) AS good "
            f"FROM gateway_decisions WHERE {SINCE} AND ({known}) GROUP BY scope ORDER BY scope")


def statuses(reader: Reads, slo: Slo, *, since: float) -> list[SloStatus]:
    """Every objective in every scope that had requests since `since` (epoch seconds)."""
    since_us = round(since * 1e6)
    on_requests = [o for o in slo.objectives if o.sli not in GATEWAY_SLIS]
    counted: dict[str, dict[str, list[int]]] = {o.name: {} for o in on_requests}
    if on_requests:
        parameters: dict[str, object] = {"since": since_us}
        parameters.update({f"threshold_{i}": slo.threshold(o) for i, o in enumerate(on_requests)})
        for row in named(reader.query(_requests_sql(on_requests), parameters=parameters)):
            by_scope = {"model": str(row.model), "engine": str(row.engine), "lane": str(row.lane)}
            for i, o in enumerate(on_requests):
                total, good = int(getattr(row, f"total_{i}")), int(getattr(row, f"good_{i}"))
                if total:
                    sums = counted[o.name].setdefault(by_scope[o.scope], [0, 0])
                    sums[0] += total
                    sums[1] += good
    out = []
    for o in slo.objectives:
        if o.sli in GATEWAY_SLIS:
            parameters = {"since": since_us, "threshold": slo.threshold(o)}
            for r in named(reader.query(_decision_sql(o), parameters=parameters)):
                out.append(SloStatus(o.name, o.sli, f"{o.scope}={r.scope}", int(r.total), int(r.good), o.target))
            continue
        for scope, (total, good) in sorted(counted[o.name].items()):
            out.append(SloStatus(o.name, o.sli, f"{o.scope}={scope}", total, good, o.target))
    return out


def render(found: Sequence[SloStatus]) -> str:
    """An aligned table: each objective and scope, its SLI against its target, and the error budget."""
    rows = [[s.objective, s.scope, str(s.total), str(s.good), _pct(s.ratio, 3), _pct(s.target, 3),
             _pct(s.budget_used, 1), _pct(1 - s.budget_used, 1)] for s in found]
    return render_table(["objective", "scope", "total", "good", "SLI", "target", "budget used", "budget left"], rows)


def _pct(value: float, digits: int) -> str:
    return "-" if math.isnan(value) else f"{value * 100:.{digits}f}%"
