"""Requests: the slowest ones, each one click from the engine timeline around it, and latency distributions."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.models import dashboard as dm

from stepline.alerting.config import AlertConfig
from stepline.dashboards import engine
from stepline.dashboards.panels import WHERE, distribution, grid, timeline_base
from stepline.dashboards.query import ClickHouseQuery, Format
from stepline.queries.requests import MERGED

UID = "stepline-requests"
PADDING_MS = 10_000
"""Context either side of a request when jumping to the engine timeline."""

TIMELINE_URL = (f"/d/{engine.UID}/{engine.SLUG}?from=${{__data.fields.from_ms}}&to=${{__data.fields.to_ms}}"
                "&var-host=${__data.fields.host}&var-engine=${__data.fields.engine}"
                "&${datasource:queryparam}&${prometheus:queryparam}")


def dashboard(config: AlertConfig) -> db.Dashboard:
    """The requests dashboard."""
    d = timeline_base("stepline / Requests", UID,
                      "Finished requests: the slowest, and how latency is distributed.",
                      ["requests"])
    link = (db.DashboardLink("Engine timeline around this request").type(dm.DashboardLinkType.LINK)
            .url(TIMELINE_URL).target_blank(False))
    d = d.with_panel(grid(
        "Slowest requests",
        "Which requests took longest end to end, where their time went, and how big they were.",
        ClickHouseQuery(f"""
            SELECT ts AS finished, host, engine, request_id, finish_reason,
                   queue_seconds, ttft_seconds, mean_tpot_seconds, e2e_seconds,
                   prompt_tokens, cached_tokens, generation_tokens, preemptions,
                   toUnixTimestamp64Milli(arrival_ts) - {PADDING_MS} AS from_ms,
                   toUnixTimestamp64Milli(ts) + {PADDING_MS} AS to_ms
            FROM {MERGED} WHERE $__timeFilter(ts) AND {WHERE}
            ORDER BY e2e_seconds DESC LIMIT 100""", Format.TABLE),
        units=[(".*_seconds", "s"), (".*_tokens|preemptions", "short")], hidden=["from_ms", "to_ms"],
        links=[link], h=12))
    d = d.with_panel(distribution(
        "Time to first token", "How TTFT is distributed over the finished requests.", "s",
        f"SELECT ttft_seconds FROM {MERGED} WHERE $__timeFilter(ts) AND {WHERE} AND isFinite(ttft_seconds) "
        "LIMIT 100000"))
    d = d.with_panel(distribution(
        "Inter-token latency", "How the gaps between streamed tokens are distributed (from steps).", "s",
        f"SELECT itl AS itl_seconds FROM steps ARRAY JOIN itl_seconds AS itl "
        f"WHERE $__timeFilter_ms(ts) AND {WHERE} LIMIT 100000"))
    return d.with_panel(distribution(
        "End-to-end latency", "How long whole requests took, arrival to last token.", "s",
        f"SELECT e2e_seconds FROM {MERGED} WHERE $__timeFilter(ts) AND {WHERE} LIMIT 100000"))
