"""Whether each engine, and the telemetry stepline reads from it, is alive: down or gone, stalled past its watchdog
budget, wedged with a queue, its stat-logger plugin silent."""

from __future__ import annotations

from stepline.alerting.config import AlertConfig
from stepline.alerting.rule import Alert, diagnose_hint

WATCHDOG_CONTEXT = (
    "state [state], no progress for [age] against a budget of [budget] (derived from the work in flight); "
    "[waiting] waiting, [running] running. Top finding: [finding]. "
    "Run: stepline diagnose --engine [engine] --since {since}"
)


def engine_liveness(cfg: AlertConfig) -> list[Alert]:
    """An engine that is down or gone, stalled past its watchdog budget, or wedged with a queue."""
    s = cfg.sel
    ctx = WATCHDOG_CONTEXT.format(since=cfg.diagnose_since)
    diag = diagnose_hint(cfg)
    vllm_sources = s('source=~"vllm_metrics:.*"')
    gone = s('source=~"vllm_metrics:.*"', 'reason=~"' + "|".join(cfg.engine_gone_reasons) + '"')
    stalled_state = s('state="stalled"')
    gpu = f"stepline_engine_gpu_utilization_ratio{s()}"
    return [
        Alert(
            "EngineDown", "critical",
            f'label_replace(stepline_source_up{vllm_sources}, '
            f'"engine", "$1", "source", "vllm_metrics:(.*)") == 0',
            cfg.engine_down_for,
            "vLLM engine [engine] is not answering /metrics.",
            "The collector has failed to scrape engine [engine] ([source]) for at least "
            f"{cfg.engine_down_for}: it is hung, too busy to answer within the scrape timeout, or not serving "
            "HTTP (a refused connection pages EngineGone at once). Alertmanager inhibits "
            "EngineStalled and EngineWedgedWithQueue for this engine while this fires (the Prometheus rules, and "
            "Grafana's rules forwarded by its Alertmanager contact point); Grafana's own notification policies "
            "do not inhibit, so a Grafana contact point that bypasses Alertmanager sends them too. " + diag,
        ),
        Alert(
            "EngineGone", "critical",
            f'label_replace(stepline_source_failure_info{gone}, '
            f'"engine", "$1", "source", "vllm_metrics:(.*)") == 1',
            cfg.engine_gone_for,
            "vLLM engine [engine] is gone: its /metrics scrape failed ([reason]).",
            "The collector's latest scrape of engine [engine] ([source]) failed with [reason]: refused means "
            "nothing listens on its port (the process exited, crashed or was killed, or is still starting), gone "
            "that it closed the connection without an answer (it died answering). This pages at once, evaluated "
            f"every {cfg.fast_evaluation_interval}; a scrape that times out (a hung or overloaded engine) waits "
            f"EngineDown's {cfg.engine_down_for}. Alertmanager inhibits EngineDown, EngineStalled and "
            "EngineWedgedWithQueue for this engine while this fires. " + diag,
            fast=True,
        ),
        Alert(
            "EngineStalled", "critical",
            f"(stepline_engine_progress_age_seconds{s()} > stepline_engine_progress_budget_seconds{s()})\n"
            f'  and ignoring (state) (stepline_engine_state{stalled_state} == 1)',
            cfg.stalled_for,
            "Engine [engine] has made no progress for [value_duration], beyond its watchdog budget.",
            "Engine [engine]: " + ctx,
        ),
        Alert(
            "EngineWedgedWithQueue", "critical",
            # An engine with no GPU reading at all (a CPU build, NVML down) is judged on its queue and progress
            # alone, and its page says so rather than "GPUs idle".
            f"(stepline_engine_waiting_requests{s()} > 0)\n"
            f"  and (stepline_engine_progress_age_seconds{s()} > stepline_engine_progress_budget_seconds{s()}\n"
            f"       or stepline_engine_progress_age_seconds{s()} > {cfg.wedge_min_age_seconds:g})\n"
            f"  and ({gpu} < {cfg.wedge_gpu_idle_ratio:g}\n"
            f"       or (stepline_engine_waiting_requests{s()} unless {gpu}))",
            cfg.wedged_for,
            "Engine [engine] is wedged: [value] requests waiting, no progress, [gpus].",
            "Engine [engine] has requests queued and nothing moves ([gpus]): a leaked slot or a stuck lane, not "
            "slow work. " + ctx,
        ),
    ]


def plugin_liveness(cfg: AlertConfig) -> list[Alert]:
    """An engine that works while its stat-logger plugin sends nothing."""
    return [
        Alert(
            "PluginSilent", "warning",
            f"stepline_engine_plugin_silent_seconds{cfg.sel()} > 0",
            cfg.plugin_silent_for,
            "The stepline plugin of engine [engine] is silent: no step for [value_duration] while the engine works.",
            "Engine [engine]'s /metrics counters (generated, prompt or iteration tokens) have moved for "
            "[value_duration] with no step from its stat-logger plugin: its steps, the plugin's request rows and the "
            "step-based watchdog budgets are missing (the watchdog falls back to /metrics). Causes: vLLM's elastic EP "
            "scale-up rebuilds the stat loggers without custom ones (restart the engine); the plugin did not load "
            "(VLLM_PLUGINS, vLLM's start-up log); its STEPLINE_PLUGIN_SOCKET is not the collector's; it names the "
            "engine otherwise (STEPLINE_ENGINE). `stepline doctor` and the timeline's plugin_silent event say "
            "which. " + diagnose_hint(cfg),
        ),
    ]
