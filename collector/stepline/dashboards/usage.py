"""Usage: who used the GPUs over time, from the collector's per-minute rollup (usage_minutes): GPU time, energy,
tokens and requests by a chosen dimension, the idle share, and the range's totals with a cost at one price."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.models import dashboard as dm

from stepline.alerting.config import AlertConfig
from stepline.analysis.usage_by import DIMENSIONS, IDLE, NONE, UNATTRIBUTED
from stepline.dashboards.panels import WHERE, grid, series, timeline_base
from stepline.dashboards.query import ClickHouseQuery, Format
from stepline.queries.gateway import TENANT

UID = "stepline-usage"
# Each point is a whole number of the rollup's minutes: a finer interval would show empty minutes between them.
BIN = "toStartOfInterval(ts, toIntervalSecond(greatest($__interval_s, 60)))"
BIN_S = "greatest($__interval_s, 60)"
# The request's value of the chosen dimension (stepline.analysis.usage_by.Who.value), idle and unattributed time
# on lines of their own.
_VALUE = (f"multiIf('${{by}}' = 'tenant', {TENANT}, "
          "'${by}' = 'team', team, '${by}' = 'key', `key`, '${by}' = 'user', `user`, "
          "'${by}' = 'end_user', end_user, '${by}' = 'model', model, '${by}' = 'adapter', adapter, "
          "'${by}' = 'lane', lane, engine)")
GROUP = (f"multiIf(line = 'idle', '{IDLE}', line = 'unattributed', '{UNATTRIBUTED}', {_VALUE} = '', '{NONE}', "
         f"{_VALUE})")
PRICE = "toFloat64OrNull('${gpu_price}')"  # empty: NULL, no cost
FROM = f"FROM usage_minutes WHERE $__timeFilter(ts) AND {WHERE}"


def _over_time(value: str) -> ClickHouseQuery:
    """`value` per group per point (a sum over the point's minutes)."""
    return ClickHouseQuery(f"""
        SELECT {BIN} AS time, {GROUP} AS group_name, {value} AS value
        {FROM}
        GROUP BY time, group_name ORDER BY time""")


def _variables() -> list[db.CustomVariable | db.TextBoxVariable]:
    by = (db.CustomVariable("by").label("Group by").values(",".join(DIMENSIONS))
          .current(dm.VariableOption(selected=True, text="team", value="team")))
    price = (db.TextBoxVariable("gpu_price").label("USD per GPU-hour").default_value("")
             .description("One price per GPU-hour for every GPU: the cost columns multiply GPU-hours by it (empty: "
                          "no cost). `stepline usage --gpu-price MODEL=USD` prices each GPU model."))
    return [by, price]


def dashboard(config: AlertConfig) -> db.Dashboard:
    """The Usage dashboard."""
    d = timeline_base("stepline / Usage", UID, "Who used the GPUs: each request's share of its engine's GPU time "
                      "and energy, grouped by tenant, team, key, user, end user, model, adapter, lane or engine, "
                      "from the collector's per-minute rollup (usage_minutes, written a few minutes after each "
                      "minute closes: the last minutes are not there yet). Cost is at one price per GPU-hour (the "
                      "variable); `stepline usage` prices each GPU model.", ["usage"]).time("now-24h", "now")
    for variable in _variables():
        d = d.with_variable(variable)
    d = d.with_panel(series(
        "GPU time by group", "GPUs in use on average over each point (GPU-seconds per second), stacked: each "
        "group's requests, the engines' idle time and what no known request can take (unattributed).", "short",
        _over_time(f"sum(gpu_seconds) / {BIN_S}"), stacked=True))
    d = d.with_panel(series(
        "Idle share of GPU time", "The share of the engines' GPU time with no request on them, per point.",
        "percentunit", ClickHouseQuery(f"""
            SELECT {BIN} AS time, sumIf(gpu_seconds, line = 'idle') / nullIf(sum(gpu_seconds), 0) AS idle_share
            {FROM}
            GROUP BY time ORDER BY time""")))
    d = d.with_panel(series(
        "Energy by group", "The GPUs' energy over each point as average power (W), stacked by group; engines "
        "whose GPUs were not sampled have none.", "watt",
        _over_time(f"sum(energy_mj) / 1000 / {BIN_S}"), stacked=True))
    d = d.with_panel(series(
        "Tokens by group", "Prompt and generated tokens per second of the requests that finished in each point.",
        "short", _over_time(f"sum(prompt_tokens + generation_tokens) / {BIN_S}"), stacked=True, w=12))
    d = d.with_panel(series(
        "Requests by group", "Requests per second that finished in each point.", "reqps",
        _over_time(f"sum(requests) / {BIN_S}"), stacked=True, w=12))
    return d.with_panel(grid(
        "Totals by group", "The range's requests, tokens, GPU time, energy and cost per group (cost: GPU-hours x "
        "the price variable), with each group's share of the GPU time.", ClickHouseQuery(f"""
            SELECT group_name, requests, prompt_tokens, generation_tokens, gpu_seconds, energy_kwh,
                   gpu_seconds / 3600 * {PRICE} AS cost,
                   cost / nullIf(prompt_tokens + generation_tokens, 0) * 1e6 AS cost_per_1m_tokens,
                   gpu_seconds / sum(gpu_seconds) OVER () AS share_of_gpu_time
            FROM (SELECT {GROUP} AS group_name, sum(requests) AS requests, sum(prompt_tokens) AS prompt_tokens,
                         sum(generation_tokens) AS generation_tokens, sum(gpu_seconds) AS gpu_seconds,
                         sum(energy_mj) / 3.6e9 AS energy_kwh
                  {FROM}
                  GROUP BY group_name)
            ORDER BY gpu_seconds DESC""", Format.TABLE),
        units=[("gpu_seconds", "s"), ("energy_kwh", "kwatth"), ("cost.*", "currencyUSD"),
               ("share_of_gpu_time", "percentunit")], h=10))
