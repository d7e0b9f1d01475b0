"""Data queries: ClickHouse SQL for the timeline, PromQL for the collector's own metrics."""

from __future__ import annotations

import textwrap
from enum import IntEnum

from grafana_foundation_sdk.builders import prometheus
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog import runtime as cogruntime
from grafana_foundation_sdk.cog import variants as cogvariants
from grafana_foundation_sdk.models.common import DataSourceRef
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

CLICKHOUSE_TYPE = "grafana-clickhouse-datasource"
CLICKHOUSE = DataSourceRef(type_val=CLICKHOUSE_TYPE, uid="${datasource}")
PROMETHEUS = DataSourceRef(type_val="prometheus", uid="${prometheus}")


class Format(IntEnum):
    """The ClickHouse datasource's result formats."""

    TIME_SERIES = 0
    TABLE = 1


def sql(text: str) -> str:
    """A query as written in a triple-quoted string, dedented and stripped."""
    return textwrap.dedent(text).strip()


class ClickHouseQuery(cogbuilder.Builder[cogvariants.Dataquery]):
    """One raw-SQL target of grafana-clickhouse-datasource (the SDK has no builder for it)."""

    def __init__(self, raw_sql: str, fmt: Format = Format.TIME_SERIES, ref_id: str = "A") -> None:
        self.raw_sql = sql(raw_sql)
        self.fmt = fmt
        self.ref_id = ref_id

    def build(self) -> cogvariants.Dataquery:
        return cogruntime.UnknownDataquery({
            "datasource": {"type": CLICKHOUSE_TYPE, "uid": "${datasource}"},
            "editorType": "sql",
            "format": int(self.fmt),
            "rawSql": self.raw_sql,
            "refId": self.ref_id,
        })


def promql(expr: str, legend: str = "", ref_id: str = "A", *, instant: bool = False) -> prometheus.Dataquery:
    """A Prometheus target on the `${prometheus}` datasource."""
    query = prometheus.Dataquery().expr(expr).ref_id(ref_id).datasource(PROMETHEUS)
    if legend:
        query = query.legend_format(legend)
    if instant:
        return query.instant().format(PromQueryFormat.TABLE)
    return query.range()
