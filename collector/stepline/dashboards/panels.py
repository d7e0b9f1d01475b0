"""Panel and variable helpers shared by every dashboard: one look, units and legends set on purpose."""

from __future__ import annotations

from collections.abc import Sequence

from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import histogram, stat, table, timeseries
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog import variants as cogvariants
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm

from stepline.dashboards.query import CLICKHOUSE, CLICKHOUSE_TYPE, PROMETHEUS, ClickHouseQuery, Format

Target = cogbuilder.Builder[cogvariants.Dataquery]

# Filters every timeline query carries; `$__conditionalAll` turns each into 1=1 when "All" is chosen.
HOST = "$__conditionalAll(host IN (${host:singlequote}), $host)"
ENGINE = "$__conditionalAll(engine IN (${engine:singlequote}), $engine)"
GPU = "$__conditionalAll(toString(gpu_index) IN (${gpu:singlequote}), $gpu)"
WHERE = f"{HOST} AND {ENGINE}"


def _legend() -> cb.VizLegendOptions:
    return (cb.VizLegendOptions().display_mode(cm.LegendDisplayMode.TABLE).placement(cm.LegendPlacement.BOTTOM)
            .show_legend(True).calcs(["mean", "max", "lastNotNull"]))


def thresholds(*steps: tuple[float | None, str]) -> db.ThresholdsConfig:
    """Absolute thresholds; the first step's value is None (the base colour)."""
    return db.ThresholdsConfig().mode(dm.ThresholdsMode.ABSOLUTE).steps(
        [dm.Threshold(value=v, color=c) for v, c in steps])


def series(title: str, description: str, unit: str, *targets: Target, stacked: bool = False,
           lines: Sequence[tuple[float, str]] = (), bars: bool = False, w: int = 12, h: int = 8,
           datasource: cm.DataSourceRef = CLICKHOUSE) -> timeseries.Panel:
    """A time series; `lines` draws dashed threshold lines (SLOs) at (value, colour)."""
    panel = (timeseries.Panel().title(title).description(description).unit(unit).datasource(datasource)
             .targets(list(targets)).legend(_legend()).span(w).height(h).fill_opacity(10 if not stacked else 60)
             .line_width(1).span_nulls(False))
    if stacked:
        panel = panel.stacking(cb.StackingConfig().mode(cm.StackingMode.NORMAL))
    if bars:
        panel = panel.draw_style(cm.GraphDrawStyle.BARS)
    if lines:
        panel = (panel.thresholds(thresholds((None, "transparent"), *lines))
                 .thresholds_style(cb.GraphThresholdsStyleConfig().mode(cm.GraphThresholdsStyleMode.DASHED)))
    return panel


def right_axis(panel: timeseries.Panel, pattern: str, unit: str) -> timeseries.Panel:
    """Move the fields matching `pattern` to a right axis with their own unit."""
    return panel.override_by_regexp(pattern, [dm.DynamicConfigValue(id_val="custom.axisPlacement", value="right"),
                                              dm.DynamicConfigValue(id_val="unit", value=unit)])


def grid(title: str, description: str, target: Target, *, units: Sequence[tuple[str, str]] = (),
         hidden: Sequence[str] = (), links: Sequence[db.DashboardLink] = (), w: int = 24, h: int = 9,
         datasource: cm.DataSourceRef = CLICKHOUSE) -> table.Panel:
    """A table; `units` maps column-name regexps to units, `hidden` names columns only data links read."""
    panel = (table.Panel().title(title).description(description).datasource(datasource).with_target(target)
             .unit("short").span(w).height(h).filterable(True))
    for pattern, unit in units:
        panel = panel.override_by_regexp(pattern, [dm.DynamicConfigValue(id_val="unit", value=unit)])
    for name in hidden:
        panel = panel.override_by_name(name, [dm.DynamicConfigValue(id_val="custom.hidden", value=True)])
    if links:
        panel = panel.data_links(list(links))
    return panel


def single(title: str, description: str, unit: str, target: Target, steps: Sequence[tuple[float | None, str]],
           *, w: int = 6, h: int = 5, datasource: cm.DataSourceRef = PROMETHEUS) -> stat.Panel:
    """A stat: one number per series, coloured by `steps`."""
    return (stat.Panel().title(title).description(description).unit(unit).datasource(datasource)
            .with_target(target).thresholds(thresholds(*steps)).span(w).height(h)
            .graph_mode(cm.BigValueGraphMode.AREA).color_mode(cm.BigValueColorMode.BACKGROUND)
            .reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]).values(False)))


def distribution(title: str, description: str, unit: str, raw_sql: str, *, w: int = 8, h: int = 8
                 ) -> histogram.Panel:
    """A histogram of raw values (one row per observation)."""
    return (histogram.Panel().title(title).description(description).unit(unit).datasource(CLICKHOUSE)
            .with_target(ClickHouseQuery(raw_sql, Format.TABLE)).span(w).height(h).fill_opacity(60)
            .legend(cb.VizLegendOptions().show_legend(True).display_mode(cm.LegendDisplayMode.LIST)
                    .placement(cm.LegendPlacement.BOTTOM)))


def datasource_variables() -> list[db.DatasourceVariable]:
    """`$datasource` (ClickHouse) and `$prometheus`."""
    return [db.DatasourceVariable("datasource").label("ClickHouse").type(CLICKHOUSE_TYPE),
            db.DatasourceVariable("prometheus").label("Prometheus").type("prometheus")]


def ch_variable(name: str, label: str, raw_sql: str) -> db.QueryVariable:
    """A multi-value ClickHouse query variable with All, refreshed with the time range."""
    text = " ".join(raw_sql.split())
    return (db.QueryVariable(name).label(label).datasource(CLICKHOUSE).query(text).definition(text)
            .multi(True).include_all(True).refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(dm.VariableSort.ALPHABETICAL_ASC)
            .current(dm.VariableOption(selected=True, text=["All"], value=[ALL_VALUE])))


ALL_VALUE = "$__all"

HOST_VARIABLE_SQL = "SELECT DISTINCT host FROM engine_samples WHERE $__timeFilter(ts) ORDER BY host"
# Steps by the minute (GROUP BY, not DISTINCT, reads their per-minute projection): an engine stepping within a
# minute of the range counts.
ENGINE_VARIABLE_SQL = (
    "SELECT DISTINCT engine FROM (SELECT DISTINCT host, engine FROM engine_samples WHERE $__timeFilter(ts) "
    "UNION ALL SELECT host, engine FROM steps WHERE toStartOfMinute(ts) >= toStartOfMinute($__fromTime) "
    "AND toStartOfMinute(ts) <= $__toTime GROUP BY host, engine) "
    f"WHERE engine != '' AND {HOST} ORDER BY engine")
GPU_VARIABLE_SQL = (f"SELECT DISTINCT toString(gpu_index) AS gpu FROM gpu_samples WHERE $__timeFilter(ts) AND {WHERE} "
                    "ORDER BY gpu")


def timeline_variables(*, gpu: bool = False) -> list[cogbuilder.Builder[dm.VariableModel]]:
    """Datasources, then host, engine and (optionally) gpu, each narrowing the next."""
    variables: list[cogbuilder.Builder[dm.VariableModel]] = [*datasource_variables()]
    variables.append(ch_variable("host", "Host", HOST_VARIABLE_SQL))
    variables.append(ch_variable("engine", "Engine", ENGINE_VARIABLE_SQL))
    if gpu:
        variables.append(ch_variable("gpu", "GPU", GPU_VARIABLE_SQL))
    return variables


def events_annotation() -> db.AnnotationQuery:
    """Engine events (up/down/restart, config, XIDs, drops) as annotations from the events table."""
    return (db.AnnotationQuery().name("Engine events").datasource(CLICKHOUSE).enable(True).icon_color("orange")
            .target(ClickHouseQuery(f"""
                SELECT ts AS time, concat(kind, ' (', toString(severity), ')') AS title, message AS text,
                       [kind, engine] AS tags
                FROM events
                WHERE $__timeFilter(ts) AND {HOST} AND (engine = '' OR {ENGINE})
                ORDER BY ts""", Format.TABLE)))


def base(title: str, uid: str, description: str, tags: Sequence[str] = ()) -> db.Dashboard:
    """A dashboard with the house settings: UTC, last hour, 30 s refresh, stepline tags."""
    return (db.Dashboard(title).uid(uid).description(description).tags(["stepline", *tags]).timezone("utc")
            .time("now-1h", "now").refresh("30s").editable().tooltip(dm.DashboardCursorSync.CROSSHAIR))


def timeline_base(title: str, uid: str, description: str, tags: Sequence[str] = (), *, gpu: bool = False
                  ) -> db.Dashboard:
    """A ClickHouse dashboard: the house settings, the timeline variables and the engine-events annotation."""
    d = base(title, uid, description, tags)
    for variable in timeline_variables(gpu=gpu):
        d = d.with_variable(variable)
    return d.annotation(events_annotation())
