"""Service-level objectives: what counts as a good request for each SLI, the share of good requests a deployment
promises over a window, and the label each is kept per.

Declared once (`Slo.objectives`; a deployment's own in an objectives file, `load_objectives`, that the collector,
`stepline alerts build`, `dashboards build` and `slo` are all given), read by the collector's SLI counters
(`stepline_slo_requests_total`, `stepline_slo_good_requests_total`), the burn-rate alerts, the SLO dashboard and
`stepline slo`. The defaults are starting points to change, not promises: 99% of requests with TTFT and mean TPOT
within the `Slo` thresholds, and 99% finishing without an error, over 30 days, per model; 99% of each lane's and each
tenant's requests answered by the gateway.

A tenant is known only where a gateway says who sent a request (the team, else the API key's alias, else the end user,
else the user: `model.rows.tenant_of`), so a tenant's objectives are the gateway's SLIs, judged on its decisions: what
the tenant saw, the gateway's own first byte and status. The engine's reports name no sender: tying them to one takes
the gateway join, which the store does (`stepline usage`) and a counter, counting as reports arrive, cannot.
"""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal, get_args

from stepline.model.rows import UNKNOWN_FINISH_REASON, GatewayDecision, Request

Sli = Literal["ttft", "tpot", "availability", "gateway_availability", "gateway_first_byte"]
Scope = Literal["model", "lane", "engine", "tenant"]
SLIS: tuple[Sli, ...] = get_args(Sli)
SCOPES: tuple[Scope, ...] = get_args(Scope)
LATENCY_SLIS: tuple[Sli, ...] = ("ttft", "tpot", "gateway_first_byte")
GATEWAY_SLIS: tuple[Sli, ...] = ("gateway_availability", "gateway_first_byte")
"""The SLIs judged on a gateway's decisions, the only ones a tenant's objective can read."""
# vLLM's reasons for a request that did not end as the client asked: an engine error, or aborted (which includes a
# client that disconnected: vLLM cannot tell them apart, so the engine-side availability is the conservative one).
FAILED_FINISH_REASONS = ("error", "abort")
_NAME = re.compile(r"[a-z][a-z0-9_]*")


@dataclass(frozen=True)
class Objective:
    """One SLO: `target` of the requests good by `sli`, over `window_days`, per `scope`.

    SLIs: `ttft`, a request's time to first token at most the threshold; `tpot`, its mean time per output token at
    most the threshold; `availability`, the engine finished it without error (finish_reason not error or abort);
    `gateway_availability`, a gateway's routing decision answered below 500 (or the client left first);
    `gateway_first_byte`, the gateway's first byte back within the threshold of its decision (the TTFT the client
    saw, queueing and retries included, for a streamed answer; the whole answer's time for one that is not).
    """

    name: str
    sli: Sli
    target: float = 0.99
    scope: Scope = "model"
    """The label the objective is kept per: model (the engine's model name), lane (the gateway lane of the engine's
    latest decision; '' without a gateway), engine, or tenant (who sent the request, as the gateway says: a
    gateway SLI's only)."""
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
        if self.sli in GATEWAY_SLIS and self.scope == "model":
            raise ValueError(f"objective {self.name}: a gateway's decisions name no engine model; scope it by lane, "
                             "engine or tenant")
        if self.scope == "tenant" and self.sli not in GATEWAY_SLIS:
            raise ValueError(f"objective {self.name}: only a gateway knows the tenant; a tenant's objective reads "
                             f"{' or '.join(GATEWAY_SLIS)}, not {self.sli}")
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
    Objective("tenant_availability", "gateway_availability", scope="tenant"),
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


def judge_decision(sli: Sli, threshold_s: float, d: GatewayDecision) -> bool | None:
    """Whether a gateway's decision was good by `sli`; None when it does not tell (or `sli` is the engine's).
    `gateway_availability`: answered below 500, or the client left (status 0 without a disconnect: the gateway never
    answered). `gateway_first_byte`: its first byte within `threshold_s` of the decision; an attempt that sent none
    is bad where it failed, unknown where the client left first."""
    if sli == "gateway_availability":
        return 0 < d.status < 500 or d.client_disconnected
    if sli == "gateway_first_byte":
        if d.first_byte_ts is None:
            return None if d.client_disconnected else False
        return d.first_byte_ts - d.ts <= threshold_s * 1e6
    return None


def load_objectives(path: Path) -> tuple[Objective, ...]:
    """The objectives of a TOML file, one `[[objective]]` table each (the fields of `Objective`:
    name, sli, and optionally target, scope, threshold_seconds, window_days); raises ValueError naming the file and
    what is wrong."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"objectives file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"objectives file {path}: not TOML ({exc})") from None
    tables = data.get("objective")
    if not isinstance(tables, list) or not tables or not all(isinstance(t, dict) for t in tables):
        raise ValueError(f"objectives file {path}: no [[objective]] tables")
    known = {f.name for f in fields(Objective)}
    out = []
    for i, table in enumerate(tables, 1):
        unknown = sorted(set(table) - known)
        if unknown:
            raise ValueError(f"objectives file {path}: objective {i} has unknown field {unknown[0]!r} (fields: "
                             f"{', '.join(sorted(known))})")
        out.append(_objective(path, i, table))
    names = [o.name for o in out]
    if len(set(names)) != len(names):
        raise ValueError(f"objectives file {path}: objective names repeat ({', '.join(sorted(names))})")
    return tuple(out)


def _objective(path: Path, i: int, table: dict[str, Any]) -> Objective:
    if "name" not in table or "sli" not in table:
        raise ValueError(f"objectives file {path}: objective {i} needs a name and an sli")
    try:
        return Objective(**table)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"objectives file {path}: {exc}") from None
