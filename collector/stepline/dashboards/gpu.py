"""GPU: clocks, power, energy, heat, utilisation, interconnect, throttling and XIDs per GPU."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as db

from stepline.alerting.config import AlertConfig
from stepline.dashboards.buckets import GATE, MINUTE, RAW, per_interval
from stepline.dashboards.panels import ENGINE, GPU, HOST, grid, series, timeline_base
from stepline.dashboards.query import ClickHouseQuery, Format

UID = "stepline-gpu"

# gpu_samples.engine is '' for a GPU no engine was seen on: such GPUs show under "All" engines only.
GPU_WHERE = f"$__timeFilter_ms(ts) AND {HOST} AND {ENGINE} AND {GPU}"
PER_INTERVAL_WHERE = f"{GATE} AND $__timeFilter_ms(bucket) AND {HOST} AND {ENGINE} AND {GPU}"
GPU_SERIES = "concat(host, '/gpu', toString(gpu_index)) AS gpu"


def _per_gpu(columns: str) -> ClickHouseQuery:
    """Per GPU and interval: rows below a minute, the per-minute projection (schema.GPU_AGGREGATES) above."""
    return ClickHouseQuery(per_interval(f"""
        SELECT $__timeInterval_ms(bucket) AS time, {GPU_SERIES}, {columns}
        FROM gpu_samples WHERE {PER_INTERVAL_WHERE}
        GROUP BY time, gpu""", levels=(RAW, MINUTE)))


def dashboard(config: AlertConfig) -> db.Dashboard:
    """The GPU dashboard."""
    d = timeline_base("stepline / GPU", UID,
                      "Per-GPU telemetry from NVML, with throttle reasons and XID errors.",
                      ["gpu"], gpu=True)
    d = d.with_panel(series("Clocks", "Whether SM and memory clocks held under load.", "rotmhz",
                            _per_gpu("avg(sm_clock_mhz) AS sm, avg(mem_clock_mhz) AS mem")))
    d = d.with_panel(series(
        "Power", "How much power each GPU drew: the driver's 1-second average, and the instant reading (NVML "
        "FI_DEV_POWER_INSTANT, Ampere and newer), which shows what the average blurs at 10 Hz.", "watt",
        _per_gpu("avg(power_w) AS power_avg_1s, avg(power_instant_w) AS power_instant")))
    d = d.with_panel(grid(
        "Energy used in range", "How much energy each GPU used over the selected time range.",
        ClickHouseQuery(per_interval(f"""
            SELECT {GPU_SERIES}, any(gpu_name) AS model, (max(energy_mj) - min(energy_mj)) / 1000 AS energy_j,
                   avg(power_w) AS mean_power_w
            FROM gpu_samples WHERE {PER_INTERVAL_WHERE}
            GROUP BY gpu""", order_by="gpu", levels=(RAW, MINUTE)), Format.TABLE),
        units=[("energy_j", "joule"), ("mean_power_w", "watt")], w=12, h=8))
    d = d.with_panel(series("Temperatures", "How hot the GPU die and its memory ran.", "celsius",
                            _per_gpu("max(temp_gpu_c) AS gpu_temp, max(temp_mem_c) AS mem_temp")))
    d = d.with_panel(series(
        "Utilisation", "How busy each GPU was: any kernel (util), SMs with work (SM active, GPM), the graphics "
        "engine (GPM), tensor cores and SM occupancy.", "percent",
        _per_gpu("avg(util_gpu_pct) AS util, avg(sm_active_pct) AS sm_active, avg(graphics_active_pct) AS graphics, "
                 "avg(tensor_active_pct) AS tensor, avg(sm_occupancy_pct) AS occupancy")))
    d = d.with_panel(series("DRAM bandwidth", "How busy GPU memory bandwidth was.", "percent",
                            _per_gpu("avg(dram_bw_util_pct) AS dram_bw")))
    d = d.with_panel(series("Memory used", "How much GPU memory was allocated, of the total.", "bytes",
                            _per_gpu("max(mem_used_bytes) AS used, max(mem_total_bytes) AS total")))
    d = d.with_panel(series(
        "PCIe and NVLink", "How much each GPU moved over PCIe and NVLink, each direction.", "Bps",
        _per_gpu("avg(pcie_tx_bytes_per_s) AS pcie_tx, avg(pcie_rx_bytes_per_s) AS pcie_rx, "
                 "avg(nvlink_tx_bytes_per_s) AS nvlink_tx, avg(nvlink_rx_bytes_per_s) AS nvlink_rx")))
    d = d.with_panel(series(
        "Clock-event (throttle) reasons", "Why clocks were held back: samples per interval with each reason.",
        "short",
        ClickHouseQuery(f"""
            SELECT $__timeInterval_ms(ts) AS time, concat(host, '/gpu', toString(gpu_index), ' ', reason) AS series,
                   count() AS samples
            FROM gpu_samples ARRAY JOIN clock_event_flags AS reason
            WHERE {GPU_WHERE} AND reason != 'gpu_idle'
            GROUP BY time, series ORDER BY time"""), stacked=True, bars=True))
    d = d.with_panel(grid(
        "HBM row remapping", "NVML's row remapper per GPU (the HBM health signal): rows remapped for uncorrectable "
        "and correctable errors, a remap pending (needs a GPU reset) or failed (no spare rows: replace the GPU).",
        ClickHouseQuery(f"""
            SELECT {GPU_SERIES}, any(gpu_name) AS model, max(remapped_rows_uncorrectable) AS uncorrectable,
                   max(remapped_rows_correctable) AS correctable, max(remapped_rows_pending) AS pending,
                   max(remapped_rows_failure) AS failed
            FROM gpu_samples WHERE {GPU_WHERE} AND remapped_rows_uncorrectable IS NOT NULL
            GROUP BY gpu ORDER BY failed DESC, pending DESC, uncorrectable DESC, gpu""", Format.TABLE), w=12, h=8))
    return d.with_panel(grid(
        "XID errors", "Which GPUs reported XID errors, and what the driver said.",
        ClickHouseQuery(f"""
            SELECT ts, host, engine, attributes['gpu'] AS gpu, attributes['xid'] AS xid,
                   toString(severity) AS severity, message
            FROM events
            WHERE $__timeFilter(ts) AND kind = 'gpu_xid' AND {HOST} AND (engine = '' OR {ENGINE})
              AND $__conditionalAll(attributes['gpu'] IN (${{gpu:singlequote}}), $gpu)
            ORDER BY ts DESC LIMIT 200""", Format.TABLE), h=8))
