"""The liveness rules in promtool, every 5 s as the fast group is evaluated: a refused engine pages at once while a
timing-out one keeps EngineDown's patience; a wedge says "GPUs idle" only where there are GPU readings; a silent
plugin is ticketed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from stepline.alerting.liveness import engine_liveness, plugin_liveness
from tests.alerting.test_build import ALERTS, CFG, _tool, engine, expected, labels, needs_promtool, series


def test_the_crash_path_is_evaluated_in_the_fast_group_and_the_rest_is_not() -> None:
    fast = [a.name for a in (*engine_liveness(CFG), *plugin_liveness(CFG)) if a.fast]
    assert fast == ["EngineGone"]
    assert CFG.fast_evaluation_interval == "5s" and CFG.engine_gone_for == "0m"


def _scenarios() -> list[dict[str, object]]:
    wedge_ctx = {"state": "stalled", "age": "3m 0s", "budget": "2m 0s", "waiting": "4", "running": "2",
                 "finding": "none yet", "value": "4"}
    # Every 5 s for 5 minutes; the GPU engine's GPUs read 1% busy, the CPU engine has no GPU series at all.
    gpu_engine = engine("gpu-e", "stalled", "0+5x60", "120x60", "4x60", "2x60", "0.01x60", n=60)
    cpu_engine = [s for s in engine("cpu-e", "stalled", "0+5x60", "120x60", "4x60", "2x60", "0x60", n=60)
                  if not s["series"].startswith("stepline_engine_gpu_utilization_ratio")]
    return [
        {   # Both scrapes fail from 10 s on: one refused (the process is gone), one timing out (hung, or busy).
            "name": "a refused engine pages at once, a timing-out one keeps its patience",
            "input_series": [
                series("stepline_source_up", 'source="vllm_metrics:crashed"', "1 1 0x30"),
                series("stepline_source_failure_info", 'source="vllm_metrics:crashed",reason="refused"', "_ _ 1x30"),
                series("stepline_source_up", 'source="vllm_metrics:hung"', "1 1 0x30"),
                series("stepline_source_failure_info", 'source="vllm_metrics:hung",reason="timeout"', "_ _ 1x30"),
            ],
            "alert_rule_test": [
                {"eval_time": "5s", "alertname": "EngineGone", "exp_alerts": []},
                {"eval_time": "10s", "alertname": "EngineGone", "exp_alerts": [{
                    "exp_labels": labels(engine="crashed", source="vllm_metrics:crashed", reason="refused",
                                         severity="critical"),
                    "exp_annotations": expected("EngineGone", "critical", engine="crashed",
                                                source="vllm_metrics:crashed", reason="refused"),
                }]},
                # 30 s into the hang nothing has paged for it; a minute in, EngineDown does (for both: Alertmanager
                # inhibits the crashed engine's while EngineGone fires).
                {"eval_time": "40s", "alertname": "EngineGone", "exp_alerts": [{
                    "exp_labels": labels(engine="crashed", source="vllm_metrics:crashed", reason="refused",
                                         severity="critical"),
                    "exp_annotations": expected("EngineGone", "critical", engine="crashed",
                                                source="vllm_metrics:crashed", reason="refused"),
                }]},
                {"eval_time": "40s", "alertname": "EngineDown", "exp_alerts": []},
                {"eval_time": "75s", "alertname": "EngineDown", "exp_alerts": [
                    {"exp_labels": labels(engine=e, source=f"vllm_metrics:{e}", severity="critical"),
                     "exp_annotations": expected("EngineDown", "critical", engine=e, source=f"vllm_metrics:{e}")}
                    for e in ("crashed", "hung")]},
            ],
        },
        {   # Wedged alike, one with idle GPUs, one without a GPU reading (a CPU build): each page says what is known.
            "name": "a wedge says GPUs idle only where there are GPU readings",
            "input_series": [*gpu_engine, *cpu_engine],
            "alert_rule_test": [{"eval_time": "3m", "alertname": "EngineWedgedWithQueue", "exp_alerts": [
                {"exp_labels": labels(engine=e, severity="critical"),
                 "exp_annotations": expected("EngineWedgedWithQueue", "critical", engine=e, gpus=gpus, **wedge_ctx)}
                for e, gpus in (("cpu-e", "no GPU readings"), ("gpu-e", "GPUs idle"))]}],
        },
        {   # The watchdog calls the plugin silent 30 s after the counters began moving without a step; back at 4m.
            "name": "a silent plugin is ticketed",
            "input_series": [series("stepline_engine_plugin_silent_seconds", 'engine="e1"', "0x6 30+5x41 0x12")],
            "alert_rule_test": [
                {"eval_time": "80s", "alertname": "PluginSilent", "exp_alerts": []},
                {"eval_time": "2m", "alertname": "PluginSilent", "exp_alerts": [{
                    "exp_labels": labels(engine="e1", severity="warning"),
                    "exp_annotations": expected("PluginSilent", "warning", engine="e1", value_duration="1m 55s"),
                }]},
                {"eval_time": "4m30s", "alertname": "PluginSilent", "exp_alerts": []},
            ],
        },
    ]


@needs_promtool
def test_promtool_liveness_unit_tests(tmp_path: Path) -> None:
    shutil.copy(ALERTS / "prometheus-rules.yaml", tmp_path / "rules.yaml")
    spec = {"rule_files": ["rules.yaml"], "evaluation_interval": CFG.fast_evaluation_interval, "tests": [
        {"interval": "5s", **t} for t in _scenarios()]}
    (tmp_path / "tests.yaml").write_text(json.dumps(spec, indent=1))  # JSON is YAML
    out = _tool(str(shutil.which("promtool")), "test", "rules", "tests.yaml", cwd=tmp_path)
    assert "SUCCESS" in out
