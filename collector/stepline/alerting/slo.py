"""Multi-window, multi-burn-rate alerts on the objectives (`Slo.objectives`), and the recording rules they read.

The Google SRE workbook, chapter 5 "Alerting on SLOs" (https://sre.google/workbook/alerting-on-slos/), section 6
"Multiwindow, Multi-Burn-Rate Alerts", table 5-8, for a 30-day objective: page when 2% of the budget burns in an
hour (14.4x the sustainable rate, over 1 h and its 5 m short window) or 5% in six hours (6x, over 6 h and 30 m);
ticket when 10% burns in a day (3x, over 1 d and 2 h) or in three days (1x, over 3 d and 6 h). The long window makes
a blip too small to alert; the short one (1/12 of it) makes the alert stop soon after the burning does.

The error ratio per window is recorded once per scope (`stepline_slo:error_ratio:rate1h`...), the budget per
objective (`stepline_slo:error_budget:ratio`): Prometheus evaluates a group's rules in order, so the alerts after
them read this evaluation's values. Grafana's rules query the same recorded series: the Prometheus it reads must
load `prometheus-rules.yaml`.
"""

from __future__ import annotations

from dataclasses import dataclass

from stepline.alerting.config import AlertConfig
from stepline.alerting.rule import Alert, Severity
from stepline.config.objectives import Scope


@dataclass(frozen=True)
class BurnWindow:
    """Alert at `severity` when the error ratio over both windows is above `factor` times the error budget."""

    severity: Severity
    factor: float
    long: str
    short: str


BURN_WINDOWS = (
    BurnWindow("critical", 14.4, "1h", "5m"),
    BurnWindow("critical", 6.0, "6h", "30m"),
    BurnWindow("warning", 3.0, "1d", "2h"),
    BurnWindow("warning", 1.0, "3d", "6h"),
)
WINDOWS = ("5m", "30m", "1h", "2h", "6h", "1d", "3d")
"""Every window a burn-rate alert reads, shortest first."""
ALERT = "SloErrorBudgetBurn"
BUDGET = "stepline_slo:error_budget:ratio"


def error_ratio(window: str) -> str:
    """The recorded error ratio of every objective over `window`."""
    return f"stepline_slo:error_ratio:rate{window}"


def recording_rules(cfg: AlertConfig) -> list[dict[str, object]]:
    """Each objective's error budget, then the error ratio over each window: one rule per window, the objectives
    of each scope summed by it (two rules of one name and labels would record the same series)."""
    budgets: list[dict[str, object]] = [
        {"record": BUDGET, "expr": f"vector({o.error_budget:g})", "labels": {"objective": o.name}}
        for o in cfg.slo.objectives]
    scopes = _by_scope(cfg).items()
    return budgets + [{"record": error_ratio(w), "expr": "\nor\n".join(_ratio_expr(cfg, scope, names, w)
                                                                       for scope, names in scopes)}
                      for w in WINDOWS]


def _by_scope(cfg: AlertConfig) -> dict[Scope, list[str]]:
    scopes: dict[Scope, list[str]] = {}
    for o in cfg.slo.objectives:
        scopes.setdefault(o.scope, []).append(o.name)
    return scopes


def _ratio_expr(cfg: AlertConfig, scope: Scope, names: list[str], window: str) -> str:
    """1 - good/total over `window`, summed over the collectors, per objective and scope; no series without
    requests (0/0 is NaN, which no comparison passes)."""
    sel = cfg.sel('objective=~"' + "|".join(names) + '"')
    by = f"sum by (objective, {scope})"
    return (f"1 - (\n  {by} (rate(stepline_slo_good_requests_total{sel}[{window}]))\n"
            f"  / {by} (rate(stepline_slo_requests_total{sel}[{window}]))\n)")


def _burning(w: BurnWindow) -> str:
    """The series burning faster than `w` allows over both its windows, labelled with the long one."""
    over = f"> on (objective) group_left () ({w.factor:g} * {BUDGET})"
    return (f'label_replace(\n  {error_ratio(w.long)} {over}\n  and {error_ratio(w.short)} {over},\n'
            f'  "long_window", "{w.long}", "", ""\n)')


def burn_alerts(cfg: AlertConfig) -> list[Alert]:
    """The page (fast burns) and the ticket (slow burns)."""
    out = []
    kinds: tuple[tuple[Severity, str, str], ...] = (("critical", "Page", "2% of it in an hour or 5% in six hours"),
                                                    ("warning", "Ticket", "10% of it in a day or in three days"))
    for severity, verb, spent in kinds:
        windows = [w for w in BURN_WINDOWS if w.severity == severity]
        pairs = " or ".join(f"{w.factor:g}x over {w.long} and {w.short}" for w in windows)
        out.append(Alert(
            ALERT, severity,
            "\n or ".join(_burning(w) for w in windows),
            "0m",
            "SLO [objective] of [scope] burns its error budget: [value_ratio] of requests bad over [long_window].",
            f"{verb}: objective [objective] of [scope] has had [value_ratio] of its requests bad over the last "
            f"[long_window], against an error budget that allows {spent} ({pairs} the budget's rate, the Google SRE "
            "workbook's multi-window burn rates). See the SLO dashboard, and `stepline slo --since 30d`; "
            f"Run: stepline diagnose --since {cfg.diagnose_since}",
        ))
    return out
