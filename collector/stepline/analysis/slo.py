"""The objectives (`Slo.objectives`) over a window, from the store: per objective and scope, how many requests its SLI
judged, how many were good, and how much of the error budget that spent. `stepline slo` prints it.

Each SLI reads what the collector's counters read (`config.objectives.judge_request`, `judge_decision`), from the
merged requests (a request's two reports as one row) and the gateway's decisions; a lane-scoped request objective
takes the lane from the gateway's decision for that request (the counters, seeing one report at a time, take the
engine's latest).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from stepline.config.objectives import FAILED_FINISH_REASONS, Objective
from stepline.config.slo import Slo
from stepline.core.texttable import render_table
from stepline.model.rows import UNKNOWN_FINISH_REASON
from stepline.queries.requests import MERGED
from stepline.queries.window import SINCE
from stepline.store.reads import Reads

_FAILED = ", ".join(f"'{r}'" for r in FAILED_FINISH_REASONS)
# What each request SLI reads, and when a request counts and is good (as `judge_request`).
_REQUEST_SLI = {
    "ttft": ("ttft_seconds", "NOT isNaN(ttft_seconds)", "ttft_seconds <= {threshold:Float64}"),
    "tpot": ("mean_tpot_seconds", "NOT isNaN(mean_tpot_seconds)", "mean_tpot_seconds <= {threshold:Float64}"),
    "availability": ("finish_reason", f"finish_reason NOT IN ('', '{UNKNOWN_FINISH_REASON}')",
                     f"finish_reason NOT IN ({_FAILED})"),
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
    scope: str  # "model=...", "lane=...", "engine=..."
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
    """One pass over the merged requests for every request objective (each `o{i}`, its threshold bound as
    {threshold_i:Float64}): per model, engine and lane, how many requests each objective's SLI judged and how many
    were good. Reading the requests merged is most of the cost, so it is done once, not once per objective."""
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
        good = good.replace("{threshold:Float64}", f"{{threshold_{i}:Float64}}")
        counts.append(f"countIf({known}) AS total_{i}, countIf(({known}) AND ({good})) AS good_{i}")
    return (f"SELECT toString(model_name) AS model, toString(engine) AS engine, toString({lane}) AS lane, "
            f"{', '.join(counts)} FROM {source} GROUP BY model, engine, lane")


def _decision_sql(o: Objective) -> str:
    scope = _SCOPE_COLUMN[o.scope]
    return (f"SELECT toString({scope}) AS scope, count() AS total, "
            "countIf((status > 0 AND status < 500) OR client_disconnected) AS good "
            f"FROM gateway_decisions WHERE {SINCE} GROUP BY scope ORDER BY scope")


def statuses(reader: Reads, slo: Slo, *, since: float) -> list[SloStatus]:
    """Every objective in every scope that had requests since `since` (epoch seconds)."""
    since_us = round(since * 1e6)
    on_requests = [o for o in slo.objectives if o.sli != "gateway_availability"]
    counted: dict[str, dict[str, list[int]]] = {o.name: {} for o in on_requests}
    if on_requests:
        parameters: dict[str, object] = {"since": since_us}
        parameters.update({f"threshold_{i}": slo.threshold(o) for i, o in enumerate(on_requests)})
        for row in reader.query(_requests_sql(on_requests), parameters=parameters).result_rows:
            by_scope = {"model": str(row[0]), "engine": str(row[1]), "lane": str(row[2])}
            for i, o in enumerate(on_requests):
                total, good = int(row[3 + 2 * i]), int(row[4 + 2 * i])
                if total:
                    sums = counted[o.name].setdefault(by_scope[o.scope], [0, 0])
                    sums[0] += total
                    sums[1] += good
    out = []
    for o in slo.objectives:
        if o.sli == "gateway_availability":
            for scope, total, good in reader.query(_decision_sql(o), parameters={"since": since_us}).result_rows:
                out.append(SloStatus(o.name, o.sli, f"{o.scope}={scope}", int(total), int(good), o.target))
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
