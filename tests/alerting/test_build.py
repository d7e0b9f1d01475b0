"""Alert rules: generated files match the committed ones, and Prometheus/Alertmanager's own tools accept them
and fire (or stay quiet) on the scenarios that matter."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from stepline.alerting.build import build, render
from stepline.alerting.config import AlertConfig
from stepline.alerting.definitions import Alert, alerts
from stepline.alerting.slo import recording_rules

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "alerts"
PROMTOOL = shutil.which("promtool")
AMTOOL = shutil.which("amtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (apt-get install prometheus)")
needs_amtool = pytest.mark.skipif(
    AMTOOL is None, reason="amtool not installed (apt-get install prometheus-alertmanager)")

CFG = AlertConfig()
SEL = 'job="stepline",instance="c1:9464"'


def _tool(*args: str, cwd: Path | None = None) -> str:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=30, cwd=cwd)
    assert proc.returncode == 0, f"{' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_generated_files_match_committed(tmp_path: Path) -> None:
    written = build(tmp_path)
    rel = sorted(str(p.relative_to(tmp_path)) for p in written)
    assert rel == sorted(render())
    for r in rel:
        committed = ALERTS / r
        assert committed.exists(), f"{committed} missing: run `stepline alerts build`"
        assert committed.read_bytes() == (tmp_path / r).read_bytes(), f"{r} drifted: run `stepline alerts build`"


def test_build_is_deterministic(tmp_path: Path) -> None:
    assert render() == render()
    assert all("\t" not in text for text in render().values())


@needs_promtool
def test_promtool_check_rules() -> None:
    out = _tool(str(PROMTOOL), "check", "rules", str(ALERTS / "prometheus-rules.yaml"))
    assert f"SUCCESS: {len(alerts(CFG)) + len(recording_rules(CFG))} rules found" in out


# --- promtool test rules -------------------------------------------------------------------------------------

def _find(name: str, severity: str) -> Alert:
    return next(a for a in alerts(CFG) if a.name == name and a.severity == severity)


def expected(name: str, severity: str, **values: str) -> dict[str, str]:
    """The annotations promtool should render, from the definition's text with placeholders filled in."""
    a = _find(name, severity)

    def fill(text: str) -> str:
        return re.sub(r"\[([a-z_]+)\]", lambda m: values[m.group(1)], text)

    return {"summary": fill(a.summary), "description": fill(a.description), "runbook_url": CFG.runbook(a.name)}


def series(metric: str, labels: str, values: str) -> dict[str, str]:
    return {"series": f"{metric}{{{SEL}{',' if labels else ''}{labels}}}", "values": values}


def engine(name: str, state: str, age: str, budget: str, waiting: str, running: str, gpu: str,
           n: int = 40) -> list[dict[str, str]]:
    """The watchdog series of one engine; `state` is constant over the test."""
    e = f'engine="{name}"'
    out = [series("stepline_engine_state", f'{e},state="{s}"', f"{int(s == state)}x{n}")
           for s in ("idle", "progressing", "slow", "stalled", "down")]
    out += [
        series("stepline_engine_progress_age_seconds", e, age),
        series("stepline_engine_progress_budget_seconds", e, budget),
        series("stepline_engine_waiting_requests", e, waiting),
        series("stepline_engine_running_requests", e, running),
        series("stepline_engine_gpu_utilization_ratio", e, gpu),
    ]
    return out


def labels(**extra: str) -> dict[str, str]:
    return {"job": "stepline", "instance": "c1:9464", **extra}


WEDGE_DESCRIPTION = (
    "Engine wedged has requests queued and nothing moves (GPUs idle): a leaked slot or a stuck lane, "
    "not slow work. state stalled, no progress for 3m 0s against a budget of 2m 0s (derived from the work in "
    "flight); 4 waiting, 2 running. Top finding: critical engine_wedged: 4 requests waiting with GPUs idle "
    "for 3m. Run: stepline diagnose --engine wedged --since 30m"
)


def scenarios() -> list[dict[str, object]]:
    finding = series("stepline_engine_top_finding_info",
                     'engine="wedged",kind="engine_wedged",severity="critical",'
                     'title="4 requests waiting with GPUs idle for 3m"', "1x40")
    watchdog_ctx = {"state": "stalled", "budget": "2m 0s", "waiting": "4", "running": "2",
                    "finding": "critical engine_wedged: 4 requests waiting with GPUs idle for 3m"}
    return [
        {   # Legitimately slow: a 359k-token prefill (slow, age < budget) and a 700k-token decode (progressing).
            "name": "slow but healthy work does not page",
            "input_series": [
                *engine("big-prefill", "slow", "0+5x40", "600x40", "3x40", "40x40", "0.95x40"),
                *engine("long-decode", "progressing", "0.5x40", "60x40", "0x40", "1x40", "0.9x40"),
            ],
            "alert_rule_test": [
                {"eval_time": t, "alertname": n, "exp_alerts": []}
                for t in ("5m", "15m") for n in ("EngineStalled", "EngineWedgedWithQueue", "EngineDown")
            ],
        },
        {   # Wedged: a queue, no progress, GPUs idle. Pages within its `for`; recovers when work moves again.
            "name": "wedged engine with a queue pages, then resolves",
            "input_series": [
                *engine("wedged", "stalled", "0+30x12 0x28", "120x40", "4x12 0x28", "2x40", "0.01x12 0.8x28"),
                finding,
            ],
            "alert_rule_test": [
                {"eval_time": "1m", "alertname": "EngineWedgedWithQueue", "exp_alerts": []},
                {"eval_time": "3m", "alertname": "EngineWedgedWithQueue", "exp_alerts": [{
                    "exp_labels": labels(engine="wedged", severity="critical"),
                    "exp_annotations": {
                        **expected("EngineWedgedWithQueue", "critical", engine="wedged", value="4", age="3m 0s",
                                   gpus="GPUs idle", **watchdog_ctx),
                        "description": WEDGE_DESCRIPTION,
                    },
                }]},
                {"eval_time": "5m", "alertname": "EngineStalled", "exp_alerts": [{
                    "exp_labels": labels(engine="wedged", severity="critical"),
                    "exp_annotations": expected("EngineStalled", "critical", engine="wedged",
                                                value_duration="5m 0s", age="5m 0s", **watchdog_ctx),
                }]},
                {"eval_time": "10m", "alertname": "EngineWedgedWithQueue", "exp_alerts": []},
                {"eval_time": "10m", "alertname": "EngineStalled", "exp_alerts": []},
            ],
        },
        {   # Flapping: the queue empties every other scrape, so the 1m `for` never completes.
            "name": "flapping does not page",
            "input_series": engine("flappy", "stalled", "0+30x40", "120x40", "4 0 4 0 4 0 4 0 4 0 4 0 4 0 4 0",
                                   "1x40", "0.01 0.9 0.01 0.9 0.01 0.9 0.01 0.9 0.01 0.9 0.01 0.9 0.01 0.9"),
            "alert_rule_test": [
                {"eval_time": t, "alertname": "EngineWedgedWithQueue", "exp_alerts": []} for t in ("2m", "4m", "6m")
            ],
        },
        {   # Engine down: EngineDown fires (its stalled/wedged pages are inhibited in Alertmanager).
            "name": "engine down",
            "input_series": [series("stepline_source_up", 'source="vllm_metrics:e1"', "1 1 0x20")],
            "alert_rule_test": [
                {"eval_time": "1m", "alertname": "EngineDown", "exp_alerts": []},
                {"eval_time": "3m", "alertname": "EngineDown", "exp_alerts": [{
                    "exp_labels": labels(engine="e1", source="vllm_metrics:e1", severity="critical"),
                    "exp_annotations": expected("EngineDown", "critical", engine="e1", source="vllm_metrics:e1"),
                }]},
            ],
        },
        {   # A cause no other alert tells (a power cap): ticketed once per engine and kind, though its title changes
            # as it is re-diagnosed (the watchdog removes the old title's series: stale at the next scrape); a cause
            # with alerts of its own (a monster's prefill) is left to them.
            "name": "a diagnosed power cap is ticketed with its finding",
            "input_series": [
                series("stepline_engine_top_finding_info", 'engine="capped",kind="gpu_throttling",'
                       'severity="warning",title="SM 1154 of 1980 MHz"', "1x4 stale"),
                series("stepline_engine_top_finding_info", 'engine="capped",kind="gpu_throttling",'
                       'severity="warning",title="SM 1100 of 1980 MHz"', "_x4 1x36"),
                series("stepline_engine_top_finding_info", 'engine="big",kind="prefill_interference",'
                       'severity="critical",title="monster"', "1x40"),
            ],
            "alert_rule_test": [
                {"eval_time": "30s", "alertname": "EngineDiagnosed", "exp_alerts": []},
                {"eval_time": "5m", "alertname": "EngineDiagnosed", "exp_alerts": [{
                    "exp_labels": labels(engine="capped", kind="gpu_throttling", severity="warning"),
                    "exp_annotations": expected("EngineDiagnosed", "warning", engine="capped", kind="gpu_throttling",
                                                finding="warning gpu_throttling: SM 1100 of 1980 MHz"),
                }]},
            ],
        },
        {   # A lane whose slots leaked: the gateway holds 4 on an idle engine (critical), 4 on an engine running 1
            # (warning, 3 leaked); a gateway in step with its engine, one request in transit, is quiet.
            "name": "slots a gateway leaked page, one in transit does not",
            "input_series": [
                series("stepline_gateway_in_flight", 'gateway="router",engine="heavy",source="decisions"', "4x40"),
                *engine("heavy", "idle", "0x40", "5x40", "0x40", "0x40", "0x40"),
                series("stepline_gateway_in_flight", 'gateway="router",engine="busy",source="decisions"', "4x40"),
                *engine("busy", "progressing", "0x40", "5x40", "0x40", "1x40", "0.5x40"),
                series("stepline_gateway_in_flight",
                       'gateway="router",engine="fast",source="vllm_router_running_requests"', "6x40"),
                *engine("fast", "progressing", "0x40", "5x40", "1x40", "4x40", "0.6x40"),
            ],
            "alert_rule_test": [
                {"eval_time": "2m", "alertname": "GatewaySlotLeak", "exp_alerts": []},
                {"eval_time": "8m", "alertname": "GatewaySlotLeak", "exp_alerts": [
                    {"exp_labels": labels(gateway="router", engine="busy", source="decisions", severity="warning"),
                     "exp_annotations": expected("GatewaySlotLeak", "warning", gateway="router", source="decisions",
                                                 engine="busy", value="3")},
                    {"exp_labels": labels(gateway="router", engine="heavy", source="decisions", severity="critical"),
                     "exp_annotations": expected("GatewaySlotLeak", "critical", gateway="router", source="decisions",
                                                 engine="heavy", value="4")},
                    {"exp_labels": labels(gateway="router", engine="heavy", source="decisions", severity="warning"),
                     "exp_annotations": expected("GatewaySlotLeak", "warning", gateway="router", source="decisions",
                                                 engine="heavy", value="4")},
                ]},
            ],
        },
        {   # A hook failing open on one decision every 30 s to the fast lane; the heavy lane's are answered.
            "name": "a routing hook that fails open is ticketed",
            "input_series": [
                series("stepline_gateway_decisions_total", 'gateway="router",lane="fast",outcome="failed_open"',
                       "0x10 1+1x30"),
                series("stepline_gateway_decisions_total", 'gateway="router",lane="heavy",outcome="answered"',
                       "0+5x40"),
            ],
            "alert_rule_test": [
                {"eval_time": "4m", "alertname": "GatewayFailOpen", "exp_alerts": []},
                {"eval_time": "12m", "alertname": "GatewayFailOpen", "exp_alerts": [{
                    "exp_labels": labels(gateway="router", lane="fast", severity="warning"),
                    # 14 increases in the last 10 min, as increase() extrapolates them from the samples.
                    "exp_annotations": expected("GatewayFailOpen", "warning", gateway="router", lane="fast",
                                                value="14"),
                }]},
            ],
        },
        {   # The collector drops rows (20/s) and plugin records; a machine without GPUs is not a down source.
            "name": "collector dropping data and sources down",
            "input_series": [
                series("stepline_writer_rows_dropped_total", 'table="steps",reason="queue_full"', "0+600x30"),
                series("stepline_source_counts_total", 'source="plugin",counter="plugin_dropped_records"', "0x30"),
                series("stepline_source_up", 'source="gpu"', "0x30"),
                series("stepline_source_up", 'source="host"', "0x30"),
                series("stepline_gpu_present", "", "0x30"),
            ],
            "alert_rule_test": [
                {"eval_time": "8m", "alertname": "CollectorDroppingData", "exp_alerts": [{
                    "exp_labels": labels(severity="warning"),
                    "exp_annotations": expected("CollectorDroppingData", "warning", instance="c1:9464",
                                                value_rate="20"),
                }]},
                {"eval_time": "12m", "alertname": "CollectorSourceDown", "exp_alerts": [{
                    "exp_labels": labels(source="host", severity="warning"),
                    "exp_annotations": expected("CollectorSourceDown", "warning", source="host",
                                                instance="c1:9464"),
                }]},
            ],
        },
        {   # The store refuses writes: the spool fills (warning), then nears its bound (critical); then it drains.
            "name": "store unavailable while the spool fills",
            "input_series": [
                series("stepline_writer_write_errors_total", 'table="steps"', "0+2x24 48x16"),
                series("stepline_spool_bytes", "", "0+40000000x24 0x16"),
                series("stepline_spool_limit_bytes", "", "1073741824x40"),
            ],
            "alert_rule_test": [
                {"eval_time": "3m", "alertname": "CollectorStoreUnavailable", "exp_alerts": []},
                {"eval_time": "7m", "alertname": "CollectorStoreUnavailable", "exp_alerts": [{
                    "exp_labels": labels(severity="warning"),
                    "exp_annotations": expected("CollectorStoreUnavailable", "warning", instance="c1:9464",
                                                value_rate="560M"),
                }]},
                {"eval_time": "11m30s", "alertname": "CollectorStoreUnavailable", "exp_alerts": [
                    {"exp_labels": labels(severity="warning"),
                     "exp_annotations": expected("CollectorStoreUnavailable", "warning", instance="c1:9464",
                                                 value_rate="920M")},
                    {"exp_labels": labels(severity="critical"),
                     "exp_annotations": expected("CollectorStoreUnavailable", "critical", instance="c1:9464",
                                                 value_ratio="85.68%")},
                ]},
                {"eval_time": "19m", "alertname": "CollectorStoreUnavailable", "exp_alerts": []},
            ],
        },
        {   # A GPU machine whose NVML breaks: gpu_present drops to 0 too, but the source must still alert.
            "name": "gpu source down on a machine with GPUs",
            "input_series": [
                series("stepline_source_up", 'source="gpu"', "1 1 1 0x30"),
                series("stepline_gpu_present", "", "1 1 1 0x30"),
            ],
            "alert_rule_test": [{"eval_time": "14m", "alertname": "CollectorSourceDown", "exp_alerts": [{
                "exp_labels": labels(source="gpu", severity="warning"),
                "exp_annotations": expected("CollectorSourceDown", "warning", source="gpu", instance="c1:9464"),
            }]}],
        },
        {   # A sidecar that never reached NVML where GPUs are expected (STEPLINE_EXPECT_GPUS): no GPU sample ever, yet
            # it alerts; the same collector without the setting would be a machine without GPUs.
            "name": "gpu source never up where GPUs are expected",
            "input_series": [
                series("stepline_source_up", 'source="gpu"', "0x30"),
                series("stepline_gpu_present", "", "0x30"),
                series("stepline_gpu_expected", "", "1x30"),
            ],
            "alert_rule_test": [{"eval_time": "12m", "alertname": "CollectorSourceDown", "exp_alerts": [{
                "exp_labels": labels(source="gpu", severity="warning"),
                "exp_annotations": expected("CollectorSourceDown", "warning", source="gpu", instance="c1:9464"),
            }]}],
        },
        {   # A GPU falls off the bus; another GPU remaps an HBM row, then the remap fails on a third.
            "name": "gpu lost and row remapping",
            "input_series": [
                series("stepline_gpu_lost_total", 'engine="e1",gpu="2"', "0 0 1x20"),
                series("stepline_gpu_row_remap", 'engine="e1",gpu="0",state="pending"', "0 0 1x20"),
                series("stepline_gpu_row_remap", 'engine="e1",gpu="0",state="failed"', "0x22"),
                series("stepline_gpu_row_remap", 'engine="e1",gpu="1",state="failed"', "0 0 0 0 1x18"),
            ],
            "alert_rule_test": [
                {"eval_time": "30s", "alertname": "GpuLost", "exp_alerts": []},
                {"eval_time": "3m", "alertname": "GpuLost", "exp_alerts": [{
                    "exp_labels": labels(engine="e1", gpu="2", severity="critical"),
                    "exp_annotations": expected("GpuLost", "critical", engine="e1", gpu="2"),
                }]},
                {"eval_time": "1m30s", "alertname": "GpuRowRemap", "exp_alerts": [{
                    "exp_labels": labels(engine="e1", gpu="0", state="pending", severity="warning"),
                    "exp_annotations": expected("GpuRowRemap", "warning", engine="e1", gpu="0"),
                }]},
                {"eval_time": "3m", "alertname": "GpuRowRemap", "exp_alerts": [
                    {"exp_labels": labels(engine="e1", gpu="0", state="pending", severity="warning"),
                     "exp_annotations": expected("GpuRowRemap", "warning", engine="e1", gpu="0")},
                    {"exp_labels": labels(engine="e1", gpu="1", state="failed", severity="critical"),
                     "exp_annotations": expected("GpuRowRemap", "critical", engine="e1", gpu="1")},
                ]},
            ],
        },
        {   # A GPU lost at 1m stays out for 20 minutes, long past the window of its one loss: the page holds until it
            # is sampled again (stepline_gpu_gone goes absent at 21m; 5 minutes later Prometheus sees it stale).
            "name": "gpu lost stays firing while it is out",
            "input_series": [
                series("stepline_gpu_lost_total", 'engine="e1",gpu="3"', "0 0 1x60"),
                series("stepline_gpu_gone", 'engine="e1",gpu="3"', "_ _ 1x40 _x20"),
            ],
            "alert_rule_test": [
                {"eval_time": "18m", "alertname": "GpuLost", "exp_alerts": [{
                    "exp_labels": labels(engine="e1", gpu="3", severity="critical"),
                    "exp_annotations": expected("GpuLost", "critical", engine="e1", gpu="3"),
                }]},
                {"eval_time": "28m", "alertname": "GpuLost", "exp_alerts": []},
            ],
        },
        {
            "name": "watchdog always fires",
            "input_series": [],
            "alert_rule_test": [{"eval_time": "1m", "alertname": "Watchdog", "exp_alerts": [{
                "exp_labels": {"severity": "none"},
                "exp_annotations": expected("Watchdog", "none"),
            }]}],
        },
    ]


@needs_promtool
def test_promtool_rule_unit_tests(tmp_path: Path) -> None:
    shutil.copy(ALERTS / "prometheus-rules.yaml", tmp_path / "rules.yaml")
    spec = {"rule_files": ["rules.yaml"], "evaluation_interval": "30s", "tests": [
        {"interval": "30s", **t} for t in scenarios()]}
    (tmp_path / "tests.yaml").write_text(json.dumps(spec, indent=1))  # JSON is YAML
    out = _tool(str(PROMTOOL), "test", "rules", "tests.yaml", cwd=tmp_path)
    assert "SUCCESS" in out


def test_grafana_rules_from_the_same_definitions() -> None:
    from stepline.alerting.grafana import rules_file

    doc = rules_file(CFG)
    rules = [r for group in doc["groups"] for r in group["rules"]]  # type: ignore[attr-defined]
    assert len(rules) == len(alerts(CFG))
    assert len({r["uid"] for r in rules}) == len(rules) == len({r["title"] for r in rules})
    for r in rules:
        assert r["condition"] == "C"
        assert r["data"][0]["datasourceUid"] == CFG.grafana_datasource_uid
        assert "$labels" in r["annotations"]["summary"] + r["annotations"]["description"] or r["title"] == "Watchdog"
