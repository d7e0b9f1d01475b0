"""The alert list: every rule once, with placeholders that each backend renders in its own templating.

Placeholders in summaries and descriptions: `[engine]`, `[value]`, `[value_duration]`, `[value_ratio]`,
and for the watchdog pages `[state]`, `[budget]`, `[age]`, `[waiting]`, `[running]`, `[finding]`, `[gpus]`
("GPUs idle", or "no GPU readings" for an engine that has none), and for the SLO alerts `[objective]`, `[scope]`,
`[long_window]` (see `templates.py`). The engines' liveness alerts are in `liveness.py`, the SLO burn-rate alerts in
`slo.py`.
"""

from __future__ import annotations

from stepline.alerting.config import AlertConfig
from stepline.alerting.liveness import engine_liveness, plugin_liveness
from stepline.alerting.rule import Alert, Severity, diagnose_hint
from stepline.alerting.slo import burn_alerts

__all__ = ["Alert", "Severity", "alerts"]


def alerts(cfg: AlertConfig) -> list[Alert]:
    """Every alert, in the order they appear in the rule file."""
    return [*engine_liveness(cfg), *plugin_liveness(cfg), *_engine_latency(cfg), *_engine_cache(cfg),
            *_engine_diagnosis(cfg), *_gateways(cfg), *burn_alerts(cfg), *_gpu_clocks(cfg), *_gpu_faults(cfg),
            *_collector_health(cfg), *_dead_mans_switch()]


def _engine_latency(cfg: AlertConfig) -> list[Alert]:
    """Decode starved by prefill, and requests queued behind a long prefill."""
    s = cfg.sel
    slo = cfg.slo
    diag = diagnose_hint(cfg)
    return [
        Alert(
            "DecodeStarvation", "warning",
            f"(stepline_engine_itl_p99_seconds{s()} > {slo.itl_p99_seconds:g})\n"
            f"  and (stepline_engine_prefill_step_share{s()} > {cfg.starvation_min_prefill_share:g})",
            cfg.starvation_for,
            "Decode on [engine] is starved by prefill: ITL p99 [value_duration] (SLO "
            f"{slo.itl_p99_seconds:g}s).",
            "Engine [engine]: ITL p99 over the last minute is [value_duration] against an SLO of "
            f"{slo.itl_p99_seconds:g}s while prefill shares the steps (long prompts in chunked prefill). "
            "Top finding: [finding]. " + diag,
        ),
        Alert(
            "DecodeStarvation", "critical",
            f"(stepline_engine_itl_p99_seconds{s()} > {slo.itl_p99_critical_seconds:g})\n"
            f"  and (stepline_engine_prefill_step_share{s()} > {cfg.starvation_min_prefill_share:g})",
            cfg.starvation_critical_for,
            "Decode on [engine] has collapsed behind prefill: ITL p99 [value_duration].",
            "Engine [engine]: ITL p99 over the last minute is [value_duration] (critical above "
            f"{slo.itl_p99_critical_seconds:g}s): streams get about one token per prefill step. "
            "Top finding: [finding]. " + diag,
        ),
        Alert(
            "HeadOfLineBlocking", "warning",
            f"stepline_engine_queued_behind_prefill{s()} > 0",
            cfg.hol_blocked_for,
            "[value] requests on [engine] are queued behind a long prefill.",
            "Engine [engine]: [value] requests have been waiting while a prefill of four or more token budgets "
            "has run for 10 s or more. Top finding: [finding]. " + diag,
        ),
        Alert(
            "HeadOfLineBlocking", "critical",
            f"stepline_engine_queued_behind_prefill{s()} >= {cfg.hol_critical_requests}",
            cfg.hol_critical_for,
            "[value] requests on [engine] are queued behind a long prefill.",
            f"Engine [engine]: {cfg.hol_critical_requests} or more requests ([value]) have waited behind "
            f"a long prefill for {cfg.hol_critical_for}. Top finding: [finding]. " + diag,
        ),
    ]


def _engine_cache(cfg: AlertConfig) -> list[Alert]:
    """The prefix cache collapsing, and the KV cache full enough to preempt."""
    s = cfg.sel
    diag = diagnose_hint(cfg)
    return [
        Alert(
            "PrefixCacheCollapse", "warning",
            f"(stepline_engine_prefix_cache_hit_ratio{s()}\n"
            f"  < {cfg.prefix_cache_drop_factor:g} * avg_over_time(stepline_engine_prefix_cache_hit_ratio{s()}[1h]))\n"
            f"  and (avg_over_time(stepline_engine_prefix_cache_hit_ratio{s()}[1h])"
            f" > {cfg.prefix_cache_min_baseline:g})",
            cfg.prefix_cache_for,
            "Prefix-cache hit ratio on [engine] collapsed to [value_ratio].",
            "Engine [engine]: the prefix-cache hit ratio over the last minute is [value_ratio], under "
            f"{cfg.prefix_cache_drop_factor:g}x its own 1 h average: new prompts are being computed "
            "from scratch (burst of unseen prefixes, or eviction under KV pressure). " + diag,
        ),
        Alert(
            "KVCachePressure", "warning",
            f"(stepline_engine_kv_cache_usage_ratio{s()} > {cfg.kv_usage_warning_ratio:g})\n"
            f"  and (increase(stepline_engine_preemptions_total{s()}[5m]) > 0)",
            cfg.kv_for,
            "KV cache on [engine] is [value_ratio] full and requests are being preempted.",
            "Engine [engine]: KV cache usage [value_ratio] with preemptions in the last 5m; preempted "
            "requests recompute their prefill. " + diag,
        ),
        Alert(
            "KVCachePressure", "critical",
            f"(stepline_engine_kv_cache_usage_ratio{s()} > {cfg.kv_usage_critical_ratio:g})\n"
            f"  and (increase(stepline_engine_preemptions_total{s()}[5m])"
            f" > {cfg.kv_preemptions_critical_per_5m})",
            cfg.kv_for,
            "KV cache on [engine] is [value_ratio] full with a preemption storm.",
            f"Engine [engine]: KV cache usage [value_ratio] and more than {cfg.kv_preemptions_critical_per_5m} "
            "preemptions in 5m: the engine spends its time recomputing. " + diag,
        ),
    ]


def _engine_diagnosis(cfg: AlertConfig) -> list[Alert]:
    """A cause the watchdog's diagnosis names and no other alert pages on."""
    diag = diagnose_hint(cfg)
    diagnosed = cfg.sel('kind=~"' + "|".join(cfg.diagnosed_kinds) + '"', 'severity=~"warning|critical"')
    return [
        Alert(
            "EngineDiagnosed", "warning",
            # By engine and kind: the finding's title changes as it is re-diagnosed, the alert must not.
            f"max by (job, instance, engine, kind) (stepline_engine_top_finding_info{diagnosed}) == 1",
            cfg.diagnosed_for,
            "Engine [engine]: the diagnosis names [kind].",
            "The watchdog's diagnosis of engine [engine] names a cause no other alert pages on, for "
            f"{cfg.diagnosed_for}: [finding]. (GPU throttling here includes a power cap holding clocks below the "
            "GPU's maximum, which GpuThrottling leaves out because sw_power_cap alone is normal under load.) " + diag,
        ),
    ]


def _gateways(cfg: AlertConfig) -> list[Alert]:
    """The gateway in front of the engines: slots it leaked, and a routing hook that fails open."""
    s = cfg.sel
    diag = diagnose_hint(cfg)
    lookback = cfg.gateway_leak_lookback
    # What the gateway holds at its least over the lookback, against what the engine held at its most: a lower bound
    # of the slots leaked, whatever the traffic did meanwhile.
    held = (f"max by (job, instance, engine) (max_over_time(stepline_engine_running_requests{s()}[{lookback}])\n"
            f"    + max_over_time(stepline_engine_waiting_requests{s()}[{lookback}]))")
    leaked = (f"min_over_time(stepline_gateway_in_flight{s()}[{lookback}])\n"
              f"  - on (job, instance, engine) group_left ()\n  {held}")
    failed_open = s('outcome="failed_open"')
    return [
        Alert(
            "GatewaySlotLeak", "warning",
            f"({leaked}) >= {cfg.gateway_leaked_slots}",
            cfg.gateway_leak_for,
            "Gateway [gateway] holds [value] more slots on [engine] than the engine runs.",
            f"Gateway [gateway] ([source]) has held [value] more requests in flight to engine [engine] than the engine "
            f"ran and queued, through the last {lookback}: slots released on success or failure but not on a "
            "client's disconnect. The lane refuses or queues work its engine could do. " + diag,
        ),
        Alert(
            "GatewaySlotLeak", "critical",
            f"({leaked}) >= {cfg.gateway_leaked_slots}\n  and on (job, instance, engine) ({held}) == 0",
            cfg.gateway_leak_for,
            "Gateway [gateway] holds [value] leaked slots on [engine] while the engine is idle.",
            f"Gateway [gateway] ([source]) holds [value] slots on engine [engine] beyond what it runs, and the "
            f"engine has run and queued nothing for {lookback}: the lane is wedged at the gateway while its GPUs "
            "idle. Restart the gateway or reset its counters; release slots on every exit path. " + diag,
        ),
        Alert(
            "GatewayFailOpen", "warning",
            f"sum by (job, instance, gateway, lane) (increase(stepline_gateway_decisions_total{failed_open}"
            f"[{cfg.gateway_fail_open_window}]))\n  >= {cfg.gateway_fail_open_decisions}",
            "0m",
            "Gateway [gateway] failed open on [value] decisions to lane [lane].",
            "Gateway [gateway]'s routing hook swallowed exceptions or measured nothing against its size bar on "
            f"[value] decisions in {cfg.gateway_fail_open_window}, and routed them to lane [lane] anyway: monsters can "
            f"land on the fast lane, unseen. Run: stepline diagnose --since {cfg.diagnose_since}",
        ),
    ]


def _gpu_clocks(cfg: AlertConfig) -> list[Alert]:
    """GPU clocks held down by temperature or the board."""
    diag = diagnose_hint(cfg)
    throttled = cfg.sel('reason=~"' + "|".join(cfg.throttle_reasons) + '"')
    return [
        Alert(
            "GpuThrottling", "warning",
            f'stepline_gpu_clock_event_active{throttled} == 1',
            cfg.throttle_for,
            "GPU [gpu] of [engine] is throttled ([reason]).",
            "GPU [gpu] of engine [engine] has reported [reason] for "
            f"{cfg.throttle_for}: clocks are held down by temperature or the board. " + diag,
        ),
        Alert(
            "GpuThrottling", "critical",
            f'stepline_gpu_clock_event_active{throttled} == 1',
            cfg.throttle_critical_for,
            "GPU [gpu] of [engine] has been throttled for {for_} ([reason]).".replace(
                "{for_}", cfg.throttle_critical_for),
            "GPU [gpu] of engine [engine] has reported [reason] for "
            f"{cfg.throttle_critical_for}: check cooling and power delivery. " + diag,
        ),
    ]


def _gpu_faults(cfg: AlertConfig) -> list[Alert]:
    """GPU hardware faults: XIDs, lost GPUs, HBM row remaps."""
    s = cfg.sel
    diag = diagnose_hint(cfg)
    fatal_xid = s('xid=~"' + "|".join(str(x) for x in cfg.fatal_xids) + '"')
    remap_pending, remap_failed = s('state="pending"'), s('state="failed"')
    return [
        Alert(
            "GpuXidError", "warning",
            f"increase(stepline_gpu_xid_errors_total{s()}[{cfg.xid_window}]) > 0\n"
            f"  or (stepline_gpu_xid_errors_total{s()} > 0 unless stepline_gpu_xid_errors_total{s()}"
            f" offset {cfg.xid_window})",
            "0m",
            "GPU [gpu] of [engine] reported XID [xid].",
            "GPU [gpu] of engine [engine] reported XID [xid] in the last "
            f"{cfg.xid_window}. " + diag,
        ),
        Alert(
            "GpuXidError", "critical",
            f"increase(stepline_gpu_xid_errors_total{fatal_xid}"
            f"[{cfg.xid_window}]) > 0\n"
            f"  or (stepline_gpu_xid_errors_total{fatal_xid} > 0"
            f" unless stepline_gpu_xid_errors_total{s()} offset {cfg.xid_window})",
            "0m",
            "GPU [gpu] of [engine] reported fatal XID [xid].",
            f"GPU [gpu] of engine [engine] reported XID [xid] (one of {', '.join(map(str, cfg.fatal_xids))}): "
            "uncorrectable memory error, NVLink, GSP or the GPU fell off the bus. Drain the node. " + diag,
        ),
        Alert(
            "GpuLost", "critical",
            f"increase(stepline_gpu_lost_total{s()}[{cfg.xid_window}]) > 0\n"
            f"  or (stepline_gpu_lost_total{s()} > 0 unless stepline_gpu_lost_total{s()} offset {cfg.xid_window})\n"
            f"  or stepline_gpu_gone{s()} == 1",
            "0m",
            "GPU [gpu] of [engine] is lost.",
            "NVML reports GPU [gpu] of engine [engine] lost (fell off the bus, or a reset is required): it is out "
            "of rotation until the node is drained and the GPU reset or replaced. The alert holds while it is out "
            "(stepline_gpu_gone) and resolves once the collector samples it again. " + diag,
        ),
        Alert(
            "GpuRowRemap", "warning",
            f"stepline_gpu_row_remap{remap_pending} == 1",
            "0m",
            "GPU [gpu] of [engine] has an HBM row remap pending.",
            "GPU [gpu] of engine [engine] remapped a failing HBM row; the remap takes effect at the next GPU "
            "reset. Drain and reset it at the next maintenance window. " + diag,
        ),
        Alert(
            "GpuRowRemap", "critical",
            f"stepline_gpu_row_remap{remap_failed} == 1",
            "0m",
            "GPU [gpu] of [engine] failed to remap an HBM row.",
            "GPU [gpu] of engine [engine] could not remap a failing HBM row (no spare rows left): its memory is "
            "failing. Drain the node and replace the GPU. " + diag,
        ),
    ]


def _collector_health(cfg: AlertConfig) -> list[Alert]:
    """The collector itself: dropping data, unable to write to its store, a source down."""
    s = cfg.sel
    other_sources = s('source!~"vllm_metrics:.*"')
    gpu_source = s('source="gpu"')
    dropped_counters = s('counter=~"' + "|".join(cfg.dropped_source_counters) + '"')
    drops = (
        "sum without (table, reason, source, counter) (\n"
        f"  rate(stepline_writer_rows_dropped_total{s()}[{cfg.drop_window}])\n"
        f"  or rate(stepline_source_counts_total{dropped_counters}[{cfg.drop_window}])\n)"
    )
    return [
        Alert(
            "CollectorDroppingData", "warning",
            f"({drops}) > 0",
            cfg.drop_for,
            "The stepline collector [instance] is dropping data.",
            "Collector [instance] has dropped [value_rate] rows or records a second over the last "
            f"{cfg.drop_window}: the timeline has holes. Check the writer queue (stepline_writer_queue_rows) "
            "and the store.",
        ),
        Alert(
            "CollectorDroppingData", "critical",
            f"({drops}) > {cfg.drop_critical_rows_per_second:g}",
            cfg.drop_for,
            "The stepline collector [instance] is dropping [value_rate] rows a second.",
            "Collector [instance] has dropped [value_rate] rows or records a second over the last "
            f"{cfg.drop_window}: the store is down or far too slow. Check the writer queue "
            "(stepline_writer_queue_rows) and the store.",
        ),
        Alert(
            "CollectorStoreUnavailable", "warning",
            f"stepline_spool_bytes{s()} > 0\n"
            f"  and ignoring (table) increase(stepline_writer_write_errors_total{s()}[{cfg.drop_window}]) > 0",
            cfg.store_unavailable_for,
            "The stepline collector [instance] cannot write to its store.",
            f"Collector [instance] has failed inserts for {cfg.store_unavailable_for}; batches wait in its spool "
            "([value_rate]B) and are replayed when the store accepts them. Nothing is lost until the spool is "
            "full. Check the store (reachable, disk, too many parts) and the collector's log.",
        ),
        Alert(
            "CollectorStoreUnavailable", "critical",
            f"stepline_spool_bytes{s()} / stepline_spool_limit_bytes{s()} > {cfg.spool_critical_ratio:g}",
            "0m",
            "The stepline collector [instance]'s spool is [value_ratio] full.",
            "Collector [instance] cannot write to its store and its spool is [value_ratio] of its bound: past it, "
            "the oldest batches are dropped (reason spool_full). Bring the store back, or give the spool room "
            "(--spool-max-bytes, and the volume under --spool-dir).",
        ),
        Alert(
            "CollectorSourceDown", "warning",
            f'(stepline_source_up{other_sources} == 0)\n'
            f'  unless (stepline_source_up{gpu_source} == 0'
            f" and ignoring (source) max_over_time(stepline_gpu_present{s()}[{cfg.gpu_present_lookback}]) == 0\n"
            f"    unless ignoring (source) stepline_gpu_expected{s()} == 1)",
            cfg.source_down_for,
            "Collector source [source] on [instance] is down.",
            "Source [source] of collector [instance] has failed every poll for "
            f"{cfg.source_down_for}; its rows are missing from the timeline. `stepline status` and the "
            "collector's log name the error. (The gpu source on a machine without GPUs does not count, unless "
            "STEPLINE_EXPECT_GPUS says GPUs are expected there.)",
        ),
    ]


def _dead_mans_switch() -> list[Alert]:
    """The pipeline's heartbeat: always firing."""
    return [
        Alert(
            "Watchdog", "none",
            "vector(1)",
            "0m",
            "The stepline alerting pipeline is alive.",
            "Always firing. Route it to a dead man's switch: silence from this alert means Prometheus, "
            "the rules or Alertmanager are broken.",
        ),
    ]
