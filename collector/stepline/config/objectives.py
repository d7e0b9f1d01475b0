"""Service-level objectives: what counts as a good request for each SLI, the share of good requests a deployment
promises over a window, and the label each is kept per.

Declared once (`Slo.objectives`), read by the collector's SLI counters (`stepline_slo_requests_total`,
`stepline_slo_good_requests_total`), the burn-rate alerts, the SLO dashboard and `stepline slo`. The defaults are
starting points to change, not promises: 99% of requests with TTFT and mean TPOT within the `Slo` thresholds, and 99%
finishing without an error, over 30 days, per model.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal, get_args

from stepline.model.rows import UNKNOWN_FINISH_REASON, GatewayDecision, Request

Sli = Literal["ttft", "tpot", "availability", "gateway_availability"]
Scope = Literal["model", "lane", "engine"]
SLIS: tuple[Sli, ...] = get_args(Sli)
SCOPES: tuple[Scope, ...] = get_args(Scope)
LATENCY_SLIS: tuple[Sli, ...] = ("ttft", "tpot")
# vLLM's reasons for a request that did not end as the client asked: an engine error, or aborted (which includes a
# client that disconnected: vLLM cannot tell them apart, so the engine-side availability is the conservative one).
FAILED_FINISH_REASONS = ("error", "abort")
_NAME = re.compile(r"[a-z][a-z0-9_]*")


@dataclass(frozen=True)
class Objective:
    """One SLO: `target` of the requests good by `sli`, over `window_days`, per `scope`.

    SLIs: `ttft`, a request's time to first token at most the threshold; `tpot`, its mean time per output token at
    most the threshold; `availability`, the engine finished it without error (finish_reason not error or abort);
    `gateway_availability`, a gateway's routing decision answered below 500 (or the client left first).
    """

    name: str
    sli: Sli
    target: float = 0.99
    scope: Scope = "model"
    """The label the objective is kept per: model (the engine's model name), lane (the gateway lane of the engine's
    latest decision; '' without a gateway) or engine."""
    threshold_seconds: float | None = None
    """The latency SLIs' bound; None: the `Slo`'s (ttft_p99_seconds, tpot_seconds)."""
    window_days: int = 30

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise ValueError(f"objective name {self.name!r}: lower-case letters, digits and _ (it is a label value)")
        if self.sli not in SLIS:
            raise ValueError(f"objective {self.name}: sli {self.sli!r} is not one of {', '.join(SLIS)}")
        if self.scope not in SCOPES:
            raise ValueError(f"objective {self.name}: scope {self.scope!r} is not one of {', '.join(SCOPES)}")
        if self.sli == "gateway_availability" and self.scope == "model":
            raise ValueError(f"objective {self.name}: a gateway's decisions name no model; scope it by lane or engine")
        if not 0 < self.target < 1:
            raise ValueError(f"objective {self.name}: target {self.target} is not between 0 and 1 (e.g. 0.99)")
        if self.threshold_seconds is not None and not 0 < self.threshold_seconds < math.inf:
            raise ValueError(f"objective {self.name}: threshold {self.threshold_seconds} s is not positive")
        if self.window_days < 1:
            raise ValueError(f"objective {self.name}: window of {self.window_days} days")

    @property
    def error_budget(self) -> float:
        """The share of requests allowed to be bad."""
        return 1.0 - self.target


DEFAULT_OBJECTIVES: tuple[Objective, ...] = (
    Objective("ttft", "ttft"),
    Objective("tpot", "tpot"),
    Objective("availability", "availability"),
    Objective("gateway_availability", "gateway_availability", scope="lane"),
)


def judge_request(sli: Sli, threshold_s: float, r: Request) -> bool | None:
    """Whether the report says the request was good by `sli`; None when it does not know (or `sli` is the
    gateway's)."""
    if sli == "ttft":
        return None if math.isnan(r.ttft_seconds) else r.ttft_seconds <= threshold_s
    if sli == "tpot":
        return None if math.isnan(r.mean_tpot_seconds) else r.mean_tpot_seconds <= threshold_s
    if sli == "availability":
        if r.finish_reason in ("", UNKNOWN_FINISH_REASON):
            return None
        return r.finish_reason not in FAILED_FINISH_REASONS
    return None


def judge_decision(d: GatewayDecision) -> bool:
    """Whether a gateway's decision was good for `gateway_availability`: answered below 500, or the client left
    (status 0 without a disconnect: the gateway never answered)."""
    return 0 < d.status < 500 or d.client_disconnected
