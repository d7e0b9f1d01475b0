"""Grafana-managed alert rules, contact points and notification policy (file provisioning), built with
grafana-foundation-sdk's alerting builders from the same definitions as the Prometheus rules.

Which fields Grafana interpolates decides how a `$` is written (grafana/grafana
`pkg/services/provisioning/alerting/rules_types.go`): a query's `model` is taken raw (`QueryV1.mapToModel`
marshals `Model.Raw`), so PromQL's `$1` and the math expression's `$A` are written as they are; the fields
read with `.Value()` (group name, folder, interval, rule uid, title, condition, for, states, labels, refId,
datasourceUid) expand `$VAR`/`${VAR}` from Grafana's environment, so none of them may hold a `$` except
the datasource uid's intended `${STEPLINE_PROMETHEUS_UID}`; annotations expand at most `${VAR}`
(`ValueWithBracedVars`), so they may hold `$labels`/`$values` but never `${`.
"""

from __future__ import annotations

import json
import re
from typing import Any, cast

from grafana_foundation_sdk.builders import alerting as ab
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog import variants as cogvariants
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.cog.runtime import UnknownDataquery
from grafana_foundation_sdk.models.alerting import RelativeTimeRange

from stepline.alerting import receivers, templates
from stepline.alerting.config import AlertConfig
from stepline.alerting.definitions import Alert, alerts
from stepline.alerting.prometheus import HEARTBEAT

ORG_ID = 1
EXPR_UID = "__expr__"
CONTACT_POINT = "stepline-alertmanager"
CONTACT_POINTS = {"critical": "stepline-page", "warning": "stepline-ticket", "heartbeat": "stepline-heartbeat"}
"""Route -> Grafana's own contact point for it, used when receivers are named for the route."""
_DURATION = re.compile(r"^(\d+)([smh])$")
GRAFANA_TICK_S = 10


class _Model(cogbuilder.Builder[cogvariants.Dataquery]):
    """A raw query model (the SDK has no Prometheus-for-alerting or math-expression builder that fits)."""

    def __init__(self, data: dict[str, Any]) -> None:
        self._data = data

    def build(self) -> cogvariants.Dataquery:
        return UnknownDataquery(self._data)


def _seconds(duration: str) -> int:
    m = _DURATION.match(duration)
    if not m:
        raise ValueError(f"unsupported duration {duration!r}")
    return int(m.group(1)) * {"s": 1, "m": 60, "h": 3600}[m.group(2)]


def _prom_query(cfg: AlertConfig, ref: str, expr: str) -> ab.Query:
    window = max(600, 2 * max((_seconds(d) for d in re.findall(r"\[(\d+[smh])\]", expr)), default=0))
    return (ab.Query(ref).datasource_uid(cfg.grafana_datasource_uid)
            .relative_time_range(RelativeTimeRange(from_val=window, to=0))
            .model(_Model({"refId": ref, "expr": expr, "instant": True, "range": False,
                           "intervalMs": 1000, "maxDataPoints": 43200})))


def rule_uid(a: Alert) -> str:
    """Stable uid (<= 40 chars) for a Grafana rule."""
    return f"stepline-{a.anchor}-{a.severity}"[:40]


def rule(cfg: AlertConfig, a: Alert, title: str) -> ab.Rule:
    """A Grafana-managed rule: A is the PromQL (firing when it returns a series), C = is_number($A)."""
    group = cfg.fast_group_name if a.fast else cfg.group_name
    r = (ab.Rule(title).uid(rule_uid(a)).folder_uid(cfg.grafana_folder_uid).rule_group(group)
         .org_id(ORG_ID).condition("C").for_val(a.for_)
         .no_data_state("OK").exec_err_state("Error").is_paused(False)
         .labels({"severity": a.severity, **a.labels})
         .annotations({"summary": templates.grafana(a.summary),
                       "description": templates.grafana(a.description),
                       "runbook_url": cfg.runbook(a.name)})
         .with_query(_prom_query(cfg, "A", a.expr)))
    for ref in templates.grafana_aux_refs(a.summary, a.description):
        r = r.with_query(_prom_query(cfg, ref, templates.GRAFANA_AUX[ref].replace("{sel}", cfg.sel())))
    return r.with_query(
        ab.Query("C").datasource_uid(EXPR_UID).relative_time_range(RelativeTimeRange(from_val=0, to=0))
        .model(_Model({"refId": "C", "type": "math", "expression": "is_number($A)",
                       "datasource": {"type": "__expr__", "uid": EXPR_UID}})))


def _plain(obj: object) -> Any:
    return json.loads(json.dumps(obj, cls=JSONEncoder))


# The rule fields rules_types.go reads with `.Value()` (environment-expanded); `model` is raw, annotations
# braced-only (grafana/grafana pkg/services/provisioning/alerting/rules_types.go).
_EXPANDED_RULE_FIELDS = ("uid", "title", "condition", "for", "keepFiringFor", "noDataState", "execErrState",
                         "dashboardUid")


def _check_expansion(cfg: AlertConfig, r: dict[str, Any]) -> None:
    """Refuse a `$` that Grafana's provisioning would expand from its environment."""
    title = r.get("title", "?")
    expanded = [(k, r[k]) for k in _EXPANDED_RULE_FIELDS if isinstance(r.get(k), str)]
    expanded += [(f"labels.{k}", v) for k, v in r.get("labels", {}).items()]
    expanded += [(f"data.{q['refId']}.refId", q["refId"]) for q in r["data"]]
    expanded += [(f"data.{q['refId']}.datasourceUid", q["datasourceUid"]) for q in r["data"]
                 if q["datasourceUid"] != cfg.grafana_datasource_uid]
    for where, value in expanded:
        if "$" in value:
            raise ValueError(f"rule {title}: {where} = {value!r}: Grafana would expand its `$` from the environment")
    for key, value in r.get("annotations", {}).items():
        if "${" in value:
            raise ValueError(f"rule {title}: annotation {key} = {value!r}: Grafana would expand its `${{`")


def grafana_interval(duration: str) -> str:
    """A group interval Grafana evaluates as given: its scheduler ticks every 10 s (`[unified_alerting]
    min_interval`, 10s by default), so an interval is a multiple of 10 s."""
    seconds = max(GRAFANA_TICK_S, -(-_seconds(duration) // GRAFANA_TICK_S) * GRAFANA_TICK_S)
    return f"{seconds}s" if seconds % 60 else f"{seconds // 60}m"


def rules_file(cfg: AlertConfig) -> dict[str, object]:
    """`alerting/*.yaml` provisioning document: the rule group, and the fast one (`Alert.fast`)."""
    every = alerts(cfg)
    paired = {a.name for a in every if sum(b.name == a.name for b in every) > 1}
    groups = []
    for name, interval, fast in ((cfg.group_name, cfg.evaluation_interval, False),
                                 (cfg.fast_group_name, cfg.fast_evaluation_interval, True)):
        interval = grafana_interval(interval)
        group = ab.RuleGroup(name).folder_uid(cfg.grafana_folder_uid).interval(_seconds(interval))
        for a in every:
            if a.fast != fast:
                continue
            # Grafana wants titles unique in a folder: the critical half of a pair says so in its title.
            title = f"{a.name} (critical)" if a.name in paired and a.severity == "critical" else a.name
            group = group.with_rule(rule(cfg, a, title))
        groups.append(_group(cfg, _plain(group.build()), interval))
    return {"apiVersion": 1, "groups": groups}


def _group(cfg: AlertConfig, built: dict[str, Any], interval: str) -> dict[str, object]:
    file_rules = []
    for r in built["rules"]:
        for api_only in ("folderUID", "ruleGroup", "orgID"):
            r.pop(api_only, None)
        _check_expansion(cfg, r)
        file_rules.append(r)
    group_fields = {"name": built["title"], "folder": "stepline", "interval": interval}
    for key, value in group_fields.items():
        if "$" in value:
            raise ValueError(f"rule group {key} = {value!r}: Grafana would expand its `$` from the environment")
    return {"orgId": ORG_ID, **group_fields, "rules": file_rules}


def _grafana_routes(cfg: AlertConfig) -> dict[str, str]:
    """Route -> the contact point Grafana delivers it to: its own for a route with receivers named, else the one
    forwarding to Alertmanager (which applies the route's default there)."""
    named = set() if cfg.grafana_via_alertmanager else receivers.named_routes(cfg)
    return {route: CONTACT_POINTS[route] if route in named else CONTACT_POINT for route in receivers.ROUTES}


def _integration(r: receivers.Receiver, uid: str) -> dict[str, Any]:
    settings = receivers.grafana_settings(r)
    for key, value in settings.items():
        # The only `$` Grafana may expand here is the secret's `$__file{...}`.
        if isinstance(value, str) and "$" in value.replace("$__file{", ""):
            raise ValueError(f"contact point {uid}: {key} = {value!r}: Grafana would expand its `$`")
    cp: dict[str, Any] = _plain(ab.ContactPoint().uid(uid).name(uid).type(cast(Any, r.kind))
                                .settings(settings).disable_resolve_message(r.route == "heartbeat").build())
    cp.pop("name")
    return cp


def contact_points_file(cfg: AlertConfig) -> dict[str, object]:
    """The contact points the policy tree names: one per route with receivers named, holding an integration per
    receiver (secrets as `$__file{path}`, `receivers.grafana_settings`), and the one forwarding every other alert
    to an Alertmanager (`cfg.grafana_alertmanager_url`)."""
    points: list[dict[str, object]] = []
    routes = _grafana_routes(cfg)
    if CONTACT_POINT in routes.values():
        cp = _plain(ab.ContactPoint().uid(CONTACT_POINT).name(CONTACT_POINT).type("alertmanager")
                    .settings({"url": cfg.grafana_alertmanager_url})
                    .disable_resolve_message(False).build())
        cp.pop("name")
        # The SDK's enum says "alertmanager"; Grafana registers the integration as "prometheus-alertmanager"
        # (grafana/alerting receivers/alertmanager: Type), which posts to `<url>/api/v2/alerts`.
        cp["type"] = "prometheus-alertmanager"
        points.append({"orgId": ORG_ID, "name": CONTACT_POINT, "receivers": [cp]})
    for route, integrations in receivers.routed(cfg).items():
        name = routes[route]
        if name != CONTACT_POINT:
            points.append({"orgId": ORG_ID, "name": name, "receivers": [
                _integration(r, f"{name}-{r.kind}-{i}") for i, r in enumerate(integrations)]})
    return {"apiVersion": 1, "contactPoints": points}


def policies_file(cfg: AlertConfig) -> dict[str, object]:
    """The notification policy tree: grouped by engine; the heartbeat re-sent every minute so Alertmanager keeps it."""
    def route(matcher: str, receiver: str, **timing: str) -> ab.NotificationPolicy:
        name, value = matcher.split("=", 1)
        p = ab.NotificationPolicy().receiver(receiver).object_matchers([[name, "=", value]])
        for key, val in timing.items():
            p = getattr(p, key)(val)
        return p

    to = _grafana_routes(cfg)
    tree = (ab.NotificationPolicy().receiver(to["warning"])
            .group_by(["grafana_folder", "alertname", "engine"])
            .group_wait("30s").group_interval("5m").repeat_interval("4h")
            .routes([
                route(f"alertname={HEARTBEAT}", to["heartbeat"], group_wait="0s", group_interval="1m",
                      repeat_interval="1m"),
                route("severity=critical", to["critical"], group_wait="10s", repeat_interval="1h"),
                route("severity=warning", to["warning"]),
            ]))
    return {"apiVersion": 1, "policies": [{"orgId": ORG_ID, **_plain(tree.build())}]}
