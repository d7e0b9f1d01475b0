"""SLOs: each objective's SLI, its burn rate over the alerts' windows, and the error budget left, from Prometheus
(the collector's SLI counters and the burn-rate recording rules of alerts/prometheus-rules.yaml)."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.models import dashboard as dm

from stepline.alerting.config import AlertConfig
from stepline.alerting.slo import BUDGET, BURN_WINDOWS, error_ratio
from stepline.config.objectives import Objective
from stepline.dashboards.panels import base, datasource_variables, series, single
from stepline.dashboards.query import PROMETHEUS, promql

UID = "stepline-slo"


def _sum(cfg: AlertConfig, o: Objective, counter: str, window: str) -> str:
    sel = cfg.sel(f'objective="{o.name}"')
    return f"sum by ({o.scope}) (increase(stepline_slo_{counter}_total{sel}[{window}]))"


def _panels(cfg: AlertConfig, o: Objective) -> list[cogbuilder.Builder[dm.Panel]]:
    """Budget left over the objective's window, the SLI, and the burn rate per alert window."""
    window = f"{o.window_days}d"
    legend = f"{{{{{o.scope}}}}}"
    bad_ratio = f"(1 - {_sum(cfg, o, 'good_requests', window)} / {_sum(cfg, o, 'requests', window)})"
    left = single(
        f"{o.name}: error budget left ({window})",
        f"The share of the {o.error_budget:.2%} of requests allowed to be bad over {window} not yet spent, per "
        f"{o.scope}: 1 - bad share / budget (below 0: spent). Prometheus must keep {window} of samples.",
        "percentunit", _instant(f"1 - {bad_ratio} / {o.error_budget:g}", legend),
        [(None, "red"), (0.0, "orange"), (0.25, "green")], w=6, h=8)
    sli_expr = (f"{_sum(cfg, o, 'good_requests', '$__rate_interval')}\n  / "
                f"{_sum(cfg, o, 'requests', '$__rate_interval')}")
    sli = series(f"{o.name}: SLI", f"The share of {o.sli} requests good, per {o.scope}; dashed: the target "
                 f"{o.target:.2%}.", "percentunit", promql(sli_expr, legend), lines=[(o.target, "red")],
                 w=9, datasource=PROMETHEUS)
    burn_targets = [
        promql(f"{error_ratio(w)}{{objective=\"{o.name}\"}}\n  / on (objective) group_left () {BUDGET}",
               f"{legend} {w}", chr(ord("A") + i))
        for i, w in enumerate(sorted({b.long for b in BURN_WINDOWS}, key=_minutes))]
    burn = series(f"{o.name}: burn rate", "How many times faster than the budget allows the requests go bad, over "
                  "each alert's long window (1 = the budget lasts exactly its window); dashed: the page's 14.4x and "
                  "6x, the ticket's 3x and 1x (the recording rules of alerts/prometheus-rules.yaml).", "x",
                  *burn_targets, lines=[(b.factor, "red" if b.severity == "critical" else "orange")
                                        for b in BURN_WINDOWS], w=9, datasource=PROMETHEUS)
    return [left, sli, burn]


def _instant(expr: str, legend: str) -> prometheus.Dataquery:
    """One number per series now: a 30-day increase evaluated at every step of a range would cost Prometheus dear."""
    return prometheus.Dataquery().expr(expr).ref_id("A").datasource(PROMETHEUS).legend_format(legend).instant()


def _minutes(window: str) -> int:
    return int(window[:-1]) * {"m": 1, "h": 60, "d": 1440}[window[-1]]


def dashboard(config: AlertConfig) -> db.Dashboard:
    """The SLO dashboard: a row of panels per objective."""
    d = base("stepline / SLOs", UID, "Are the objectives met, how fast is each error budget burning, and how much "
             "is left?", ["slo"]).time("now-7d", "now")
    for variable in datasource_variables():
        d = d.with_variable(variable)
    for o in config.slo.objectives:
        for panel in _panels(config, o):
            d = d.with_panel(panel)
    return d
